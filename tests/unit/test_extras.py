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


def test_only_packages_of_an_extra_get_the_line(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # as if scipy, transformers were not installed
                        lambda name, *a: None if name in ("scipy", "transformers") else real_find_spec(name, *a))
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


def test_an_installed_package_of_the_wrong_version_keeps_its_own_error():
    """'cannot import name X from transformers' (an old version) read 'transformers is not installed'."""
    assert missing_extra(ImportError("cannot import name 'Nope' from 'scipy'", name="scipy")) is None


def test_a_failing_import_that_is_no_missing_extra_is_reported_once_for_the_job(monkeypatch):
    """Such an ImportError escaped _run's job-wide handling on a multi-rank launch: every rank
    printed its own traceback and gloo peers waited out the distributed timeout."""
    from ascender_dist import cli
    from ascender_dist.parallel import job_errors

    reported = []
    monkeypatch.setattr(job_errors, "connect", lambda: None)
    monkeypatch.setattr(job_errors, "multi_rank_launch", lambda: True)
    monkeypatch.setattr(job_errors, "report_unexpected", lambda exc: reported.append(exc) or False)

    def broken():
        raise ImportError("libfoo.so: cannot open shared object file", name="some_native_ext")

    assert cli._run(broken) == 1 and len(reported) == 1


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
