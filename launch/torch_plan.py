"""Which torch `launch/setup.sh` installs, decided before anything is installed.

Rules, in order (why: a cluster's CUDA torch, e.g. an NGC container's ``2.13.0a0+nv...`` build,
must never be replaced by a pip resolve, and a CPU-only machine must not download a multi-GB
CUDA build):

1. ``TORCH_SPEC`` set: install exactly that (the user knows best).
2. a torch inside the project's range (``pyproject.toml``) is already installed, in ``.venv`` or
   in the Python that creates it: keep it (the venv then sees the base Python's packages).
3. no CUDA device (probe ``nvidia-smi -L``, else ``/proc/driver/nvidia/gpus``): the CPU build,
   ``torch==<tested version>`` from ``TORCH_CPU_INDEX`` (default the PyTorch CPU wheel index: on
   Linux x86_64, PyPI's own ``torch==<version>`` is the CUDA build; set it empty for pip's default
   index, e.g. a site mirror that holds CPU wheels). ``torch==<tested version>+cpu`` (LOCAL_SPEC) is
   tried first from pip's own configuration (default index, mirrors, ``--find-links`` wheels), which
   cannot hand out PyPI's CUDA build for it: a machine that already holds the CPU wheel never waits
   on an unreachable or slow PyTorch index.
4. a CUDA device: ``torch==<tested version>`` from ``TORCH_CUDA_INDEX`` (default the PyTorch CUDA
   12.6 wheel index; set it empty for the default index, whose Linux wheels are CUDA builds).

When rule 2 keeps the base Python's torch while ``.venv`` holds a torch of its own (a CPU build
from a GPU-less login node, an out-of-range one), that one is uninstalled first (REMOVE): the
venv's own site-packages come before the base Python's, so it would hide the kept build.

Probes can be replaced for tests and odd sites: ``ASCENDER_CUDA_PROBE`` is a shell command whose
exit status says whether a CUDA device is present, ``ASCENDER_TORCH_PROBE`` one that prints the
installed torch version (nothing: none installed) of the interpreter in ``$ASCENDER_PROBED_PYTHON``,
``ASCENDER_TORCH_CUDA_PROBE`` one that prints its ``torch.version.cuda`` (nothing: a CPU build).

Before any of that, a Python older than ``requires-python``, or a ``.venv`` of another Python
version, stops the set-up in one line (exit 2).

Prints one line of shell assignments for setup.sh to ``eval``: ACTION (keep|install), SPEC,
INDEX_URL, LOCAL_SPEC (an install to try before the one from INDEX_URL; empty: none), SYSTEM_SITE
(1: create the venv with --system-site-packages), REMOVE (packages to uninstall from the venv first),
GPU (1: a CUDA device is present: the torch must have CUDA), REASON.
Standard library only (it runs before the virtualenv exists).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

TESTED_TORCH = "2.13.0"  # the version CI installs and the README's tested combinations name
DEFAULT_CUDA_INDEX = "https://download.pytorch.org/whl/cu126"
DEFAULT_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
REPO_ROOT = Path(__file__).resolve().parents[1]


def torch_range(pyproject: Path = REPO_ROOT / "pyproject.toml") -> str:
    """The torch requirement's version range from ``pyproject.toml`` (e.g. ``>=2.13.0a0,<2.14``)."""
    m = re.search(r'^\s*"torch\s*([<>=!~][^";]*)"', pyproject.read_text(), re.M)
    if m is None:
        sys.exit(f"error: {pyproject}: no torch requirement in dependencies")
    return m.group(1).replace(" ", "")


def in_range(version: str, spec: str) -> bool:
    """pip's own rule for an installed version: pre-releases (2.13.0a0+nv...) count as in range."""
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion, Version
    except ImportError:  # a bare interpreter: pip always carries packaging
        from pip._vendor.packaging.specifiers import SpecifierSet
        from pip._vendor.packaging.version import InvalidVersion, Version
    try:
        return SpecifierSet(spec).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def has_cuda_device() -> bool:
    """A CUDA device is visible: the probe command succeeds (default: nvidia-smi lists a GPU, or the
    NVIDIA driver lists one under /proc)."""
    probe = os.environ.get("ASCENDER_CUDA_PROBE")
    if probe is not None:
        return subprocess.run(probe, shell=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and "GPU" in out.stdout:
            return True
    except (OSError, subprocess.TimeoutExpired):
        pass
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def _probe(python: str, code: str, probe_var: str | None = None) -> str | None:
    """What ``python -c code`` prints (stripped; None when it fails), or, when the environment sets
    ``probe_var``, what that shell command prints with ``$ASCENDER_PROBED_PYTHON`` = ``python``."""
    probe = os.environ.get(probe_var) if probe_var else None
    if probe is not None:
        env = {**os.environ, "ASCENDER_PROBED_PYTHON": python}
        return subprocess.run(probe, shell=True, capture_output=True, text=True, env=env).stdout.strip()
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def installed_torch(python: str) -> str | None:
    """Version of torch installed for ``python`` (or what ASCENDER_TORCH_PROBE prints), else None."""
    if "ASCENDER_TORCH_PROBE" not in os.environ and (not python or not Path(python).exists()
                                                     and not shutil.which(python)):
        return None
    code = "from importlib.metadata import version; print(version('torch'))"
    return _probe(python, code, "ASCENDER_TORCH_PROBE") or None


def is_cuda_build(python: str, version: str) -> bool:
    """Whether the torch ``version`` installed for ``python`` has CUDA: its ``torch.version.cuda``
    (what ASCENDER_TORCH_CUDA_PROBE prints, nothing meaning none, when set), not only a ``+cpu``
    suffix, which CPU builds from conda or a mirror do not carry. Unknown (torch does not import,
    or only ASCENDER_TORCH_PROBE is set): the suffix decides, and setup.sh checks the result."""
    if version.endswith("+cpu"):
        return False
    if "ASCENDER_TORCH_CUDA_PROBE" not in os.environ and "ASCENDER_TORCH_PROBE" in os.environ:
        return True
    cuda = _probe(python, "import torch; print(torch.version.cuda or '')", "ASCENDER_TORCH_CUDA_PROBE")
    return cuda is None or bool(cuda)


def python_problem(venv_python: str, pyproject: Path = REPO_ROOT / "pyproject.toml") -> str | None:
    """Why this Python cannot set up the project, or None: older than ``requires-python`` (torch and
    the pins have no wheels for it, and pip's error never says so), or a ``.venv`` made by another
    Python version (re-running with the right PYTHON reused it, failing the same way)."""
    m = re.search(r'^\s*requires-python\s*=\s*">=\s*(\d+)\.(\d+)"', pyproject.read_text(), re.M)
    if m and sys.version_info[:2] < (int(m[1]), int(m[2])):
        return (f"Python {sys.version_info[0]}.{sys.version_info[1]} ({sys.executable}) is older than the project's "
                f"{m[1]}.{m[2]}: set PYTHON to a Python {m[1]}.{m[2]}+ interpreter")
    if Path(venv_python).exists():
        theirs = _probe(venv_python, "import sys; print('%d.%d' % sys.version_info[:2])")
        ours = f"{sys.version_info[0]}.{sys.version_info[1]}"
        if theirs and theirs != ours:
            return (f"{venv_python} is Python {theirs}, this setup runs Python {ours} ({sys.executable}): "
                    "delete .venv (rm -rf .venv) and re-run")
    return None


def decide(venv_python: str, base_python: str) -> dict:
    """The plan as a dict of ACTION, SPEC, INDEX_URL, SYSTEM_SITE, REASON (see module docstring)."""
    spec_env = os.environ.get("TORCH_SPEC", "")
    rng = torch_range()
    gpu = has_cuda_device()
    flags = dict(REMOVE="", GPU="1" if gpu else "0", LOCAL_SPEC="")
    if spec_env:
        return dict(ACTION="install", SPEC=spec_env, INDEX_URL="", SYSTEM_SITE="0", **flags, REASON="TORCH_SPEC is set")
    venv_version = installed_torch(venv_python)
    for python, system_site in ((venv_python, "0"), (base_python, "1")):
        version = venv_version if python == venv_python else installed_torch(python)
        if version and gpu and not is_cuda_build(python, version):  # e.g. a .venv made on a GPU-less login node
            print(f"setup: torch {version} for {python} is a CPU build and this host has a CUDA device: not used",
                  file=sys.stderr)
        elif version and in_range(version, rng):
            # the venv's own torch (and the triton a CUDA wheel brings) would shadow the base Python's
            remove = "torch triton" if system_site == "1" and venv_version else ""
            return dict(ACTION="keep", SPEC=f"torch=={version}", INDEX_URL="", SYSTEM_SITE=system_site,
                        **{**flags, "REMOVE": remove}, REASON=f"torch {version} is installed and in range {rng}")
        elif version:
            print(f"setup: torch {version} for {python} is outside {rng}: not used", file=sys.stderr)
    if gpu:
        index = os.environ.get("TORCH_CUDA_INDEX", DEFAULT_CUDA_INDEX)
        return dict(ACTION="install", SPEC=f"torch=={TESTED_TORCH}", INDEX_URL=index, SYSTEM_SITE="0", **flags,
                    REASON="a CUDA device is present: CUDA build")
    index = os.environ.get("TORCH_CPU_INDEX", DEFAULT_CPU_INDEX)
    local = f"torch=={TESTED_TORCH}+cpu" if index else ""
    return dict(ACTION="install", SPEC=f"torch=={TESTED_TORCH}", INDEX_URL=index, SYSTEM_SITE="0",
                **{**flags, "LOCAL_SPEC": local}, REASON="no CUDA device: CPU build")


def main(argv: list[str]) -> int:
    venv_python = argv[1] if len(argv) > 1 else ".venv/bin/python"
    base_python = argv[2] if len(argv) > 2 else sys.executable
    problem = python_problem(venv_python)
    if problem:
        print(f"setup: error: {problem}; nothing installed", file=sys.stderr)
        return 2
    plan = decide(venv_python, base_python)
    print(" ".join(f"{k}={shlex.quote(v)}" for k, v in plan.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
