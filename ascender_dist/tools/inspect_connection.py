"""Look inside a trained Connection model: learned slot-to-slot connection, per-slot token loads and
reasoning steps, as PNG heatmaps plus a JSON summary.

    ascender-dist inspect-connection --consolidated exports/run --out inspect/ [--text "def f(x): ..."]

Runs the consolidated model on one process (TP=1), records the hidden states entering every
Connection layer, and asks each layer for its connection matrix, slot loads and steps taken.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from ascender_dist.config.architectures import expand_layer_pattern
from ascender_dist.tools.convert import (ConversionError, read_consolidated, recorded_tokenizer_sha256,
                                         refuse_other_tokenizer, within)


def _connection_layers(model) -> list:
    from ascender_dist.models.specs.connection import ConnectionSelfAttention

    return [m for m in model.modules() if isinstance(m, ConnectionSelfAttention)]


def _heatmap(matrix: torch.Tensor, path: Path, title: str, xlabel: str, ylabel: str,
             yticks: Optional[list[str]] = None) -> None:
    from ascender_dist.plotting import pyplot

    plt = pyplot()  # one line naming the research extra when matplotlib is missing

    rows, cols = matrix.shape
    fig, ax = plt.subplots(figsize=(max(4, cols * 0.25 + 2), max(3, rows * 0.22 + 1.5)))
    image = ax.imshow(matrix.float().numpy(), aspect="auto", cmap="viridis")
    fig.colorbar(image, ax=ax)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if yticks is not None:
        ax.set_yticks(range(len(yticks)))
        ax.set_yticklabels(yticks, fontsize=6, family="monospace")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _tokens(cfg, meta: dict, text: Optional[str], max_tokens: int, meta_file: Optional[Path] = None):
    """(token ids [1, n], token strings) from ``text`` or the first validation sample, at most
    ``max_tokens`` and ``model.seq_length`` of them (the positions the model has: learned ones end
    there); the tokenizer (and the shards) must be the ones the weights were trained with when
    ``meta`` records it."""
    from data_pipeline.tokenizer import Tokenizer

    max_tokens = min(max_tokens, cfg.model.seq_length)
    tokenizer = Tokenizer.load(Path(cfg.data.tokenizer)) if cfg.data.tokenizer and Path(cfg.data.tokenizer).is_file() else None
    if tokenizer is not None:  # another tokenizer would label (or, with --text, encode) other pieces
        refuse_other_tokenizer(cfg.data.tokenizer, tokenizer.sha256, meta, meta_file or Path("meta.json"))
    if text is not None:
        if tokenizer is None:
            raise ConversionError("data.tokenizer", f"{cfg.data.tokenizer or '(unset)'}: tokenizer not found, needed for --text")
        ids = tokenizer.encode(text)[:max_tokens]
    else:
        from ascender_dist.training.run import loader_source
        from data_pipeline.loader import StreamingLoader

        source, url_template = loader_source(cfg)
        loader = StreamingLoader(source, seq_length=cfg.model.seq_length, micro_batch_size=1, global_batch_size=1,
                                 dp_rank=0, dp_size=1, seed=cfg.train.seed, split="val", url_template=url_template,
                                 tokenizer_sha256=recorded_tokenizer_sha256(meta))
        ids = next(iter(loader))["tokens"][0, :max_tokens].tolist()
    if not ids:  # a --text the tokenizer encodes to nothing
        raise ConversionError("--text", f"{text!r} gives no tokens to inspect")
    labels = [tokenizer.decode([i]) if tokenizer else str(i) for i in ids]
    return torch.tensor([ids]), [repr(t)[1:-1][:12] for t in labels]


def _input_steps(stats, hp) -> dict:
    """Reasoning steps of the states that the input reached (ReasoningStats.input_steps). Causal
    layers reason once per chunk of ``causal_chunk_size`` tokens from the chunks before it; the
    first chunk's state is the bare slots, the same for every input, so it is reported apart
    (``steps_first_chunk``) and ``steps_mean`` / ``steps_max`` are None when the input fits in one
    chunk. stats.steps: [b] (full) or [b, chunks], with a trailing [N] for per-slot stops."""
    steps = stats.steps.float()
    if not stats.causal:
        return {"steps_mean": steps.mean().item(), "steps_max": steps.max().item()}
    per_chunk = steps.transpose(0, 1).reshape(steps.shape[1], -1)  # [chunks, b (x N)]
    later = stats.input_steps().float() if steps.shape[1] > 1 else None
    return {"steps_mean": later.mean().item() if later is not None else None,
            "steps_max": later.max().item() if later is not None else None,
            "steps_per_chunk": per_chunk.mean(1).tolist(), "steps_first_chunk": per_chunk[0].mean().item(),
            "causal_chunk_size": hp.causal_chunk_size}


def check_input_arguments(text: Optional[str], max_tokens: int) -> None:
    """Before anything is read: --max-tokens >= 1 (a negative one would slice from the end) and a
    --text that is not empty."""
    if max_tokens < 1:
        raise ConversionError("--max-tokens", f"must be >= 1 (got {max_tokens})")
    if text is not None and not text.strip():
        raise ConversionError("--text", "is empty: no tokens to inspect")


def make_out_dir(out_dir: Path, consolidated: Path) -> None:
    """Create ``--out`` before the model is built: an existing file, or the consolidated directory or
    a path inside it (its files are what the other tools check and replace), is one line."""
    out_dir = Path(out_dir)
    if within(out_dir.resolve(), Path(consolidated).resolve()):
        raise ConversionError(out_dir, f"is the consolidated directory {consolidated} or inside it: choose an "
                                       "--out outside it")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConversionError(out_dir, f"cannot create the output directory ({exc.strerror or exc})") from None


def inspect_connection(consolidated: Path, out_dir: Path, text: Optional[str] = None, max_tokens: int = 64) -> dict:
    from ascender_dist.config.resolve import derive
    from ascender_dist.training.engine import build_run_model
    from ascender_dist.parallel.setup import init_model_parallel, init_process_group
    from ascender_dist.training.weights import load_canonical_state, pad_vocab

    from ascender_dist.tools.hf_export import check_weights_fit_config

    check_input_arguments(text, max_tokens)
    state, cfg, meta = read_consolidated(consolidated)
    make_out_dir(out_dir, consolidated)
    if "C" not in expand_layer_pattern(cfg.model):
        raise ConversionError(Path(consolidated) / "meta.json", "model has no Connection layers ('C' in layer_pattern)")
    # a config.yaml edited by hand (fewer layers...) would otherwise be inspected as another model
    check_weights_fit_config(state, cfg, meta, Path(consolidated))
    init_process_group()
    init_model_parallel(1, 1, cfg.train.seed)
    derived = derive(cfg, 1, meta["vocab_size"])
    model = build_run_model(cfg, derived).eval()
    padded = pad_vocab(state, derived.vocab_size, derived.padded_vocab_size, str(consolidated))
    load_canonical_state(model, cfg, padded, source=str(consolidated))
    tokens, labels = _tokens(cfg, meta, text, max_tokens, Path(consolidated) / "meta.json")
    layers = _connection_layers(model)
    inputs: dict[int, torch.Tensor] = {}
    hooks = [layer.register_forward_pre_hook(lambda mod, args, i=i: inputs.__setitem__(i, args[0].detach()))
             for i, layer in enumerate(layers)]
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    with torch.no_grad():
        model(tokens, positions, None)
    for hook in hooks:
        hook.remove()
    out_dir = Path(out_dir)
    summary = {"source": str(consolidated), "step": meta.get("step"), "tokens": labels, "layers": {}}
    for i, wrapper in enumerate(layers):
        layer, number = wrapper.layer, wrapper.layer_number
        matrix = layer.connection_matrix()
        with torch.no_grad():
            loads = layer.slot_loads(inputs[i])[0]  # [s, N]
            layer(inputs[i])
        steps = _input_steps(layer.last_stats, layer.hp)
        _heatmap(matrix, out_dir / f"layer{number:02d}_connection.png",
                 f"layer {number}: {layer.hp.connection} connection (slot i -> slot j)", "target slot j", "source slot i")
        _heatmap(loads, out_dir / f"layer{number:02d}_slot_loads.png", f"layer {number}: token -> slot loads",
                 "slot", "token", yticks=labels)
        summary["layers"][number] = {
            "connection": layer.hp.connection, "matrix": matrix.tolist(),
            "slot_load_totals": loads.sum(0).tolist(),
            **steps, "max_steps": layer.hp.max_steps,
        }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
