"""`python -m benchmarks.gpu_check --cpu-dry-run --archive` end to end on CPU: every section's files, sane
values, the CPU named and no GPU claimed, the packages recorded, the archive holding the final files
(a few minutes on 2 cores)."""

import json
import os
import subprocess
import sys
import tarfile

import pytest

from benchmarks.gpu_check.kernel_tests import KERNEL_TESTS
from benchmarks.gpu_check.plan import DRY_RUN, SECTIONS
from tests.helpers.multiproc import REPO_ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    archive = _archive(out)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--cpu-dry-run", "--out", str(out),
                           "--archive", str(archive)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1200)
    return proc, out


def _archive(out):
    return out.with_name(out.name + ".tar.gz")  # beside the results folder, as $OUT/... is on a GPU machine


def _load(out, name):
    return json.loads((out / f"{name}.json").read_text())


def test_runs_every_section_and_exits_zero(dry_run):
    proc, out = dry_run
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    for name in SECTIONS:
        assert f"[{name}] start (budget {DRY_RUN.budgets[name]:.0f} s)" in log  # progress + budget per section
        assert (out / f"{name}.json").is_file() and (out / f"{name}.md").is_file()
    summary = _load(out, "summary")
    assert summary["mode"] == "cpu-dry-run" and summary["exit_code"] == 0 and summary["complete"] is True
    assert list(summary["sections"]) == list(SECTIONS)
    for s in summary["sections"].values():
        assert s["status"].startswith(("ok", "skipped")), s
        assert 0 < s["seconds"] and s["budget_s"] > 0


def test_names_the_cpu_and_claims_no_gpu(dry_run):
    _, out = dry_run
    for name in ("summary", *SECTIONS):
        m = _load(out, name)["machine"]
        assert m["device"] == "cpu" and m["device_name"].startswith("CPU")
        assert (m["cuda"], m["device_count"], m["peak_bf16_tflops"], m["compute_capability"]) == (None, 0, None, None)
        assert m["driver_version"] is None and m["nvidia_smi"] is None
        assert m["commit"] and m["date_utc"].endswith("UTC") and m["torch"]
        text = (out / f"{name}.md").read_text()
        assert "CPU dry run" in text and "NVIDIA" not in text
        assert "{" not in text  # every placeholder filled in


def test_kernel_tests_counted_and_never_passing_when_absent(dry_run):
    _, out = dry_run
    runs = _load(out, "tests")["runs"]
    kernels = runs["kernels"]
    if (REPO_ROOT / KERNEL_TESTS).exists():
        assert kernels["status"] == "ok" and kernels["passed"] >= 1 and kernels["failed"] == kernels["errors"] == 0
        assert kernels["triton_interpret"] == "1"
    else:
        assert kernels["status"].startswith("skipped:") and "passed" not in kernels
    assert runs["cuda_marked"]["status"].startswith("ok") and runs["cuda_marked"]["failed"] == 0
    assert "--continue-on-collection-errors" in runs["cuda_marked"]["command"]


def test_packages_recorded_and_the_archive_holds_the_final_files(dry_run):
    proc, out = dry_run
    packages = _load(out, "summary")["machine"]["packages"]
    for mod in ("torch", "triton", "megatron.core", "deepspeed", "webdataset", "sentencepiece", "pytest"):
        assert packages[mod]["ok"] is True and packages[mod]["version"], (mod, packages[mod])
    assert "Packages (imported at start-up): torch " in (out / "summary.md").read_text()
    with tarfile.open(_archive(out)) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    assert set(files) == {p.name for p in out.iterdir()}
    assert all(files[name] == (out / name).read_bytes() for name in files)
    assert f"archive {_archive(out)} rewritten" in proc.stdout + proc.stderr


def test_attention_table(dry_run):
    _, out = dry_run
    att = _load(out, "attention")
    assert att["ascender_impl"] == "fast" and att["ascender_not_triton_because"]
    assert att["dtype"] == "float32" and att["device"] == "cpu"
    assert [r["n"] for r in att["rows"]] == list(DRY_RUN.lengths)
    for p in att["points"]:
        assert p["status"] == "ok" and p["peak_mib"] is None  # no CUDA memory on CPU
        assert len(p["times_s"]) == DRY_RUN.repeats and 0 < p["min_s"] <= p["median_s"]
    assert {p["backend"] for p in att["points"] if p["impl"] == "sdpa"} <= {
        "FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH"}
    for r in att["rows"]:
        assert r["time_ratio"] == pytest.approx(r["ascender"]["median_s"] / r["sdpa"]["median_s"])
        assert "memory_ratio" not in r and r["flop_ratio"] > 1
    assert (out / "attention.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("section, world, archs", [("training", 1, ["gpt", "ascender", "connection"]),
                                                    ("nccl", 2, ["gpt", "ascender"])])
def test_training_sections(dry_run, section, world, archs):
    _, out = dry_run
    res = _load(out, section)
    assert res["backend"] == "gloo" and res["devices"] == ["cpu"] * world
    assert [r["arch"] for r in res["rows"]] == archs
    for r in res["rows"]:
        assert r["world"] == world and r["precision"] == "fp32" and r["losses_finite"]
        assert r["vocab_size"] == DRY_RUN.vocab_size  # model.vocab_size above the tokenizer's, as the GPU plan does
        assert r["measured_steps"] >= 1 and r["tokens_per_s"] > 0 and r["flops_per_token"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["global_batch"] * r["seq_length"] / r["step_s"])
        assert r["tflops_per_device"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / world / 1e12)
        assert r["mfu"] is None and r["peak_tflops"] is None
