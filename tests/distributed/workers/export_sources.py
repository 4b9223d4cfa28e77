"""Tiny trained gpt / ascender / connection runs, consolidated, for the export and evaluation tests.

``train_sources`` runs on 2 ranks (one launch trains all four, in different layouts: gpt DP2,
a Llama-shaped gpt (RMSNorm, swiglu, no biases, GQA) DP2, ascender TP2, connection DP2 with the
mixed pattern ``SCA``); :func:`ensure_sources` (pytest side)
builds the data, trains, and consolidates each run through ``ascender-dist consolidate`` once per
pytest session, so test_hf_remote_code and test_evaluate share one set of checkpoints.
"""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

from tests.helpers.data import tiny_run_config
from tests.helpers.multiproc import run_checks

ASCENDER = {"architecture": "ascender", "num_query_groups": 2,
            "ascender": {"d_z": 4, "d_a": 4, "k": 4, "window": 8, "num_global": 2, "chunk_size": 8,
                         "omega_init": 0.5}}
CONNECTION = {"architecture": "connection", "num_layers": 3, "layer_pattern": "SCA",
              "normalization": "RMSNorm", "activation": "swiglu", "add_bias_linear": False,
              "untie_embeddings_and_output_weights": True,
              "ascender": {"d_z": 4, "d_a": 4, "k": 4, "window": 8, "num_global": 2, "chunk_size": 8},
              "connection": {"num_slots": 4, "rank": 4, "max_steps": 3, "causal_chunk_size": 8}}
LLAMA = {"normalization": "RMSNorm", "activation": "swiglu", "add_bias_linear": False, "num_query_groups": 2}
RUNS = {  # run name (architecture-size, as the scaling runs) -> (model, parallel)
    "gpt-tiny": ({}, {}),
    "llama-tiny": (LLAMA, {}),
    "ascender-tiny": (ASCENDER, {"tensor_model_parallel_size": 2}),
    "connection-tiny": (CONNECTION, {}),
}
STEPS = 4


def _train(args, name: str):
    from ascender_dist.config.resolve import config_from_dict
    from ascender_dist.training.trainer import Trainer

    model, parallel = RUNS[name]
    cfg = config_from_dict(tiny_run_config(args["data"], Path(args["root"]) / name, name=name,
                                           train={"train_steps": STEPS}, model=model, parallel=parallel))
    return Trainer(cfg).fit()


def train_sources(args):
    return run_checks({name: (lambda name=name: _train(args, name)) for name in RUNS})


def source_dir(tmp_path_factory) -> Path:
    """One directory per pytest session (``ASCENDER_TEST_SOURCES`` to keep them across sessions)."""
    import os

    return Path(os.environ.get("ASCENDER_TEST_SOURCES") or tmp_path_factory.getbasetemp() / "export_sources")


def ensure_sources(base: Path) -> dict:
    """Data + trained + consolidated runs under ``base`` (made once; later callers reuse them).

    Returns {"data": {...}, "consolidated": {run name: dir}, "losses": {run name: [train losses]}}.
    """
    from tests.helpers.data import make_tiny_dataset
    from tests.helpers.multiproc import assert_check, run_ranks
    from tests.integration.test_conversion import cli

    base = Path(base)
    base.mkdir(parents=True, exist_ok=True)
    done = base / "sources.json"
    with open(base / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.is_file():
            return json.loads(done.read_text())
        data = make_tiny_dataset(base / "data", vocab_size=500)  # padded to 512 by training
        args = {"data": data, "root": str(base / "runs")}
        results = run_ranks("tests.distributed.workers.export_sources:train_sources", world_size=2, timeout=500,
                            args=args)
        losses = {name: assert_check(results, name)[0] for name in RUNS}
        consolidated = {}
        for name in RUNS:
            out = base / "consolidated" / name
            cli("consolidate", "--checkpoint", str(base / "runs" / name / "checkpoints"), "--out", str(out))
            consolidated[name] = str(out)
        sources = {"data": data, "consolidated": consolidated, "losses": losses}
        done.write_text(json.dumps(sources, indent=1))
        return sources
