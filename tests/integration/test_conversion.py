"""Checkpoint conversion round trips on CPU: any layout -> consolidated -> Hugging Face / another layout."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ascender_dist.versions import git_state
from tests.helpers.data import make_tiny_dataset
from tests.helpers.multiproc import REPO_ROOT, assert_check, run_ranks
from tests.helpers.single_rank import single_rank_group  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # as a user's shell: the command launches its own ranks
    for _ in range(3):  # the launcher's rendezvous port can be taken between picking and binding it
        proc = subprocess.run([sys.executable, "-m", "ascender_dist.cli", *args], cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True, timeout=400)
        if "EADDRINUSE" not in proc.stderr + proc.stdout:
            break
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    data = make_tiny_dataset(tmp_path_factory.mktemp("data"), vocab_size=500)  # padded to 512 by training
    root = tmp_path_factory.mktemp("runs")
    args = {"data": data, "root": str(root)}
    losses = run_ranks("tests.distributed.workers.conversion:train_sources", world_size=2, timeout=400, args=args)
    exports = tmp_path_factory.mktemp("exports")
    for name in ("gpt_tp2", "llama_pp2"):
        assert_check(losses, name)  # a run that raised after its last checkpoint would pass unseen
        cli("consolidate", "--checkpoint", str(root / name / "checkpoints"), "--out", str(exports / name))
    return {"args": args, "root": root, "exports": exports, "losses": losses, "data": data}


def _our_logits(consolidated: Path, tokens: torch.Tensor) -> torch.Tensor:
    """Our megatron model (TP=1) with the consolidated weights, logits over the real vocabulary."""
    from ascender_dist.config.resolve import derive
    from ascender_dist.training.engine import build_run_model
    from ascender_dist.parallel.setup import init_model_parallel
    from ascender_dist.tools.convert import read_consolidated
    from ascender_dist.training.weights import load_canonical_state, pad_vocab

    state, cfg, meta = read_consolidated(consolidated)
    init_model_parallel(1, 1, seed=0)
    derived = derive(cfg, 1, meta["vocab_size"])
    model = build_run_model(cfg, derived)
    load_canonical_state(model, cfg, pad_vocab(state, derived.vocab_size, derived.padded_vocab_size))
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions, None)[..., : meta["vocab_size"]]


def test_consolidated_has_canonical_names_and_no_vocab_padding(runs):
    from ascender_dist.tools.convert import read_consolidated
    from data_pipeline.tokenizer import tokenizer_sha256

    state, cfg, meta = read_consolidated(runs["exports"] / "gpt_tp2")
    assert meta["tensor_model_parallel_size"] == 2 and meta["step"] == 3
    # the checkpoint records the tokenizer's identity; consolidate carries it (export-hf checks it)
    assert meta["tokenizer_sha256"] == tokenizer_sha256(Path(runs["data"]["tokenizer"]))
    # and the tokenizer its data was made with (the manifest's), which a resume compares
    trained = json.loads((runs["root"] / "gpt_tp2" / "checkpoints" / "step_00000003" / "meta.json").read_text())
    assert trained["data_tokenizer_sha256"] == meta["tokenizer_sha256"]
    # the code that trained it: this checkout's commit, carried into the consolidated directory
    assert trained["code"] == meta["code"] and trained["code"]["git_commit"] == git_state()["git_commit"]
    assert len(meta["code"]["git_commit"]) == 40
    assert state["embedding.word_embeddings.weight"].shape[0] == meta["vocab_size"] < meta["padded_vocab_size"]
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in state
    assert cfg.parallel.tensor_model_parallel_size == 1


@pytest.mark.parametrize("name,hf_class", [("gpt_tp2", "GPTNeoXForCausalLM"), ("llama_pp2", "LlamaForCausalLM")])
def test_hugging_face_export_logits_match(runs, single_rank_group, tmp_path, name, hf_class):
    from transformers import AutoModelForCausalLM

    out = tmp_path / f"hf_{name}"
    cli("export-hf", "--consolidated", str(runs["exports"] / name), "--out", str(out),
        "--tokenizer", runs["data"]["tokenizer"])
    hf = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    assert type(hf).__name__ == hf_class
    tokens = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(tokens).logits  # [b, s, v]
    ours = _our_logits(runs["exports"] / name, tokens)
    assert theirs.shape == ours.shape
    assert (theirs - ours).abs().max().item() < 1e-4


def _tree(directory: Path) -> dict:
    """Every file under ``directory`` (relative path -> bytes)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def source_logs(runs):
    """The source run's TensorBoard directory before the reshard (its files and their bytes)."""
    tensorboard = runs["root"] / "gpt_tp2" / "tensorboard"
    assert tensorboard.is_dir()  # the source run logged there: the reshard must leave it alone
    return _tree(tensorboard)


@pytest.fixture(scope="module")
def resharded(runs, source_logs, tmp_path_factory):
    """The TP2 run's consolidated weights resharded to TP1 x PP2 (a training checkpoint); read from a
    copy whose meta.json names another training commit (RESHARD_SOURCE_CODE), which the resharded
    checkpoint must keep rather than record the resharding checkout's."""
    import shutil

    source = tmp_path_factory.mktemp("reshard-source") / "gpt_tp2"
    shutil.copytree(runs["exports"] / "gpt_tp2", source)
    meta = json.loads((source / "meta.json").read_text())
    (source / "meta.json").write_text(json.dumps({**meta, "code": RESHARD_SOURCE_CODE}))
    out = tmp_path_factory.mktemp("resharded") / "checkpoints"
    cli("reshard", "--consolidated", str(source), "--out", str(out),
        "--set", "parallel.tensor_model_parallel_size=1", "--set", "parallel.pipeline_model_parallel_size=2")
    return out


RESHARD_SOURCE_CODE = {"git_commit": "f" * 40, "git_dirty": False, "git_changes_sha256": None}


def test_reshard_writes_nothing_into_the_source_run(runs, source_logs, resharded):
    """The reshard's run has no log sinks: no TensorBoard events file in the source run's
    output_dir (nor anywhere), and nothing but checkpoints in --out."""
    assert _tree(runs["root"] / "gpt_tp2" / "tensorboard") == source_logs
    assert not list(resharded.rglob("events.out.tfevents*")) and not (resharded / "wandb").exists()
    meta = json.loads((resharded / "step_00000003" / "meta.json").read_text())
    source = json.loads((runs["exports"] / "gpt_tp2" / "meta.json").read_text())
    assert meta["tokenizer_sha256"] == source["tokenizer_sha256"] is not None
    assert meta["code"] == RESHARD_SOURCE_CODE  # the code that trained the weights, not the reshard's


def test_reshard_to_another_layout_resumes_training(runs, resharded):
    meta = json.loads((resharded / "step_00000003" / "meta.json").read_text())
    assert meta["pipeline_model_parallel_size"] == 2 and meta["tensor_model_parallel_size"] == 1
    results = run_ranks("tests.distributed.workers.conversion:continue_resharded", world_size=2, timeout=300,
                        args={**runs["args"], "resharded": str(resharded)})
    value = assert_check(results, "resume_resharded")[0]
    original = assert_check(results, "resume_original")[0]
    assert value["start"] == original["start"] == 3 and len(value["losses"]) == len(original["losses"]) == 2
    # The first loss after resuming comes before any optimizer step: the same weights on the same batch
    # (data position carried over) in another layout, so equal to fp32 round-off. (The 12 vocab padding
    # rows that consolidation drops and reshard zero-fills take no part: the loss normalises over the
    # tokenizer's 500 ids only.) The weights themselves are checked exactly below.
    assert abs(value["losses"][0] - original["losses"][0]) < 2e-6, (value, original)
    # Steps 4 and 5 run at the schedule's rates for steps 4 and 5 in both (not one step ahead).
    from ascender_dist.config.resolve import config_from_dict
    from ascender_dist.training.lr_schedule import lr_at
    from tests.helpers.data import tiny_run_config

    cfg = config_from_dict(tiny_run_config(runs["data"], "unused", train={"train_steps": 5}))
    expected = [[step, lr_at(step, cfg.optimizer, 5)] for step in (4, 5)]
    assert value["lrs"] == original["lrs"] == expected, (value["lrs"], original["lrs"])


def test_reshard_then_consolidate_gives_back_every_weight(runs, resharded, tmp_path):
    """Round trip TP2 -> consolidated -> TP1 x PP2 -> consolidated: every tensor bit for bit, so the
    reshard put every shard where the new layout reads it."""
    from ascender_dist.tools.convert import read_consolidated

    again = tmp_path / "again"
    cli("consolidate", "--checkpoint", str(resharded), "--tag", "step_00000003", "--out", str(again))  # resumed since
    source, _, meta = read_consolidated(runs["exports"] / "gpt_tp2")
    back, _, meta_back = read_consolidated(again)
    assert meta_back["pipeline_model_parallel_size"] == 2 and meta_back["step"] == meta["step"] == 3
    assert back.keys() == source.keys() and len(source) > 10
    for name, tensor in source.items():
        assert torch.equal(back[name], tensor), name


def test_bad_checkpoints_fail_in_one_line(runs, tmp_path):
    source = runs["root"] / "gpt_tp2" / "checkpoints"
    proc = cli("consolidate", "--checkpoint", str(source), "--out", str(tmp_path / "x"), "--architecture",
               "ascender", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith("meta.json: architecture is 'gpt', expected 'ascender'")
    broken = tmp_path / "broken"
    import shutil

    shutil.copytree(source, broken)
    (broken / "step_00000003" / "COMPLETE").unlink()
    proc = cli("consolidate", "--checkpoint", str(broken), "--out", str(tmp_path / "y"), check=False)
    assert proc.returncode == 2 and "no COMPLETE marker" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "y").exists()
    (broken / "step_00000003" / "COMPLETE").write_text("3\n")
    meta_file = broken / "step_00000003" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["versions"]["megatron-core"] = "0.9.0"
    meta_file.write_text(json.dumps(meta))
    proc = cli("consolidate", "--checkpoint", str(broken), "--out", str(tmp_path / "z"), check=False)
    assert proc.returncode == 2
    assert "written with megatron-core 0.9.0, the converter knows 0.16.1" in proc.stderr.strip().splitlines()[-1]
    proc = cli("export-hf", "--consolidated", str(tmp_path / "missing"), "--out", str(tmp_path / "w"), check=False)
    assert proc.returncode == 2 and "not a consolidated directory" in proc.stderr


def test_out_that_would_lose_data_is_refused_on_every_rank(runs, tmp_path):
    """The 2-rank checkpoint: the re-launched ranks refuse --out inside the checkpoint before any work
    (exit 2, one error line, no hang), and the latest tag survives; export-hf keeps its input."""
    source = runs["root"] / "gpt_tp2" / "checkpoints"
    tag = source / "step_00000003"
    before = sorted(p.relative_to(tag) for p in tag.rglob("*"))
    proc = cli("consolidate", "--checkpoint", str(source), "--out", str(tag), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert any(line.rstrip().endswith(f"{tag}: output is inside the input directory {source}; choose a directory "
                                      "outside it") for line in proc.stderr.splitlines()), proc.stderr[-3000:]
    assert sorted(p.relative_to(tag) for p in tag.rglob("*")) == before and (tag / "COMPLETE").is_file()
    proc = cli("consolidate", "--checkpoint", str(source), "--tag", "step_5", "--out", str(tmp_path / "x"), check=False)
    assert proc.returncode == 2 and "no such checkpoint tag (available: " in proc.stderr.strip().splitlines()[-1]
    exported = runs["exports"] / "gpt_tp2"
    proc = cli("export-hf", "--consolidated", str(exported), "--out", str(exported), check=False)
    assert proc.returncode == 2 and "output is the input directory" in proc.stderr.strip().splitlines()[-1]
    assert (exported / "meta.json").is_file() and not (exported / "ascender_dist.json").exists()
