"""Source rules that keep the training loop extensible: measurements are Trainer callbacks, not
patches of a Trainer, and nothing writes private attributes of a DeepSpeed engine."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["ascender_dist", "data_pipeline", "benchmarks", "launch"]

# `trainer.x = ...`, `trainer.x.y = ...`, `trainer.step += 1`, `setattr(trainer, ...)`
TRAINER_WRITE = re.compile(r"\btrainer(\.\w+)+\s*([-+*/]?=)(?!=)|\bsetattr\(\s*trainer\b")
# `engine._anything = ...`, `x._config.y = ...` (DeepSpeed's engine keeps its config in ``_config``)
ENGINE_PRIVATE_WRITE = re.compile(r"\bengine\w*(\.\w+)*\._\w+(\.\w+)*\s*([-+*/]?=)(?!=)|\._config(\.\w+)+\s*=(?!=)")


def _python_files():
    for top in SOURCES:
        yield from sorted((ROOT / top).rglob("*.py"))


def _offences(pattern, files):
    out = []
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if pattern.search(code):
                out.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return out


@pytest.mark.parametrize("line", [
    "trainer.train_step = timed_step", "trainer._batches = hashed", "trainer.metrics.scalars = capture",
    "trainer.step += 1", "setattr(trainer, 'save', f)", "trainer.save = lambda: None"])
def test_trainer_write_pattern_catches_patches(line):
    assert TRAINER_WRITE.search(line)


@pytest.mark.parametrize("line", ["trainer.step == 3", "x = trainer.step", "trainer.fit(final_save=False)"])
def test_trainer_write_pattern_ignores_reads(line):
    assert not TRAINER_WRITE.search(line)


@pytest.mark.parametrize("line", [
    "self.engine._config.load_universal_checkpoint = False", "engine._global_steps = 3",
    "model_engine._config.x = 1"])
def test_engine_pattern_catches_private_writes(line):
    assert ENGINE_PRIVATE_WRITE.search(line)


def test_no_module_outside_training_replaces_a_trainer_attribute():
    files = [p for p in _python_files() if "ascender_dist/training" not in p.relative_to(ROOT).as_posix()]
    assert not _offences(TRAINER_WRITE, files), "use a Callback (ascender_dist/training/callbacks.py)"


def test_no_module_writes_a_private_deepspeed_engine_attribute():
    assert not _offences(ENGINE_PRIVATE_WRITE, list(_python_files()))


# `version("pkg")` of importlib.metadata raises for a package run from a source checkout; only
# ascender_dist/versions.py may call it (it records None instead)
METADATA_VERSION_CALL = re.compile(r"\bimportlib\.metadata\b.*\bversion\b|(?<![\w.])version\(\s*[\"'\w]")


@pytest.mark.parametrize("line", ["from importlib.metadata import version", 'version("torch")', "version(name)",
                                  "from importlib.metadata import PackageNotFoundError, version"])
def test_metadata_version_pattern_catches_calls(line):
    assert METADATA_VERSION_CALL.search(line)


@pytest.mark.parametrize("line", ["torch.version.cuda", "platform.python_version()", "package_version(name)",
                                  "torch.backends.cudnn.version()"])
def test_metadata_version_pattern_ignores_others(line):
    assert not METADATA_VERSION_CALL.search(line)


# torch_plan.py probes another interpreter (before anything is installed) and handles its failure
# the launch scripts run before this package is installed (setup.sh, the Dockerfile's first layers)
METADATA_ALLOWED = {ROOT / "ascender_dist" / "versions.py", ROOT / "launch" / "torch_plan.py",
                    ROOT / "launch" / "keep_installed.py"}


def test_only_versions_module_reads_package_metadata():
    files = [p for p in _python_files() if p not in METADATA_ALLOWED]
    assert _offences(METADATA_VERSION_CALL, files) == []


# a port from bind(("127.0.0.1", 0)) lies in the ephemeral range, where outgoing connections can take it
# before the launched process listens: rendezvous ports come from ascender_dist/ports.py alone
PORT_ZERO_BIND = re.compile(r"\.bind\(\s*\([^()]*,\s*0\s*\)\s*\)")


def test_port_zero_bind_pattern():
    assert PORT_ZERO_BIND.search('sock.bind(("127.0.0.1", 0))') and PORT_ZERO_BIND.search("s.bind((host, 0))")
    assert not PORT_ZERO_BIND.search("sock.bind((host, port))")


def test_only_the_ports_module_picks_ports_by_binding_port_zero():
    files = [p for p in _python_files() if p != ROOT / "ascender_dist" / "ports.py"]
    files += sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "launch").rglob("*.sh"))  # the scripts' one-liners
    exempt = {"test_source_rules.py", "test_ports.py"}  # the rule itself; the test holding a kernel-picked port
    assert _offences(PORT_ZERO_BIND, [p for p in files if p.name not in exempt]) == []
