"""``outboxd bench``: every phase in order, each bounded, then the table (or JSON).

A phase that fails is reported with its error and the others still run, so one broken
figure never hides the rest; the exit status is 0 only when every figure was measured.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from outboxd_bench import phases
from outboxd_bench.endpoints import endpoint_counts, phase_endpoints
from outboxd_bench.enqueue import ENQUEUE_ROUNDS, phase_enqueue
from outboxd_bench.harness import Bench, Options
from outboxd_bench.peer import phase_peer, require_sdk
from outboxd_bench.procs import BenchUsageError, PhaseError
from outboxd_bench.recovery import phase_recovery
from outboxd_bench.report import figures, machine_info, render_table, targets
from outboxd_bench.scale import phase_scale
from outboxd_bench.wrk import WRK_CONNECTIONS, phase_wrk

Phase = tuple[str, str, Callable[[], dict[str, Any]]]
SIGTERM_EXIT = 128 + signal.SIGTERM  # what a shell reports for a process that SIGTERM ended


class Terminated(BaseException):
    """SIGTERM, raised in the main thread as SIGINT raises ``KeyboardInterrupt`` (and, like it,
    past the phases' ``except Exception``), so that the teardown runs: SIGTERM's default action
    ended the bench at once and left its receivers and daemon running, its rows in the outbox
    (the next run refused the database) and its scratch directory with the keys."""


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` while the block runs."""
    def terminate(signum: int, frame: Any) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM noted, not acted on, until the block ends, then raised again: a stop
    must not cut the teardown short. (Handlers rather than a signal mask: a mask holds only
    the thread that sets it, and the CPU meter's sampler thread would take the signal.)"""
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        signal.raise_signal(received[0])  # the restored handler acts on it


def plan(bench: Bench) -> list[Phase]:
    """The phases of one run; the bare loop runs before and after the daemons at each
    concurrency, and the ceiling is the best of them, so a burst of background load during
    one pass cannot flatter the daemon."""
    o = bench.options
    bare = [(f"bare_c{c}", f"bare httpx loop, concurrency {c}: {o.messages} POSTs",
             lambda c=c: phases.phase_bare(bench, c)) for c in o.bare_concurrency]
    again = [(f"{key}_again", f"{title} (again)", run) for key, title, run in bare]
    main, many = bench.main, bench.many
    peer: list[Phase] = [("peer_adcp", f"adcp PgTaskWebhookOutbox (defaults) drains {o.messages}",
                          lambda: phase_peer(bench))] if o.peer == "adcp" else []
    steps: list[Phase] = [
        *bare,
        ("wrk", f"C client (wrk, {WRK_CONNECTIONS} connections) for {o.duration:g} s", lambda: phase_wrk(bench)),
        ("throughput_one_origin", f"one daemon drains {o.messages} to one origin",
         lambda: phases.phase_throughput(bench, phases.one_origin(bench), main, tag="one")),
        ("throughput_shared_origin", f"one daemon drains {o.messages} from {o.shared_tenants} tenants to one origin",
         lambda: phases.phase_throughput(bench, phases.shared_origin(bench), main, tag="shared")),
        ("throughput_many_origins", f"one daemon drains {o.messages} to {o.origins} origins",
         lambda: phases.phase_throughput(bench, phases.many_origins(bench), many, tag="many")),
        ("throughput_two_daemons", f"two daemons drain {o.messages} to one origin",
         lambda: phases.phase_throughput(bench, phases.one_origin(bench), main, daemons=2, tag="two")),
        *peer,
        *again,
        ("latency_healthy", f"latency at {o.rate:g}/s for {o.duration:g} s",
         lambda: phases.phase_latency(bench, hang=False)),
        ("latency_isolation", "latency with one tenant hanging", lambda: phases.phase_latency(bench, hang=True)),
        ("latency_recovery", f"latency at {o.rate:g}/s to one origin, alone and with a replay job of "
                             f"{o.recovery_messages:,} running", lambda: phase_recovery(bench)),
        ("rss_10k_due", f"RSS with {phases.DUE_FOR_RSS:,} due", lambda: phases.phase_rss(bench)),
        ("scale", f"claim plan with 0 and {o.scale_rows:,} delivered rows", lambda: phase_scale(bench)),
        ("enqueue", f"what an enqueue adds to a seller transaction, {ENQUEUE_ROUNDS:,} interleaved rounds",
         lambda: phase_enqueue(bench)),
        ("endpoints", f"claim and one daemon with {', '.join(f'{n:,}' for n in endpoint_counts(o.endpoints))} "
         "backlogged endpoints",
         lambda: phase_endpoints(bench)),
    ]
    if not o.only:
        return steps
    unknown = sorted(set(o.only) - {key for key, _, _ in steps})
    if unknown:
        raise BenchUsageError(f"--only: no phase named {', '.join(unknown)} "
                              f"(phases: {', '.join(key for key, _, _ in steps)})")
    return [step for step in steps if step[0] in o.only]


def run_bench(settings: Any, args: argparse.Namespace) -> int:
    """Run every phase, print the table (or JSON); 0 when every figure was measured."""
    from outbox.db import is_postgresql

    if not is_postgresql(settings.database_url):
        raise BenchUsageError("bench needs PostgreSQL: set OUTBOX_DATABASE_URL=postgresql://... "
                              "(SQLite is a single-process embedded store and is not benchmarked)")
    options = Options.from_args(args)
    if options.peer == "adcp":
        require_sdk()

    def progress(message: str) -> None:
        print(f"outboxd bench: {message}", file=sys.stderr, flush=True)

    bench = Bench(settings, options, progress)
    report: dict[str, Any] = {
        "options": {k: getattr(options, k) for k in ("messages", "rate", "duration", "scale_rows", "bare_concurrency",
                                                     "shared_tenants", "origins", "tls", "peer", "endpoints",
                                                     "recovery_messages")},
        "settings": {k: getattr(settings, k) for k in ("concurrency", "endpoint_concurrency", "claim_batch",
                                                       "poll_interval_seconds")},
        "receiver": {"path": "/ok", "verifies_signatures": False}, "phases": {}, "errors": {}}
    try:
        with sigterm_unwinds():
            _run(bench, report)
    except Terminated:
        progress("stopped by SIGTERM")
        return SIGTERM_EXIT
    if not report["errors"] and not options.only:
        report["figures"] = figures(report)
        report["targets"] = targets(report)
    print(json.dumps(report, indent=2) if options.json else render_table(report))
    return 0 if not report["errors"] else 1


def _run(bench: Bench, report: dict[str, Any]) -> None:
    """Every phase of the plan into ``report``, then the teardown, whatever stopped them."""
    progress = bench.progress
    try:
        bench.preflight()
        report["machine"] = machine_info(bench.engine)
        bench.setup()
        steps = plan(bench)
        for i, (key, title, phase) in enumerate(steps, 1):
            progress(f"[{i}/{len(steps)}] {title}")
            try:
                bench.checkpoint()  # every phase starts on a settled server, as if it ran first
                report["phases"][key] = phase()
            except PhaseError as exc:
                report["errors"][key] = str(exc)
                progress(f"{key} failed: {exc}")
            except Exception as exc:  # a database error in one phase must not hide the others' figures
                detail = str(getattr(exc, "orig", None) or exc).splitlines()[0] if str(exc) else ""
                report["errors"][key] = f"{type(exc).__name__}: {detail}"
                progress(f"{key} failed: {report['errors'][key]}")
    finally:
        with signals_deferred():
            bench.teardown()
    report["checkpoints_between_phases"] = bench.checkpoints
