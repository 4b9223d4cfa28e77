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

from ascender_dist.config.errors import ConfigError
from ascender_dist.config.schema import RunConfig
from ascender_dist.parallel.consolidate import gather_tp_tensor, split_full, tp_partition


VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def strip_vocab_padding(state: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """Drop the rows of the padding ids (exports see the tokenizer's vocabulary only)."""
    return {k: (v[:vocab_size].clone() if k in VOCAB_ROWS else v) for k, v in state.items()}


def pad_vocab(state: dict[str, torch.Tensor], vocab_size: int, padded_vocab_size: int,
              source: str = "checkpoint.init_from") -> dict[str, torch.Tensor]:
    """Zero rows for the padding ids (never targets; their logits are 0 until trained). Weights with
    fewer rows than the run's ``vocab_size`` real ids (another, smaller tokenizer's) are refused with a
    ConfigError naming ``source``: zero-padding would give real tokens zero rows without a word."""
    for key in VOCAB_ROWS:
        if key in state and state[key].shape[0] < vocab_size:
            raise ConfigError(source, f"{key} has {state[key].shape[0]} rows, fewer than this run's {vocab_size} token "
                                      f"ids (weights of another tokenizer?): ids {state[key].shape[0]}-{vocab_size - 1} "
                                      "would start with zero rows")
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
    """Full fp32 tensors by canonical name on global rank 0 (None elsewhere). Collective on all ranks.

    Every rank takes part in the TP gathers (and ZeRO-3's), but only one rank per pipeline stage
    (data-parallel and tensor-parallel rank 0) keeps a CPU copy, and only rank 0 receives the stages'
    copies: peak host memory is one model on rank 0 and one stage on each stage leader, whatever
    the data-parallel size. A bf16 run's weights are its optimizer's fp32 master copies (the bf16
    parameters are those rounded), so that consolidate -> reshard keeps what the optimizer held."""
    from megatron.core import parallel_state as mps
    from tqdm import tqdm

    named = list(canonical_parameters(module, cfg))
    leader = mps.get_data_parallel_rank() == 0 and mps.get_tensor_model_parallel_rank() == 0
    local: dict[str, torch.Tensor] = {}
    with _gathered([p for _, p in named], cfg.parallel.zero_stage):
        for name, param in tqdm(named, desc="gather weights", unit="tensor",
                                disable=not progress or dist.get_rank() != 0):
            full = gather_tp_tensor(_master_value(param), param, mps.get_tensor_model_parallel_group())
            if leader:
                local[name] = full.float().cpu()
    pieces = _stage_pieces_on_rank0(mps.get_pipeline_model_parallel_rank(), local if leader else None)
    if pieces is None:
        return None
    merged: dict[str, torch.Tensor] = {}
    # the tied embedding module is on the first and the last stage: its word embeddings are equal on
    # both, but only the first stage's position embeddings are trained, so the first stage's copy wins
    for _, piece in sorted(pieces, key=lambda stage_piece: -stage_piece[0]):
        merged.update(piece)
    return merged


def _master_value(param: nn.Parameter) -> torch.Tensor:
    """The fp32 master copy DeepSpeed's ZeRO optimizer keeps of a low-precision parameter (this
    TP rank's whole shard; collective over the data-parallel group), else the parameter itself."""
    if param.dtype == torch.float32:
        return param.data
    from deepspeed.utils import safe_get_full_fp32_param

    master = safe_get_full_fp32_param(param)
    return param.data if master is None else master


def _stage_pieces_on_rank0(pp_rank: int, piece: Optional[dict]) -> Optional[list[tuple[int, dict]]]:
    """[(pipeline stage, its tensors)] of every stage leader (the ranks with a ``piece``) on global
    rank 0, None elsewhere: the leaders' ranks are exchanged first (a few bytes each), then each
    leader sends its stage to rank 0 alone, so no other rank receives weights. Collective on all ranks."""
    leaders: list = [None] * dist.get_world_size()
    dist.all_gather_object(leaders, (dist.get_rank(), pp_rank) if piece is not None else None)
    if dist.get_rank() != 0:
        if piece is not None:
            dist.send_object_list([piece], dst=0)
        return None
    pieces = []
    for entry in filter(None, leaders):
        src, stage = entry
        if src == 0:
            pieces.append((stage, piece))
        else:
            box: list = [None]
            dist.recv_object_list(box, src=src)
            pieces.append((stage, box[0]))
    return pieces


def _weights_error(field: Optional[str], source: str, problem: str):
    """One-line ConfigError: ``field: source: problem`` (``source: problem`` without a field)."""
    from ascender_dist.config.errors import ConfigError

    where = source or "weights"
    return ConfigError(field, f"{where}: {problem}") if field else ConfigError(where, problem)


def rank_shards(module: nn.Module, cfg: RunConfig, full: dict[str, torch.Tensor], source: str = "",
                field: Optional[str] = None) -> list[tuple[str, nn.Parameter, torch.Tensor]]:
    """(canonical name, local parameter, this rank's shard of ``full[name]``) for every parameter of
    ``module`` (before DeepSpeed wraps it). A tensor the module needs that ``full`` lacks or has in
    another shape is a one-line ConfigError naming ``field`` (the config field that named
    ``source``, when there is one)."""
    from megatron.core import parallel_state as mps

    tp_size, tp_rank = mps.get_tensor_model_parallel_world_size(), mps.get_tensor_model_parallel_rank()
    shards = []
    for name, param in canonical_parameters(module, cfg):
        if name not in full:
            raise _weights_error(field, source, f"no tensor {name}, which this model needs (another model.num_layers, "
                                                "untie_embeddings_and_output_weights or architecture?)")
        sharded, dim, stride = tp_partition(param)
        split = sharded and tp_size > 1
        whole = tuple(n * tp_size if split and d == dim else n for d, n in enumerate(param.shape))
        if tuple(full[name].shape) != whole:  # before the split: a tensor of other rank or size fails it anywhere
            raise _weights_error(field, source, f"{name} has shape {tuple(full[name].shape)}, which does not fit this "
                                                f"model ({whole}, {tuple(param.shape)} per TP rank)")
        shards.append((name, param, split_full(full[name], dim, tp_size, tp_rank, stride) if split else full[name]))
    return shards


@torch.no_grad()
def copy_shards(shards: list[tuple[str, nn.Parameter, torch.Tensor]]) -> set[str]:
    """Copy each shard of :func:`rank_shards` into its parameter; returns the canonical names."""
    for _, param, value in shards:
        param.copy_(value.to(param.dtype))
    return {name for name, _, _ in shards}


@torch.no_grad()
def set_fp32_masters(shards: list[tuple[str, nn.Parameter, torch.Tensor]]) -> None:
    """After DeepSpeed wrapped the parameters: give the ZeRO optimizer's fp32 master copies of
    low-precision parameters the loaded fp32 values (it built them from the bf16-rounded
    parameters). Collective over the data-parallel group; nothing to do for fp32 parameters."""
    from deepspeed.utils import safe_set_full_fp32_param

    for _, param, value in shards:
        if param.dtype != torch.float32:
            safe_set_full_fp32_param(param, value.to(torch.float32))


def load_canonical_state(module: nn.Module, cfg: RunConfig, full: dict[str, torch.Tensor], source: str = "",
                         field: Optional[str] = None) -> set[str]:
    """Copy this rank's shard of each canonical tensor into ``module``; returns the canonical names
    it read (errors: :func:`rank_shards`)."""
    return copy_shards(rank_shards(module, cfg, full, source, field))


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

    if path.is_dir():  # e.g. a consolidated directory: its weights are one file in it
        inside = path / "model.safetensors"
        raise error(f"is a directory; pass {inside}" if inside.is_file() else "is a directory, not a weights file")
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

    from data_pipeline._io import exclusive_temporary, honour_umask

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, fd = exclusive_temporary(path)  # created by us: a link planted at the name is gone
    os.close(fd)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata=metadata)
    honour_umask(tmp)  # safetensors writes 0600
    os.replace(tmp, path)
