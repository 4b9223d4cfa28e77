"""benchmarks.gpu_check without running its sections: failure handling, exit status, pytest counting, the
results archive and incremental summary, the package check, the pytest timeout, the machine record and the
wheel preparation (no network used)."""

import json
import os
import sys
import tarfile
import textwrap
import time

import pytest
import torch

from benchmarks.gpu_check import __main__ as gpu_check
from benchmarks.gpu_check import kernel_tests, packages, prepare_wheels
from benchmarks.gpu_check.kernel_tests import junit_counts
from benchmarks.gpu_check.machine import gpu_driver, header_lines
from benchmarks.gpu_check.plan import DRY_RUN, Budget
from benchmarks.gpu_check.report import NOT_RUN, RUNNING

ALL_IMPORT = {mod: {"ok": True, "version": "1.0", "from": "/site", "import_s": 0.0} for mod, _ in packages.PACKAGES}


@pytest.fixture(autouse=True)
def _packages_all_import(monkeypatch):
    """main()'s start-up package check (a child importing deepspeed and megatron, ~10 s) replaced by a record
    in which every package imports; tests of the check itself call packages.check_packages."""
    monkeypatch.setattr(gpu_check, "check_packages", lambda env=None: dict(ALL_IMPORT))


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


# ---------------------------------------------------------------------------------------------- archive, summary


def _archive(path):
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_archive_and_summary_are_rewritten_around_every_section(tmp_path, monkeypatch):
    out, archive = tmp_path / "out", tmp_path / "back" / "gpu_check.tar.gz"
    seen = {}

    def section(name):
        def run(plan, work, budget):
            seen[name] = {"archive": _archive(archive), "summary": json.loads((out / "summary.json").read_text())}
            return {"status": "ok"}
        return run

    for name in ("tests", "attention", "training"):
        monkeypatch.setitem(gpu_check.RUNNERS, name, section(name))
    argv = ["--cpu-dry-run", "--out", str(out), "--archive", str(archive), "--sections", "tests", "attention",
            "training"]
    assert gpu_check.main(argv) == 0

    # before the first section: machine and packages recorded, every section unfinished, no exit status
    first = json.loads(seen["tests"]["archive"]["summary.json"])
    assert first["complete"] is False and first["exit_code"] is None
    assert [s["status"] for s in first["sections"].values()] == [RUNNING, NOT_RUN, NOT_RUN]
    assert first["machine"]["packages"]["deepspeed"]["ok"] is True
    # what a kill during the third section would leave: the first two finished, in the archive and on disk
    third = seen["training"]["archive"]
    assert {"tests.json", "tests.md", "attention.json", "attention.md", "summary.json", "summary.md"} <= set(third)
    assert "training.json" not in third
    summary = json.loads(third["summary.json"])
    assert [s["status"] for s in summary["sections"].values()] == ["ok", "ok", RUNNING]
    assert summary == seen["training"]["summary"]
    assert "INCOMPLETE" in third["summary.md"].decode()
    # at the end: every file of the results folder, the final summary
    final = _archive(archive)
    assert set(final) == {p.name for p in out.iterdir()}
    assert all(final[name] == (out / name).read_bytes() for name in final)
    done = json.loads(final["summary.json"])
    assert done["complete"] is True and done["exit_code"] == 0
    assert [s["status"] for s in done["sections"].values()] == ["ok", "ok", "ok"]
    assert not [p for p in archive.parent.iterdir() if p.name != archive.name]  # no temporary file left behind


# ---------------------------------------------------------------------------------------------- package check


def test_a_section_whose_packages_do_not_import_is_skipped_with_one_line(tmp_path, monkeypatch):
    record = {**ALL_IMPORT, "deepspeed": {"ok": False, "error": "ModuleNotFoundError: No module named 'hjson'"},
              "webdataset": {"ok": False, "error": "not installed"}}
    monkeypatch.setattr(gpu_check, "check_packages", lambda env=None: record)
    ran = []
    monkeypatch.setitem(gpu_check.RUNNERS, "training", lambda plan, work, budget: ran.append(1) or {"status": "ok"})
    monkeypatch.setitem(gpu_check.RUNNERS, "attention", lambda plan, work, budget: {"status": "ok"})
    code = gpu_check.main(["--cpu-dry-run", "--out", str(tmp_path), "--sections", "attention", "training"])
    assert code == 0 and ran == []
    status = json.loads((tmp_path / "training.json").read_text())["status"]
    assert status.startswith("skipped: needs deepspeed (ModuleNotFoundError: No module named 'hjson'), "
                             "webdataset (not installed)")
    assert "\n" not in status and "prepare_wheels" in status
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["sections"]["attention"]["status"] == "ok"
    assert summary["machine"]["packages"]["deepspeed"]["ok"] is False
    assert "deepspeed MISSING (ModuleNotFoundError: No module named 'hjson')" in (tmp_path / "summary.md").read_text()


def test_check_packages_imports_each_and_names_the_missing_dependency(tmp_path):
    (tmp_path / "brokenpkg").mkdir()
    (tmp_path / "brokenpkg" / "__init__.py").write_text("import missing_dep_xyz\n")
    (tmp_path / "okpkg.py").write_text("__version__ = '4.5'\n")
    names = (("json", "json"), ("okpkg", "okpkg"), ("no_such_module_xyz", "x"), ("brokenpkg", "brokenpkg"))
    got = packages.check_packages(env={"PYTHONPATH": str(tmp_path)}, packages=names)
    assert got["json"]["ok"] is True and got["okpkg"] == {**got["okpkg"], "ok": True, "version": "4.5",
                                                           "from": str(tmp_path.resolve())}
    assert got["no_such_module_xyz"] == {"ok": False, "error": "not installed"}
    assert got["brokenpkg"] == {"ok": False, "error": "ModuleNotFoundError: No module named 'missing_dep_xyz'"}
    # a check that cannot finish says so and skips nothing
    unknown = packages.check_packages(packages=names, timeout=0.001)
    assert all(r["ok"] is None and "timed out" in r["error"] for r in unknown.values())
    assert packages.missing_line("training", {"deepspeed": unknown["json"]}) is None


def test_every_section_need_is_a_recorded_package():
    recorded = {mod for mod, _ in packages.PACKAGES}
    assert set(packages.NEEDS) == set(gpu_check.RUNNERS)
    assert all(set(needs) <= recorded for needs in packages.NEEDS.values())


# ---------------------------------------------------------------------------------------------- tests section

FAKE_PYTEST = """
import signal, sys, time
from pathlib import Path
args = sys.argv[1:]
Path({argv_file!r}).write_text("\\n".join(args))
xml = Path(next(a for a in args if a.startswith("--junitxml="))[len("--junitxml="):])
"""

COLLECTION_XML = (
    '<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="3" failures="{failures}" errors="1" '
    'skipped="0"><testcase classname="" name="tests.unit.test_hf"><error message="collection failure">'
    "ImportError while importing test module\n&gt;   import lm_eval\nE   ModuleNotFoundError: No module named "
    "'lm_eval'</error></testcase><testcase classname=\"tests.unit.t\" name=\"a\"/>"
    '<testcase classname="tests.unit.t" name="b">{b}</testcase></testsuite></testsuites>')


def _fake_pytest(tmp_path, monkeypatch, body):
    script = tmp_path / "fake_pytest.py"
    script.write_text(FAKE_PYTEST.format(argv_file=str(tmp_path / "argv.txt")) + textwrap.dedent(body))
    monkeypatch.setattr(kernel_tests, "PYTEST", [sys.executable, str(script)])
    return tmp_path / "argv.txt"


@pytest.mark.parametrize("failures", [0, 1])
def test_collection_errors_are_their_own_line_and_fail_nothing_when_every_test_passed(tmp_path, monkeypatch,
                                                                                        failures):
    b = '<failure message="assert 1 == 2">x</failure>' if failures else ""
    xml_text = COLLECTION_XML.format(failures=failures, b=b)
    argv = _fake_pytest(tmp_path, monkeypatch, f"""
        xml.write_text({xml_text!r})
        print("1 error in 0.1s" if {failures} == 0 else "1 failed, 1 error")
        sys.exit(1)
    """)
    monkeypatch.setattr(kernel_tests, "KERNEL_TESTS", "tests/unit/no_such_kernel_tests.py")
    work = tmp_path / "work"
    work.mkdir()
    result = kernel_tests.run(DRY_RUN, work, Budget(60.0))
    assert "--continue-on-collection-errors" in argv.read_text().splitlines()
    marked = result["runs"]["cuda_marked"]
    assert marked["collection_errors"] == ["tests.unit.test_hf: ModuleNotFoundError: No module named 'lm_eval'"]
    assert (marked["passed"], marked["failed"], marked["errors"]) == (2 - failures, failures, 0)
    if failures:
        assert marked["status"] == "failed: 1 failed, 0 errors" and result["status"].startswith("failed")
    else:
        assert marked["status"].startswith("ok; 1 test module(s) not collected")
        assert result["status"] == "ok (1 test module(s) not collected: see tests.md)"
    assert "- `tests.unit.test_hf: ModuleNotFoundError: No module named 'lm_eval'`" in kernel_tests.markdown(result)


def test_collection_errors_as_a_real_pytest_reports_them(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "test_ok.py").write_text("import pytest\n\n@pytest.mark.cuda\ndef test_a():\n    pass\n")
    (tree / "test_broken.py").write_text("import missing_dep_xyz\n\ndef test_b():\n    pass\n")
    run = kernel_tests.run_pytest("cuda_marked", [str(tree), "-m", "cuda", "--continue-on-collection-errors"],
                                  DRY_RUN, tmp_path, 120, empty_ok=True)
    assert run["returncode"] == 1 and (run["passed"], run["failed"], run["errors"]) == (1, 0, 0)
    # the module's dotted name depends on where the tree lies relative to pytest's rootdir
    (entry,) = run["collection_errors"]
    assert entry.endswith("test_broken: ModuleNotFoundError: No module named 'missing_dep_xyz'"), entry
    assert run["status"].startswith("ok")


def test_pytest_at_its_timeout_gets_sigint_and_keeps_its_counts_and_tail(tmp_path, monkeypatch):
    _fake_pytest(tmp_path, monkeypatch, """
        def stop(*_):
            xml.write_text('<testsuite tests="3" failures="0" errors="0" skipped="1"><testcase classname="t" '
                           'name="a"/><testcase classname="t" name="b"/></testsuite>')
            print("!!! KeyboardInterrupt !!!")
            print("2 passed, 1 skipped in 2.0s")
            sys.exit(2)
        signal.signal(signal.SIGINT, stop)
        print("collected 9 items", flush=True)
        time.sleep(60)
    """)
    t0 = time.monotonic()
    run = kernel_tests.run_pytest("kernels", ["x"], DRY_RUN, tmp_path, 3, empty_ok=False)
    assert time.monotonic() - t0 < 20
    assert run["stopped_by"] == "SIGINT" and run["returncode"] == 2
    assert run["status"] == ("failed: pytest timed out after 3 s (section budget), stopped by SIGINT; before it: "
                             "2 passed, 0 failed, 0 errors, 1 skipped")
    assert run["output_tail"][0] == "collected 9 items" and run["output_tail"][-1] == "2 passed, 1 skipped in 2.0s"
    text = "\n".join(kernel_tests.markdown({"runs": {"kernels": run}}))
    assert "stopped by SIGINT" in text and "2 passed, 1 skipped in 2.0s" in text


def test_a_process_that_ignores_sigint_is_killed_after_the_grace(tmp_path):
    script = tmp_path / "stubborn.py"
    script.write_text("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                      "print('ignoring SIGINT', flush=True)\ntime.sleep(60)\n")
    t0 = time.monotonic()
    got = kernel_tests.run_interruptible([sys.executable, str(script)], tmp_path, dict(os.environ), 3,
                                         tmp_path / "out.log", grace=1)
    assert time.monotonic() - t0 < 15
    assert got["stopped"] == "SIGKILL" and got["returncode"] == -9 and "ignoring SIGINT" in got["output"]
    quick = kernel_tests.run_interruptible([sys.executable, "-c", "print('done')"], tmp_path, dict(os.environ), 30,
                                           tmp_path / "quick.log")
    assert quick == {"returncode": 0, "output": "done\n", "stopped": None}


# ---------------------------------------------------------------------------------------------- machine record


def _bin(tmp_path, body):
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    smi = folder / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + body)
    smi.chmod(0o755)
    return str(folder)


def test_gpu_driver_from_nvidia_smi_and_tolerant_of_its_absence(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _bin(tmp_path, 'echo "NVIDIA H200, 580.159.04, 143771 MiB"\n'))
    assert gpu_driver() == {"driver_version": "580.159.04", "nvidia_smi": ["NVIDIA H200, 580.159.04, 143771 MiB"]}
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    absent = gpu_driver()
    assert absent["driver_version"] is None and absent["nvidia_smi"].startswith("not run: FileNotFoundError")
    monkeypatch.setenv("PATH", _bin(tmp_path, 'echo "NVIDIA-SMI has failed" >&2; exit 9\n'))
    assert gpu_driver() == {"driver_version": None, "nvidia_smi": "exit 9: NVIDIA-SMI has failed"}


def _info(**fields):
    info = {"device": "cuda", "device_name": "NVIDIA H200", "device_count": 1, "device_memory_gib": 139.8,
            "compute_capability": "9.0", "torch": "2.11.0+cu130", "triton": "3.6.0", "cuda": "13.0",
            "driver_version": "580.159.04", "versions": {"deepspeed": "0.19.8", "megatron-core": "0.16.1"},
            "python": "3.12.3", "cpu_model": "Xeon", "cores": 16, "commit": "abc", "uncommitted": [],
            "date_utc": "2026-11-29 10:00:00 UTC"}
    return {**info, **fields}


def test_the_header_names_the_driver_beside_cuda():
    assert "CUDA 13.0 (driver 580.159.04), deepspeed 0.19.8" in header_lines(_info())[1]


def test_a_copied_tree_is_not_recorded_as_clean_unless_its_copier_says_so(monkeypatch):
    from benchmarks.gpu_check.machine import SOURCE_COMMIT_VAR, SOURCE_DIRTY_VAR, source_state

    monkeypatch.setenv(SOURCE_COMMIT_VAR, "093ca37")
    monkeypatch.delenv(SOURCE_DIRTY_VAR, raising=False)
    state = source_state()
    assert state == {"commit": "093ca37 (per ASCENDER_SOURCE_COMMIT)", "git_commit": "093ca37", "git_dirty": None,
                     "git_changes_sha256": None}
    line = header_lines(_info(**state))[2]
    assert line.startswith("Commit 093ca37 (per ASCENDER_SOURCE_COMMIT) (uncommitted changes unknown")
    for value, dirty in (("1", True), ("0", False), ("maybe", None)):
        monkeypatch.setenv(SOURCE_DIRTY_VAR, value)
        assert source_state()["git_dirty"] is dirty
    monkeypatch.setenv(SOURCE_DIRTY_VAR, "1")
    assert "with uncommitted changes (git status not clean)" in header_lines(_info(**source_state()))[2]
    monkeypatch.setenv(SOURCE_DIRTY_VAR, "0")
    assert header_lines(_info(**source_state()))[2] == \
        "Commit 093ca37 (per ASCENDER_SOURCE_COMMIT); measured 2026-11-29 10:00:00 UTC."


def test_a_checkout_records_git_state_and_old_records_keep_their_files(monkeypatch):
    from benchmarks.gpu_check import machine

    monkeypatch.delenv(machine.SOURCE_COMMIT_VAR, raising=False)
    state = machine.source_state()
    assert set(state) == {"commit", "git_commit", "git_dirty", "git_changes_sha256"}
    assert state["git_dirty"] in (True, False, None)
    old = _info(uncommitted=["a.py", "b.py"])  # recorded before git_state: the tracked files that differed
    assert "Commit abc with uncommitted changes in a.py, b.py;" in header_lines(old)[2]


# ---------------------------------------------------------------------------------------------- attention table


def _cpu_plan(repeats=5, warmup=2):
    import dataclasses

    return dataclasses.replace(DRY_RUN, repeats=repeats, warmup=warmup)


def test_sdpa_and_ascender_alternate_within_each_round(monkeypatch):
    """Stand-in layers on CPU: each call is logged; the timed calls alternate SDPA and ASCender round by round."""
    from benchmarks.gpu_check import attention_table as at

    calls, clock = [], {"sdpa": iter([1.0, 2.0, 1.0, 4.0, 1.0]), "ascender": iter([10.0, 4.0, 30.0, 8.0, 50.0])}
    runs = {name: (lambda name=name: calls.append(name)) for name in ("sdpa", "ascender")}
    monkeypatch.setattr(at, "call_seconds", lambda run, device: (run(), next(clock[calls[-1]]))[1])
    timed = at.time_interleaved(runs, _cpu_plan())
    # first call + 1 more warm-up each, then 5 rounds, SDPA first in even rounds, ASCender first in odd ones
    assert calls == ["sdpa", "sdpa", "ascender", "ascender"] + ["sdpa", "ascender", "ascender", "sdpa"] * 2 + \
        ["sdpa", "ascender"]
    assert timed["sdpa"]["times_s"] == [1.0, 2.0, 1.0, 4.0, 1.0] and timed["sdpa"]["median_s"] == 1.0
    assert timed["ascender"]["min_s"] == 4.0 and timed["ascender"]["first_call_s"] >= 0


def _point(impl, n, times, **extra):
    import statistics

    return {"impl": impl, "n": n, "status": "ok", "backend": "MATH" if impl == "sdpa" else "fast", "times_s": times,
            "median_s": statistics.median(times), "min_s": min(times), "first_call_s": 0.1, "peak_mib": None,
            "host_load_1m": [0.5, 0.7], **extra}


def test_the_table_reports_median_and_minimum_of_the_same_round_ratios():
    from benchmarks.gpu_check import attention_table as at

    sdpa = _point("sdpa", 24, [1.0, 2.0, 1.0, 4.0, 1.0])
    asc = _point("ascender", 24, [10.0, 4.0, 30.0, 8.0, 50.0])
    (row,) = at.table_rows([sdpa, asc])
    # same-round ratios 10, 2, 30, 2, 50: median 10, min 2 (the ratio of the medians would be 10 / 1 = 10 too,
    # but its minimum does not exist; a slow round of both calls cancels)
    assert row["round_ratio"]["ratios"] == [10.0, 2.0, 30.0, 2.0, 50.0]
    assert (row["round_ratio"]["median"], row["round_ratio"]["min"]) == (10.0, 2.0)
    asc2 = _point("ascender", 24, [2.0, 4.0, 2.0, 8.0, 2.0])  # twice SDPA in every round
    (row2,) = at.table_rows([sdpa, asc2])
    assert row2["round_ratio"]["median"] == row2["round_ratio"]["min"] == 2.0
    assert row2["time_ratio"] == 2.0  # the ratio of the medians, kept for older readers
    result = {"rows": [row], "shape": {"batch": 1, "heads": 8, "head_dim": 64, "d_z": 32, "d_a": 32, "k": 16,
                                       "window": 128, "num_global": 4},
              "ascender_impl": "fast", "ascender_not_triton_because": "CPU", "dtype": "float32", "device": "cpu",
              "repeats": 5, "warmup": 2}
    md = "\n".join(at.markdown(result))
    assert "| ASCender / SDPA (median / min) |" in md and "| host load |" in md
    assert "| 24 | 10000.000 / 4000.000 | 1000.000 / 1000.000 | 10.00 / 2.00 | n/a (CPU) |" in md
    assert md.splitlines()[4].endswith("| 0.5 / 0.7 |")


def test_measure_pair_records_rounds_load_and_a_failing_layer(monkeypatch):
    from benchmarks.gpu_check import attention_table as at

    state = {"ascender_calls": 0}

    def build(impl, n, plan, ascender_impl):
        def run():
            if impl == "ascender":
                state["ascender_calls"] += 1
                if n == 40 and state["ascender_calls"] > 4:  # out of memory in a timed round
                    raise RuntimeError("CUDA out of memory\ndetail")
        return run, "MATH" if impl == "sdpa" else ascender_impl

    monkeypatch.setattr(at, "build_runner", build)
    monkeypatch.setattr(at.os, "getloadavg", lambda: (1.5, 1.0, 1.0))
    sdpa, asc = at.measure_pair(24, _cpu_plan(), "fast")
    assert sdpa["status"] == asc["status"] == "ok" and len(sdpa["times_s"]) == len(asc["times_s"]) == 5
    assert sdpa["host_load_1m"] == [1.5, 1.5] and asc["peak_mib"] is None
    (row,) = at.table_rows([sdpa, asc])
    assert len(row["round_ratio"]["ratios"]) == 5 and row["round_ratio"]["min"] <= row["round_ratio"]["median"]
    state["ascender_calls"] = 0
    sdpa, asc = at.measure_pair(40, _cpu_plan(), "fast")
    assert sdpa["status"] == "ok" and len(sdpa["times_s"]) == 5
    assert asc["status"] == "failed: RuntimeError: CUDA out of memory"
    (row,) = at.table_rows([sdpa, asc])
    assert "round_ratio" not in row and "time_ratio" not in row


def test_an_older_attention_record_still_renders():
    """benchmarks/results/gpu/attention.json predates the same-round ratios: the ratio of its medians is shown."""
    from benchmarks.gpu_check import attention_table as at
    from benchmarks.gpu_check.__main__ import GPU_RESULTS

    path = GPU_RESULTS / "attention.json"
    if not path.exists():
        pytest.skip("no committed GPU attention record")
    result = json.loads(path.read_text())
    md = "\n".join(at.markdown(result))
    if any("round_ratio" not in r and "time_ratio" in r for r in result["rows"]):
        assert "(ratio of medians)" in md


# ---------------------------------------------------------------------------------------------- wheels


def test_prepare_wheels_carries_what_the_gpu_machine_lacks_at_the_installed_versions():
    from importlib.metadata import version

    want = prepare_wheels.wanted()
    for name in ("deepspeed", "megatron-core", "webdataset", "hjson", "pydantic", "pydantic-core", "braceexpand"):
        assert want[name]["version"] == version(name)
    assert not set(want) & (prepare_wheels.ON_DEVICE - set(prepare_wheels.ALSO_CARRY))
    assert "torch" not in want and "numpy" not in want


def test_prepare_wheels_without_network_downloads_nothing_and_says_so(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "hjson-3.0.0-py3-none-any.whl"  # another version: two would stop the install there
    stale.write_bytes(b"")
    monkeypatch.setattr(prepare_wheels, "index_host", lambda: "pypi.example")
    monkeypatch.setattr(prepare_wheels, "reachable", lambda host: False)
    monkeypatch.setattr(prepare_wheels, "download", lambda *a: pytest.fail("downloaded without network"))
    assert prepare_wheels.main(["--dir", str(tmp_path)]) == 1
    text = capsys.readouterr().out
    assert "NO NETWORK: pypi.example:443" in text and "nothing was downloaded" in text
    assert "removed hjson-3.0.0-py3-none-any.whl" in text and not stale.exists()


def test_the_next_lengths_estimate_counts_the_sdpa_calls_of_the_graph_rounds():
    """The CUDA-graph replays are timed in rounds with SDPA, so SDPA's calls count twice when the
    ASCender point has a graph; the budget check would otherwise start a length it cannot finish."""
    from types import SimpleNamespace

    from benchmarks.gpu_check.attention_table import next_length_seconds

    plan = SimpleNamespace(warmup=1, repeats=3)  # 5 calls per point (warm-up, repeats, first call)
    sdpa = {"impl": "sdpa", "status": "ok", "median_s": 1.0}
    eager = {"impl": "ascender", "status": "ok", "median_s": 2.0}
    graphed = {**eager, "graph_status": "ok", "graph_median_s": 0.5}
    assert next_length_seconds([sdpa, eager], plan, 99.0) == pytest.approx(5 * 1.0 + 5 * 2.0)
    assert next_length_seconds([sdpa, graphed], plan, 99.0) == pytest.approx(5 * 1.0 + 5 * 2.0 + 6 * 0.5 + 6 * 1.0)
    assert next_length_seconds([sdpa, {**eager, "status": "error"}], plan, 99.0) == 99.0
