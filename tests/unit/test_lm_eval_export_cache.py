"""The lm-eval adapter's export cache ``<consolidated>/.hf-export`` under several processes (as
``accelerate launch`` starts them): on a cold cache one exports, the others wait and load that
export; none deletes a directory another one is writing or loading."""

from __future__ import annotations

import json
import multiprocessing
import time
import traceback
from pathlib import Path

from tests.unit.test_convert_out_dir import consolidated  # noqa: F401  (fixture: a tiny consolidated gpt)


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


def test_processes_on_a_cold_cache_export_once_and_all_load_it(consolidated, tmp_path):  # noqa: F811
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
