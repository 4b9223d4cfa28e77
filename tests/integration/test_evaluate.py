"""``ascender-dist evaluate``: val loss / perplexity and a local lm-eval task over tiny trained runs.

The runs (gpt, ascender TP2, connection with the mixed pattern SCA) are trained and consolidated
once per session by tests/distributed/workers/export_sources.py. The lm-eval task is a 10-example
multiple-choice task over Python snippets, written by this module as YAML + jsonl (no network:
``datasets``' packaged json builder reads the local file).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.lm_eval_task import TASK
from tests.helpers.lm_eval_task import write_task as write_lm_eval_task
from tests.helpers.multiproc import REPO_ROOT
from tests.helpers.single_rank import single_rank_group  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow

QUESTIONS = [  # (context, choices, index of the answer)
    ("def add(a, b):\n    return", [" a + b", " a - b", " None"], 0),
    ("import", [" os", " 123", " )"], 0),
    ("for i in range(10):\n   ", [" print(i)", " ))((", " 7 7 7"], 0),
    ("class Foo:\n    def __init__(self", [", x):", " ]]", " +"], 0),
    ("if x is None:\n    return", [" None", " ((", " :"], 0),
    ("# comment\nx =", [" 1", " def", " class"], 1),
    ("while True:\n    ", ["break", "))", "]]"], 0),
    ("from typing import", [" Optional", " 99", " ("], 2),
    ("try:\n    pass\nexcept", [" Exception:", " 5", " {"], 0),
    ("return self.", ["value", "(((", "123"], 0),
]
def write_task(directory: Path) -> Path:
    return write_lm_eval_task(directory, QUESTIONS)


def _env(tmp: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp / "datasets-cache"), "TOKENIZERS_PARALLELISM": "false"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    return env


def run_module(module: str, *args: str, tmp: Path, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT, env=_env(tmp), capture_output=True,
                          text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def evaluated(sources, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evaluate")
    tasks = write_task(tmp / "tasks")
    c = sources["consolidated"]
    out = tmp / "out"
    proc = run_module("ascender_dist.tools.evaluate", c["connection-tiny"], c["gpt-tiny"],
                      f"asc-tiny={c['ascender-tiny']}", "--tasks", TASK, "--include-path", str(tasks),
                      "--out", str(out), tmp=tmp)
    return {"tmp": tmp, "tasks": tasks, "out": out, "stdout": proc.stdout,
            "report": json.loads((out / "results.json").read_text()), "md": (out / "results.md").read_text()}


def test_json_has_every_run_with_finite_consistent_numbers(evaluated):
    report = evaluated["report"]
    runs = {r["name"]: r for r in report["runs"]}
    assert [r["name"] for r in report["runs"]] == ["gpt-tiny", "asc-tiny", "connection-tiny"]  # gpt, ascender, conn
    assert report["columns"] == ["val_loss", "perplexity", f"{TASK} acc", f"{TASK} acc_norm"]
    for name, arch in (("gpt-tiny", "gpt"), ("asc-tiny", "ascender"), ("connection-tiny", "connection")):
        run = runs[name]
        assert run["architecture"] == arch and run["size"] == "tiny" and run["step"] == 4
        assert math.isfinite(run["val_loss"]) and 0 < run["val_loss"] < math.log(500) + 1
        assert math.isclose(run["perplexity"], math.exp(run["val_loss"]), rel_tol=1e-12)
        assert run["val_samples"] > 0 and run["val_tokens"] == run["val_samples"] * 32
        metrics = run["tasks"][TASK]
        assert metrics["samples"] == len(QUESTIONS)
        for metric in ("acc", "acc_norm"):
            assert 0.0 <= metrics[metric] <= 1.0
            assert (metrics[metric] * len(QUESTIONS)) == pytest.approx(round(metrics[metric] * len(QUESTIONS)))
            assert math.isfinite(metrics[f"{metric}_stderr"])
        assert run["parameters"] > 0
        # which code trained the weights and which evaluated them: this checkout, both
        assert run["trained_code"]["git_commit"] == report["code"]["git_commit"] and len(run["trained_code"]["git_commit"]) == 40
    assert len({runs[n]["val_samples"] for n in runs}) == 1  # the same val split for every run


def test_markdown_table_matches_json(evaluated):
    md, report = evaluated["md"], evaluated["report"]
    assert md.strip() in evaluated["stdout"]
    lines = md.splitlines()
    assert "## tiny" in lines
    header = next(line for line in lines if line.startswith("| run"))
    assert header == f"| run | architecture | parameters | step | val loss | perplexity | {TASK} acc | {TASK} acc_norm |"
    rows = [line for line in lines if line.startswith("| ") and not line.startswith(("| run", "| ---"))]
    assert [row.split(" | ")[0][2:] for row in rows] == ["gpt-tiny", "asc-tiny", "connection-tiny"]
    for row, run in zip(rows, report["runs"]):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[4]) == pytest.approx(run["val_loss"], abs=1e-4)
        assert float(cells[5]) == pytest.approx(run["perplexity"], abs=1e-4)
        assert float(cells[6]) == pytest.approx(run["tasks"][TASK]["acc"], abs=1e-4)


def test_val_loss_equals_megatron_loss_on_the_val_split(sources, evaluated, single_rank_group):
    """The plain-torch model on the val split gives what our megatron model (TP=1) gives, over the
    tokenizer's vocabulary (consolidation drops the padding rows, as every export does)."""
    from ascender_dist.config.resolve import derive
    from ascender_dist.training.engine import build_run_model
    from ascender_dist.parallel.setup import init_model_parallel
    from ascender_dist.tools.convert import read_consolidated
    from ascender_dist.training.layer_stats import last_training_step, set_training_step
    from ascender_dist.training.weights import load_canonical_state, pad_vocab
    from data_pipeline.loader import StreamingLoader

    state, cfg, meta = read_consolidated(Path(sources["consolidated"]["ascender-tiny"]))
    init_model_parallel(1, 1, seed=0)
    derived = derive(cfg, 1, meta["vocab_size"])
    model = build_run_model(cfg, derived).eval()
    load_canonical_state(model, cfg, pad_vocab(state, derived.vocab_size, derived.padded_vocab_size))
    set_training_step(model, last_training_step(meta["step"]))  # the step the saved weights last ran
    loader = StreamingLoader(cfg.data.manifest, seq_length=cfg.model.seq_length, micro_batch_size=16,
                             global_batch_size=16, dp_rank=0, dp_size=1, seed=0, split="val")
    losses = []
    with torch.no_grad():
        for batch in loader:
            tokens = batch["tokens"].long()
            positions = torch.arange(tokens.shape[1] - 1).unsqueeze(0).expand(tokens.shape[0], -1)
            logits = model(tokens[:, :-1], positions, None)[..., : meta["vocab_size"]]  # padding ids dropped
            losses.append(float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                                  tokens[:, 1:].reshape(-1))))
    ours = next(r for r in evaluated["report"]["runs"] if r["name"] == "asc-tiny")
    assert ours["val_samples"] == len(losses) * 16  # 16 divides the val split here: no tail dropped
    assert sum(losses) / len(losses) == pytest.approx(ours["val_loss"], abs=1e-4)


def test_lm_eval_accuracy_equals_direct_loglikelihoods(sources, evaluated):
    """acc / acc_norm recomputed by hand from the exported model's log-likelihoods."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir = evaluated["out"] / "hf" / "connection-tiny"
    tok = AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True, dtype=torch.float32).eval()
    right = right_norm = 0
    for context, choices, answer in QUESTIONS:
        scores = []
        for choice in choices:
            ctx, cont = context, choice
            spaces = len(ctx) - len(ctx.rstrip())  # lm-eval moves trailing whitespace to the continuation
            if spaces:
                ctx, cont = ctx[:-spaces], ctx[-spaces:] + cont
            context_ids = tok(ctx)["input_ids"]
            whole = tok(ctx + cont)["input_ids"]
            continuation = whole[len(context_ids):]
            ids = torch.tensor([whole])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids[:, :-1]).logits.double(), -1)[0]
            positions = range(len(context_ids) - 1, len(whole) - 1)
            scores.append(sum(logp[p, t].item() for p, t in zip(positions, continuation)))
        right += max(range(len(choices)), key=lambda i: scores[i]) == answer
        normed = [s / len(c) for s, c in zip(scores, choices)]
        right_norm += max(range(len(choices)), key=lambda i: normed[i]) == answer
    metrics = next(r for r in evaluated["report"]["runs"] if r["name"] == "connection-tiny")["tasks"][TASK]
    assert metrics["acc"] == pytest.approx(right / len(QUESTIONS))
    assert metrics["acc_norm"] == pytest.approx(right_norm / len(QUESTIONS))


def test_lm_eval_cli_with_the_registered_model(sources, evaluated):
    """`python -m ascender_dist.tools.lm_eval_adapter --model ascender-dist ...` on a consolidated dir."""
    tmp = evaluated["tmp"]
    out = tmp / "lm_eval_cli"
    run_module("ascender_dist.tools.lm_eval_adapter", "--model", "ascender-dist", "--model_args",
               f"pretrained={sources['consolidated']['gpt-tiny']},dtype=float32", "--tasks", TASK,
               "--include_path", str(evaluated["tasks"]), "--device", "cpu", "--output_path", str(out), tmp=tmp)
    results = [json.loads(p.read_text()) for p in out.rglob("results_*.json")]
    assert len(results) == 1
    acc = results[0]["results"][TASK]["acc,none"]
    ours = next(r for r in evaluated["report"]["runs"] if r["name"] == "gpt-tiny")["tasks"][TASK]["acc"]
    assert acc == pytest.approx(ours)


def test_bad_input_is_one_line_exit_2(sources, evaluated, tmp_path):
    c = sources["consolidated"]
    not_a_run = tmp_path / "empty"
    not_a_run.mkdir()
    cases = [
        ((str(not_a_run),), "not a consolidated directory"),
        ((str(tmp_path / "missing"),), "run directory not found"),
        ((c["gpt-tiny"], "--tasks", "no_such_task_xyz"), "unknown lm-eval task 'no_such_task_xyz'"),
    ]
    for args, message in cases:
        proc = run_module("ascender_dist.tools.evaluate", *args, "--out", str(tmp_path / "o"), tmp=tmp_path,
                          check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert lines[-1].startswith("error: ") and message in lines[-1], lines[-1]
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o" / "results.json").exists()


def test_missing_task_data_offline_is_one_line_and_keeps_the_val_result(sources, evaluated, tmp_path):
    """`--tasks arc_easy` offline with an empty datasets cache: one error line naming the task and the
    command that fetches its data, exit 2, and results.json still holds the validation loss."""
    out = tmp_path / "o"
    env_home = tmp_path / "hf-home"  # nothing cached here
    proc = subprocess.run([sys.executable, "-m", "ascender_dist.tools.evaluate", sources["consolidated"]["gpt-tiny"],
                           "--tasks", "arc_easy", "--out", str(out)], cwd=REPO_ROOT,
                          env={**_env(tmp_path), "HF_HOME": str(env_home)}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and proc.stderr.strip().splitlines()[-1] == errors[0], proc.stderr[-3000:]
    assert errors[0].startswith("error: lm-eval task 'arc_easy' (dataset allenai/ai2_arc/ARC-Easy): data not available")
    assert "datasets.load_dataset('allenai/ai2_arc', 'ARC-Easy')" in errors[0]
    assert "HF_DATASETS_OFFLINE/HF_HUB_OFFLINE unset" in errors[0]
    report = json.loads((out / "results.json").read_text())
    assert report["error"] == errors[0][len("error: "):]
    run = report["runs"][0]
    assert "tasks" not in run and math.isfinite(run["val_loss"])
    full = next(r for r in evaluated["report"]["runs"] if r["name"] == "gpt-tiny")
    assert run["val_loss"] == pytest.approx(full["val_loss"], abs=1e-9) and run["val_samples"] == full["val_samples"]
    assert "| gpt-tiny |" in (out / "results.md").read_text() and "| gpt-tiny |" in proc.stdout
