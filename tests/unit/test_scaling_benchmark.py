"""benchmarks/scaling.py: a layout's round is paired with the reference's round of the same index
(made-up step times, no training)."""

import pytest

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


def _parse(monkeypatch, *argv):
    """main()'s argument checks only: a refused argument exits before any run starts."""
    import sys

    monkeypatch.setattr(sys, "argv", ["scaling.py", *argv])
    monkeypatch.setattr(scaling.tempfile, "mkdtemp", lambda **kw: pytest.fail("a refused run started"))
    scaling.main()


@pytest.mark.parametrize("argv", [["--rounds", "3"], ["--rounds", "4"], ["--ckpt-reps", "3"]])
def test_fewer_than_five_rounds_or_checkpoint_reps_are_refused(monkeypatch, capsys, argv):
    with pytest.raises(SystemExit) as info:
        _parse(monkeypatch, *argv)
    assert info.value.code == 2 and "must be >= 5" in capsys.readouterr().err


def test_quick_may_run_fewer_rounds_and_defaults_are_five(monkeypatch):
    import argparse

    p = argparse.ArgumentParser()
    quick = argparse.Namespace(quick=True, render=False, summarise=None, rounds=1, ckpt_reps=1)
    scaling.check_repeats(p, quick)  # no error
    seen = []

    class Parsed(Exception):
        pass

    def capture(parser, args):  # the arguments main() parsed with no flags given: its defaults
        seen.append(args)
        raise Parsed

    monkeypatch.setattr(scaling, "check_repeats", capture)
    with pytest.raises(Parsed):
        _parse(monkeypatch)
    assert (seen[0].rounds, seen[0].ckpt_reps, seen[0].quick) == (5, 5, False)


def _measured(checkpoints: dict) -> dict:
    return {"args": dict(small_global_batch=2, global_batch=4, small_warmup=1, warmup=1), "raw": {},
            "checkpoints": checkpoints, "machine": {}, "wall_seconds": 1.0, "launches": [], "uptime_end": "",
            "small_gate_step_s": None}


def test_checkpoint_times_report_median_and_minimum():
    ck = {"debug": {"params": 10, "bytes": 160, "save_s": [0.5, 0.2, 0.4, 0.3, 0.9], "load_s": [0.3, 0.1, 0.2, 0.2, 0.4],
                    "files": []}}
    (c,) = scaling.summarise(_measured(ck))["checkpoints"]
    assert (c["save_s"], c["save_s_min"], c["load_s"], c["load_s_min"]) == (0.4, 0.2, 0.2, 0.1)
    old = {k: v for k, v in c.items() if not k.endswith("_min")}  # a record made before the minimum was kept
    assert scaling.ckpt_min(old, "save") == 0.2 and scaling.ckpt_min(old, "load") == 0.1


def test_the_committed_scaling_json_still_renders(capsys):
    """scaling.json of an older run (3 checkpoint repetitions, commit + uncommitted files): rendered as it is."""
    import json

    saved = json.loads((scaling.RESULTS / "scaling.json").read_text())
    scaling.report(saved, write=False)
    out = capsys.readouterr().out
    reps = saved["meta"]["args"]["ckpt_reps"]
    assert "save s: median (min)" in out
    if reps < 5:
        assert f"timed {reps} times between barriers (FEWER than the 5" in out
    c = saved["checkpoints"][0]
    assert f"{c['save_s']:.2f} ({min(c['save_s_all']):.2f})" in out


def test_the_git_state_is_rendered_and_old_records_keep_their_line():
    assert scaling.code_line({"git_commit": "a" * 40, "git_dirty": True}) == f"commit {'a' * 12} (dirty)"
    assert scaling.code_line({"git_commit": "b" * 40, "git_dirty": False}) == f"commit {'b' * 12}"
    assert scaling.code_line({"commit": "47aa6e7", "uncommitted": ["x.py"]}) == \
        "commit 47aa6e7, with other engineers' uncommitted edits in x.py"


def test_config_hashes_ignore_the_temporary_paths_and_follow_the_settings():
    jobs = scaling.throughput_jobs("debug", ["gpt"], ["1 rank", "TP2"], 16, 4, 32, 128)
    jobs = jobs[1] + jobs[2]
    one = scaling.config_hashes(jobs, {"128": {"manifest": "/tmp/a/m.json", "tokenizer": "/tmp/a/t.model"}})
    two = scaling.config_hashes(jobs, {"128": {"manifest": "/tmp/b/m.json", "tokenizer": "/tmp/b/t.model"}})
    assert one == two and set(one) == {"debug/gpt/1 rank", "debug/gpt/TP2"}
    assert one["debug/gpt/1 rank"] != one["debug/gpt/TP2"]  # the parallel section differs
    other_data = scaling.config_hashes(jobs, {"128": {"manifest": "/tmp/a/m.json", "tokenizer": "/tmp/a/t.model"}},
                                       {"128": "another dataset"})
    assert other_data["debug/gpt/1 rank"] != one["debug/gpt/1 rank"]
