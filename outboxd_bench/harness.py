"""The bench's fixed parts: its options, the scratch database guard, the receivers, the
daemons it starts (``outboxd run`` subprocesses with the operator's settings, defaults
unless tuned) and the producer it plays (the real :func:`outbox.enqueue_task_webhook`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from outbox.claim_sql import DUE_TABLES
from outboxd_bench.certs import make_tls_files
from outboxd_bench.procs import (BENCH_APPLICATION, READY_TIMEOUT, BenchUsageError, Proc, ReceiverProc, spawn,
                                 start_receiver, wait_for)

TENANTS = 10
FEW_ENDPOINTS = 10  # the many-endpoints phase's baseline: as many backlogged endpoints as TENANTS
SETTLE_SECONDS = 1.0  # after "daemon.started": let LISTEN connect before work is committed
SHUTDOWN_GRACE = 2.0
INSUFFICIENT_PRIVILEGE = "42501"  # SQLSTATE of a CHECKPOINT the role may not run
BENCH_KEY_ID = "outboxd-bench"
# outbox_signing_keys too: each run's daemons register that run's throwaway key (keyring bootstrap);
# the recovery jobs too: a job left running would go on replaying into the next run's rows
OUTBOX_TABLES = ("outbox_messages", "outbox_attempts", "outbox_sequences", "outbox_breakers", *DUE_TABLES,
                 "outbox_breaker_transitions", "outbox_signing_keys", "outbox_jobs", "outbox_job_items")
# The operator's knobs, passed through from the configured settings: the daemons run with
# whatever the operator runs (the defaults, unless tuned).
PASS_THROUGH = ("concurrency", "endpoint_concurrency", "claim_batch", "poll_interval_seconds",
                "connect_timeout_seconds", "read_timeout_seconds", "lease_seconds", "retry_base_seconds",
                "retry_max_seconds", "breaker_failure_threshold", "breaker_success_threshold",
                "breaker_open_seconds", "breaker_max_open_seconds", "sinks", "sink_timeout_seconds",
                "retry_horizon_seconds")


@dataclass(frozen=True)
class Options:
    """What ``outboxd bench`` was asked to do (see ``outboxd bench --help``)."""

    messages: int = 3000
    rate: float = 200.0
    duration: float = 10.0
    scale_rows: int = 1_000_000
    bare_concurrency: tuple[int, ...] = (1, 8, 32)
    shared_tenants: int = 100
    origins: int = 8
    tls: bool = True
    json: bool = False
    peer: str | None = None
    only: tuple[str, ...] = ()  # phase names to run (empty: all)
    endpoints: int = 10_000  # backlogged endpoints of the many-endpoints phase
    recovery_messages: int = 10_000  # dead messages of the recovery phase's replay job

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Options":
        raw = str(getattr(args, "bare_concurrency", "1,8,32"))
        try:
            levels = tuple(int(c) for c in raw.split(",") if c.strip())
        except ValueError:
            raise BenchUsageError(f"--bare-concurrency must be integers separated by commas, got {raw!r}") from None
        options = cls(int(getattr(args, "messages", 3000)), float(getattr(args, "rate", 200.0)),
                      float(getattr(args, "duration", 10.0)), int(getattr(args, "scale_rows", 1_000_000)),
                      levels, int(getattr(args, "shared_tenants", 100)), int(getattr(args, "origins", 8)),
                      not bool(getattr(args, "plain_http", False)), bool(getattr(args, "json", False)),
                      getattr(args, "peer", None),
                      tuple(p.strip() for p in str(getattr(args, "only", "") or "").split(",") if p.strip()),
                      int(getattr(args, "endpoints", 10_000)),
                      int(getattr(args, "recovery_messages", 10_000)))
        if options.messages < 1 or not levels or min(levels) < 1:
            raise BenchUsageError("--messages and every --bare-concurrency level must be at least 1")
        if options.rate <= 0 or options.duration <= 0:
            raise BenchUsageError("--rate and --duration must be positive")
        if min(options.scale_rows, options.shared_tenants, options.origins, options.recovery_messages) < 1:
            raise BenchUsageError("--scale-rows, --shared-tenants, --origins and --recovery-messages "
                                  "must be at least 1")
        if options.endpoints <= FEW_ENDPOINTS:
            raise BenchUsageError(f"--endpoints must be more than {FEW_ENDPOINTS}")
        if options.peer not in (None, "adcp"):
            raise BenchUsageError(f"--peer must be adcp, got {options.peer!r}")
        return options

    @property
    def drain_timeout(self) -> float:
        """A throughput phase may take this long: generous, assumes >= 25 deliveries/s."""
        return self.timeout_for(self.messages)

    @staticmethod
    def timeout_for(deliveries: int) -> float:
        """How long a drain of ``deliveries`` may take, as :attr:`drain_timeout` counts it."""
        return 30.0 + deliveries / 25.0


@dataclass
class Bench:
    """One bench run: its scratch directory, engine, receivers and daemons."""

    settings: Any  # outbox.config.Settings
    options: Options
    progress: Callable[[str], None]
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="outboxd-bench-")))

    def __post_init__(self) -> None:
        from outbox.config import load_settings
        from outbox.db import make_engine

        # Named, so the CPU meter leaves out the bench's own statements (its progress polls
        # scan the outbox: they are not the daemon's work).
        self.engine = make_engine(self.settings.database_url, pool_size=2, max_overflow=2,
                                  connect_args={"application_name": BENCH_APPLICATION})
        self.producer_settings = load_settings(env={"OUTBOX_ALLOW_HTTP": "true",
                                                    "OUTBOX_ALLOWED_CIDRS": "127.0.0.0/8"})
        self.daemons: list[Proc] = []
        self.receivers: list[ReceiverProc] = []
        self.run_id = uuid.uuid4().hex[:8]
        self.sample_body = b""
        self.ca_file: Path | None = None
        self.owns_tables = False  # set once preflight found the outbox empty: only then is truncating ours
        self.checkpoints = True  # False once the server refused a CHECKPOINT (the role may not)

    # ----------------------------------------------------------------- setup / teardown

    def preflight(self) -> None:
        from sqlalchemy import text

        from outbox.migrate import current_revision, head_revision

        with self.engine.connect() as conn:
            revision = current_revision(conn)
            if revision != head_revision():
                raise BenchUsageError(f"database schema is at {revision or 'nothing'}, expected {head_revision()}: "
                                      "run `outboxd migrate` first")
            for table in OUTBOX_TABLES:
                if conn.execute(text(f"SELECT EXISTS (SELECT 1 FROM {table})")).scalar():
                    raise BenchUsageError(f"{table} is not empty: the bench truncates the outbox tables, so point "
                                          "OUTBOX_DATABASE_URL at a scratch database (createdb; outboxd migrate)")
        self.owns_tables = True

    def setup(self) -> None:
        from supervisor.wire.signing import generate_signing_key_pem

        self.key_file = self.workdir / "bench-key.pem"
        self.key_file.write_bytes(generate_signing_key_pem())
        self.key_file.chmod(0o600)
        tls = None
        if self.options.tls:
            self.ca_file, cert, key = make_tls_files(self.workdir)
            tls = (cert, key)
        self.receivers = [start_receiver(self.workdir, "receiver", tls=tls),
                          start_receiver(self.workdir, "receiver-2", tls=tls),
                          start_receiver(self.workdir, "receiver-many", listen=self.options.origins, tls=tls)]

    def teardown(self) -> None:
        for daemon in self.daemons:
            daemon.stop(signal.SIGKILL)
        for receiver in self.receivers:
            receiver.proc.stop(signal.SIGKILL)
        try:
            if self.owns_tables:
                self.truncate()  # leave the scratch outbox as empty as we found it
        finally:
            self.engine.dispose()
            shutil.rmtree(self.workdir, ignore_errors=True)

    def truncate(self) -> None:
        from sqlalchemy import text

        with self.engine.begin() as conn:
            conn.execute(text(f"TRUNCATE {', '.join(OUTBOX_TABLES)} RESTART IDENTITY"))

    def checkpoint(self) -> None:
        """``CHECKPOINT``: what was written so far goes to disk now, not while the next
        measurement is timed (docs/performance.md, "How each figure is taken"). A role that
        may not (superuser or ``pg_checkpoint`` may) is told once here and in the report, and
        the bench goes on; any other failure is the phase's."""
        from sqlalchemy import text
        from sqlalchemy.exc import DBAPIError

        if not self.checkpoints:
            return
        try:
            with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.execute(text("CHECKPOINT"))
        except DBAPIError as exc:
            if getattr(exc.orig, "sqlstate", None) != INSUFFICIENT_PRIVILEGE:
                raise
            self.checkpoints = False
            reason = str(exc.orig).splitlines()[0]
            self.progress(f"CHECKPOINT refused ({reason}): phases may carry the writes of the ones before")

    @property
    def main(self) -> ReceiverProc:
        """The one-origin receiver."""
        return self.receivers[0]

    @property
    def aux(self) -> ReceiverProc:
        """The tenth tenant's own origin in the latency runs."""
        return self.receivers[1]

    @property
    def many(self) -> ReceiverProc:
        """One process serving ``--origins`` ports: many origins."""
        return self.receivers[2]

    # ----------------------------------------------------------------- daemons

    def daemon_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        for name in PASS_THROUGH:
            value = getattr(self.settings, name)
            env[f"OUTBOX_{name.upper()}"] = ",".join(value) if isinstance(value, tuple) else str(value)
        env.update({
            "OUTBOX_DATABASE_URL": self.settings.database_url,
            "OUTBOX_SIGNING_KEY_FILE": str(self.key_file),
            "OUTBOX_SIGNING_KEY_ID": BENCH_KEY_ID,
            "OUTBOX_ALLOWED_CIDRS": "127.0.0.0/8",
            "OUTBOX_LOG_FORMAT": "json",
            "OUTBOX_SHUTDOWN_GRACE_SECONDS": str(SHUTDOWN_GRACE),
        })
        if self.ca_file is not None:
            env["OUTBOX_TLS_CA_FILE"] = str(self.ca_file)
        else:
            env["OUTBOX_ALLOW_HTTP"] = "true"
        return env

    def start_daemons(self, count: int, *, tag: str) -> list[Proc]:
        env = self.daemon_env()
        started = []
        for i in range(count):
            proc = spawn(f"daemon-{tag}-{i + 1}", [sys.executable, "-m", "supervisor.cli", "run"],
                         self.workdir / f"daemon-{tag}-{i + 1}.log", env)
            self.daemons.append(proc)
            started.append(proc)
        for proc in started:
            wait_for(f"start {proc.name}", lambda p=proc: "daemon.started" in p.log_tail(100_000),
                     READY_TIMEOUT, proc)
        time.sleep(SETTLE_SECONDS)
        return started

    def stop_daemons(self, procs: Sequence[Proc]) -> None:
        for proc in procs:
            if proc.alive():
                proc.popen.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.stop()
            self.daemons.remove(proc)

    # ----------------------------------------------------------------- producing

    def enqueue(self, conn: Any, i: int, tenant: int, url: str) -> Any:
        """One task webhook through the real producer API, in the caller's transaction."""
        import outbox

        return outbox.enqueue_task_webhook(
            conn, tenant_id=f"bench-tenant-{tenant}", task_id=f"task_{self.run_id}_{i}",
            task_type="create_media_buy", status="completed", settings=self.producer_settings,
            push_notification_config={"url": url, "operation_id": f"op_{self.run_id}_{i}",
                                      "token": "bench-token-0123456789abcdef"},
            result={"media_buy_id": f"mb_{i}", "buyer_ref": f"buyer-ref-{i}", "status": "active",
                    "creative_deadline": "2026-12-01T00:00:00Z",
                    "packages": [{"package_id": f"pkg_{i}_{j}", "buyer_ref": f"pkg-ref-{j}",
                                  "status": "active", "budget": 1500.0 + j, "pacing": "even"}
                                 for j in range(3)]},
            context={"bench": self.run_id})

    def insert_due_sql(self, conn: Any, count: int, url: str, prefix: str, *, tenants: int = TENANTS) -> None:
        """``count`` due messages for ``tenants`` tenants (dealt round-robin), inserted by
        plain SQL (the any-language producer contract)."""
        from sqlalchemy import text

        conn.execute(text("""
            INSERT INTO outbox_messages (tenant_id, url, idempotency_key, body, task_id, task_type, task_status)
            SELECT 'bench-tenant-' || (g % :tenants), :url, k.key,
                   convert_to(json_build_object(
                       'idempotency_key', k.key, 'operation_id', 'op_' || g, 'task_id', 'task_' || g,
                       'task_type', 'create_media_buy', 'status', 'completed',
                       'timestamp', to_char(now() AT TIME ZONE 'utc', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"'),
                       'result', json_build_object('media_buy_id', 'mb_' || g, 'status', 'active',
                                                   'padding', repeat('x', 400)))::text, 'UTF8'),
                   'task_' || g, 'create_media_buy', 'completed'
            FROM generate_series(1, :n) AS g, LATERAL (SELECT :prefix || g AS key) AS k
        """), {"n": count, "url": url, "prefix": f"whk_{prefix}_{self.run_id}_", "tenants": tenants})

    @staticmethod
    def fold_arrivals(conn: Any) -> None:
        """Fold every due arrival into the due tables, as the daemon's claims would: each
        claim folds at most ``FOLD_LIMIT`` (outbox/claim_sql.py), a bulk insert many more."""
        from sqlalchemy import text

        from outbox.store import _STATEMENTS

        while conn.execute(text("SELECT EXISTS (SELECT 1 FROM outbox_due_arrivals)")).scalar():
            conn.execute(_STATEMENTS[True].gather_due)

    def sample(self) -> bytes:
        """A real producer body (enqueued and rolled back) for the bare loop to POST."""
        from sqlalchemy import text

        if not self.sample_body:
            with self.engine.connect() as conn:
                with conn.begin() as txn:
                    message = self.enqueue(conn, 0, 0, self.main.url("/ok"))
                    self.sample_body = bytes(conn.execute(text("SELECT body FROM outbox_messages WHERE id = :id"),
                                                          {"id": message.id}).scalar_one())
                    txn.rollback()
        return self.sample_body
