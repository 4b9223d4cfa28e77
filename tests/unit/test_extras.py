"""A command whose optional dependency (pyproject extra) is missing ends with one line naming the
extra and exit status 2, not an ImportError's traceback (ascender_dist/extras.py)."""

import subprocess
import sys

import pytest

from ascender_dist.extras import INSTALL_HINT, MissingExtra, missing_extra, require_extra
from tests.helpers.project import REPO_ROOT, pyproject


def test_every_named_package_maps_to_an_extra_of_pyproject():
    from ascender_dist.extras import EXTRA_OF

    extras = pyproject()["optional-dependencies"]
    assert set(EXTRA_OF.values()) <= set(extras)


def test_only_packages_of_an_extra_get_the_line():
    line = missing_extra(ModuleNotFoundError("No module named 'scipy'", name="scipy"))
    assert line == "scipy is not installed: pip install 'ascender-dist[research]'"
    assert missing_extra(ModuleNotFoundError("x", name="transformers.models.llama")).endswith("[hf]'")
    assert missing_extra(ModuleNotFoundError("No module named 'torch'", name="torch")) is None  # a broken install
    assert missing_extra(ValueError("scipy")) is None
    with pytest.raises(MissingExtra, match=r"^wandb is not installed: pip install 'ascender-dist\[wandb\]'$"):
        sys.modules["wandb"] = None  # import of wandb halted
        try:
            require_extra("wandb")
        finally:
            del sys.modules["wandb"]


def _blocked(modules: list[str], argv: list[str]) -> subprocess.CompletedProcess:
    """ascender-dist ARGV in a fresh interpreter in which ``modules`` cannot be imported."""
    code = (f"import sys\nfor m in {modules!r}: sys.modules[m] = None\n"
            f"from ascender_dist.cli import main\nsys.exit(main({argv!r}))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)


@pytest.mark.parametrize("argv, modules, extra", [
    (["tables", "nowhere"], ["matplotlib", "scipy", "sklearn"], "research"),
    (["figures", "nowhere"], ["matplotlib", "scipy", "sklearn"], "research"),
    (["export-hf", "--consolidated", "nowhere", "--out", "out"], ["transformers"], "hf"),
])
def test_a_command_without_its_extra_is_one_line_and_exit_2(argv, modules, extra):
    proc = _blocked(modules, argv)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr and len([line for line in lines if line.startswith("error")]) == 1, lines
    assert lines[-1].startswith("error: ") and f"{INSTALL_HINT}{extra}]'" in lines[-1], lines[-1]
