"""benchmarks.gpu_check without running its sections: failure handling, exit status, pytest counting."""

import json

import pytest
import torch

from benchmarks.gpu_check import __main__ as gpu_check
from benchmarks.gpu_check.kernel_tests import junit_counts


def _ok(plan, work, budget):
    return {"status": "ok", "rows": []}


def _boom(plan, work, budget):
    raise ValueError("boom: the first line\nsecond line")


def test_a_failing_section_records_its_line_and_the_next_still_runs(tmp_path, monkeypatch):
    ran = []

    def attention(plan, work, budget):
        ran.append("attention")
        return {"status": "ok"}

    monkeypatch.setitem(gpu_check.RUNNERS, "tests", _boom)
    monkeypatch.setitem(gpu_check.RUNNERS, "attention", attention)
    code = gpu_check.main(["--cpu-dry-run", "--out", str(tmp_path), "--sections", "tests", "attention"])
    assert code == 1
    assert ran == ["attention"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["exit_code"] == 1
    assert summary["sections"]["tests"]["status"] == "failed: ValueError: boom: the first line"
    assert summary["sections"]["attention"]["status"] == "ok"
    tests = json.loads((tmp_path / "tests.json").read_text())
    assert tests["error_detail"] == ["second line"]
    assert "failed: ValueError: boom" in (tmp_path / "tests.md").read_text()
    assert "| [tests](tests.md) | failed: ValueError" in (tmp_path / "summary.md").read_text()


def test_skipped_sections_do_not_fail_the_run(tmp_path, monkeypatch):
    monkeypatch.setitem(gpu_check.RUNNERS, "nccl", lambda plan, work, budget: {"status": "skipped: one GPU"})
    assert gpu_check.main(["--cpu-dry-run", "--out", str(tmp_path), "--sections", "nccl"]) == 0
    assert json.loads((tmp_path / "nccl.json").read_text())["status"] == "skipped: one GPU"


def test_refusals_are_one_line(tmp_path, caplog):
    assert gpu_check.main(["--cpu-dry-run"]) == 2
    assert "--cpu-dry-run needs --out" in caplog.text
    if not torch.cuda.is_available():
        caplog.clear()
        assert gpu_check.main(["--out", str(tmp_path)]) == 2
        assert "no CUDA device visible" in caplog.text
        assert not list(tmp_path.iterdir())  # nothing written


def test_junit_counts_never_count_a_skip_as_a_pass(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="5" failures="1" errors="1" skipped="2">'
        '<testcase classname="tests.unit.t" name="a"/>'
        '<testcase classname="tests.unit.t" name="b"><failure message="assert 1 == 2&#10;more">x</failure></testcase>'
        '<testcase classname="tests.unit.t" name="c"><error message="fixture broke">x</error></testcase>'
        '<testcase classname="tests.unit.t" name="d"><skipped message="no triton"/></testcase>'
        '<testcase classname="tests.unit.t" name="e"><skipped message="no triton"/></testcase>'
        "</testsuite></testsuites>")
    counts = junit_counts(xml)
    assert (counts["passed"], counts["failed"], counts["errors"], counts["skipped"]) == (1, 1, 1, 2)
    assert counts["failed_tests"] == ["tests.unit.t::b: assert 1 == 2", "tests.unit.t::c: fixture broke"]


@pytest.mark.parametrize("name", ["tests", "attention", "training", "nccl"])
def test_every_section_has_a_budget_in_both_plans(name):
    from benchmarks.gpu_check.plan import DRY_RUN, GPU

    assert GPU.budgets[name] > 0 and DRY_RUN.budgets[name] > 0
    assert sum(GPU.budgets.values()) <= 9 * 60 - 20  # the 9-minute promise, with room to start and write
