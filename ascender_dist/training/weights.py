"""Whole-model weights in one canonical naming, whatever the parallel layout.

The canonical name of a parameter is its name in megatron's GPTModel at TP=1 (the layout of a
consolidated checkpoint): ``embedding.word_embeddings.weight``, ``decoder.layers.3.mlp.linear_fc1.weight``...
PP=1 modules are ``LanguageModel`` wrappers (prefix ``model.``); PP>1 modules are DeepSpeed
PipelineModules, mapped by :func:`ascender_dist.models.pipeline.canonical_name`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from ascender_dist.config.schema import RunConfig
from ascender_dist.parallel.consolidate import gather_tp_tensor, split_full, tp_partition


VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def strip_vocab_padding(state: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """Drop the rows of the padding ids (exports see the tokenizer's vocabulary only)."""
    return {k: (v[:vocab_size].clone() if k in VOCAB_ROWS else v) for k, v in state.items()}


def pad_vocab(state: dict[str, torch.Tensor], padded_vocab_size: int) -> dict[str, torch.Tensor]:
    """Zero rows for the padding ids (never targets; their logits are 0 until trained)."""
    out = dict(state)
    for key in VOCAB_ROWS:
        if key in out and out[key].shape[0] < padded_vocab_size:
            rows = out[key]
            out[key] = torch.cat([rows, rows.new_zeros(padded_vocab_size - rows.shape[0], *rows.shape[1:])])
    return out


def canonical_parameters(module: nn.Module, cfg: RunConfig) -> Iterator[tuple[str, nn.Parameter]]:
    """(canonical name, local parameter) for every parameter of an engine's module."""
    if cfg.parallel.pipeline_model_parallel_size > 1:
        from ascender_dist.models.pipeline import canonical_name

        for name, param in module.named_parameters():
            yield canonical_name(name, cfg.model.num_layers), param
    else:
        for name, param in module.named_parameters():
            yield name.removeprefix("model."), param


def _gathered(params: list, zero_stage: int):
    if zero_stage == 3:
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()


@torch.no_grad()
def gather_canonical_state(module: nn.Module, cfg: RunConfig, progress: bool = False) -> Optional[dict[str, torch.Tensor]]:
    """Full fp32 tensors by canonical name on global rank 0 (None elsewhere). Collective on all ranks."""
    from megatron.core import parallel_state as mps
    from tqdm import tqdm

    named = list(canonical_parameters(module, cfg))
    local: dict[str, torch.Tensor] = {}
    with _gathered([p for _, p in named], cfg.parallel.zero_stage):
        for name, param in tqdm(named, desc="gather weights", unit="tensor",
                                disable=not progress or dist.get_rank() != 0):
            full = gather_tp_tensor(param.data, param, mps.get_tensor_model_parallel_group())
            local[name] = full.float().cpu()
    contributes = mps.get_data_parallel_rank() == 0 and mps.get_tensor_model_parallel_rank() == 0
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, (mps.get_pipeline_model_parallel_rank(), local if contributes else {}))
    if dist.get_rank() != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    # the tied embedding module is on the first and the last stage: its word embeddings are equal on
    # both, but only the first stage's position embeddings are trained, so the first stage's copy wins
    for _, piece in sorted(pieces, key=lambda stage_piece: -stage_piece[0]):
        merged.update(piece)
    return merged


def _weights_error(field: Optional[str], source: str, problem: str):
    """One-line ConfigError: ``field: source: problem`` (``source: problem`` without a field)."""
    from ascender_dist.config.errors import ConfigError

    where = source or "weights"
    return ConfigError(field, f"{where}: {problem}") if field else ConfigError(where, problem)


@torch.no_grad()
def load_canonical_state(module: nn.Module, cfg: RunConfig, full: dict[str, torch.Tensor], source: str = "",
                         field: Optional[str] = None) -> set[str]:
    """Copy this rank's shard of each canonical tensor into ``module`` (before DeepSpeed wraps it);
    returns the canonical names it read. A tensor the module needs that ``full`` lacks or has in
    another shape is a one-line ConfigError naming ``field`` (the config field that named
    ``source``, when there is one)."""
    from megatron.core import parallel_state as mps

    tp_size, tp_rank = mps.get_tensor_model_parallel_world_size(), mps.get_tensor_model_parallel_rank()
    used = set()
    for name, param in canonical_parameters(module, cfg):
        if name not in full:
            raise _weights_error(field, source, f"no tensor {name}, which this model needs (another model.num_layers, "
                                                "untie_embeddings_and_output_weights or architecture?)")
        sharded, dim, stride = tp_partition(param)
        value = split_full(full[name], dim, tp_size, tp_rank, stride) if sharded and tp_size > 1 else full[name]
        if value.shape != param.shape:
            raise _weights_error(field, source, f"{name} has shape {tuple(full[name].shape)}, which does not fit this "
                                                f"model ({tuple(param.shape)} per TP rank)")
        param.copy_(value.to(param.dtype))
        used.add(name)
    return used


def check_all_weights_used(full: dict[str, torch.Tensor], used: set[str], source: str = "",
                           field: Optional[str] = None) -> None:
    """Every tensor of ``full`` was read by some rank (``used``: this rank's names from
    load_canonical_state; gathered over all ranks when a process group is up, since a pipeline
    stage reads only its own layers). A leftover tensor means the weights are of another model
    (more layers, an untied head...): a one-line ConfigError instead of a run that silently drops
    them. Collective when distributed."""
    names = set(used)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(used))
        names = set().union(*map(set, gathered))
    unused = sorted(set(full) - names)
    if unused:
        raise _weights_error(field, source, f"{len(unused)} tensors this model has no place for, e.g. {unused[:3]} "
                                            "(another model.num_layers, untie_embeddings_and_output_weights or "
                                            "architecture?)")


def read_weights_file(path: str | Path, field: Optional[str] = "checkpoint.init_from") -> dict[str, torch.Tensor]:
    """A consolidated weights file (safetensors, canonical names).

    Problems are a one-line ConfigError: ``field: path: problem``, or ``path: problem`` when
    ``field`` is None (the file is not named by a config field).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from ascender_dist.config.errors import ConfigError

    path = Path(path)

    def error(problem: str) -> ConfigError:
        return ConfigError(field, f"{path}: {problem}") if field else ConfigError(str(path), problem)

    if not path.is_file():
        raise error("weights file not found")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise error(f"unreadable safetensors file, truncated or corrupt ({detail})") from None


def write_weights_file(state: dict[str, torch.Tensor], path: str | Path, metadata: Optional[dict] = None) -> None:
    """Write atomically (temporary name, then rename): a crash never leaves a half-written file."""
    import os

    from safetensors.torch import save_file

    from data_pipeline._io import honour_umask

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata=metadata)
    honour_umask(tmp)  # safetensors writes 0600
    os.replace(tmp, path)
