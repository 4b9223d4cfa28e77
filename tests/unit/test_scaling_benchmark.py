"""benchmarks/scaling.py: a layout's round is paired with the reference's round of the same index
(made-up step times, no training)."""

import benchmarks.scaling as scaling


def _rank(step_s: float, steps: int = 6, skipped: bool = False) -> dict:
    if skipped:
        return {"skipped": "failed"}
    return {"step_s": [step_s] * steps, "cpu_s": [step_s] * steps, "wall_s": [step_s] * steps, "load_before": [0.0],
            "load_after": [0.0], "params_this_rank": 1, "grad_accum": 1, "losses": [1.0]}


def test_round_ratios_pair_rounds_by_index():
    args = dict(small_global_batch=2, global_batch=4, small_warmup=1, warmup=1)
    raw = {  # the reference lost round 2, DP2 lost round 1: only round 0 pairs
        "debug/gpt/1 rank": [[_rank(1.0)], [_rank(2.0)], [_rank(0.0, skipped=True)]],
        "debug/gpt/DP2": [[_rank(0.5), _rank(0.5)], [_rank(0.0, skipped=True)] * 2, [_rank(0.8), _rank(0.8)]],
    }
    measured = {"args": args, "raw": raw, "checkpoints": {}, "machine": {}, "wall_seconds": 1.0, "launches": 2,
                "uptime_end": "", "small_gate_step_s": None}
    points = {p["layout"]: p for p in scaling.summarise(measured)["points"]}
    assert points["DP2"]["round_ratios"] == [2.0]  # 1.0 s / 0.5 s in round 0; rounds 1 and 2 have no pair
