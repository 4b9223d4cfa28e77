"""The lm-eval adapter's export cache ``<consolidated>/.hf-export``: under several processes (as
``accelerate launch`` starts them) on a cold cache one exports, the others wait and load that
export, and none deletes a directory another one is writing or loading; it always carries the run's
tokenizer and is exported again when the tokenizer, config.yaml or ascender-dist version changed."""

from __future__ import annotations

import json
import multiprocessing
import shutil
import time
import traceback
from pathlib import Path

import pytest

from tests.helpers.errors import one_line
from tests.unit.export_fixtures import run_with_tokenizer, two_tokenizers, write_run  # noqa: F401  (fixtures)


def _cache_user(consolidated_dir: str, log: str, result: str, barrier) -> None:
    """One process: wait for the other at ``barrier``, then ask for the Hugging Face directory (cold
    cache: each export is logged to ``log`` and takes a second longer, so that exports overlap if
    nothing serialises them), then read what it got. Writes ``ok`` or the traceback to ``result``."""
    try:
        import safetensors.torch

        import ascender_dist.tools.hf_export as hf_export
        from ascender_dist.tools.lm_eval_adapter import hf_directory

        real_export = hf_export.export_hf

        def slow_logged_export(*args, **kwargs):
            with open(log, "a") as fh:
                fh.write("export\n")
            time.sleep(1.0)
            return real_export(*args, **kwargs)

        hf_export.export_hf = slow_logged_export
        barrier.wait(timeout=120)
        out = hf_directory(consolidated_dir)
        assert hf_export.is_export_output(out), sorted(p.name for p in Path(out).iterdir())
        json.loads((out / "config.json").read_text())
        assert safetensors.torch.load_file(str(out / "model.safetensors"))
        Path(result).write_text("ok")
    except BaseException:  # noqa: BLE001  (reported to the parent)
        Path(result).write_text(traceback.format_exc())


def test_processes_on_a_cold_cache_export_once_and_all_load_it(run_with_tokenizer, tmp_path):  # noqa: F811
    consolidated = run_with_tokenizer
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    log = tmp_path / "exports.log"
    results = [tmp_path / f"result{i}.txt" for i in range(2)]
    procs = [ctx.Process(target=_cache_user, args=(str(consolidated), str(log), str(r), barrier)) for r in results]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    for p in procs:
        if p.is_alive():
            p.kill()
    reports = [r.read_text() if r.is_file() else "no result" for r in results]
    assert reports == ["ok", "ok"], "\n".join(reports)
    assert log.read_text().count("export") == 1  # the second process waited and found the cache warm
    assert not [p.name for p in consolidated.iterdir() if p.name.startswith("..hf-export.")]  # no staging left


def _marker(out: Path) -> dict:
    return json.loads((out / "ascender_dist.json").read_text())


def test_a_run_whose_tokenizer_does_not_resolve_is_not_cached_without_it(two_tokenizers, tmp_path):
    """The first call runs where data.tokenizer does not resolve: one line, and no tokenizer-less export
    left in the cache (every later call found it warm and failed with "no tokenizer", also once the
    tokenizer was reachable). Once it resolves, the export carries it."""
    from ascender_dist.tools.lm_eval_adapter import EXPORT_SUBDIR, AdapterError, hf_directory, load_tokenizer
    from data_pipeline.tokenizer import Tokenizer

    ours = two_tokenizers[0]
    later = tmp_path / "later" / "tokenizer.model"  # the path config.yaml names, not there yet
    run = write_run(tmp_path / "cons", ours, data_tokenizer=str(later))
    with pytest.raises(AdapterError) as info:
        hf_directory(run)
    one_line(info.value, str(run / "config.yaml"), str(later), "lm-eval needs the tokenizer")
    assert not (run / EXPORT_SUBDIR).exists()
    later.parent.mkdir()
    shutil.copyfile(ours, later)
    out = hf_directory(run)
    text = "def add(a, b):\n    return a + b\n"
    assert load_tokenizer(out)(text, add_special_tokens=False)["input_ids"] == Tokenizer.load(ours).encode(text)


def test_a_stale_cache_is_exported_again(run_with_tokenizer, two_tokenizers):
    """A cache written by another ascender-dist version (its remote code and vendored math are that
    version's), before config.yaml changed or without the tokenizer is not re-used."""
    import yaml

    from ascender_dist.tools.lm_eval_adapter import hf_directory
    from ascender_dist.versions import package_version
    from data_pipeline.tokenizer import tokenizer_sha256

    out = hf_directory(run_with_tokenizer)
    first = _marker(out)
    assert first["ascender_dist_version"] == package_version("ascender-dist")
    assert first["tokenizer_sha256"] == tokenizer_sha256(two_tokenizers[0])
    assert hf_directory(run_with_tokenizer) == out and _marker(out) == first  # warm: re-used as it is
    provenance = ("ascender_dist_version", "export_code_sha256", "config_sha256", "meta_sha256",
                  "weights_size_mtime_ns", "tokenizer_sha256")
    written_before = {k: v for k, v in first.items() if k not in provenance}  # the marker older versions wrote
    # another version; the same version number from other code (a git checkout between commits); ...
    for stale in ({**first, "ascender_dist_version": "0.0.1"}, {**first, "export_code_sha256": "0" * 64},
                  {**first, "tokenizer_sha256": None}, {**first, "config_sha256": "0" * 64},
                  {**first, "meta_sha256": "0" * 64}, {**first, "weights_size_mtime_ns": [0, 0]}, written_before):
        (out / "ascender_dist.json").write_text(json.dumps(stale))
        assert _marker(hf_directory(run_with_tokenizer)) == first, stale
    config = run_with_tokenizer / "config.yaml"
    raw = yaml.safe_load(config.read_text())
    raw["name"] = "renamed"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    again = _marker(hf_directory(run_with_tokenizer))
    assert again["run_name"] == "renamed" and again["config_sha256"] != first["config_sha256"]


def test_a_cache_whose_python_is_not_ours_is_never_loaded(run_with_tokenizer, tmp_path):  # noqa: F811
    """A marker's provenance is claims anyone who can read the run can copy: a planted
    configuration_evil.py behind an auto_map was served as the warm cache, and trust_remote_code
    ran it."""
    from ascender_dist.tools.convert import ConversionError
    from ascender_dist.tools.hf_export import AUTO_MAP, code_is_installed_code
    from ascender_dist.tools.lm_eval_adapter import AdapterError, hf_directory

    out = hf_directory(run_with_tokenizer)
    assert code_is_installed_code(out)
    config = json.loads((out / "config.json").read_text())
    evil_map = {**AUTO_MAP, "AutoConfig": "configuration_evil.EvilConfig"}
    (out / "config.json").write_text(json.dumps({**config, "auto_map": evil_map}))  # the marker left as it was
    assert not code_is_installed_code(out)
    assert hf_directory(run_with_tokenizer) == out  # exported again: its own config.json back
    assert json.loads((out / "config.json").read_text()) == config and code_is_installed_code(out)
    # transformers follows a tokenizer_config.json auto_map too ("<dir>--module.Class": any directory)
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(
        {**tokenizer_config, "auto_map": {"AutoTokenizer": [f"{tmp_path}--tok.EvilTok", None]}}))
    assert not code_is_installed_code(out)
    assert hf_directory(run_with_tokenizer) == out
    assert json.loads((out / "tokenizer_config.json").read_text()) == tokenizer_config
    (out / "configuration_evil.py").write_text("import os; os.system('touch PWNED')\n")
    assert not code_is_installed_code(out)
    with pytest.raises((AdapterError, ConversionError)) as info:  # the planted file is not ours to delete
        hf_directory(run_with_tokenizer)
    assert "configuration_evil.py" in str(info.value)
