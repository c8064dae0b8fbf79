"""A database that stops answering without closing anything (a network black hole, a stuck
pooler): the daemon's statements time out, the outage guard counts them, and the daemon
exits non-zero within its bound instead of hanging a claim or a flush for ever.

The black hole is a loopback TCP proxy in this process that, once stalled, still accepts
connections and reads what it is sent (so the client's kernel sees every byte acknowledged)
but forwards nothing either way: neither TCP keepalives nor the TCP user timeout notice it,
only the client's own statement deadline does.
"""

from __future__ import annotations

import time

from tests import procs
from tests.db_proxies import stalling_proxy
from tests.ledger import check_ledger, daemon_events, enqueue_batch, exit_line, finished, message_key


def test_a_black_holed_database_trips_the_outage_guard_within_its_bound(pg_engine, pg_url, tmp_path):
    key, jwks = procs.make_key(tmp_path)
    timeout, outage = 2, 5
    with procs.receiver(tmp_path, jwks, verifier="library") as (port, arrivals_log), \
            stalling_proxy(pg_url) as (proxy, proxied):
        base = f"http://127.0.0.1:{port}/ok"
        env = procs.daemon_env(proxied, key, database_statement_timeout_seconds=timeout,
                               database_outage_seconds=outage)
        log = tmp_path / "through-proxy.log"
        daemon = procs.start_daemon(env, log)
        try:
            enqueue_batch(pg_engine, [("t1", base, message_key("bh", i)) for i in range(5)])
            assert procs.wait_until(lambda: finished(pg_engine, 5, final=("delivered",)), 40), daemon_events(log)[-3:]
            proxy.stall()
            stalled_at = time.monotonic()
            enqueue_batch(pg_engine, [("t1", base, message_key("bh", i)) for i in range(5, 10)])
            # A claim or flush fails after the statement timeout; reconnecting fails after the
            # connect timeout; past the outage deadline the daemon exits (the driver gives up on
            # its other statements within 10 s). Generous on a busy machine, and finite.
            assert daemon.wait(timeout + 10 + outage + 40) != 0
            elapsed = time.monotonic() - stalled_at
        finally:
            procs.stop(daemon)
        causes = {e.get("cause") for e in daemon_events(log) if e.get("event") == "database.error"}
        assert causes & {"timeout", "connection"}, causes
        assert "database unreachable for" in exit_line(log) or "statement timed out" in exit_line(log)
        print(f"\nblack hole: the daemon exited {elapsed:.1f} s after the database stopped answering "
              f"(statement timeout {timeout} s, outage bound {outage} s)")
        # Nothing was lost: a daemon on a working connection finishes the rest.
        daemon = procs.start_daemon(procs.daemon_env(pg_url, key), tmp_path / "direct.log")
        try:
            assert procs.wait_until(lambda: finished(pg_engine, 10, final=("delivered",)), 60)
        finally:
            procs.stop(daemon)
        summary = check_ledger(pg_engine, [arrivals_log])
        assert summary["delivered"] == 10, summary
