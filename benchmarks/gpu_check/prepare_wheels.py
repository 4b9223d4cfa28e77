"""Fill the git-ignored ``.whl/`` with exactly the wheels a lent GPU machine lacks, to travel with ``carry``.

    .venv/bin/python -m benchmarks.gpu_check.prepare_wheels           # fetch / build what is missing, prune the rest
    .venv/bin/python -m benchmarks.gpu_check.prepare_wheels --list    # only say what it would carry (no network)

Run it HERE (on the machine with network), with the project's ``.venv``: the GPU machine can reach no package
registry. What it carries: the project's runtime dependencies (``pyproject.toml``) and what they need in turn
(their installed metadata), minus what the GPU machine's image already has (``ON_DEVICE``, the device notes'
package list), at the versions installed in this interpreter (so ``pyproject.toml``'s pins: checked).
``typing-extensions`` travels too: the image has one of unrecorded version, and pydantic-core sets a floor.

Wheels are for the GPU machine's Python (CPython 3.12, manylinux x86_64), by ``pip download --no-deps
--only-binary=:all:``; a package with no such wheel on the index (deepspeed publishes only an sdist) is built
here with ``pip wheel --no-deps --no-build-isolation`` and ``DS_BUILD_OPS=0`` and kept only if the wheel is
pure Python (``py3-none-any``). Wheels already in ``.whl/`` at the right version are kept; any other ``.whl``
there (another version, no longer needed) is removed, since two versions of one package stop the install.
Without network to the index, it downloads nothing and says so (exit 1). It ends with the folder's size (the
working tree that travels is limited to 64 MiB) and the ``carry`` / install line for the ``run`` command.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path
from urllib.parse import urlparse

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / ".whl"
TRAVEL_LIMIT_MIB = 64  # the whole working tree that travels, wheels included
PYTHON_VERSION = "3.12"
# the GPU machine's image, read off such a machine (the device notes' KINDS.md, 2026-11-17): never carried
ON_DEVICE = frozenset(canonicalize_name(n) for n in """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp
""".split())
ALSO_CARRY = {"typing-extensions": "on the image at a version not on record; pydantic and pydantic-core set a floor"}
# the GPU machine's interpreter, for the environment markers of Requires-Dist
DEVICE_ENV = {"python_version": PYTHON_VERSION, "python_full_version": "3.12.3", "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
              "platform_machine": "x86_64", "os_name": "posix", "extra": ""}
PLATFORMS = ["manylinux1_x86_64", "manylinux2014_x86_64"] + [f"manylinux_2_{n}_x86_64" for n in range(5, 40)]
INSTALL = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
           ".whl/*.whl && export PYTHONPATH=/tmp/site || exit;")


def _applies(req: Requirement) -> bool:
    return req.marker is None or req.marker.evaluate(DEVICE_ENV)


def project_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[Requirement]:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [r for r in map(Requirement, deps) if _applies(r)]


def wanted(pyproject: Path = ROOT / "pyproject.toml") -> dict:
    """``{canonical name: {"version", "why"}}``: what the GPU machine lacks, at this interpreter's versions.
    Raises SystemExit naming a package that is not installed here or not at the version pyproject.toml pins."""
    todo, out, problems = [], {}, []
    for req in project_requirements(pyproject):
        name = canonicalize_name(req.name)
        if name in ON_DEVICE:
            continue
        todo.append((name, req, "needed by pyproject.toml"))
    todo += [(name, None, why) for name, why in ALSO_CARRY.items()]
    while todo:
        name, req, why = todo.pop(0)
        if name in out:
            continue
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            problems.append(f"{name} ({why}) is not installed in {sys.executable}")
            continue
        if req is not None and req.specifier and not req.specifier.contains(version, prereleases=True):
            problems.append(f"{name} {version} is installed here but it is {why}, which asks for {req}")
            continue
        out[name] = {"version": version, "why": why}
        for text in metadata.requires(name) or []:
            sub = Requirement(text)
            sub_name = canonicalize_name(sub.name)
            if _applies(sub) and sub_name not in ON_DEVICE and sub_name not in out:
                todo.append((sub_name, sub, f"needed by {name}"))
    if problems:
        raise SystemExit("prepare_wheels: cannot pin the wheels to this interpreter's packages:\n  "
                         + "\n  ".join(problems) + "\nInstall the project into the .venv first (launch/setup.sh), "
                         "and run this with .venv/bin/python.")
    return out


def index_host() -> str:
    """The host of the package index pip uses here (PIP_INDEX_URL / pip config), pypi.org by default."""
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
        for line in proc.stdout.splitlines():
            key, _, value = line.partition("=")
            if key.endswith(".index-url"):
                url = value.strip().strip("'\"")
    return urlparse(url or "https://pypi.org/simple").hostname or "pypi.org"


def reachable(host: str, timeout: float = 5.0) -> bool:
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def wheels_in(folder: Path) -> list[tuple[str, str, Path]]:
    """``(canonical name, version, path)`` of each ``.whl`` in ``folder`` (name "?" where the file name is not
    a wheel's)."""
    found = []
    for path in sorted(folder.glob("*.whl")):
        try:
            name, version, _, _ = parse_wheel_filename(path.name)
            found.append((str(name), str(version), path))
        except Exception:  # noqa: BLE001 - not a wheel's name
            found.append(("?", "?", path))
    return found


def prune(folder: Path, want: dict) -> dict:
    """Remove every wheel that is not wanted at that version (and a second one of a package); returns
    ``{name: path}`` of the wheels kept."""
    kept = {}
    for name, version, path in wheels_in(folder):
        if name in want and want[name]["version"] == version and name not in kept:
            kept[name] = path
        else:
            path.unlink()
            print(f"  removed {path.name} (not wanted at that version: two versions of one package stop the install)")
    return kept


def _pip(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})


def download(name: str, version: str, folder: Path) -> tuple[bool, str]:
    """(ok, what happened): a binary wheel for the GPU machine's Python, else (pure Python) one built here."""
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    proc = _pip("download", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON_VERSION,
                "--implementation", "cp", *platforms, "-d", str(folder), f"{name}=={version}")
    if proc.returncode == 0:
        return True, "downloaded"
    first = (proc.stderr.strip().splitlines() or ["?"])[-1][:200]
    before = set(folder.glob("*.whl"))
    proc = _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(folder), f"{name}=={version}",
                env={"DS_BUILD_OPS": "0"})
    built = sorted(set(folder.glob("*.whl")) - before)
    if proc.returncode != 0 or not built:
        return False, (f"no wheel for CPython {PYTHON_VERSION} ({first}); building one here failed too: "
                       f"{(proc.stderr.strip().splitlines() or ['?'])[-1][:200]}")
    not_pure = [p for p in built if not p.name.endswith("-py3-none-any.whl")]
    if not_pure:
        for p in built:
            p.unlink()
        return False, f"no wheel on the index, and the one built here is not pure Python ({not_pure[0].name})"
    return True, f"built here from the sdist (DS_BUILD_OPS=0): {built[0].name}"


def unmet(folder: Path, names: set) -> list[str]:
    """Requirements of the wheels in ``folder`` (their METADATA) that neither travel nor are on the image."""
    missing = []
    for path in sorted(folder.glob("*.whl")):
        with zipfile.ZipFile(path) as zf:
            meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            headers = Parser().parsestr(zf.read(meta).decode("utf-8", "replace"), headersonly=True)
        for text in headers.get_all("Requires-Dist") or []:
            req = Requirement(text)
            dep = canonicalize_name(req.name)
            if _applies(req) and dep not in names and dep not in ON_DEVICE:
                missing.append(f"{path.name} needs {req}")
    return missing


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check.prepare_wheels",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="only print what would travel (no network, nothing written)")
    p.add_argument("--dir", type=Path, default=WHEELS, help=f"the folder (default {WHEELS.relative_to(ROOT)}/)")
    args = p.parse_args(argv)
    want = wanted()
    print(f"The GPU machine lacks {len(want)} packages (pinned to {sys.executable}'s):")
    for name, w in want.items():
        print(f"  {name + '==' + w['version']:<28} {w['why']}")
    if args.list:
        return 0
    folder = args.dir
    folder.mkdir(parents=True, exist_ok=True)
    kept = prune(folder, want)
    if kept:
        print("  already there: " + ", ".join(f"{n}=={want[n]['version']}" for n in kept))
    todo = [n for n in want if n not in kept]
    done, failed = [], []
    if todo:
        host = index_host()
        if not reachable(host):
            print(f"NO NETWORK: {host}:443 cannot be reached from here, so nothing was downloaded. Still missing "
                  f"from {folder}: {', '.join(todo)}. Run this again where the index can be reached.")
            return 1
        for name in todo:
            ok, what = download(name, want[name]["version"], folder)
            (done if ok else failed).append(name)
            print(f"  {name}=={want[name]['version']}: {what}")
    have = prune(folder, want)
    problems = unmet(folder, set(have))
    size = sum(path.stat().st_size for path in have.values())
    print(f"{folder}: {len(have)} wheels, {size / 2**20:.1f} MiB (the tree that travels may hold {TRAVEL_LIMIT_MIB} "
          f"MiB in all); {len(done)} fetched or built now, {len(kept)} kept, {len(failed)} failed")
    for path in sorted(have.values()):
        print(f"  {path.name}  {path.stat().st_size / 1024:,.0f} kB")
    for line in problems:
        print(f"  UNMET: {line} (neither carried nor on the GPU machine's image)")
    if failed or problems or set(want) - set(have):
        print(f"NOT READY: missing {', '.join(sorted(set(want) - set(have))) or 'nothing'}; see the lines above.")
        return 1
    if size > TRAVEL_LIMIT_MIB * 2**20 / 2:
        print(f"WARNING: the wheels take over half of the {TRAVEL_LIMIT_MIB} MiB the tree may take.")
    print(f"READY. In the device tool's run: carry=[\".whl\"], and begin the command with:\n  {INSTALL}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
