"""The bench's noise warning: every meter reading in a phase's figures is looked at, nested
ones too (the recovery phase's two runs, the many-endpoints drains), not only a top-level one."""

from __future__ import annotations

from outboxd_bench.report import NOISY_SHARE, noisy


def _reading(share: float) -> dict[str, float]:
    return {"other_share": share, "other_cpu_s": share * 10}


def test_a_disturbed_meter_is_flagged_wherever_it_sits_in_a_phase() -> None:
    loud, quiet = _reading(NOISY_SHARE + 0.1), _reading(NOISY_SHARE - 0.1)
    phases = {
        "bare_c1": {"requests_per_s": 1000.0, "cpu": quiet},
        "throughput_one_origin": {"cpu": loud},
        "latency_recovery": {"without_job": {"p99_ms": 3.0, "cpu": quiet}, "with_job": {"cpu": loud}},
        "endpoints": {"claims": {"10": {"execution_ms": 0.8}},
                      "drain_few": {"cpu": quiet}, "drain_many": {"cpu": loud}},
        "enqueue": {"p50_ms": {"alone": 1.0}, "cpu": loud},
        "scale": {"empty": {"execution_ms": 1.0}},
    }
    assert noisy(phases) == {"throughput_one_origin": loud["other_share"],
                             "latency_recovery.with_job": loud["other_share"],
                             "endpoints.drain_many": loud["other_share"], "enqueue": loud["other_share"]}
