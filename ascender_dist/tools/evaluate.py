"""``ascender-dist evaluate``: validation loss / perplexity and lm-evaluation-harness tasks of
several runs, side by side, grouped by model size.

    ascender-dist evaluate exports/gpt-small exports/ascender-small exports/connection-small \\
        --tasks hellaswag,arc_easy --out eval/small

Each RUN is ``DIR`` or ``NAME=DIR``; DIR is a consolidated directory (``ascender-dist consolidate``)
or a Hugging Face export (``ascender-dist export-hf``). NAME defaults to the directory name
(``gpt-small``...). For every run:

* validation loss: mean next-token cross entropy over every sample of the val split of the data
  (the run's ``data.manifest`` / ``data.mixture``, or ``--manifest``), read by
  ``data_pipeline.loader.StreamingLoader(split="val")`` in stored order, exactly as training's
  ``val/loss`` (inputs ``tokens[:, :-1]``, labels ``tokens[:, 1:]``), averaged over all tokens;
  perplexity = exp(val loss) (null when the loss is past exp's float range, ~709.8 nats). Data
  made with another tokenizer than the run's (meta.json's ``tokenizer_sha256``, else the sha256 of
  an export's ``tokenizer.model`` or of the run's ``data.tokenizer``) is refused in one line. The
  softmax is over the tokenizer's vocabulary (consolidation drops the vocab padding rows, as every
  export does), as training's, whose loss gives the padding ids zero probability
  (``models.build.vocab_cross_entropy``): on the same samples it equals training's ``val/loss`` up
  to float rounding. The model runs single-process in plain torch: the Hugging Face model of
  :mod:`ascender_dist.hf` (what ``export-hf`` writes, tested to match our megatron model at TP=1
  within 1e-4) built from the consolidated weights, no megatron, no process group; an export
  directory is loaded with ``AutoModelForCausalLM`` (remote code on) through
  ``lm_eval_adapter.remote_code_path``, so each export runs its own code even where exports of one
  directory name (``small/hf``, ``medium/hf``) are evaluated together.
* lm-eval tasks (``--tasks``): a consolidated run is exported into ``OUT/hf/NAME`` first, then
  lm-eval's HFLM runs it through the ``ascender-dist`` model of
  :mod:`ascender_dist.tools.lm_eval_adapter` (``--include-path`` adds task YAML directories).

Writes ``OUT/results.json`` (every number, per run, plus the settings) and ``OUT/results.md``
(one table per size: rows = runs, columns = val loss, perplexity, each task metric) and prints
the markdown. A bad directory or an unknown task is one line on stderr and exit status 2; so is, before
any model runs, what lm-eval would stop at (no tokenizer, the wrong one, an ``OUT/hf/NAME`` that must
not be replaced) and a run without validation data. A failure once some runs finished (a task's
data missing, an export or lm-eval failing on a later run) still writes both files with what
finished plus ``"error"`` (a crash's traceback in ``"traceback"``), then prints its one line (exit
status 2, or 1 for a crash).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from ascender_dist.config.errors import UserError
from ascender_dist.extras import missing_extra
from ascender_dist.tools.safetensors_header import UnreadableWeights, export_parameters, stored_parameters

log = logging.getLogger("ascender_dist")

SIZE_ORDER = ("debug", "tiny", "small", "medium", "large", "xl")
ARCH_ORDER = ("gpt", "ascender", "connection")


MAX_EXP_ARG = math.log(sys.float_info.max)  # ~709.78: math.exp raises OverflowError above


class EvaluationError(UserError, ValueError):
    """Bad input for ``evaluate``; ``str(e)`` is one line naming the run, directory or task."""


@dataclass
class Run:
    name: str
    path: Path
    kind: str  # "consolidated" | "hf"
    architecture: str = "?"
    size: str = "unknown"
    parameters: Optional[int] = None
    step: Optional[int] = None
    seq_length: Optional[int] = None
    vocab_size: Optional[int] = None
    manifest: object = None  # what StreamingLoader reads (path or [(path, weight), ...])
    tokenizer: Optional[str] = None  # the run's data.tokenizer, or an export's tokenizer.model
    tokenizer_sha256: Optional[str] = None  # what the weights were trained with (consolidated meta.json)
    results: dict = field(default_factory=dict)
    config: object = field(default=None, repr=False)  # a consolidated run's config (config.yaml)
    meta: Optional[dict] = field(default=None, repr=False)  # a consolidated run's meta.json
    trained_code: Optional[dict] = None  # the git commit that trained the weights (meta.json's code)


# ----------------------------------------------------------------------------- runs
def _size_of(preset: Optional[str], *names: str) -> str:
    if preset:
        return preset
    for name in names:
        suffix = (name or "").rsplit("-", 1)[-1].lower()
        if suffix in SIZE_ORDER:
            return suffix
    return "unknown"


def _stored_parameters(weights: Path) -> int:
    """Parameter count of a safetensors file from its header; a truncated or corrupt file is one
    line naming it (safetensors_header)."""
    try:
        return stored_parameters(weights)
    except UnreadableWeights as exc:
        raise EvaluationError(str(exc)) from None


def _export_parameters(export: Path) -> int:
    """The tensors an export's ``*.safetensors`` files store, counted from their headers (each file
    checked: one line for a truncated one): the run's parameter count until a model is loaded, so
    ``--no-val`` still reports it (a remote-code export also stores its few fixed per-head and slot
    buffers, which a loaded model does not count)."""
    try:
        return export_parameters(export)
    except UnreadableWeights as exc:
        raise EvaluationError(str(exc)) from None


def tokenizer_identity(run: Run) -> Optional[str]:
    """The sha256 of the tokenizer the run's validation data must have been made with: the one its
    meta.json records, else that of its tokenizer file (an export's ``tokenizer.model``, a run's
    ``data.tokenizer`` when it exists here), else None (the data cannot be checked). A tokenizer
    file that exists but cannot be read is a one-line EvaluationError naming it."""
    if run.tokenizer_sha256:
        return run.tokenizer_sha256
    if not run.tokenizer or not Path(run.tokenizer).exists():
        return None
    from data_pipeline.tokenizer import tokenizer_sha256

    try:
        return tokenizer_sha256(Path(run.tokenizer))
    except OSError as exc:
        raise EvaluationError(f"{run.tokenizer}: cannot read the tokenizer of run {run.name} "
                              f"({exc.strerror or exc})") from None


def _refuse_recorded_url(run_dir: Path, where: str, value: str) -> None:
    """A run directory's config.yaml is data anyone could have written: a ``pipe:`` manifest there
    would run its command as whoever evaluates the run. URLs and commands are taken from
    ``--manifest`` only."""
    from data_pipeline.shards import is_url_or_command

    if value and is_url_or_command(value):
        raise EvaluationError(f"{run_dir / 'config.yaml'}: {where} {value[:80]!r} is a URL or command, not a local "
                              "path: evaluate reads a run's own data from local manifests only (pass --manifest)")


def parse_run(text: str, manifest: Optional[str]) -> Run:
    """``DIR`` or ``NAME=DIR`` -> a described :class:`Run` (one-line EvaluationError otherwise)."""
    from ascender_dist.tools.lm_eval_adapter import is_consolidated, is_hf_export

    name, sep, directory = text.partition("=")
    if not sep or Path(text).is_dir():  # a directory whose path holds '=' (sweep folders: lr=3e-4/...) is DIR
        name, directory = "", text
    path = Path(directory)
    if not path.is_dir():
        raise EvaluationError(f"{path}: run directory not found")
    name = name or path.resolve().name
    if is_consolidated(path):
        from ascender_dist.tools.convert import read_config, read_json_file, recorded_tokenizer_sha256

        meta = read_json_file(path / "meta.json")
        cfg = read_config(path, one_device=True)  # the strict loader: one-line errors naming config.yaml
        model, data = cfg.model, cfg.data
        mixture = [(m.manifest, float(m.weight)) for m in data.mixture]
        if not manifest:  # the run's own data: only local manifests (a URL or pipe: command came with the files)
            for where, recorded in [("data.manifest", data.manifest)] + [
                    (f"data.mixture[{i}].manifest", m) for i, (m, _) in enumerate(mixture)]:
                _refuse_recorded_url(path, where, recorded)
        run = Run(name, path, "consolidated", architecture=meta.get("architecture", "?"),
                  size=_size_of(model.preset, name, cfg.name), step=meta.get("step"),
                  seq_length=model.seq_length, vocab_size=meta.get("vocab_size"),
                  manifest=manifest or mixture or data.manifest or None,
                  tokenizer=data.tokenizer or None, tokenizer_sha256=recorded_tokenizer_sha256(meta),
                  config=cfg, meta=meta, trained_code=meta.get("code"))
        run.parameters = _stored_parameters(path / "model.safetensors")
        return run
    if is_hf_export(path):
        from ascender_dist.tools.convert import read_json_file

        parameters = _export_parameters(path)  # before transformers reads the weights: one line
        config = read_json_file(path / "config.json")
        info = read_json_file(path / "ascender_dist.json") if (path / "ascender_dist.json").is_file() else {}
        seq = config.get("max_position_embeddings") or config.get("n_positions")
        tokenizer = path / "tokenizer.model"  # what export-hf copies; its sha256 is the tokenizer's identity
        return Run(name, path, "hf", architecture=info.get("model_architecture") or config.get("model_type", "?"),
                   size=_size_of(info.get("preset"), name, info.get("run_name")), step=info.get("step"),
                   seq_length=seq, vocab_size=config.get("vocab_size"), manifest=manifest,
                   tokenizer=str(tokenizer) if tokenizer.exists() else None, parameters=parameters,
                   trained_code=info.get("trained_code"))
    raise EvaluationError(f"{path}: not a consolidated directory (model.safetensors + meta.json + config.yaml) "
                          "nor a Hugging Face export (config.json + *.safetensors)")


# ----------------------------------------------------------------------------- models
def load_model(run: Run, device: str = "cpu"):
    """The plain-torch model of a run in eval mode (fp32)."""
    import torch

    if run.kind == "consolidated":
        from ascender_dist.hf.modeling_ascender_dist import AscenderDistForCausalLM
        from ascender_dist.tools.convert import read_consolidated
        from ascender_dist.tools.hf_export import check_weights_fit_config, remote_code_config, remote_code_state

        state, cfg, meta = read_consolidated(run.path)
        check_weights_fit_config(state, cfg, meta, run.path)  # load_state_dict raises on shapes, in many lines
        tied = not cfg.model.untie_embeddings_and_output_weights
        config = remote_code_config(cfg, meta, state["embedding.word_embeddings.weight"].shape[0], tied)
        model = AscenderDistForCausalLM(config)
        missing, unexpected = model.load_state_dict(remote_code_state(state, config), strict=False)
        missing = [k for k in missing if not (tied and k == "lm_head.weight")]
        if missing or unexpected:
            raise EvaluationError(f"{run.path}: weights do not fit the model (missing {missing[:3]}, "
                                  f"unexpected {unexpected[:3]})")
        if tied:
            model.tie_weights()
        run.parameters = sum(p.numel() for p in model.parameters())
    else:
        from transformers import AutoModelForCausalLM

        from ascender_dist.tools.lm_eval_adapter import remote_code_path

        link = run.path
        # a partial or foreign export is one line, not transformers' many; RuntimeError: weights that do
        # not fit config.json (transformers 5: "You set `ignore_mismatched_sizes` to `False` ...")
        try:
            link = remote_code_path(run.path)  # its own code, whatever other exports of its name ran
            model = AutoModelForCausalLM.from_pretrained(str(link), trust_remote_code=True, dtype=torch.float32)
        except (OSError, ValueError, ImportError, RuntimeError) as exc:
            reason = _one_line(exc).replace(str(link), str(run.path))  # the directory the user named
            reason = reason.split(" Checkout 'https://huggingface.co")[0]  # a local directory: no Hub
            raise EvaluationError(f"{run.path}: cannot load the Hugging Face export of run {run.name} "
                                  f"({reason}): a partial or damaged export? export it again") from None
        run.parameters = sum(p.numel() for p in model.parameters())
    return model.to(device).eval()


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """``exc`` as one short line: its message with whitespace collapsed, else its type's name."""
    text = " ".join(str(exc).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text or type(exc).__name__


def check_validation_input(run: Run) -> None:
    """What the validation loss needs and the run description alone tells (no model loaded): a
    one-line EvaluationError naming the run otherwise."""
    if not run.manifest:
        raise EvaluationError(f"{run.name}: no validation data (the run names no data.manifest; pass --manifest)")
    if not run.seq_length:  # only an export can lack it: a consolidated config.yaml always has model.seq_length
        raise EvaluationError(f"{run.path / 'config.json'}: no max_position_embeddings (nor n_positions): the "
                              f"sequence length of {run.name} is unknown")


def validation_loss(run: Run, model, batch_size: int = 8, max_samples: Optional[int] = None,
                    device: str = "cpu") -> dict:
    """Token-mean cross entropy over the val split (every sample, stored order) and its exp."""
    import torch
    import torch.nn.functional as F

    from data_pipeline.loader import StreamingLoader

    check_validation_input(run)
    loader = StreamingLoader(run.manifest, seq_length=run.seq_length, micro_batch_size=1, global_batch_size=1,
                             dp_rank=0, dp_size=1, seed=0, split="val", tokenizer_sha256=tokenizer_identity(run),
                             vocab_size=run.vocab_size)
    total = min(len(loader), max_samples) if max_samples else len(loader)
    if total == 0:
        raise EvaluationError(f"{run.name}: the validation split is empty")
    loss_sum, tokens, samples = 0.0, 0, 0
    pending = []

    def flush():
        nonlocal loss_sum, tokens
        batch = torch.cat(pending).to(device)  # [b, s + 1]
        pending.clear()
        with torch.no_grad():
            logits = model(batch[:, :-1]).logits.float()
        labels = batch[:, 1:]
        loss_sum += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                          reduction="sum").double())
        tokens += labels.numel()

    started = time.monotonic()
    for batch in loader:
        pending.append(batch["tokens"].long())
        samples += 1
        if len(pending) == batch_size:
            flush()
        if samples == total:
            break
    if pending:
        flush()
    loss = loss_sum / tokens
    if not math.isfinite(loss):  # NaN / inf weights: no number to report (and no valid JSON to write)
        raise EvaluationError(f"{run.path}: {run.name}'s validation loss is {loss} (non-finite weights or logits)")
    # a diverged run's loss can be finite and past exp's float range (~709.8 nats): perplexity null there
    perplexity = math.exp(loss) if loss < MAX_EXP_ARG else None
    return {"val_loss": loss, "perplexity": perplexity, "val_samples": samples, "val_tokens": tokens,
            "val_seconds": round(time.monotonic() - started, 2)}


# ----------------------------------------------------------------------------- lm-eval
def task_manager(include_path: Optional[list[str]]):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path or None)


def check_tasks(tasks: list[str], manager) -> None:
    known = set(manager.all_tasks)
    for task in tasks:
        if task not in known and not manager.match_tasks([task]):
            raise EvaluationError(f"unknown lm-eval task {task!r} (see `lm-eval ls tasks`; "
                                  "--include-path DIR adds task YAMLs)")


class TaskDataError(EvaluationError):
    """An lm-eval task whose dataset cannot be loaded (offline and not cached, ...); one line."""


def _task_dataset(manager, task: str) -> tuple[Optional[str], Optional[str]]:
    """(dataset_path, dataset_name) of ``task`` from lm-eval's task index (None for a group or tag)."""
    entry = getattr(manager, "task_index", {}).get(task)
    cfg = getattr(entry, "cfg", None) if entry is not None else None
    if not isinstance(cfg, dict) and isinstance(entry, dict):
        cfg = entry
    cfg = cfg if isinstance(cfg, dict) else {}
    path, name = cfg.get("dataset_path"), cfg.get("dataset_name")
    return (path if isinstance(path, str) else None), (name if isinstance(name, str) else None)


def fetch_hint(task: str, manager) -> str:
    """How to put ``task``'s dataset into the local cache (on a machine that reaches the Hub)."""
    import os

    path, name = _task_dataset(manager, task)
    offline = [k for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE") if os.environ.get(k, "").lower() in ("1", "true")]
    where = f" with {'/'.join(offline)} unset" if offline else ""
    if path:
        args = f"{path!r}" + (f", {name!r}" if name else "")
        return (f"fetch it{where} where the Hub is reachable: python -c \"import datasets; "
                f"datasets.load_dataset({args})\" (same HF_HOME / HF_DATASETS_CACHE as here)")
    return f"run `lm-eval run --tasks {task} --limit 1`{where} where the Hub is reachable to cache its data"


def check_task_data(tasks: list[str], manager) -> None:
    """Load every task's dataset now (from the cache when offline); the first that fails is a
    one-line TaskDataError naming the task, its dataset and how to fetch it."""
    for task in tasks:
        try:
            if hasattr(manager, "load"):
                manager.load([task])
            else:  # lm-eval before TaskManager.load
                from lm_eval.tasks import get_task_dict

                get_task_dict([task], manager)
        except ImportError:
            raise
        except Exception as exc:  # datasets / huggingface_hub raise many types here; all mean "no data"
            path, name = _task_dataset(manager, task)
            dataset = f" (dataset {path}{'/' + name if name else ''})" if path else ""
            reason = " ".join(str(exc).split())[:200] or type(exc).__name__
            raise TaskDataError(f"lm-eval task {task!r}{dataset}: data not available ({reason}); "
                                f"{fetch_hint(task, manager)}") from None


def export_dir(run: Run, out: Path) -> Path:
    """Where a consolidated run is exported for lm-eval: ``OUT/hf/NAME``."""
    return out / "hf" / run.name


def check_task_input(run: Run, out: Path) -> None:
    """Before any model runs: what lm-eval needs of ``run`` that its files tell. An export has a
    tokenizer; a consolidated run has a ``data.tokenizer`` file here, that file is the tokenizer the
    weights were trained with (meta.json's ``tokenizer_sha256`` / vocab size), and ``OUT/hf/NAME``
    may be written (a new directory or a previous export, not inside the run). One-line errors."""
    if run.kind == "hf":
        if not ((run.path / "tokenizer_config.json").is_file() or (run.path / "tokenizer.model").is_file()):
            raise EvaluationError(f"{run.path}: lm-eval needs the tokenizer, and the export has none "
                                  "(tokenizer_config.json or tokenizer.model): export with --tokenizer")
        return
    from ascender_dist.tools.hf_export import check_export_out, check_tokenizer

    if run.name in ("", ".", "..") or Path(run.name).name != run.name:
        raise EvaluationError(f"run name {run.name!r} cannot name the export directory {out / 'hf'}/NAME of "
                              "its lm-eval tasks: use NAME=DIR with a plain name")
    if not (run.tokenizer and Path(run.tokenizer).is_file()):
        raise EvaluationError(f"{run.name}: lm-eval needs the tokenizer, and the run's data.tokenizer "
                              f"({run.tokenizer!r}, {run.path / 'config.yaml'}) is not a file here")
    check_tokenizer(Path(run.tokenizer), run.config, run.meta or {}, run.path / "meta.json")
    check_export_out(export_dir(run, out), run.path)


def check_exports_spare_inputs(runs: Sequence[Run], out: Path) -> None:
    """No run's ``OUT/hf/NAME`` may be, hold or lie inside another input of the same command: a
    previous export of ``OUT`` given back as a baseline would be overwritten by the new run's
    export before it is evaluated, and its scores would be the new model's."""
    for run in runs:
        if run.kind == "hf":
            continue
        target = export_dir(run, out).resolve()
        for other in runs:
            if other is run:
                continue  # its own folder: check_export_out
            source = other.path.resolve()
            if target == source or source.is_relative_to(target) or target.is_relative_to(source):
                raise EvaluationError(f"{export_dir(run, out)}: run {run.name!r} would export its model there for "
                                      f"lm-eval, over run {other.name!r}'s input {other.path}; use another --out "
                                      "or run name")


def hf_dir_for(run: Run, out: Path) -> Path:
    if run.kind == "hf":
        return run.path
    from ascender_dist.tools.hf_export import export_hf

    tokenizer = run.tokenizer if run.tokenizer and Path(run.tokenizer).is_file() else None
    if tokenizer is None:
        raise EvaluationError(f"{run.name}: lm-eval needs the tokenizer, and the run's data.tokenizer "
                              f"({run.tokenizer!r}) is not a file")
    return export_hf(run.path, export_dir(run, out), tokenizer=tokenizer)


def lm_eval_tasks(run: Run, hf_dir: Path, tasks: list[str], manager, *, batch_size, device: str,
                  limit: Optional[float], num_fewshot: Optional[int], trust_export_code: bool = False) -> dict:
    """{task: {metric: value}} (stderr as ``<metric>_stderr``) from lm_eval.simple_evaluate."""
    import lm_eval

    from ascender_dist.tools.lm_eval_adapter import register

    register()
    result = lm_eval.simple_evaluate(
        model="ascender-dist", model_args={"pretrained": str(hf_dir), "dtype": "float32",
                                           "trust_export_code": trust_export_code}, tasks=tasks,
        task_manager=manager, batch_size=batch_size, device=device, limit=limit, num_fewshot=num_fewshot,
        log_samples=False, bootstrap_iters=1000)
    out: dict = {}
    for task, metrics in (result or {}).get("results", {}).items():
        values = {}
        for key, value in metrics.items():
            if key == "alias" or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            metric, _, filt = key.partition(",")
            if metric == "sample_len":  # examples scored, not a metric
                values["samples"] = int(value)
                continue
            name = metric if filt in ("", "none") else f"{metric}[{filt}]"
            values[name] = float(value)
        out[task] = values
    return out


# ----------------------------------------------------------------------------- tables
def _order(run: dict):
    size = run["size"]
    arch = run["architecture"]
    return (SIZE_ORDER.index(size) if size in SIZE_ORDER else len(SIZE_ORDER), size,
            ARCH_ORDER.index(arch) if arch in ARCH_ORDER else len(ARCH_ORDER), run["name"])


def columns(runs: list[dict]) -> list[str]:
    """Metric columns: val loss, perplexity, then ``task metric`` in first-seen order (no stderr)."""
    cols = []
    if any("val_loss" in r for r in runs):
        cols += ["val_loss", "perplexity"]
    for r in runs:
        for task, metrics in r.get("tasks", {}).items():
            for metric in metrics:
                col = f"{task} {metric}"
                if not metric.endswith("_stderr") and metric != "samples" and col not in cols:
                    cols.append(col)
    return cols


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 1e4 else f"{value:.4g}"
    return str(value)


def _params(n: Optional[int]) -> str:
    if not n:
        return ""
    return f"{n / 1e6:.1f} M" if n >= 1e5 else f"{n / 1e3:.1f} K"


def cell(run: dict, col: str):
    if col in ("val_loss", "perplexity"):
        return run.get(col)
    task, _, metric = col.partition(" ")
    return run.get("tasks", {}).get(task, {}).get(metric)


def markdown(runs: list[dict]) -> str:
    """One table per size group; columns: run, architecture, parameters, step, metrics."""
    cols = columns(runs)
    if not runs:
        return "# Evaluation\n\nno runs\n"
    names = {"val_loss": "val loss", "perplexity": "perplexity"}
    headers = ["run", "architecture", "parameters", "step"] + [names.get(c, c) for c in cols]
    lines = ["# Evaluation", ""]
    groups: dict[str, list[dict]] = {}
    for run in sorted(runs, key=_order):
        groups.setdefault(run["size"], []).append(run)
    for size, members in groups.items():
        lines += [f"## {size}", "", "| " + " | ".join(headers) + " |",
                  "| " + " | ".join(["---", "---", "---:", "---:"] + ["---:"] * len(cols)) + " |"]
        for run in members:
            row = [run["name"], run["architecture"], _params(run.get("parameters")), _fmt(run.get("step"))]
            row += [_fmt(cell(run, c)) for c in cols]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ascender-dist evaluate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN", help="DIR or NAME=DIR (consolidated or Hugging Face export)")
    p.add_argument("--out", default="eval", help="directory for results.json / results.md (default: eval)")
    p.add_argument("--manifest", default=None, help="data_pipeline manifest whose val split to use "
                                                    "(default: each run's data.manifest / data.mixture)")
    p.add_argument("--no-val", action="store_true", help="skip the validation loss")
    p.add_argument("--val-samples", type=int, default=None, help="at most this many val samples per run")
    p.add_argument("--batch-size", type=int, default=8, help="val loss batch size (samples)")
    p.add_argument("--tasks", default="", help="comma-separated lm-eval tasks (default: none)")
    p.add_argument("--include-path", action="append", default=[], help="extra lm-eval task YAML directory")
    p.add_argument("--limit", type=float, default=None, help="lm-eval: examples per task (or a fraction)")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--eval-batch-size", default="1", help="lm-eval batch size (an int or 'auto')")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--trust-export-code", action="store_true",
                   help="load Hugging Face exports whose Python code is not this installation's own (it runs)")
    return p


class IncompleteEvaluation(Exception):
    """A failure after some results existed: ``results.json`` / ``results.md`` were written with what
    finished and the error (``report["error"]``); ``str(e)`` is that one line, ``status`` the exit
    status (2 for bad input, 1 for a crash, whose traceback results.json keeps)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def check_lm_eval_arguments(limit: Optional[float], num_fewshot: Optional[int]) -> None:
    """Before any model is loaded: lm-eval's ``limit`` is a fraction of each task in (0, 1) or a whole
    number of examples >= 1 (NaN, inf, 0 or a negative one failed inside lm-eval after every run's
    validation loss, as a crash), and ``num_fewshot`` >= 0 (a negative one was recorded as is)."""
    if limit is not None and not (math.isfinite(limit) and limit > 0 and (limit < 1 or limit == int(limit))):
        raise EvaluationError(f"--limit {limit!r}: expected a fraction in (0, 1) or a whole number of examples >= 1")
    if num_fewshot is not None and num_fewshot < 0:
        raise EvaluationError(f"--num-fewshot must be >= 0 (got {num_fewshot})")


def evaluate(args: argparse.Namespace) -> dict:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device != "cpu" and not (device == "cuda" or device.startswith("cuda:")):
        raise EvaluationError(f"--device {device!r}: expected cpu, cuda or cuda:N")
    if device != "cpu" and not torch.cuda.is_available():
        raise EvaluationError(f"--device {device}: no CUDA device is available here (use --device cpu)")
    for flag, value in (("--batch-size", args.batch_size), ("--val-samples", args.val_samples)):
        if value is not None and value < 1:
            raise EvaluationError(f"{flag} must be >= 1 (got {value})")
    check_lm_eval_arguments(args.limit, args.num_fewshot)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    runs = [parse_run(text, args.manifest) for text in args.runs]
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise EvaluationError(f"run names must differ (got {names}); use NAME=DIR")
    for include in args.include_path:
        if not Path(include).is_dir():
            raise EvaluationError(f"{include}: --include-path directory not found")
    batch = args.eval_batch_size
    if batch != "auto":
        try:
            batch = int(batch)
        except ValueError:
            batch = 0
        if batch < 1:
            raise EvaluationError(f"--eval-batch-size {args.eval_batch_size!r}: expected a positive integer or 'auto'")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise EvaluationError(f"{out}: --out is an existing file, not a directory")
    # everything the files tell, before any model runs: a failure after the first run's numbers
    # would otherwise cost their compute (and, before the report below, lost them)
    from ascender_dist.tools.lm_eval_adapter import AdapterError, require_own_code

    for run in runs:
        if run.kind == "hf":  # before trust_remote_code runs its Python files
            try:
                require_own_code(run.path, args.trust_export_code)
            except AdapterError as exc:
                raise EvaluationError(str(exc)) from None
        if not args.no_val:
            check_validation_input(run)
        if tasks:
            check_task_input(run, out)
    if tasks:
        check_exports_spare_inputs(runs, out)
    manager = None
    if tasks:
        manager = task_manager(args.include_path)
        check_tasks(tasks, manager)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EvaluationError(f"{out}: cannot create the output directory ({exc.strerror or exc})") from None
    rows: list[dict] = []
    current = None
    try:
        for run in runs:
            current = run
            log.info("evaluating %s (%s, %s)", run.name, run.architecture, run.path)
            row = {"name": run.name, "path": str(run.path), "kind": run.kind, "architecture": run.architecture,
                   "size": run.size, "step": run.step, "trained_code": run.trained_code}
            if not args.no_val:
                model = load_model(run, device)
                row.update(validation_loss(run, model, args.batch_size, args.val_samples, device))
                del model
            row["parameters"] = run.parameters
            rows.append(row)
        if tasks:
            current = None
            check_task_data(tasks, manager)  # the validation numbers are written even when a task's data is missing
            for run, row in zip(runs, rows):
                current = run
                row["tasks"] = lm_eval_tasks(run, hf_dir_for(run, out), tasks, manager, batch_size=batch,
                                             device=device, limit=args.limit, num_fewshot=args.num_fewshot,
                                             trust_export_code=True)  # checked above, or exported here
    except BaseException as exc:
        if not rows:  # nothing finished: nothing to keep
            raise
        _report_failure(out, rows, tasks, args, device, exc, current)
        if not isinstance(exc, Exception):  # an interrupt: the finished results are written, it goes on
            raise
        raise IncompleteEvaluation(*_failure_line(exc, current)) from exc
    return write_report(out, rows, tasks, args, device)


def _failure_line(exc: BaseException, run: Optional[Run]) -> tuple[str, int]:
    """(one line for a failure, exit status): bad input says itself (2); a crash names the run (1)."""
    if isinstance(exc, UserError):
        return str(exc), 2
    if missing_extra(exc) is not None:
        return missing_extra(exc), 2
    where = f"run {run.name}: " if run is not None else ""
    return f"{where}{type(exc).__name__}: {_one_line(exc)}", 1


def _report_failure(out: Path, rows: list[dict], tasks: list[str], args: argparse.Namespace, device: str,
                    exc: BaseException, run: Optional[Run]) -> None:
    """Write the report of the runs that finished, with the failure; a crash's traceback goes into
    results.json (the terminal gets one line)."""
    import traceback

    message, _ = _failure_line(exc, run)
    details = {}
    if run is not None:
        details["failed_run"] = run.name
    if not isinstance(exc, (UserError, ImportError)):
        details["traceback"] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    write_report(out, rows, tasks, args, device, error=message, **details)


def write_report(out: Path, rows: list[dict], tasks: list[str], args: argparse.Namespace, device: str,
                 error: Optional[str] = None, **details) -> dict:
    """Write ``results.json`` / ``results.md`` for ``rows`` (``error``: why results are missing;
    ``details``: more about it, e.g. ``failed_run``). Each file is replaced atomically (a crash
    leaves the previous one whole)."""
    from ascender_dist.training.checkpoint import atomic_write_text
    from ascender_dist.versions import git_state, package_versions

    rows = sorted(rows, key=_order)
    versions = {k: v for k, v in package_versions(("ascender-dist", "torch", "transformers", "lm_eval")).items() if v}
    report = {"runs": rows, "columns": columns(rows), "tasks": tasks,
              "settings": {"manifest": args.manifest, "val_samples": args.val_samples, "limit": args.limit,
                           "num_fewshot": args.num_fewshot, "device": device},
              "versions": versions, "code": git_state()}  # code: the evaluator's own commit
    if error:
        report["error"] = error
        report.update(details)
    try:
        atomic_write_text(out / "results.json", json.dumps(report, indent=1))
        atomic_write_text(out / "results.md", markdown(rows))
    except OSError as exc:
        raise EvaluationError(f"{out}: cannot write the results ({exc.strerror or exc})") from None
    return report


def evaluate_main(argv: Optional[Sequence[str]] = None) -> int:
    """``ascender-dist evaluate ...``: exit 0; 2 with one line on stderr for bad input; after a failure
    once some runs finished, their results are written and shown, then the one line (2, or 1 for a
    crash)."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        report = evaluate(args)
    except IncompleteEvaluation as exc:
        print(Path(args.out, "results.md").read_text())
        print(f"wrote {Path(args.out) / 'results.json'} (the runs that finished, and the error)", flush=True)
        print(f"error: {exc}", file=sys.stderr)
        return exc.status
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        if missing_extra(exc) is None:
            raise
        print(f"error: {missing_extra(exc)}", file=sys.stderr)
        return 2
    print(Path(args.out, "results.md").read_text())
    print(f"wrote {Path(args.out) / 'results.json'} and {Path(args.out) / 'results.md'}")
    return 0 if report["runs"] else 2


if __name__ == "__main__":
    sys.exit(evaluate_main())
