"""The reporting hand-off factory ``outboxd run`` calls (docs/reporting.md).

Configured with the daemon's own settings plus two variables of the seller's::

    OUTBOX_REPORTING_HANDOFF=reporting_handoff:build   # this module, on PYTHONPATH
    REPORTING_TENANT_ID=acme                           # the outboxd tenant of these notifications
    REPORTING_CIPHER_KEY=<base64 of 32 bytes>          # the SDK outbox's envelope key

The SDK's PostgreSQL reporting outbox (``adcp-reporting-storage``) lives in outboxd's
database here, so the ledger's transaction, the hand-off and outboxd share one server. The
SDK's worker expands events with outboxd's subscribers as its resolver; the hand-off then
moves each delivery into outboxd, which signs it with the tenant's keyring and sends it.
"""

from __future__ import annotations

import base64
import os

from adcp.reporting.outbox import ReportingEnvelopeCipher, ReportingNotificationWorker
from adcp_reporting_storage.outbox.pg import PgReportingOutbox
from adcp_reporting_storage.outbox.status_pg import PgReportingStatusOutbox
from psycopg_pool import AsyncConnectionPool

from outbox.config import Settings
from outbox.db import connect_options, libpq_url, make_engine
from outbox.reporting import PG_LEDGER_QUEUE, PG_STATUS_QUEUE, ReportingHandoff, pg_backlog
from outbox.reporting_subscriptions import OutboxSubscriptionResolver


async def build(settings: Settings) -> list[ReportingHandoff]:
    """One tenant's hand-offs: the SDK's worker on each of its PostgreSQL queues (ledger
    changes and delivery_ready in one, status changes in the other), outboxd's engine."""
    tenant = os.environ["REPORTING_TENANT_ID"]
    cipher = ReportingEnvelopeCipher(base64.b64decode(os.environ["REPORTING_CIPHER_KEY"]))
    conninfo = libpq_url(settings.database_url)
    # Bounded like the daemon's own connections: a server that stops answering fails a turn
    # within seconds (outbox.db.connect_options), and the next turn connects afresh.
    bounds = connect_options(settings)
    pool = AsyncConnectionPool(conninfo, min_size=1, max_size=2, open=False, kwargs=bounds)
    await pool.open()
    engine = make_engine(settings.database_url, connect_args=bounds)
    subscriptions = OutboxSubscriptionResolver(engine, tenant, settings)

    async def close() -> None:
        await pool.close()
        engine.dispose()

    queues = [(PgReportingOutbox(pool=pool), PG_LEDGER_QUEUE, close), (PgReportingStatusOutbox(pool=pool),
                                                                       PG_STATUS_QUEUE, None)]
    return [ReportingHandoff(worker=ReportingNotificationWorker(outbox=queue, cipher=cipher, subscriptions=subscriptions),
                             engine=engine, tenant_id=tenant, settings=settings, backlog=pg_backlog(pool, table),
                             close=closer) for queue, table, closer in queues]
