"""A seller process for the key-rotation tests: enqueues until its stop file appears.

Configured from the environment like any seller (``OUTBOX_*``). For every committed
message it records the idempotency key, the SHA-256 of the bytes it rendered (the stored
row opened in the same transaction) and the key the row was sealed under.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

from sqlalchemy import select

import outbox
from outbox.db import make_engine
from outbox.keyset import stop_reporting
from outbox.schema import messages
from outbox.sealing import plaintext


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stop", type=Path, required=True)
    args = parser.parse_args()
    settings = outbox.load_settings()
    engine = make_engine(settings.database_url)
    n = 0
    with args.out.open("a") as log:
        while not args.stop.exists():
            with engine.begin() as conn:
                message = outbox.enqueue_task_webhook(
                    conn, tenant_id="rotation", task_id=f"{args.name}_{n}", task_type="create_media_buy",
                    status="completed", result={"media_buy_id": f"mb_{n}"}, settings=settings,
                    push_notification_config={"url": args.url, "operation_id": f"op_{n}",
                                              "token": f"rotation-token-{args.name}-{n:06d}"})
                row = conn.execute(select(messages.c.body, messages.c.body_key_id, messages.c.tenant_id,
                                          messages.c.idempotency_key).where(messages.c.id == message.id)).one()
                rendered = plaintext(row, settings.sealing())
            log.write(json.dumps({"key": message.idempotency_key, "sha256": hashlib.sha256(rendered).hexdigest(),
                                  "sealed_under": row.body_key_id}) + "\n")
            log.flush()
            n += 1
            time.sleep(0.05)
    stop_reporting(engine)  # a clean shutdown: a rotation under way need not wait this process out
    engine.dispose()


if __name__ == "__main__":
    main()
