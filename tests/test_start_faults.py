"""A database that fails while the daemon starts, after the schema check (loading the signing
keys): the daemon rides it out as it rides out an outage at the schema check, and starts
delivering once the database answers.

The failure is real: the daemon's role loses, then gets back, the right to read the keyring.
"""

from __future__ import annotations

import uuid

import psycopg
from sqlalchemy.engine import make_url

from tests import procs
from tests.ledger import check_ledger, daemon_events, enqueue_batch, finished, message_key


def test_a_database_failing_after_the_schema_check_is_ridden_out_at_start(pg_engine, pg_url, tmp_path):
    role = f"outboxd_start_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(f'CREATE ROLE "{role}" LOGIN')
        admin.execute(f'GRANT ALL ON ALL TABLES IN SCHEMA public TO "{role}"')
        admin.execute(f'GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO "{role}"')
        admin.execute(f'REVOKE SELECT ON outbox_signing_keys FROM "{role}"')
        try:
            key, jwks = procs.make_key(tmp_path)
            with procs.receiver(tmp_path, jwks, verifier="library") as (port, arrivals_log):
                env = procs.daemon_env(make_url(pg_url).set(username=role).render_as_string(hide_password=False), key)
                log = tmp_path / "daemon.log"
                daemon = procs.start_daemon(env, log)
                try:
                    failing = {"event": "database.error", "doing": "start up"}
                    assert procs.wait_until(lambda: any(failing.items() <= e.items() for e in daemon_events(log)),
                                            30), daemon_events(log)[-3:]
                    assert daemon.poll() is None, log.read_text()[-500:]  # still waiting, not gone
                    admin.execute(f'GRANT SELECT ON outbox_signing_keys TO "{role}"')
                    enqueue_batch(pg_engine, [("t1", f"http://127.0.0.1:{port}/ok", message_key("start", i))
                                              for i in range(5)])
                    assert procs.wait_until(lambda: finished(pg_engine, 5, final=("delivered",)), 60), \
                        daemon_events(log)[-3:]
                    assert procs.stop(daemon) == 0
                finally:
                    if daemon.poll() is None:
                        daemon.kill()
            events = [e.get("event") for e in daemon_events(log)]
            assert "database.recovered" in events and "daemon.started" in events, events
            assert "Traceback" not in log.read_text(errors="replace")
            assert check_ledger(pg_engine, [arrivals_log])["delivered"] == 5
        finally:
            admin.execute(f'DROP OWNED BY "{role}"')
            admin.execute(f'DROP ROLE "{role}"')
