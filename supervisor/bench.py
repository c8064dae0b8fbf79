"""``outboxd bench``: throughput, latency, isolation, scale and memory, in one bounded run.

Everything runs for real on this machine against the configured PostgreSQL database:

* the **receiver** is its own process (``python -m supervisor.receiver``, path ``/ok``)
  started *without* ``--jwks``, so it spends no CPU verifying signatures (the daemon still
  signs every request); a second receiver plays the tenth tenant (``/ok``, or ``/hang``
  for the isolation run) so that tenant has an origin of its own;
* the **daemons** are real ``outboxd run`` subprocesses configured by ``OUTBOX_*``
  variables; their CPU and peak RSS come from ``/proc/<pid>/stat`` and ``/status``;
* the **bare loop** is an ``httpx.AsyncClient`` POSTing the same body to the same
  receiver at the same concurrency, in its own process, with no database and no signing:
  the practical ceiling of the HTTP client the daemon uses.

Phases (each has its own timeout, so the run always ends by itself):

1. bare httpx loop: ``--messages`` POSTs (run again after phase 2; the ceiling is the
   better of the two runs, so a burst of background load cannot flatter the daemon);
2. throughput: ``--messages`` messages committed at once, drained by one daemon, then by two;
3. latency: ``--rate`` messages/s for ``--duration`` s, each committed in its own
   transaction across ten tenants; commit time (producer, right after ``COMMIT``) to
   arrival time (receiver log), same machine clock;
4. isolation: the same with the tenth tenant's endpoint accepting and never answering;
5. memory: peak RSS of one daemon facing 10,000 due messages for ``--duration`` s;
6. scale: ``EXPLAIN (ANALYZE, BUFFERS)`` of the claim statement of :mod:`outbox.store`
   with ``--scale-rows`` delivered rows in the table vs none (measured before and after).

Every timed phase also reports where the machine's CPU went (:class:`CpuMeter`),
including ``other``: processes that are not part of the bench. On a small shared box that
column says whether a throughput or latency figure can be trusted.

The bench needs a migrated, **empty** outbox (it truncates the outbox tables between
phases and leaves them empty): point ``OUTBOX_DATABASE_URL`` at a scratch database.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TENANTS = 10
DUE_FOR_RSS = 10_000
SCALE_DUE_ROWS = 1_000  # pending rows present in both scale cases, so the claim has work
SCALE_REPEATS = 31
SCALE_WARMUP = 3
READY_TIMEOUT = 30.0  # a daemon or receiver that does not start within this fails the phase
STOP_TIMEOUT = 20.0
LATENCY_TAIL_TIMEOUT = 15.0  # after the last commit, wait at most this long for arrivals
SCALE_TIMEOUT = 900.0  # seconds for inserting the history rows (statement_timeout)
SETTLE_SECONDS = 1.0  # after "daemon.started": let LISTEN connect before work is committed
POLL = 0.05
SHUTDOWN_GRACE = 2.0
BENCH_KEY_ID = "outboxd-bench"
OUTBOX_TABLES = ("outbox_messages", "outbox_attempts", "outbox_sequences", "outbox_breakers")
# Operator knobs that shape the daemon and are passed through from the configured settings.
PASS_THROUGH = ("claim_batch", "poll_interval_seconds", "connect_timeout_seconds", "read_timeout_seconds",
                "lease_seconds", "retry_base_seconds", "retry_max_seconds", "breaker_failure_threshold",
                "breaker_success_threshold", "breaker_open_seconds", "breaker_max_open_seconds", "sinks",
                "sink_timeout_seconds", "retry_horizon_seconds")
CLK_TCK = os.sysconf("SC_CLK_TCK")
NPROC = os.cpu_count() or 1
NOISY_SHARE = 0.15  # above this share of the box taken by others, a phase's figures are flagged


class PhaseError(Exception):
    """A phase could not produce its figures (timeout, a process that would not start)."""


# --------------------------------------------------------------------------- /proc readings


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a live process, from ``/proc/<pid>/stat``."""
    fields_ = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields_[11]) + int(fields_[12])) / CLK_TCK


def memory_mb(pid: int, field_name: str = "VmHWM") -> float:
    """``VmHWM`` (peak resident set) or ``VmRSS`` of a live process, in MB (10^6 bytes)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) * 1024 / 1e6
    raise PhaseError(f"/proc/{pid}/status has no {field_name}")


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs, from ``/proc/stat``."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values) - idle, sum(values)


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile (no interpolation: every reported value was observed)."""
    ordered = sorted(values)
    if not ordered:
        raise PhaseError("no samples")
    return ordered[max(0, math.ceil(pct / 100 * len(ordered)) - 1)]


class CpuMeter:
    """Where the machine's CPU went during one measurement.

    The box is small (2 cores) and may be shared, so every figure comes with its context:
    CPU of the daemons, the receivers, this process (the producer), the PostgreSQL backends
    serving the bench database, and ``other``: everything else that ran meanwhile
    (PostgreSQL's background writers, other users of the machine).
    """

    def __init__(self, engine: Any, daemons: Sequence[int], receivers: Sequence[int]) -> None:
        self._engine = engine
        self._daemons, self._receivers = list(daemons), list(receivers)

    def _backends(self) -> dict[int, float]:
        from sqlalchemy import text

        with self._engine.connect() as conn:
            pids = conn.execute(text("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")).scalars()
            return {pid: cpu for pid in pids if (cpu := _cpu_or_none(pid)) is not None}

    def start(self) -> "CpuMeter":
        self._backends0 = self._backends()
        self._procs0 = {pid: cpu_seconds(pid) for pid in self._daemons + self._receivers}
        self._self0 = time.process_time()
        self._wall0 = time.perf_counter()
        self._box0 = machine_jiffies()
        return self

    def stop(self, extra_cpu_s: float = 0.0) -> dict[str, float]:
        """``extra_cpu_s``: CPU of a process measured by itself (the bare loop)."""
        busy, total = machine_jiffies()
        wall = time.perf_counter() - self._wall0
        own = time.process_time() - self._self0
        procs = {pid: cpu_seconds(pid) - self._procs0[pid] for pid in self._daemons + self._receivers}
        backends = sum(cpu - self._backends0.get(pid, 0.0) for pid, cpu in self._backends().items())
        box = (busy - self._box0[0]) / CLK_TCK
        daemons = sum(procs[p] for p in self._daemons)
        receivers = sum(procs[p] for p in self._receivers)
        ours = daemons + receivers + backends + own + extra_cpu_s
        return {"wall_s": round(wall, 3), "box_busy": round((busy - self._box0[0]) / max(total - self._box0[1], 1), 3),
                "box_cpu_s": round(box, 2), "daemons_cpu_s": round(daemons, 3), "receiver_cpu_s": round(receivers, 3),
                "postgres_cpu_s": round(backends, 3), "bench_cpu_s": round(own, 3),
                "other_cpu_s": round(max(box - ours, 0.0), 2),
                # share of the whole box taken by processes that are not part of the bench
                "other_share": round(max(box - ours, 0.0) / max(wall * NPROC, 1e-6), 3)}


def _cpu_or_none(pid: int) -> float | None:
    try:
        return cpu_seconds(pid)
    except (OSError, IndexError, ValueError):
        return None


# --------------------------------------------------------------------------- processes


@dataclass
class Proc:
    """A child process with its log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, chars: int = 400) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:].strip().replace("\n", " | ")
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def _spawn(name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> Proc:
    handle = open(log, "ab")
    try:
        popen = subprocess.Popen(argv, env=env, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    finally:
        handle.close()
    return Proc(name, popen, log)


def _wait_for(what: str, predicate: Callable[[], bool], timeout: float, proc: Proc | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and not proc.alive():
            raise PhaseError(f"{what}: {proc.name} exited with {proc.popen.returncode}: {proc.log_tail()}")
        if time.monotonic() > deadline:
            raise PhaseError(f"{what}: not within {timeout:.0f} s")
        time.sleep(POLL)


@dataclass
class ReceiverProc:
    proc: Proc
    port: int
    arrivals: Path

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def offset(self) -> int:
        return self.arrivals.stat().st_size

    def read_from(self, offset: int) -> list[dict[str, Any]]:
        with open(self.arrivals, "rb") as handle:
            handle.seek(offset)
            data = handle.read()
        rows = []
        for line in data.splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a line being written right now
        return rows


def start_receiver(workdir: Path, name: str) -> ReceiverProc:
    port_file, arrivals = workdir / f"{name}.port", workdir / f"{name}.jsonl"
    arrivals.touch()
    proc = _spawn(name, [sys.executable, "-m", "supervisor.receiver", "--port-file", str(port_file),
                         "--log", str(arrivals)], workdir / f"{name}.out")
    _wait_for(f"start {name}", port_file.exists, READY_TIMEOUT, proc)
    return ReceiverProc(proc, int(port_file.read_text()), arrivals)


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class Options:
    messages: int
    rate: float
    duration: float
    concurrency: int
    scale_rows: int
    json: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Options":
        from supervisor.cli import UserError

        options = cls(int(getattr(args, "messages", 3000)), float(getattr(args, "rate", 200.0)),
                      float(getattr(args, "duration", 10.0)), int(getattr(args, "concurrency", 32)),
                      int(getattr(args, "scale_rows", 1_000_000)), bool(getattr(args, "json", False)))
        if options.messages < 1 or options.concurrency < 1:
            raise UserError("--messages and --concurrency must be at least 1")
        if options.rate <= 0 or options.duration <= 0:
            raise UserError("--rate and --duration must be positive")
        if options.scale_rows < 1:
            raise UserError("--scale-rows must be at least 1")
        return options

    @property
    def drain_timeout(self) -> float:
        """A throughput phase may take this long: generous, assumes >= 25 deliveries/s."""
        return 30.0 + self.messages / 25.0


# --------------------------------------------------------------------------- the run


@dataclass
class Bench:
    settings: Any  # outbox.config.Settings
    options: Options
    progress: Callable[[str], None]
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="outboxd-bench-")))

    def __post_init__(self) -> None:
        from outbox.config import load_settings
        from outbox.db import make_engine

        self.engine = make_engine(self.settings.database_url, pool_size=2, max_overflow=2)
        self.producer_settings = load_settings(env={"OUTBOX_ALLOW_HTTP": "true",
                                                    "OUTBOX_ALLOWED_CIDRS": "127.0.0.0/8"})
        self.daemons: list[Proc] = []
        self.receivers: list[ReceiverProc] = []
        self.run_id = uuid.uuid4().hex[:8]
        self.sample_body = b""
        self.owns_tables = False  # set once preflight found the outbox empty: only then is truncating ours

    # ----------------------------------------------------------------- setup / teardown

    def preflight(self) -> None:
        from sqlalchemy import text

        from outbox.migrate import current_revision, head_revision
        from supervisor.cli import UserError

        with self.engine.connect() as conn:
            revision = current_revision(conn)
            if revision != head_revision():
                raise UserError(f"database schema is at {revision or 'nothing'}, expected {head_revision()}: "
                                "run `outboxd migrate` first")
            for table in OUTBOX_TABLES:
                if conn.execute(text(f"SELECT EXISTS (SELECT 1 FROM {table})")).scalar():
                    raise UserError(f"{table} is not empty: the bench truncates the outbox tables, so point "
                                    "OUTBOX_DATABASE_URL at a scratch database (createdb; outboxd migrate)")
        self.owns_tables = True

    def setup(self) -> None:
        from supervisor.signing import generate_signing_key_pem

        self.key_file = self.workdir / "bench-key.pem"
        self.key_file.write_bytes(generate_signing_key_pem())
        self.key_file.chmod(0o600)
        self.receivers = [start_receiver(self.workdir, "receiver"), start_receiver(self.workdir, "receiver-2")]

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

    @property
    def main(self) -> ReceiverProc:
        return self.receivers[0]

    @property
    def aux(self) -> ReceiverProc:
        return self.receivers[1]

    # ----------------------------------------------------------------- daemons

    def daemon_env(self, *, endpoint_concurrency: int | None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        for name in PASS_THROUGH:
            value = getattr(self.settings, name)
            env[f"OUTBOX_{name.upper()}"] = ",".join(value) if isinstance(value, tuple) else str(value)
        env.update({
            "OUTBOX_DATABASE_URL": self.settings.database_url,
            "OUTBOX_SIGNING_KEY_FILE": str(self.key_file),
            "OUTBOX_SIGNING_KEY_ID": BENCH_KEY_ID,
            "OUTBOX_ALLOW_HTTP": "true",
            "OUTBOX_ALLOWED_CIDRS": "127.0.0.0/8",
            "OUTBOX_LOG_FORMAT": "json",
            "OUTBOX_CONCURRENCY": str(self.options.concurrency),
            "OUTBOX_SHUTDOWN_GRACE_SECONDS": str(SHUTDOWN_GRACE),
            # None: the operator's per-origin cap (latency runs); throughput runs, whose
            # messages all go to one origin, lift it to the global concurrency.
            "OUTBOX_ENDPOINT_CONCURRENCY": str(endpoint_concurrency or self.settings.endpoint_concurrency),
        })
        return env

    def start_daemons(self, count: int, *, endpoint_concurrency: int | None, tag: str) -> list[Proc]:
        env = self.daemon_env(endpoint_concurrency=endpoint_concurrency)
        started = []
        for i in range(count):
            proc = _spawn(f"daemon-{tag}-{i + 1}", [sys.executable, "-m", "supervisor.cli", "run"],
                          self.workdir / f"daemon-{tag}-{i + 1}.log", env)
            self.daemons.append(proc)
            started.append(proc)
        for proc in started:
            _wait_for(f"start {proc.name}", lambda p=proc: "daemon.started" in p.log_tail(100_000),
                      READY_TIMEOUT, proc)
        return started

    def stop_daemons(self, procs: Sequence[Proc]) -> None:
        for proc in procs:
            if proc.alive():
                proc.popen.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.stop()
            self.daemons.remove(proc)

    # ----------------------------------------------------------------- producing

    def _enqueue(self, conn: Any, i: int, tenant: int, url: str) -> Any:
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

    def insert_due_sql(self, conn: Any, count: int, url: str, prefix: str) -> None:
        """``count`` due messages inserted by plain SQL (the any-language producer contract)."""
        from sqlalchemy import text

        conn.execute(text("""
            INSERT INTO outbox_messages (tenant_id, url, idempotency_key, body, task_id, task_type, task_status)
            SELECT 'bench-tenant-' || (g % 10), :url, k.key,
                   convert_to(json_build_object(
                       'idempotency_key', k.key, 'operation_id', 'op_' || g, 'task_id', 'task_' || g,
                       'task_type', 'create_media_buy', 'status', 'completed',
                       'timestamp', to_char(now() AT TIME ZONE 'utc', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"'),
                       'result', json_build_object('media_buy_id', 'mb_' || g, 'status', 'active',
                                                   'padding', repeat('x', 400)))::text, 'UTF8'),
                   'task_' || g, 'create_media_buy', 'completed'
            FROM generate_series(1, :n) AS g, LATERAL (SELECT :prefix || g AS key) AS k
        """), {"n": count, "url": url, "prefix": f"whk_{prefix}_{self.run_id}_"})

    # ----------------------------------------------------------------- phase 1: bare loop

    def phase_bare(self) -> dict[str, Any]:
        self.truncate()
        if not self.sample_body:
            with self.engine.connect() as conn:
                with conn.begin() as txn:  # a real producer body, rolled back
                    self.sample_body = bytes(self._sample_body(conn))
                    txn.rollback()
        body_file = self.workdir / "body.json"
        body_file.write_bytes(self.sample_body)
        out = self.workdir / "bare.json"
        meter = CpuMeter(self.engine, [], [self.main.proc.pid]).start()
        proc = _spawn("bare-httpx", [sys.executable, "-m", "supervisor.bench", "bare", self.main.url("/ok"),
                                     str(self.options.messages), str(self.options.concurrency), str(body_file),
                                     str(out)], self.workdir / "bare.log")
        try:
            proc.popen.wait(self.options.drain_timeout)
        except subprocess.TimeoutExpired:
            proc.stop(signal.SIGKILL)
            raise PhaseError(f"bare loop did not finish {self.options.messages} POSTs in "
                             f"{self.options.drain_timeout:.0f} s") from None
        if proc.popen.returncode != 0 or not out.exists():
            raise PhaseError(f"bare loop failed: {proc.log_tail()}")
        result = json.loads(out.read_text())
        result["cpu"] = meter.stop(extra_cpu_s=result["process_cpu_s"])
        return result

    def _sample_body(self, conn: Any) -> bytes:
        from sqlalchemy import text

        message = self._enqueue(conn, 0, 0, self.main.url("/ok"))
        return conn.execute(text("SELECT body FROM outbox_messages WHERE id = :id"), {"id": message.id}).scalar_one()

    # ----------------------------------------------------------------- phase 2: throughput

    def phase_throughput(self, daemons: int) -> dict[str, Any]:
        from sqlalchemy import text

        n = self.options.messages
        self.truncate()
        procs = self.start_daemons(daemons, endpoint_concurrency=self.options.concurrency, tag=f"tput{daemons}")
        try:
            time.sleep(SETTLE_SECONDS)
            url = self.main.url("/ok")
            enqueue_started = time.perf_counter()
            with self.engine.connect() as conn:
                with conn.begin():
                    for i in range(n):
                        self._enqueue(conn, i, i % TENANTS, url)
                    enqueue_seconds = time.perf_counter() - enqueue_started
                    cpu0 = {p.pid: cpu_seconds(p.pid) for p in procs}
                    meter = CpuMeter(self.engine, [p.pid for p in procs], [self.main.proc.pid]).start()
                committed = conn.execute(text("SELECT extract(epoch from clock_timestamp())::float8")).scalar_one()
            deadline = time.monotonic() + self.options.drain_timeout
            done = 0
            while True:
                with self.engine.connect() as conn:
                    done = conn.execute(text("SELECT count(*) FROM outbox_messages "
                                             "WHERE state IN ('delivered', 'dead')")).scalar_one()
                if done >= n:
                    break
                for p in procs:
                    if not p.alive():
                        raise PhaseError(f"{p.name} exited with {p.popen.returncode}: {p.log_tail()}")
                if time.monotonic() > deadline:
                    raise PhaseError(f"{daemons} daemon(s) finished {done}/{n} in {self.options.drain_timeout:.0f} s")
                time.sleep(POLL)
            cpu = {p.pid: cpu_seconds(p.pid) - cpu0[p.pid] for p in procs}
            usage = meter.stop()
            peak = {p.name: round(memory_mb(p.pid), 1) for p in procs}
            with self.engine.connect() as conn:
                states = dict(conn.execute(text("SELECT state, count(*) FROM outbox_messages GROUP BY state")).all())
                last = conn.execute(text("SELECT max(finished_at) FROM outbox_messages")).scalar_one()
                split = sorted(conn.execute(text("SELECT count(*) FROM outbox_attempts WHERE outcome = 'success' "
                                                 "GROUP BY daemon_id")).scalars().all(), reverse=True)
        finally:
            self.stop_daemons(procs)
        delivered = states.get("delivered", 0)
        if delivered == 0:
            raise PhaseError(f"nothing delivered: {states}")
        seconds = max(float(last) - float(committed), 1e-6)
        total_cpu = sum(cpu.values())
        return {
            "daemons": daemons, "messages": n, "delivered": delivered, "dead": states.get("dead", 0),
            "seconds": round(seconds, 3), "deliveries_per_s": round(delivered / seconds, 1),
            "cpu_s": round(total_cpu, 3), "cpu_s_per_1000": round(total_cpu / delivered * 1000, 3),
            "cpu_s_per_daemon": [round(c, 3) for c in cpu.values()],
            "peak_rss_mb": max(peak.values()), "peak_rss_mb_per_daemon": peak,
            "deliveries_per_daemon": split,
            "postgres_cpu_s_per_1000": round(usage["postgres_cpu_s"] / delivered * 1000, 3),
            "cpu": usage, "enqueue_seconds": round(enqueue_seconds, 3),
            "endpoint_concurrency": self.options.concurrency,
        }

    # ----------------------------------------------------------------- phases 3-4: latency

    def phase_latency(self, *, hang: bool) -> dict[str, Any]:
        self.truncate()
        procs = self.start_daemons(1, endpoint_concurrency=None, tag="hang" if hang else "latency")
        try:
            time.sleep(SETTLE_SECONDS)
            return self._offer_load(hang=hang, daemon=procs[0])
        finally:
            self.stop_daemons(procs)

    def _offer_load(self, *, hang: bool, daemon: Proc) -> dict[str, Any]:
        rate, duration = self.options.rate, self.options.duration
        count = max(1, int(rate * duration))
        offsets = (self.main.offset(), self.aux.offset())
        healthy_url, tenth_url = self.main.url("/ok"), self.aux.url("/hang" if hang else "/ok")
        commits: dict[str, tuple[float, int]] = {}
        meter = CpuMeter(self.engine, [daemon.pid], [r.proc.pid for r in self.receivers]).start()
        started = time.monotonic()
        stop_at = started + duration * 1.5 + 5  # a producer that cannot keep up stops here
        with self.engine.connect() as conn:
            for i in range(count):
                delay = started + i / rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                elif time.monotonic() > stop_at:
                    break
                tenant = i % TENANTS
                with conn.begin():  # each message in its own transaction
                    message = self._enqueue(conn, i, tenant, tenth_url if tenant == TENANTS - 1 else healthy_url)
                commits[message.idempotency_key] = (time.time(), tenant)
        produced_seconds = time.monotonic() - started
        expected = {k for k, (_, tenant) in commits.items() if not (hang and tenant == TENANTS - 1)}
        arrived: dict[str, float] = {}
        deadline = time.monotonic() + LATENCY_TAIL_TIMEOUT
        while True:
            for receiver, offset in zip(self.receivers, offsets):
                for row in receiver.read_from(offset):
                    key = row.get("key")
                    if key in commits and key not in arrived:
                        arrived[key] = float(row["t"])
            if expected <= arrived.keys() or time.monotonic() > deadline:
                break
            time.sleep(POLL * 4)
        usage = meter.stop()
        latencies = [(arrived[k] - commits[k][0]) * 1000 for k in expected if k in arrived]
        if not latencies:
            raise PhaseError("no message arrived")
        result = {
            "offered": len(commits), "offered_rate_per_s": round(len(commits) / produced_seconds, 1),
            "tenants": TENANTS, "measured_tenants": TENANTS - 1 if hang else TENANTS,
            "arrived": len(latencies), "missing": len(expected) - len(latencies),
            "p50_ms": round(percentile(latencies, 50), 2), "p95_ms": round(percentile(latencies, 95), 2),
            "p99_ms": round(percentile(latencies, 99), 2), "max_ms": round(max(latencies), 2),
            "mean_ms": round(statistics.fmean(latencies), 2),
            "daemon_cpu_s_per_1000": round(usage["daemons_cpu_s"] / len(commits) * 1000, 3),
            "cpu": usage, "daemon_peak_rss_mb": round(memory_mb(daemon.pid), 1),
        }
        if hang:  # requests that reached /hang (logged on arrival) and were never answered
            result["hanging_tenant_requests"] = sum(1 for k, (_, t) in commits.items()
                                                    if t == TENANTS - 1 and k in arrived)
        return result

    # ----------------------------------------------------------------- phase 5: memory

    def phase_rss(self) -> dict[str, Any]:
        from sqlalchemy import text

        self.truncate()
        with self.engine.begin() as conn:
            self.insert_due_sql(conn, DUE_FOR_RSS, self.main.url("/ok"), "rss")
        procs = self.start_daemons(1, endpoint_concurrency=self.options.concurrency, tag="rss")
        daemon = procs[0]
        try:
            window_end = time.monotonic() + self.options.duration
            rss_samples = []
            remaining = DUE_FOR_RSS
            while time.monotonic() < window_end:
                rss_samples.append(memory_mb(daemon.pid, "VmRSS"))
                with self.engine.connect() as conn:
                    remaining = conn.execute(text("SELECT count(*) FROM outbox_messages "
                                                  "WHERE state IN ('pending', 'in_flight')")).scalar_one()
                if remaining == 0 or not daemon.alive():
                    break
                time.sleep(0.2)
            if not daemon.alive():
                raise PhaseError(f"{daemon.name} exited: {daemon.log_tail()}")
            peak = memory_mb(daemon.pid)
        finally:
            self.stop_daemons(procs)
        return {"due_at_start": DUE_FOR_RSS, "still_due_at_end": remaining, "window_s": self.options.duration,
                "peak_rss_mb": round(peak, 1), "max_sampled_rss_mb": round(max(rss_samples), 1)}

    # ----------------------------------------------------------------- phase 6: scale

    def phase_scale(self) -> dict[str, Any]:
        """Empty, scaled, empty again: the empty figure pools both runs, so a drift in the
        machine's background load during the long insert does not masquerade as a scale effect."""
        before = self._claim_case(0)
        scaled = self._claim_case(self.options.scale_rows)
        after = self._claim_case(0)
        empty = dict(before)
        for key in ("execution_ms", "planning_ms", "client_wall_ms"):
            samples = before.pop(f"{key}_samples") + after.pop(f"{key}_samples")
            empty[key] = round(statistics.median(samples), 3)
            empty.pop(f"{key}_samples", None)
            scaled.pop(f"{key}_samples")
        empty["execution_ms_before_after"] = [before["execution_ms"], after["execution_ms"]]
        return {"empty": empty, "scaled": scaled,
                "time_ratio": round(scaled["execution_ms"] / max(empty["execution_ms"], 1e-6), 3)}

    def _claim_case(self, history: int) -> dict[str, Any]:
        from sqlalchemy import text

        self.truncate()
        insert_seconds = 0.0
        with self.engine.begin() as conn:
            conn.execute(text(f"SET LOCAL statement_timeout = '{int(SCALE_TIMEOUT)}s'"))
            if history:
                self.progress(f"inserting {history:,} delivered rows")
                started = time.perf_counter()
                self._insert_history(conn, history)
                insert_seconds = time.perf_counter() - started
            self.insert_due_sql(conn, SCALE_DUE_ROWS, self.main.url("/ok"), "scale")
        with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f"SET statement_timeout = '{int(SCALE_TIMEOUT)}s'"))
            conn.execute(text("VACUUM (ANALYZE) outbox_messages"))  # what autovacuum would soon do
            conn.execute(text("RESET statement_timeout"))
            try:  # write the fresh pages back now, not while the claim is being timed
                conn.execute(text("CHECKPOINT"))
            except Exception:  # not a superuser: measure anyway
                pass
            size = conn.execute(text("SELECT pg_total_relation_size('outbox_messages')")).scalar_one()
        executions, plannings, walls, buffers, plan = [], [], [], [], ""
        for i in range(SCALE_WARMUP + SCALE_REPEATS):
            execution, planning, lines = self._explain_claim()
            wall = self._timed_claim()
            if i >= SCALE_WARMUP:
                executions.append(execution)
                plannings.append(planning)
                walls.append(wall)
                hits = re.search(r"shared hit=(\d+)", "\n".join(lines))  # the top node's: the whole statement
                buffers.append(int(hits.group(1)) if hits else 0)
                plan = plan or "\n".join(lines)
        return {
            "history_rows": history, "due_rows": SCALE_DUE_ROWS, "limit": self._claim_limit(),
            "execution_ms": round(statistics.median(executions), 3),
            "planning_ms": round(statistics.median(plannings), 3),
            "client_wall_ms": round(statistics.median(walls), 3),
            "execution_ms_samples": executions, "planning_ms_samples": plannings, "client_wall_ms_samples": walls,
            "shared_buffers_hit": int(statistics.median(buffers)),
            "uses_due_idx": "outbox_messages_due_idx" in plan, "plan": plan,
            "insert_seconds": round(insert_seconds, 1), "table_mb": round(size / 1e6, 1),
        }

    def _claim_limit(self) -> int:
        return min(self.options.concurrency, self.settings.claim_batch)

    def _claim_params(self) -> dict[str, Any]:
        return {"limit": self._claim_limit(), "lease": 30.0, "horizon": 86_400, "daemon": "bench",
                "token": uuid.uuid4().hex, "busy": []}

    def _explain_claim(self) -> tuple[float, float, list[str]]:
        """EXPLAIN (ANALYZE, BUFFERS) of the daemon's claim, in a transaction rolled back."""
        from sqlalchemy import text

        from outbox.store import _STATEMENTS

        claim = _STATEMENTS[True].claim  # the very statement the daemon runs, with its bind types
        statement = text("EXPLAIN (ANALYZE, BUFFERS) " + claim.text).bindparams(*claim._bindparams.values())
        with self.engine.connect() as conn:
            with conn.begin() as txn:
                lines = [row[0] for row in conn.execute(statement, self._claim_params())]
                txn.rollback()
        found = {m.group(1): float(m.group(2)) for m in
                 (re.match(r"(Execution|Planning) Time: ([\d.]+) ms", ln) for ln in lines) if m}
        return found["Execution"], found.get("Planning", 0.0), lines

    def _timed_claim(self) -> float:
        """The claim as the daemon sends it, timed from the client (round trip included)."""
        from outbox.store import _STATEMENTS

        with self.engine.connect() as conn:
            with conn.begin() as txn:
                started = time.perf_counter()
                conn.execute(_STATEMENTS[True].claim, self._claim_params()).all()
                elapsed = (time.perf_counter() - started) * 1000
                txn.rollback()
        return elapsed

    def _insert_history(self, conn: Any, rows: int) -> None:
        from sqlalchemy import text

        conn.execute(text("""
            INSERT INTO outbox_messages (tenant_id, url, origin, idempotency_key, body, body_sha256, task_id,
                task_type, task_status, state, attempts, created_at, next_attempt_at, first_attempt_at,
                retry_until, last_status, finished_at)
            SELECT 'hist-tenant-' || (g % 100), 'https://buyer-' || (g % 100) || '.example/adcp/webhooks',
                   'https://buyer-' || (g % 100) || '.example', k.key, b.body, sha256(b.body),
                   'task_' || g, 'create_media_buy', 'completed', 'delivered', 1, t.at, t.at, t.at,
                   t.at + 86400, 200, t.at + 0.05
            FROM generate_series(1, :n) AS g,
                 LATERAL (SELECT 'whk_hist_' || :run || '_' || g AS key) AS k,
                 LATERAL (SELECT extract(epoch from now())::float8 - 604800 * (1 - g::float8 / :n) AS at) AS t,
                 LATERAL (SELECT convert_to(json_build_object(
                     'idempotency_key', k.key, 'operation_id', 'op_' || g, 'task_id', 'task_' || g,
                     'task_type', 'create_media_buy', 'status', 'completed',
                     'result', json_build_object('media_buy_id', 'mb_' || g, 'padding', repeat('x', 400))
                 )::text, 'UTF8') AS body) AS b
        """), {"n": rows, "run": self.run_id})


# --------------------------------------------------------------------------- the report


def machine_info(engine: Any) -> dict[str, Any]:
    from importlib.metadata import version

    from sqlalchemy import text

    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    with engine.connect() as conn:
        pg = conn.execute(text("SHOW server_version")).scalar_one()
        pg_settings = {name: conn.execute(text(f"SHOW {name}")).scalar_one()
                       for name in ("shared_buffers", "synchronous_commit", "max_connections")}
    return {"nproc": len(os.sched_getaffinity(0)), "cpu_model": model, "postgresql": pg,
            "postgresql_settings": pg_settings, "python": platform.python_version(),
            "httpx": version("httpx"), "loadavg_at_start": Path("/proc/loadavg").read_text().split()[:3]}


def best_bare(phases: dict[str, Any]) -> dict[str, Any]:
    """The bare loop ran before and after the daemons; the ceiling is its better run."""
    runs = [phases[k] for k in ("bare_httpx", "bare_httpx_again") if k in phases]
    return max(runs, key=lambda r: r["requests_per_s"])


def figures(report: dict[str, Any]) -> dict[str, float]:
    """The headline numbers, flat, units in the names."""
    ph = report["phases"]
    one, two, bare = ph["throughput_one_daemon"], ph["throughput_two_daemons"], best_bare(ph)
    healthy, iso, scale, rss = ph["latency_healthy"], ph["latency_isolation"], ph["scale"], ph["rss_10k_due"]
    return {
        "one_daemon_deliveries_per_s": one["deliveries_per_s"],
        "one_daemon_cpu_s_per_1000": one["cpu_s_per_1000"],
        "one_daemon_peak_rss_mb": one["peak_rss_mb"],
        "two_daemons_deliveries_per_s": two["deliveries_per_s"],
        "two_daemons_cpu_s_per_1000": two["cpu_s_per_1000"],
        "two_daemons_peak_rss_mb": two["peak_rss_mb"],
        "bare_httpx_requests_per_s": bare["requests_per_s"],
        "bare_httpx_cpu_s_per_1000": bare["cpu_s_per_1000"],
        "ratio_one_daemon_to_bare": round(one["deliveries_per_s"] / bare["requests_per_s"], 3),
        "ratio_two_daemons_to_one": round(two["deliveries_per_s"] / one["deliveries_per_s"], 3),
        "latency_p50_ms": healthy["p50_ms"],
        "latency_p95_ms": healthy["p95_ms"],
        "latency_p99_ms": healthy["p99_ms"],
        "isolation_healthy_p50_ms": iso["p50_ms"],
        "isolation_healthy_p95_ms": iso["p95_ms"],
        "isolation_healthy_p99_ms": iso["p99_ms"],
        "isolation_p99_ratio": round(iso["p99_ms"] / healthy["p99_ms"], 3),
        "claim_ms_empty": scale["empty"]["execution_ms"],
        "claim_ms_scaled": scale["scaled"]["execution_ms"],
        "claim_time_ratio": scale["time_ratio"],
        "rss_mb_10k_due": rss["peak_rss_mb"],
    }


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    f, ph, o = report["figures"], report["phases"], report["options"]
    scale = ph["scale"]
    rows = [
        ("one daemon >= 0.8 x bare httpx loop", f["ratio_one_daemon_to_bare"], ">= 0.8",
         f["ratio_one_daemon_to_bare"] >= 0.8),
        ("two daemons >= 1.6 x one", f["ratio_two_daemons_to_one"], ">= 1.6", f["ratio_two_daemons_to_one"] >= 1.6),
        (f"p50 <= 10 ms at {o['rate']:g} msg/s", f["latency_p50_ms"], "<= 10 ms", f["latency_p50_ms"] <= 10),
        (f"p99 <= 50 ms at {o['rate']:g} msg/s", f["latency_p99_ms"], "<= 50 ms", f["latency_p99_ms"] <= 50),
        ("isolation: healthy p99 within 2x of all-healthy p99", f["isolation_p99_ratio"], "<= 2.0",
         f["isolation_p99_ratio"] <= 2.0),
        (f"claim time within +-20% with {o['scale_rows']:,} delivered rows", f["claim_time_ratio"], "0.8..1.2",
         0.8 <= f["claim_time_ratio"] <= 1.2),
        ("claim plan uses outbox_messages_due_idx (empty and scaled)",
         f"{scale['empty']['uses_due_idx']}/{scale['scaled']['uses_due_idx']}", "True/True",
         scale["empty"]["uses_due_idx"] and scale["scaled"]["uses_due_idx"]),
        ("daemon RSS <= 200 MB with 10,000 due", f["rss_mb_10k_due"], "<= 200 MB", f["rss_mb_10k_due"] <= 200),
    ]
    return [{"target": t, "value": v, "threshold": th, "pass": bool(ok)} for t, v, th, ok in rows]


def render_table(report: dict[str, Any]) -> str:
    m, o, ph = report["machine"], report["options"], report["phases"]
    lines = [
        f"outboxd bench: {m['nproc']} CPU(s) {m['cpu_model']}, PostgreSQL {m['postgresql']}, "
        f"Python {m['python']}, httpx {m['httpx']}",
        "receiver: separate process, path /ok, started WITHOUT --jwks: it does not spend CPU verifying "
        "signatures (the daemon still signs every request); the tenth tenant has a receiver (origin) of its own",
        f"daemon: OUTBOX_CONCURRENCY={o['concurrency']}; throughput and memory runs set "
        f"OUTBOX_ENDPOINT_CONCURRENCY={o['concurrency']} (one receiver origin), latency runs keep "
        f"{report['settings']['endpoint_concurrency']}",
        "",
    ]
    errors = report.get("errors", {})
    one, two, bare = (ph.get(k) for k in ("throughput_one_daemon", "throughput_two_daemons", "bare_httpx"))
    lines.append(f"THROUGHPUT: {o['messages']} messages committed at once, drained; concurrency {o['concurrency']}")
    lines.append(f"  {'':17}{'per s':>8}{'CPU s/1000':>11}{'PG s/1000':>10}{'peak RSS MB':>12}{'wall s':>8}"
                 f"{'recv CPU s':>11}{'box busy':>9}{'other CPU s':>12}")
    rows = (("one daemon", one, "deliveries_per_s"), ("two daemons", two, "deliveries_per_s"),
            ("bare httpx, 1st", bare, "requests_per_s"), ("bare httpx, 2nd", ph.get("bare_httpx_again"), "requests_per_s"))
    for label, r, rate in rows:
        if r is None:
            continue
        pg = f"{r['postgres_cpu_s_per_1000']:.3f}" if "postgres_cpu_s_per_1000" in r else "-"
        c = r["cpu"]
        lines.append(f"  {label:17}{r[rate]:>8.1f}{r['cpu_s_per_1000']:>11.3f}{pg:>10}{r['peak_rss_mb']:>12.1f}"
                     f"{r['seconds']:>8.2f}{c['receiver_cpu_s']:>11.2f}{c['box_busy']:>9.0%}{c['other_cpu_s']:>12.2f}")
    if two is not None:
        lines.append(f"  deliveries per daemon (two): {two['deliveries_per_daemon']}")
    f = report.get("figures", {})
    if f:
        lines.append(f"  ratio one daemon / bare = {f['ratio_one_daemon_to_bare']:.2f}; "
                     f"two daemons / one = {f['ratio_two_daemons_to_one']:.2f}")
    lines.append("  (CPU s/1000: the daemon(s), or the bare loop; PG: the backends serving this database; "
                 "other: the rest of the box, incl. other users)")
    lines.append("")
    lines.append(f"LATENCY commit -> arrival: {o['rate']:g} msg/s offered for {o['duration']:g} s, "
                 f"{TENANTS} tenants, one transaction per message")
    lines.append(f"  {'':27}{'sent':>6}{'rate/s':>8}{'arrived':>8}{'p50 ms':>8}{'p95 ms':>8}{'p99 ms':>8}"
                 f"{'max ms':>8}{'CPU ms/msg':>11}{'box busy':>9}")
    for label, key in (("all healthy", "latency_healthy"), ("1 hangs (own origin): 9", "latency_isolation")):
        r = ph.get(key)
        if r is not None:
            lines.append(f"  {label:27}{r['offered']:>6}{r['offered_rate_per_s']:>8.1f}{r['arrived']:>8}"
                         f"{r['p50_ms']:>8.1f}{r['p95_ms']:>8.1f}{r['p99_ms']:>8.1f}{r['max_ms']:>8.1f}"
                         f"{r['daemon_cpu_s_per_1000']:>11.2f}{r['cpu']['box_busy']:>9.0%}")
    lines.append("")
    scale = ph.get("scale")
    if scale is not None:
        lines.append(f"SCALE: claim statement (outbox/store.py), LIMIT {scale['empty']['limit']}, "
                     f"{SCALE_DUE_ROWS} due rows, median of {SCALE_REPEATS} "
                     f"(empty: {2 * SCALE_REPEATS}, measured before and after)")
        lines.append(f"  {'':26}{'exec ms':>9}{'plan ms':>9}{'client ms':>11}{'buffers':>9}{'table MB':>10}  due_idx")
        for label, key in (("empty history", "empty"), (f"{o['scale_rows']:,} delivered", "scaled")):
            r = scale[key]
            lines.append(f"  {label:26}{r['execution_ms']:>9.3f}{r['planning_ms']:>9.3f}{r['client_wall_ms']:>11.3f}"
                         f"{r['shared_buffers_hit']:>9}{r['table_mb']:>10.1f}  {'yes' if r['uses_due_idx'] else 'NO'}")
        lines.append("")
    rss = ph.get("rss_10k_due")
    if rss is not None:
        lines.append(f"MEMORY: one daemon with {rss['due_at_start']:,} due: peak RSS {rss['peak_rss_mb']:.1f} MB "
                     f"({rss['still_due_at_end']:,} still due after {rss['window_s']:g} s)")
        lines.append("")
    if report.get("targets"):
        lines.append("TARGETS")
        for t in report["targets"]:
            value = t["value"] if isinstance(t["value"], str) else f"{t['value']:g}"
            lines.append(f"  [{'PASS' if t['pass'] else 'FAIL'}] {t['target']}: {value} (target {t['threshold']})")
    noisy = {k: v["cpu"]["other_share"] for k, v in ph.items()
             if isinstance(v, dict) and "cpu" in v and v["cpu"]["other_share"] > NOISY_SHARE}
    if noisy:
        lines.append("")
        lines.append("WARNING: other processes on this machine took CPU during: " +
                     ", ".join(f"{k} ({share:.0%} of the box)" for k, share in noisy.items()) +
                     "; throughput and latency there are understated: rerun on a quiet machine")
    for phase, error in errors.items():
        lines.append(f"  [ERROR] {phase}: {error}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- entry points


def run_bench(settings: Any, args: argparse.Namespace) -> int:
    """``outboxd bench``: run every phase, print the table (or JSON); 0 when every figure was measured."""
    from outbox.db import is_postgresql
    from supervisor.cli import UserError

    if not is_postgresql(settings.database_url):
        raise UserError("bench needs PostgreSQL: set OUTBOX_DATABASE_URL=postgresql://... "
                        "(SQLite is a single-process embedded store and is not benchmarked)")
    options = Options.from_args(args)

    def progress(message: str) -> None:
        print(f"outboxd bench: {message}", file=sys.stderr, flush=True)

    bench = Bench(settings, options, progress)
    report: dict[str, Any] = {"options": {k: getattr(options, k) for k in
                                          ("messages", "rate", "duration", "concurrency", "scale_rows")},
                              "settings": {"claim_batch": settings.claim_batch,
                                           "endpoint_concurrency": settings.endpoint_concurrency,
                                           "poll_interval_seconds": settings.poll_interval_seconds},
                              "receiver": {"path": "/ok", "verifies_signatures": False},
                              "phases": {}, "errors": {}}
    try:
        bench.preflight()
        report["machine"] = machine_info(bench.engine)
        bench.setup()
        phases: list[tuple[str, str, Callable[[], dict[str, Any]]]] = [
            ("bare_httpx", f"bare httpx loop: {options.messages} POSTs", bench.phase_bare),
            ("throughput_one_daemon", f"one daemon drains {options.messages}", lambda: bench.phase_throughput(1)),
            ("throughput_two_daemons", f"two daemons drain {options.messages}", lambda: bench.phase_throughput(2)),
            ("bare_httpx_again", "bare httpx loop again (the ceiling is the better of the two)", bench.phase_bare),
            ("latency_healthy", f"latency at {options.rate:g}/s for {options.duration:g} s",
             lambda: bench.phase_latency(hang=False)),
            ("latency_isolation", "latency with one tenant hanging", lambda: bench.phase_latency(hang=True)),
            ("rss_10k_due", f"RSS with {DUE_FOR_RSS:,} due", bench.phase_rss),
            ("scale", f"claim plan with 0 and {options.scale_rows:,} delivered rows", bench.phase_scale),
        ]
        for i, (key, title, phase) in enumerate(phases, 1):
            progress(f"[{i}/{len(phases)}] {title}")
            try:
                report["phases"][key] = phase()
            except PhaseError as exc:
                report["errors"][key] = str(exc)
                progress(f"{key} failed: {exc}")
            except Exception as exc:  # a database error in one phase must not hide the others' figures
                detail = str(getattr(exc, "orig", None) or exc).splitlines()[0] if str(exc) else ""
                report["errors"][key] = f"{type(exc).__name__}: {detail}"
                progress(f"{key} failed: {report['errors'][key]}")
    finally:
        bench.teardown()
    if not report["errors"]:
        report["figures"] = figures(report)
        report["targets"] = targets(report)
    if options.json:
        print(json.dumps(report, indent=2))
    else:
        print(render_table(report))
    return 0 if not report["errors"] else 1


# --------------------------------------------------------------------------- the bare loop process


async def _bare_loop(url: str, count: int, concurrency: int, body: bytes) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = {"Content-Type": "application/json"}
    sent = errors = 0
    async with httpx.AsyncClient(limits=limits, timeout=10.0, trust_env=False) as client:
        async def worker() -> None:
            nonlocal sent, errors
            while sent < count:
                sent += 1
                try:
                    response = await client.post(url, content=body, headers=headers)
                    if response.status_code != 200:
                        errors += 1
                except httpx.HTTPError:
                    errors += 1

        cpu0, started = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu0
    ok = count - errors
    return {"requests": count, "errors": errors, "seconds": round(seconds, 3),
            "requests_per_s": round(ok / seconds, 1), "process_cpu_s": round(cpu, 3),
            "cpu_s_per_1000": round(cpu / max(ok, 1) * 1000, 3), "peak_rss_mb": round(memory_mb(os.getpid()), 1),
            "concurrency": concurrency}


def _bare_main(argv: list[str]) -> int:
    url, count, concurrency, body_file, out = argv
    result = asyncio.run(_bare_loop(url, int(count), int(concurrency), Path(body_file).read_bytes()))
    Path(out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["bare"]:
        sys.exit(_bare_main(sys.argv[2:]))
    sys.exit("usage: python -m supervisor.bench bare URL COUNT CONCURRENCY BODY_FILE OUT (internal)")
