"""What the bench reads from ``/proc`` and the child processes it runs (receivers, daemons).

The box is small (2 cores) and may be shared, so every figure comes with where the
machine's CPU went meanwhile (:class:`CpuMeter`), read from ``/proc`` rather than
estimated.
"""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

READY_TIMEOUT = 30.0  # a daemon or receiver that does not start within this fails the phase
STOP_TIMEOUT = 20.0
POLL = 0.05
BENCH_APPLICATION = "outboxd-bench"  # the bench's own connections: not metered as the daemon's work
BACKEND_SAMPLE_SECONDS = 0.1  # how often CpuMeter reads the backends' CPU
CLK_TCK = os.sysconf("SC_CLK_TCK")
NPROC = os.cpu_count() or 1


class PhaseError(Exception):
    """A phase could not produce its figures (timeout, a process that would not start)."""


class BenchUsageError(ValueError):
    """Bad bench input or an unusable database: one line for the operator."""


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a live process, from ``/proc/<pid>/stat``."""
    fields_ = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields_[11]) + int(fields_[12])) / CLK_TCK


def cpu_or_none(pid: int) -> float | None:
    """:func:`cpu_seconds`, or ``None`` for a process that is gone (a closed backend)."""
    try:
        return cpu_seconds(pid)
    except (OSError, IndexError, ValueError):
        return None


def reaped_children_cpu() -> float:
    """User + system CPU of every child this process has waited for, over its life so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


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

    CPU of the daemons, the receivers, this process (the producer), the PostgreSQL backends
    serving the bench database (their pids from ``pg_stat_activity``, their CPU from
    ``/proc``; the bench's own connections, named ``BENCH_APPLICATION``, are left out: their
    progress polls are not the daemon's work), and ``other``: everything else that ran
    meanwhile (PostgreSQL's background writers, other users of the machine).

    A backend can close before the measurement ends (a peer's pool closing as its process
    exits), and ``/proc`` forgets it then: so the backends are sampled every
    ``BACKEND_SAMPLE_SECONDS`` from a connection of the meter's own (not counted), and a
    backend gone by the end counts its CPU at its last sample.

    The bench's own children that end inside the window (the bare loop, the SDK peer, ``wrk``)
    are counted whole from ``getrusage(RUSAGE_CHILDREN)``, which adds a child's CPU as it is
    waited for: its start, imports and exit too, which no timer inside it sees and which
    ``other`` took before. ``children`` are those already running when the window opens (the
    peer, metered from its "draining" mark): what they had spent by then is left out. Each
    must have been waited for before :meth:`stop`.
    """

    def __init__(self, engine: Any, daemons: Sequence[int], receivers: Sequence[int],
                 children: Sequence[int] = ()) -> None:
        self._engine = engine
        self._daemons, self._receivers, self._children = list(daemons), list(receivers), list(children)
        self._seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def _backends(self, conn: Any) -> dict[int, float]:
        pids = conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                            " AND pid <> pg_backend_pid() AND application_name <> %s", (BENCH_APPLICATION,)).fetchall()
        return {pid: cpu for (pid,) in pids if (cpu := cpu_or_none(pid)) is not None}

    def _sample(self, conn: Any) -> None:
        while True:
            self._seen.update(self._backends(conn))
            if self._stop.wait(BACKEND_SAMPLE_SECONDS):
                self._seen.update(self._backends(conn))
                return

    def start(self) -> "CpuMeter":
        import psycopg
        from outbox.db import libpq_url

        dsn = libpq_url(self._engine.url)
        self._conn = psycopg.connect(dsn, autocommit=True)
        self._backends0 = self._backends(self._conn)
        self._sampler = threading.Thread(target=self._sample, args=(self._conn,), name="cpu-meter", daemon=True)
        self._sampler.start()
        self._procs0 = {pid: cpu_seconds(pid) for pid in self._daemons + self._receivers}
        self._reaped0 = reaped_children_cpu() + sum(cpu_seconds(pid) for pid in self._children)
        self._self0 = time.process_time()
        self._wall0 = time.perf_counter()
        self._box0 = machine_jiffies()
        return self

    def stop(self) -> dict[str, float]:
        busy, total = machine_jiffies()
        wall = time.perf_counter() - self._wall0
        own = time.process_time() - self._self0
        children = reaped_children_cpu() - self._reaped0
        procs = {pid: cpu_seconds(pid) - self._procs0[pid] for pid in self._daemons + self._receivers}
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join()
        self._conn.close()
        backends = sum(cpu - self._backends0.get(pid, 0.0) for pid, cpu in self._seen.items())
        box = (busy - self._box0[0]) / CLK_TCK
        daemons = sum(procs[p] for p in self._daemons)
        receivers = sum(procs[p] for p in self._receivers)
        ours = daemons + receivers + backends + own + children
        return {"wall_s": round(wall, 3), "box_busy": round((busy - self._box0[0]) / max(total - self._box0[1], 1), 3),
                "box_cpu_s": round(box, 2), "daemons_cpu_s": round(daemons, 3), "receiver_cpu_s": round(receivers, 3),
                "postgres_cpu_s": round(backends, 3), "bench_cpu_s": round(own, 3),
                "children_cpu_s": round(children, 3),
                "other_cpu_s": round(max(box - ours, 0.0), 2),
                # share of the whole box taken by processes that are not part of the bench
                "other_share": round(max(box - ours, 0.0) / max(wall * NPROC, 1e-6), 3)}


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


def spawn(name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> Proc:
    """Start ``argv`` with stdout and stderr appended to ``log``."""
    handle = open(log, "ab")
    try:
        popen = subprocess.Popen(argv, env=env, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    finally:
        handle.close()
    return Proc(name, popen, log)


def wait_for(what: str, predicate: Callable[[], bool], timeout: float, proc: Proc | None = None) -> None:
    """Poll ``predicate`` until true; a dead ``proc`` or the timeout fails the phase."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and not proc.alive():
            raise PhaseError(f"{what}: {proc.name} exited with {proc.popen.returncode}: {proc.log_tail()}")
        if time.monotonic() > deadline:
            raise PhaseError(f"{what}: not within {timeout:.0f} s")
        time.sleep(POLL)


@dataclass
class ReceiverProc:
    """One receiver process serving one or more ports (origins), and its arrivals log."""

    proc: Proc
    ports: list[int]
    arrivals: Path
    scheme: str

    def url(self, path: str, origin: int = 0) -> str:
        return f"{self.scheme}://127.0.0.1:{self.ports[origin]}{path}"

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


def start_receiver(workdir: Path, name: str, *, listen: int = 1, tls: tuple[Path, Path] | None = None) -> ReceiverProc:
    """``python -m outboxd_receiver`` without ``--jwks``: it spends no CPU verifying signatures."""
    port_file, arrivals = workdir / f"{name}.port", workdir / f"{name}.jsonl"
    arrivals.touch()
    argv = [sys.executable, "-m", "outboxd_receiver", "--port-file", str(port_file), "--log", str(arrivals),
            "--listen", str(listen)]
    if tls is not None:
        argv += ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])]
    proc = spawn(name, argv, workdir / f"{name}.out")
    wait_for(f"start {name}", port_file.exists, READY_TIMEOUT, proc)
    ports = [int(p) for p in port_file.read_text().split()]
    return ReceiverProc(proc, ports, arrivals, "https" if tls else "http")
