"""The CLI called in process, as the CLI tests call it: its exit status and output, and a
database holding one dead message with an attempt to act on."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine

from outbox.schema import attempts, messages
from supervisor.cli import main
from tests.ledger import enqueue_many


def url_of(engine: Engine) -> str:
    """The engine's URL as ``OUTBOX_DATABASE_URL`` takes it (password included)."""
    return engine.url.render_as_string(hide_password=False)


def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, url: str | None,
        *args: str) -> tuple[int, str, str]:
    """``outboxd ARGS`` in this process against ``url``: (exit status, stdout, stderr)."""
    if url is not None:
        monkeypatch.setenv("OUTBOX_DATABASE_URL", url)
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse refusals
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> bool:
    """Whether a refusal is one line, without a traceback."""
    return err.count("\n") == 1 and "Traceback" not in err


def dead_with_an_attempt(engine: Engine, n: int = 1, horizon: float = 9e9) -> None:
    """``n`` messages, all dead (``gone``) after one attempt; message 1 has the attempt row."""
    enqueue_many(engine, "http://127.0.0.1:9/hook?secret=q", [""] * n)
    with engine.begin() as conn:
        conn.execute(messages.update().values(state="dead", dead_reason="gone", attempts=1, finished_at=1.0,
                                              retry_until=horizon, first_attempt_at=1.0))
        conn.execute(attempts.insert().values(message_id=1, tenant_id="tenant-0", url="http://127.0.0.1:9/hook",
                                              attempt_number=1, outcome="gone", http_status=410, will_retry=False,
                                              idempotency_key="k", trigger="scheduled", occurred_at=2.0))
