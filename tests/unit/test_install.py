"""What launch/setup.sh would install (stubbed CUDA and torch probes, `--dry-run`), the torch range
of pyproject.toml, and the Docker image's extras against pyproject.toml."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.helpers.multiproc import REPO_ROOT
from tests.helpers.project import pyproject

sys.path.insert(0, str(REPO_ROOT / "launch"))
from keep_installed import constraint_lines  # noqa: E402
from torch_plan import DEFAULT_CPU_INDEX, DEFAULT_CUDA_INDEX, TESTED_TORCH, in_range, torch_range  # noqa: E402

PYPROJECT = pyproject()
DOCKERFILE = (REPO_ROOT / "docker" / "Dockerfile").read_text()


def dry_run(gpu: bool, installed: str | None, **env: str) -> str:
    """setup.sh's decision line with a stubbed CUDA probe and installed torch version."""
    clean = {k: v for k, v in os.environ.items() if k not in ("TORCH_SPEC", "TORCH_CUDA_INDEX", "TORCH_CPU_INDEX")}
    clean.update(ASCENDER_CUDA_PROBE="true" if gpu else "false",
                 ASCENDER_TORCH_PROBE=f"echo {installed}" if installed else "true", **env)
    proc = subprocess.run(["bash", "launch/setup.sh", "--dry-run"], cwd=REPO_ROOT, env=clean, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("setup: torch: ")]
    assert len(lines) == 1, proc.stdout
    return lines[0].removeprefix("setup: torch: ")


@pytest.mark.parametrize("gpu,installed,expected", [
    (False, None, f"install torch=={TESTED_TORCH} (index {DEFAULT_CPU_INDEX}): no CUDA device"),  # PyPI's: CUDA
    (True, None, f"install torch=={TESTED_TORCH} (index {DEFAULT_CUDA_INDEX}): a CUDA device is present"),
    (True, "2.13.0a0+nv25.02", "keep torch==2.13.0a0+nv25.02:"),     # an NGC container's build stays
    (True, "2.13.0+cu126", "keep torch==2.13.0+cu126:"),
    (False, "2.13.0+cpu", "keep torch==2.13.0+cpu:"),
    (True, "2.13.1", "keep torch==2.13.1:"),
    # a CPU build (a .venv made on a GPU-less login node) on a GPU host: replaced by the CUDA build
    (True, "2.13.0+cpu", f"install torch=={TESTED_TORCH} (index {DEFAULT_CUDA_INDEX}): a CUDA device is present"),
    (True, "2.9.1", f"install torch=={TESTED_TORCH} (index {DEFAULT_CUDA_INDEX})"),  # out of range: replaced
    (False, "2.14.0", f"install torch=={TESTED_TORCH} (index {DEFAULT_CPU_INDEX}): no CUDA device"),
], ids=["cpu-fresh", "gpu-fresh", "gpu-ngc", "gpu-cuda", "cpu-kept", "gpu-patch", "gpu-cpu-build", "gpu-old", "cpu-newer"])
def test_setup_torch_decision(gpu, installed, expected):
    assert dry_run(gpu, installed).startswith(expected)


def test_a_cpu_build_without_the_cpu_suffix_is_not_kept_on_a_gpu_host():
    """A conda or mirror CPU build (no +cpu) was kept on a GPU host, then setup.sh stopped asking for
    TORCH_CUDA_INDEX, which the plan ignored: every re-run failed the same way."""
    assert dry_run(True, "2.13.0", ASCENDER_TORCH_CUDA_PROBE="true").startswith(
        f"install torch=={TESTED_TORCH} (index {DEFAULT_CUDA_INDEX}): a CUDA device is present")
    assert dry_run(True, "2.13.0", ASCENDER_TORCH_CUDA_PROBE="echo 12.6").startswith("keep torch==2.13.0:")


def test_a_python_too_old_or_a_venv_of_another_python_is_one_line(tmp_path):
    """A 3.10 python3 built a 3.10 venv and failed in pip's words; PYTHON=python3.11 then reused it."""
    from torch_plan import python_problem

    old = tmp_path / "pyproject.toml"
    old.write_text('[project]\nrequires-python = ">=3.99"\n')
    assert python_problem(str(tmp_path / "none"), old).startswith(
        f"Python {sys.version_info[0]}.{sys.version_info[1]} ({sys.executable}) is older than the project's 3.99: "
        "set PYTHON to a Python 3.99+ interpreter")
    venv_python = tmp_path / "python"
    venv_python.write_text("#!/bin/sh\necho 3.10\n")
    venv_python.chmod(0o755)
    assert python_problem(str(venv_python)).startswith(f"{venv_python} is Python 3.10, this setup runs Python "
                                                       f"{sys.version_info[0]}.{sys.version_info[1]}")
    assert python_problem(str(tmp_path / "none")) is None and python_problem(sys.executable) is None
    proc = subprocess.run([sys.executable, "launch/torch_plan.py", str(venv_python), sys.executable], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().endswith("delete .venv (rm -rf .venv) and re-run; nothing installed")


def test_a_venv_torch_that_would_hide_the_kept_base_torch_is_removed_first():
    """A .venv made on a GPU-less login node (CPU torch) re-set-up in an NGC container on a GPU node:
    the container's torch is kept and the venv's own one uninstalled, or it would shadow it."""
    probe = 'case "$ASCENDER_PROBED_PYTHON" in .venv/bin/python) echo 2.13.0+cpu;; *) echo 2.13.0a0+nv25.02;; esac'
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_SPEC", "TORCH_CUDA_INDEX", "TORCH_CPU_INDEX")}
    env.update(ASCENDER_CUDA_PROBE="true", ASCENDER_TORCH_PROBE=probe)
    out = subprocess.run(["bash", "launch/setup.sh", "--dry-run"], cwd=REPO_ROOT, env=env, capture_output=True,
                         text=True, timeout=60).stdout
    assert "setup: torch: keep torch==2.13.0a0+nv25.02:" in out, out
    assert "setup: uninstalling .venv's own torch triton first" in out, out
    # the venv's own torch in range and kept: nothing is removed
    assert "uninstalling" not in subprocess.run(
        ["bash", "launch/setup.sh", "--dry-run"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
        env={**env, "ASCENDER_TORCH_PROBE": "echo 2.13.0+cu126"}).stdout


def test_torch_spec_overrides_and_indexes_are_settable():
    assert dry_run(True, "2.13.0+cu126", TORCH_SPEC="torch==2.13.0+cpu").startswith(
        "install torch==2.13.0+cpu: TORCH_SPEC is set")
    assert dry_run(True, None, TORCH_CUDA_INDEX="") == f"install torch=={TESTED_TORCH}: a CUDA device is present: " \
                                                         "CUDA build"
    assert "(index file:///x)" in dry_run(False, None, TORCH_CPU_INDEX="file:///x")
    assert dry_run(False, None, TORCH_CPU_INDEX="") == f"install torch=={TESTED_TORCH}: no CUDA device: CPU build"


def test_the_cpu_wheel_is_tried_first_without_the_pytorch_index():
    """The +cpu wheel is asked of pip's own indexes and wheel folders before the PyTorch index (a
    machine holding it must not wait on that index), and only for the CPU plan: a plain spec from
    the default index would be PyPI's CUDA build."""
    def plan(gpu: bool, **env: str) -> dict:
        clean = {k: v for k, v in os.environ.items() if k not in ("TORCH_SPEC", "TORCH_CUDA_INDEX", "TORCH_CPU_INDEX")}
        clean.update(ASCENDER_CUDA_PROBE="true" if gpu else "false", ASCENDER_TORCH_PROBE="true", **env)
        out = subprocess.run([sys.executable, "launch/torch_plan.py", ".venv-none/bin/python", "python-none"],
                             cwd=REPO_ROOT, env=clean, capture_output=True, text=True, timeout=60, check=True).stdout
        return dict(item.split("=", 1) for item in shlex.split(out))  # KEY=value, shell-quoted

    assert plan(False)["LOCAL_SPEC"] == f"torch=={TESTED_TORCH}+cpu"
    assert plan(True)["LOCAL_SPEC"] == ""
    assert plan(False, TORCH_CPU_INDEX="")["LOCAL_SPEC"] == ""  # the default index is the only one: one try
    assert plan(False, TORCH_SPEC="torch==2.13.0")["LOCAL_SPEC"] == ""
    script = (REPO_ROOT / "launch" / "setup.sh").read_text()
    assert script.index('pip install --quiet "$LOCAL_SPEC"') < script.index('--index-url "$INDEX_URL"')


def test_torch_range_is_pips_rule():
    rng = torch_range()
    assert [d for d in PYPROJECT["dependencies"] if d.startswith("torch")] == [f"torch{rng}"]
    assert in_range(TESTED_TORCH, rng) and in_range("2.13.0+cpu", rng) and in_range("2.13.0a0+nv25.02", rng)
    assert not in_range("2.12.1", rng) and not in_range("2.14.0", rng) and not in_range("2.14.0a0", rng)
    assert not in_range("garbage", rng)


def test_docker_installs_every_runtime_extra():
    extras = re.search(r'^ARG EXTRAS="([^"]*)"$', DOCKERFILE, re.M).group(1).split()
    assert sorted(extras) == sorted(set(PYPROJECT["optional-dependencies"]) - {"dev"})
    assert "hf" in extras


def test_docker_requirement_list_has_the_extras_and_no_torch(tmp_path):
    """Run the Dockerfile's own requirements one-liner here and check what it would install."""
    cmd = re.search(r'(EXTRAS="\$\{EXTRAS\}" python -c ".*?") > /tmp/requirements.txt', DOCKERFILE).group(1)
    extras = re.search(r'^ARG EXTRAS="([^"]*)"$', DOCKERFILE, re.M).group(1)
    proc = subprocess.run(["bash", "-c", cmd.replace("python -c", f"{sys.executable} -c")], cwd=REPO_ROOT,
                          env={**os.environ, "EXTRAS": extras}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    reqs = proc.stdout.split("\n")
    names = {re.split(r"[\s<>=!~;\[]", r)[0] for r in reqs if r}
    assert "torch" not in names
    for extra in extras.split():
        for dep in PYPROJECT["optional-dependencies"][extra]:
            assert dep in reqs, dep
    assert {"megatron-core", "deepspeed", "transformers", "pyarrow", "wandb"} <= names


def _extra_packages(name: str) -> set:
    """The packages an extra installs, following references to this project's own extras
    (``ascender-dist[data,wandb]``) as pip does."""
    out = set()
    for dep in PYPROJECT["optional-dependencies"][name]:
        package = re.split(r"[\s<>=!~;\[]", dep)[0]
        if package == PYPROJECT["name"]:
            for extra in re.search(r"\[([^\]]*)\]", dep).group(1).split(","):
                out |= _extra_packages(extra.strip())
        else:
            out.add(package)
    return out


def test_dev_extra_carries_the_optional_format_and_logging_packages():
    assert {"pyarrow", "zstandard", "datasets", "wandb", "matplotlib", "scipy", "scikit-learn"} <= _extra_packages("dev")


def test_installed_torch_and_triton_are_kept_and_triton_is_a_range():
    """setup.sh and the Dockerfile install under launch/keep_installed.py's constraint, which pins the
    torch and (where torch brought one) the triton already installed; the project's triton
    requirements are ranges holding the version CUDA torch 2.13 pins, so a GPU container's own triton
    satisfies them instead of being replaced."""
    from importlib.metadata import PackageNotFoundError, version

    lines = constraint_lines()
    assert f"torch=={version('torch')}" in lines
    try:
        assert f"triton=={version('triton')}" in lines
    except PackageNotFoundError:
        assert not any(line.startswith("triton") for line in lines)
    assert "launch/keep_installed.py" in (REPO_ROOT / "launch" / "setup.sh").read_text()
    assert "python launch/keep_installed.py > /etc/pip-constraints.txt" in DOCKERFILE
    tritons = [d for extra in PYPROJECT["optional-dependencies"].values() for d in extra if d.startswith("triton")]
    assert tritons and all("==" not in d and in_range("3.7.1", d.removeprefix("triton")) for d in tritons), tritons


def _requirement_names(extra: str | None = None) -> list[str]:
    """The requirements of the dependencies (extra None) or of an extra, this project's own extras
    followed."""
    out = []
    for dep in PYPROJECT["dependencies"] if extra is None else PYPROJECT["optional-dependencies"][extra]:
        if re.split(r"[\s<>=!~;\[]", dep)[0] == PYPROJECT["name"]:
            for name in re.search(r"\[([^\]]*)\]", dep).group(1).split(","):
                out += _requirement_names(name.strip())
        else:
            out.append(dep)
    return out


def test_requires_python_admits_no_python_the_pins_refuse():
    """scikit-learn>=1.9 (research, pulled by dev) exists for Python >= 3.11 only, yet pyproject.toml and
    the README said 3.10+. For every requirement whose lowest admitted release line is the one installed
    here (e.g. scikit-learn 1.9.x for >=1.9), that release's Requires-Python must admit the project's
    minimum Python; the README's quick start names the same minimum."""
    from importlib.metadata import PackageNotFoundError, metadata

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    minimum = re.fullmatch(r">=\s*(\d+\.\d+)", PYPROJECT["requires-python"]).group(1)
    checked = set()
    for extra in [None, *PYPROJECT["optional-dependencies"]]:
        for line in _requirement_names(extra):
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"python_version": minimum}):
                continue
            lows = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
            try:
                meta = metadata(req.name)
            except PackageNotFoundError:
                continue
            installed = Version(meta["Version"])
            if not lows or installed.release[:len(lows[0].release)] != lows[0].release:
                continue  # an older release line is admitted too; its Python support is not known here
            needs = meta.get("Requires-Python")
            assert needs is None or SpecifierSet(needs).contains(minimum), (line, installed, needs, minimum)
            checked.add(req.name)
    assert "scikit-learn" in checked
    readme = (REPO_ROOT / "README.md").read_text()
    assert re.findall(r"Python (\d+\.\d+)\+", readme) == [minimum]


def test_setup_refuses_a_venv_left_without_pip(tmp_path):
    """A `python3 -m venv` that failed for want of ensurepip leaves .venv/bin/python without pip: every
    re-run of setup.sh then failed in 'No module named pip'; it says to delete .venv instead."""
    for path in ("launch/setup.sh", "launch/torch_plan.py", "launch/keep_installed.py", "pyproject.toml"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text((REPO_ROOT / path).read_text())
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / ".venv")], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_SPEC", "TORCH_CUDA_INDEX", "TORCH_CPU_INDEX")}
    env.update(PYTHON=sys.executable, ASCENDER_CUDA_PROBE="false", ASCENDER_TORCH_PROBE="true",
               PIP_INDEX_URL="http://127.0.0.1:9/", PIP_RETRIES="0", PIP_TIMEOUT="1")  # no index is reached
    proc = subprocess.run(["bash", "launch/setup.sh"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("setup: error: .venv has no pip") and "rm -rf .venv" in lines[0]
