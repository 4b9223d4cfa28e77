"""Interpretability figures and Table 4 from consolidated checkpoints (``ascender-dist consolidate`` output).

    ascender-dist figures --model ascender=exports/asc_s1 --model ascender=exports/asc_s2 \\
                          --model gpt=exports/gpt_s1 --out figures/ [--examples 1] [--max-tokens 32]
    python -m ascender_dist.research.figures ...                          (the same)

``--model LABEL=DIR`` (repeatable; a bare DIR is labelled by its architecture): several directories
with one label are seeds of one configuration. Everything runs on one process (TP = PP = 1) on the
first validation sequences of each model's own data (unshuffled, so every model reads the same ones)
or on ``--text``.

* **Figure 1** (``fig1_<label>_ex<e>_layer<L>.png``): for every ASCender layer of the first directory of
  each label, the score decomposition of every head: ``S_base``, the three normalised biases
  ``β̃_align``, ``β̃_sep``, ``β̃_coh`` (row-standardised, before ``ω``; the panel title gives ``ω``),
  the final score ``S = S_base + Σ ω β̃ (+ other)`` and the attention ``A = softmax(S / τ)``, with token
  labels. The maps come from the dense reference (:func:`ascender_dist.models.ascender.reference_attention`)
  applied to the inputs the trained layer's core attention actually received (a forward pre-hook);
  its output is checked against the layer's own output (the fast path) before anything is drawn.
* **Figure 4** (``fig4_<label>_omega.png``): learned ``ω_align / ω_sep / ω_coh`` per head, one row per
  (directory = seed, layer): head ``h`` of one seed and head ``h`` of another are unrelated, so nothing
  is averaged by head index; and (``fig4_<label>_mass_moved.png``) the share of attention mass each bias
  moves per head, same rows (total-variation distance between the attention rows with and without that
  bias, averaged over the examples).
* **Table 4** (``table4_clusters.{md,json}``): cluster quality of attention-induced token groups against
  lexical pseudo-labels (:mod:`ascender_dist.research.clusters`). Per model, example and attention
  layer (ASCender or softmax): the head-averaged attention map is split into groups (spectral clustering
  with k = number of pseudo-label classes in the example, and argmax); NMI/ARI against the pseudo-labels,
  Calinski-Harabasz and silhouette of the groups in the space of the hidden states entering that layer.
  Averaged over examples and layers per directory, then mean +- std over the label's directories.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import warnings
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from ascender_dist.logs import setup_cli_logging
from ascender_dist.config.loader import to_dict
from ascender_dist.research.ablate.provenance import config_hash, file_sha256, report_provenance

log = logging.getLogger("ascender_dist")

BIASES = ("align", "sep", "coh")
PANELS = ("S_base", "align", "sep", "coh", "S", "A")


# ============================================================================ loading and capture

def init_single_process() -> None:
    """A 1-rank gloo process group (what ``inspect-connection`` does)."""
    from ascender_dist.parallel.setup import init_single_process

    init_single_process()


class LoadedModel:
    """A consolidated model on this process, with hooks on every layer's core attention."""

    def __init__(self, directory: Path, label: Optional[str] = None):
        from ascender_dist.config.resolve import derive
        from ascender_dist.training.engine import build_run_model
        from ascender_dist.config.architectures import expand_layer_pattern
        from ascender_dist.parallel.setup import init_model_parallel
        from ascender_dist.tools.convert import read_consolidated
        from ascender_dist.training.layer_stats import last_training_step, set_training_step
        from ascender_dist.training.weights import load_canonical_state, pad_vocab

        self.directory = Path(directory)
        state, cfg, meta = read_consolidated(self.directory)
        self.cfg, self.meta = cfg, meta
        self.label = label or cfg.model.architecture
        self.step = int(meta.get("step") or 0)
        self.pattern = expand_layer_pattern(cfg.model)
        init_model_parallel(1, 1, cfg.train.seed)
        derived = derive(cfg, 1, meta["vocab_size"])
        self.model = build_run_model(cfg, derived).eval()
        padded = pad_vocab(state, derived.vocab_size, derived.padded_vocab_size, str(directory))
        load_canonical_state(self.model, cfg, padded, source=str(directory))
        set_training_step(self.model, last_training_step(self.step))  # Separation's gate as in the last step
        self.layers = list(self.model.decoder.layers)  # TransformerLayer, in order

    def core(self, layer) -> torch.nn.Module:
        return layer.self_attention.core_attention

    def is_ascender(self, layer) -> bool:
        return type(self.core(layer)).__name__ == "AscenderCoreAttention"

    def attention_layers(self) -> list:
        """Layers with a softmax-attention core (ASCender or megatron's), not Connection layers."""
        return [layer for layer in self.layers if hasattr(layer.self_attention, "core_attention")]

    @torch.no_grad()
    def capture(self, tokens: torch.Tensor) -> dict:
        """Run ``tokens`` [1, n]; return per layer number: hidden input [n, h], core inputs and output."""
        captured: dict[int, dict] = {}
        hooks = []
        for layer in self.attention_layers():
            number = int(layer.layer_number)
            slot = captured.setdefault(number, {})
            hooks.append(layer.register_forward_pre_hook(
                lambda mod, args, kwargs, s=slot: s.__setitem__(
                    "hidden", (args[0] if args else kwargs["hidden_states"]).detach()[:, 0].float()),
                with_kwargs=True))
            core = self.core(layer)
            hooks.append(core.register_forward_pre_hook(
                lambda mod, args, s=slot: s.update(query=args[0].detach(), key=args[1].detach(),
                                                   value=args[2].detach())))
            hooks.append(core.register_forward_hook(lambda mod, args, out, s=slot: s.__setitem__("out", out.detach())))
        try:
            positions = torch.arange(tokens.shape[1]).unsqueeze(0)
            self.model(tokens, positions, None)
        finally:
            for h in hooks:
                h.remove()
        return captured


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    return t.permute(1, 2, 0, 3).float()  # [sq, b, np, d] -> [b, np, sq, d]


def _expand_groups(key: torch.Tensor, value: torch.Tensor, heads: int):
    repeat = heads // key.shape[2]
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, dim=2), value.repeat_interleave(repeat, dim=2)
    return key, value


def ascender_maps(core, slot: dict, step: int) -> dict:
    """Dense reference maps ([np, s, s] each, batch 0) from the captured core inputs, checked against the
    layer's own output."""
    from ascender_dist.models.ascender.reference import reference_attention

    hp, hn = core.hp, core.head_dim
    q, z, h = torch.split(slot["query"], [hn, hp.d_z, hp.d_a], dim=-1)
    key, value = _expand_groups(slot["key"], slot["value"], q.shape[2])
    params = core.params.float()
    result = reference_attention(_bhsd(q), _bhsd(key), _bhsd(value), _bhsd(z), _bhsd(h), params, hp,
                                 use_sep=hp.separation_active(step))
    out = result.out  # [b, np, s, hd]
    b, np_, s, d = out.shape
    layer_out = slot["out"].float().reshape(s, b, np_, d).permute(1, 2, 0, 3)  # [b, np, s, hd]
    row_err = (out - layer_out).abs().amax(-1)  # [b, np, s]
    tol = 1e-4 * max(1.0, layer_out.abs().max().item())
    differing = row_err > tol
    if bool(differing.any()):
        raise RuntimeError(f"layer {core.layer_number}: the reference maps do not reproduce the layer's output in "
                           f"{int(differing.sum())} rows (max |diff| {row_err.max().item():.3g}); refusing to draw them")
    maps = {k: v[0].detach() for k, v in result.maps.items()}
    maps["omega"] = params.omega.detach().float()  # [np, 3]
    maps["tau"] = params.score_temperature().detach().float()  # as the layer used it
    maps["mass_moved"] = {k: v.detach().float() for k, v in result.stats.items()}
    maps["check"] = {"rows": int(row_err.numel()), "max_abs_diff": float(row_err.max())}
    return maps


def softmax_maps(core, slot: dict) -> dict:
    """Causal softmax attention of a plain (megatron) core attention from its captured inputs."""
    q = slot["query"]
    key, value = _expand_groups(slot["key"], slot["value"], q.shape[2])
    q, k, v = _bhsd(q), _bhsd(key), _bhsd(value)
    n, hd = q.shape[-2], q.shape[-1]
    scale = getattr(core, "softmax_scale", None) or 1.0 / math.sqrt(hd)
    S = q @ k.transpose(-1, -2) * scale
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    A = torch.softmax(S.masked_fill(~mask, float("-inf")), -1)
    out = (A @ v).permute(2, 0, 1, 3).reshape(n, q.shape[0], -1)
    err = (out - slot["out"].float()).abs().max().item()
    if err > 1e-3 * max(1.0, slot["out"].float().abs().max().item()):
        raise RuntimeError(f"layer {core.layer_number}: recomputed softmax attention does not match the "
                           f"layer output (max |diff| {err:.3g})")
    return {"S_base": S[0], "A": A[0]}


# ============================================================================ examples

def _tokenizer(cfg):
    from data_pipeline.tokenizer import Tokenizer

    path = Path(cfg.data.tokenizer) if cfg.data.tokenizer else None
    return Tokenizer.load(path) if path and path.is_file() else None


def examples(cfg, count: int, max_tokens: int, text: Optional[str] = None) -> list[list[int]]:
    """Token ids of ``count`` examples: ``text`` or the first validation sequences (stored order), at
    most ``max_tokens`` and ``model.seq_length`` each (learned positions end there)."""
    max_tokens = min(max_tokens, cfg.model.seq_length)
    if text is not None:
        tok = _tokenizer(cfg)
        if tok is None:
            from ascender_dist.tools.convert import ConversionError

            raise ConversionError("data.tokenizer", f"{cfg.data.tokenizer or '(unset)'}: not found, needed for --text")
        return [tok.encode(text)[:max_tokens]]
    from ascender_dist.training.run import loader_source
    from data_pipeline.loader import StreamingLoader

    source, url_template = loader_source(cfg)
    loader = StreamingLoader(source, seq_length=cfg.model.seq_length, micro_batch_size=1, global_batch_size=1,
                             dp_rank=0, dp_size=1, seed=cfg.train.seed, split="val", url_template=url_template)
    out = []
    for i, batch in enumerate(loader):
        if i >= count:
            break
        out.append(batch["tokens"][0, :max_tokens].tolist())
    return out


def token_strings(cfg, ids: Sequence[int]) -> tuple[list[str], list[str]]:
    """(sentencepiece pieces for pseudo-labels, short display labels)."""
    tok = _tokenizer(cfg)
    if tok is None:
        pieces = [str(i) for i in ids]
        return pieces, pieces
    pieces = [tok.sp.id_to_piece(int(i)) if 0 <= int(i) < tok.vocab_size else "<pad>" for i in ids]
    display = [p.replace("\u2581", "·").replace("\n", "\\n")[:10] for p in pieces]
    return pieces, display


# ============================================================================ plotting

def _plt():
    from ascender_dist.plotting import pyplot

    plt = pyplot()  # one line naming the research extra when matplotlib is missing

    return plt


def plot_decomposition(maps: dict, labels: list[str], path: Path, title: str, heads: Sequence[int]) -> None:
    """Figure 1: one row per head, columns S_base, β̃_align, β̃_sep, β̃_coh, S, A."""
    plt = _plt()
    n = len(labels)
    size = max(2.2, min(4.2, 0.12 * n + 0.6))  # inches per panel: ~7-pt token labels stay apart
    fig, axes = plt.subplots(len(heads), len(PANELS), figsize=(size * len(PANELS) + 1, size * len(heads) + 0.8),
                             squeeze=False)
    vis = torch.ones(n, n, dtype=torch.bool).tril()
    omega = maps["omega"]
    for row, head in enumerate(heads):
        for col, name in enumerate(PANELS):
            ax = axes[row][col]
            m = maps[name][head].float().clone()
            if name in BIASES:
                w = float(omega[head, BIASES.index(name)])
                off = bool(torch.all(m == 0))
                m = m / w if (w != 0 and not off) else m
                panel = f"β̃_{name}" + (" (off)" if off else f" (ω={w:.3f})")
                cmap, symmetric = "RdBu_r", True
            elif name == "A":
                panel, cmap, symmetric = f"A = softmax(S/τ), τ={float(maps['tau'][head]):.2f}", "magma", False
            else:
                panel, cmap, symmetric = ("S_base = qkᵀ/√d" if name == "S_base" else "S (final score)"), "viridis", False
            m = m.masked_fill(~vis, float("nan")).numpy()
            finite = m[np.isfinite(m)]
            if symmetric:
                lim = float(np.abs(finite).max()) if finite.size and np.abs(finite).max() > 0 else 1.0
                image = ax.imshow(m, cmap=cmap, vmin=-lim, vmax=lim, interpolation="nearest")
            elif name == "A" and n > 8:  # the first rows (few keys) are near 1: clip so later rows show
                vmax = float(np.nanpercentile(m[4:], 99)) if np.isfinite(m[4:]).any() else None
                image = ax.imshow(m, cmap=cmap, vmin=0.0, vmax=vmax, interpolation="nearest")
                panel += " (colour clipped at p99 of rows ≥ 4)"
            else:
                image = ax.imshow(m, cmap=cmap, interpolation="nearest")
            fig.colorbar(image, ax=ax, fraction=0.046, pad=0.02).ax.tick_params(labelsize=5)
            ax.set_title(f"head {head}: {panel}" if col == 0 else panel, fontsize=7)
            # 7-pt labels (readable at 100%), every `step`-th token when more would overlap
            step = max(1, math.ceil(n / 24))
            ticks = list(range(0, n, step))
            ax.set_xticks(ticks)
            ax.set_yticks(ticks)
            ax.set_xticklabels([labels[t] for t in ticks], rotation=90, fontsize=7, family="monospace")
            ax.set_yticklabels([labels[t] for t in ticks], fontsize=7, family="monospace")
            ax.tick_params(length=0)
            if row == len(heads) - 1:
                ax.set_xlabel("key j", fontsize=6)
            if col == 0:
                ax.set_ylabel("query i", fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_head_heatmaps(values: np.ndarray, stds: Optional[np.ndarray], layer_numbers: Sequence, path: Path,
                       title: str, panel_names: Sequence[str],
                       value_range: Optional[tuple[float, float]] = None) -> None:
    """Figure 4: values [rows, heads, len(panel_names)] as one annotated heatmap per panel; a row is a
    layer (int: "layer n") or any labelled row (str, e.g. "seed 2, layer 1"). ``value_range``: the
    colour scale (default: this figure's values), shared when several figures are compared."""
    plt = _plt()
    L, H, P = values.shape
    fig, axes = plt.subplots(1, P, figsize=(P * (0.55 * H + 1.6) + 1.0, 0.5 * L + 1.6), squeeze=False,
                             layout="constrained")
    # one colour scale: the panels (and, with value_range, the figures) are compared
    lo, hi = value_range or (float(np.nanmin(values)), float(np.nanmax(values)))
    mid = (lo + hi) / 2
    for p in range(P):
        ax = axes[0][p]
        image = ax.imshow(values[:, :, p], cmap="viridis", aspect="auto", vmin=lo, vmax=hi)
        for i in range(L):
            for j in range(H):
                text = f"{values[i, j, p]:.3f}"
                if stds is not None:
                    text += f"\n±{stds[i, j, p]:.3f}"
                ax.text(j, i, text, ha="center", va="center", fontsize=6,
                        color="k" if values[i, j, p] > mid else "w")  # dark text on the light end of viridis
        ax.set_xticks(range(H))
        ax.set_xticklabels([f"h{j}" for j in range(H)], fontsize=7)
        ax.set_yticks(range(L))
        ax.set_yticklabels([n if isinstance(n, str) else f"layer {n}" for n in layer_numbers], fontsize=7)
        ax.set_title(panel_names[p], fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.colorbar(image, ax=list(axes[0]), fraction=0.02, pad=0.02)
    fig.savefig(path, dpi=140)
    plt.close(fig)


# ============================================================================ cluster quality

def cluster_rows(maps_A: torch.Tensor, hidden: torch.Tensor, pieces: list[str], *, seed: int = 0) -> dict:
    """Cluster quality of one layer's head-averaged attention [np, s, s] against lexical pseudo-labels."""
    from .clusters import attention_groups, cluster_quality, pseudo_labels_from_tokens

    pseudo = pseudo_labels_from_tokens(pieces)
    attn = maps_A.float().mean(0).numpy()
    features = hidden.float().numpy()
    n = attn.shape[0]
    k = int(min(max(2, np.unique(pseudo).size), n - 1))
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # spectral clustering warns on graphs that are not fully connected
        for method in ("spectral", "argmax"):
            groups = attention_groups(attn, method, k if method == "spectral" else None, seed=seed)
            out[method] = cluster_quality(features, groups, pseudo, seed=seed)
    out["k"] = k
    return out


METRICS = ("nmi", "ari", "calinski_harabasz", "silhouette")


def _mean_metric(items: list[dict], method: str, metric: str) -> float:
    vals = [it[method][metric] for it in items if math.isfinite(it[method][metric])]
    return float(np.mean(vals)) if vals else float("nan")


# ============================================================================ driver

def _parse_models(specs: Sequence[str]) -> list[tuple[Optional[str], Path]]:
    out = []
    for spec in specs:
        label, sep, path = spec.partition("=")
        out.append((label, Path(path)) if sep else (None, Path(spec)))
    return out


def make_figures(models: Sequence[tuple[Optional[str], Path]], out_dir: Path, *, num_examples: int = 1,
                 max_tokens: int = 32, text: Optional[str] = None, layers: Optional[Sequence[int]] = None,
                 heads: Optional[Sequence[int]] = None, cluster_examples: int = 8,
                 cluster_tokens: Optional[int] = None) -> dict:
    """Figures 1 and 4 and Table 4 for ``models`` [(label or None, consolidated dir)]; returns the summary."""
    from .tables import summary_table

    init_single_process()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary: dict = {"figure1": [], "figure4": {}, "table4": None, "models": []}
    by_label: dict[str, list[dict]] = {}
    cluster_records: list[dict] = []
    per_layer: list[dict] = []
    for label, directory in models:
        lm = LoadedModel(directory, label)
        label = lm.label
        seq = lm.cfg.model.seq_length
        record = {"label": label, "dir": str(directory), "architecture": lm.cfg.model.architecture,
                  "step": lm.step, "seed": lm.cfg.train.seed, "pattern": lm.pattern,
                  # which trained model it scored: its run config, weights and where it was trained
                  "config_sha256": config_hash(to_dict(lm.cfg)),
                  # read_consolidated checked the file against the digest meta.json records (older
                  # directories record none: hashed here)
                  "weights_sha256": lm.meta.get("weights_sha256") or file_sha256(Path(directory) / "model.safetensors"),
                  "trained_at": {key: lm.meta.get(key) for key in ("source", "versions", "code")}}
        summary["models"].append(record)
        entry = {"record": record, "omega": {}, "mass_moved": {}}
        # ---- Table 4 + mass moved: cluster_examples sequences of cluster_tokens tokens
        items_per_layer: dict[int, list] = {}
        mass: dict[int, list] = {}
        for ids in examples(lm.cfg, cluster_examples, cluster_tokens or seq, None if text is None else text):
            pieces, _ = token_strings(lm.cfg, ids)
            captured = lm.capture(torch.tensor([ids]))
            for layer in lm.attention_layers():
                number = int(layer.layer_number)
                core = lm.core(layer)
                maps = ascender_maps(core, captured[number], lm.step) if lm.is_ascender(layer) \
                    else softmax_maps(core, captured[number])
                if "check" in maps:
                    chk = record.setdefault("reference_check", {"rows": 0, "max_abs_diff": 0.0})
                    for key_, val_ in maps["check"].items():
                        chk[key_] = max(chk[key_], val_) if key_ == "max_abs_diff" else chk[key_] + val_
                items_per_layer.setdefault(number, []).append(
                    cluster_rows(maps["A"], captured[number]["hidden"], pieces))
                if "mass_moved" in maps:
                    mass.setdefault(number, []).append(
                        torch.stack([maps["mass_moved"].get(f"mass_moved_{b}", torch.zeros_like(maps["omega"][:, 0]))
                                     for b in BIASES], -1))  # [np, 3]
        for number, items in items_per_layer.items():
            per_layer.append({"label": label, "dir": str(directory), "layer": number, "n_examples": len(items),
                              **{f"{m}_{metric}": _mean_metric(items, m, metric)
                                 for m in ("spectral", "argmax") for metric in METRICS}})
        all_items = [it for items in items_per_layer.values() for it in items]
        if all_items:
            row = {"config": label, "seed": str(directory)}
            for metric in METRICS:
                row[metric] = _mean_metric(all_items, "spectral", metric)
                row[f"argmax_{metric}"] = _mean_metric(all_items, "argmax", metric)
            row["argmax_groups"] = float(np.mean([it["argmax"]["n_clusters"] for it in all_items]))
            row["spectral_k"] = float(np.mean([it["k"] for it in all_items]))
            cluster_records.append(row)
        # ---- Figure 4 inputs
        for layer in lm.attention_layers():
            if lm.is_ascender(layer):
                number = int(layer.layer_number)
                entry["omega"][number] = lm.core(layer).params.omega.detach().float().numpy()
                if number in mass:
                    entry["mass_moved"][number] = torch.stack(mass[number]).mean(0).numpy()
        by_label.setdefault(label, []).append(entry)
        # ---- Figure 1: first directory of each label with ASCender layers
        asc_layers = [l for l in lm.attention_layers() if lm.is_ascender(l)]
        if asc_layers and len(by_label[label]) == 1:
            _check_chosen(layers, [int(l.layer_number) for l in asc_layers], "--layers", f"{directory}'s ASCender layers")
            _check_chosen(heads, list(range(lm.cfg.model.num_attention_heads)), "--heads", f"{directory}'s heads")
            for e, ids in enumerate(examples(lm.cfg, num_examples, max_tokens, text)):
                _, display = token_strings(lm.cfg, ids)
                captured = lm.capture(torch.tensor([ids]))
                for layer in asc_layers:
                    number = int(layer.layer_number)
                    if layers and number not in layers:
                        continue
                    maps = ascender_maps(lm.core(layer), captured[number], lm.step)
                    chosen = list(heads) if heads else list(range(maps["S"].shape[0]))
                    path = out_dir / f"fig1_{_safe(label)}_ex{e}_layer{number:02d}.png"
                    plot_decomposition(maps, display, path, f"Figure 1: score decomposition, {label} "
                                       f"({directory.name}, step {lm.step}), layer {number}, example {e}", chosen)
                    summary["figure1"].append(str(path))
        del lm
    # ---- Figure 4: per label, one row per (seed, layer); drawn together so they share colour scales
    for label, entries in by_label.items():
        numbers = sorted(set.intersection(*[set(e["omega"]) for e in entries])) if entries[0]["omega"] else []
        if not numbers:
            continue
        # head h of one seed and head h of another are unrelated: one row per (seed, layer), never a mean
        omega = np.stack([np.stack([e["omega"][n] for n in numbers]) for e in entries])  # [seeds, L, H, 3]
        fig4 = {"layers": numbers, "n_seeds": len(entries), "omega_per_run": omega.tolist(),
                "dirs": [e["record"]["dir"] for e in entries]}
        if all(set(numbers) <= set(e["mass_moved"]) for e in entries):
            mm = np.stack([np.stack([e["mass_moved"][n] for n in numbers]) for e in entries])  # [seeds, L, H, 3]
            fig4["mass_moved_per_run"] = mm.tolist()
        summary["figure4"][label] = fig4
    seed_of_dir = {m["dir"]: m["seed"] for m in summary["models"]}
    draw_figure4(summary["figure4"], seed_of_dir, out_dir)
    # ---- Table 4
    if cluster_records:
        _, obj_s = summary_table(cluster_records, METRICS)
        _, obj_a = summary_table(_argmax_rows(cluster_records), METRICS)
        table4 = {"metrics": list(METRICS), "spectral": obj_s, "argmax": obj_a, "rows": cluster_records,
                  "per_layer": per_layer, "settings": {"cluster_examples": cluster_examples,
                                                       "cluster_tokens": cluster_tokens, "features": "hidden states "
                                                       "entering the layer", "attention": "mean over heads"}}
        (out_dir / "table4_clusters.md").write_text(table4_markdown(table4, seed_of_dir))
        (out_dir / "table4_clusters.json").write_text(json.dumps(_json_safe(table4), indent=1))
        summary["table4"] = {"md": str(out_dir / "table4_clusters.md"), "json": str(out_dir / "table4_clusters.json")}
    summary["provenance"] = report_provenance()
    (out_dir / "figures.json").write_text(json.dumps(_json_safe(summary), indent=1))
    return summary


def _row_labels(seeds: Sequence, layers: Sequence[int]) -> list[str]:
    return [f"seed {s}, layer {n}" for s in seeds for n in layers]


def _shared_range(arrays: Sequence[np.ndarray]) -> Optional[tuple[float, float]]:
    finite = [a[np.isfinite(a)] for a in arrays]
    finite = [a for a in finite if a.size]
    if not finite:
        return None
    return float(min(a.min() for a in finite)), float(max(a.max() for a in finite))


def draw_figure4(fig4: dict, seed_of_dir: dict, out_dir: Path) -> None:
    """Figure 4 from its data (``figures.json``'s ``figure4``): per label the learned ω and the mass each
    bias moves, one row per (seed, layer); every ω figure shares one colour scale, every mass-moved
    figure another, so the labels (all biases vs one removed) can be compared by colour. Writes the PNG
    paths into ``fig4``."""
    key = lambda name: [np.asarray(e[name], dtype=float) for e in fig4.values() if name in e]  # noqa: E731
    omega_range, mass_range = _shared_range(key("omega_per_run")), _shared_range(key("mass_moved_per_run"))
    for label, e in fig4.items():
        rows = _row_labels([seed_of_dir.get(d, "?") for d in e["dirs"]], e["layers"])
        omega = np.asarray(e["omega_per_run"], dtype=float)  # [seeds, L, H, 3]
        path = out_dir / f"fig4_{_safe(label)}_omega.png"
        plot_head_heatmaps(omega.reshape(-1, *omega.shape[2:]), None, rows, path,  # [seeds*L, H, 3]
                           f"Figure 4: learned ω per head, {label}, one row per seed and layer (colour scale "
                           "shared by every label)", [f"ω_{b}" for b in BIASES], omega_range)
        e["omega_png"] = str(path)
        if "mass_moved_per_run" in e:
            mm = np.asarray(e["mass_moved_per_run"], dtype=float)  # [seeds, L, H, 3]
            mpath = out_dir / f"fig4_{_safe(label)}_mass_moved.png"
            plot_head_heatmaps(mm.reshape(-1, *mm.shape[2:]), None, rows, mpath,
                               f"Figure 4b: attention mass moved by each bias (TV distance), {label}, mean over "
                               "examples, one row per seed and layer (colour scale shared by every label)",
                               [f"mass moved: {b}" for b in BIASES], mass_range)
            e["mass_moved_png"] = str(mpath)


def _argmax_rows(rows: Sequence[dict]) -> list[dict]:
    return [{"config": r["config"], "seed": r["seed"], **{m: r[f"argmax_{m}"] for m in METRICS}} for r in rows]


def _per_seed_table(rows: Sequence[dict], metrics: Sequence[str], seed_of_dir: dict) -> str:
    """One line per directory (its "seed" key): the training seed it was made with, every metric."""
    lines = ["| config | seed | " + " | ".join(metrics) + " |", "|---|---:|" + "---:|" * len(metrics)]
    for r in rows:
        cells = [f"{r[m]:.4g}" if isinstance(r.get(m), (int, float)) and math.isfinite(r[m]) else "—" for m in metrics]
        lines.append(f"| {r['config']} | {seed_of_dir.get(r['seed'], r['seed'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def table4_markdown(table4: dict, seed_of_dir: dict) -> str:
    """table4_clusters.md from its JSON: mean ± std over seeds, then every seed's value, for spectral
    and argmax groups (rows name their directory; ``seed_of_dir`` gives its training seed)."""
    from .tables import summary_table

    metrics, settings, rows = table4["metrics"], table4["settings"], table4["rows"]
    argmax = _argmax_rows(rows)
    md_s, _ = summary_table(rows, metrics)
    md_a, _ = summary_table(argmax, metrics)
    return ("# Table 4: cluster quality of attention-induced token groups\n\n"
            "Groups from the head-averaged attention map of every attention layer; pseudo-labels: lexical "
            "token classes (`research.clusters.pseudo_labels_from_tokens`); Calinski-Harabasz and silhouette "
            "in the space of the hidden states entering the layer. Per directory: mean over "
            f"{settings['cluster_examples']} validation sequences × layers; tables: mean ± std over directories "
            "(seeds), then every seed's value.\n\n"
            "## spectral clustering (k = number of pseudo-label classes in the sequence)\n\n" + md_s +
            "\nPer seed:\n\n" + _per_seed_table(rows, metrics, seed_of_dir) +
            "\n## argmax groups (each token joins the key it attends to most)\n\n" + md_a +
            "\nPer seed:\n\n" + _per_seed_table(argmax, metrics, seed_of_dir))


def redraw(out_dir: Path) -> dict:
    """Figure 4 and Table 4 again from ``figures.json`` and ``table4_clusters.json`` in ``out_dir``,
    without the checkpoints (Figure 1 needs the models: its attention maps are not stored)."""
    from .saved_json import FOREIGN_SHAPE, foreign_shape, read_saved_json

    summary = read_saved_json(out_dir / "figures.json", ("figure4", "models"), "ascender-dist figures")
    try:
        seed_of_dir = {m["dir"]: m["seed"] for m in summary["models"]}
        draw_figure4(summary["figure4"], seed_of_dir, out_dir)
    except FOREIGN_SHAPE as exc:
        raise foreign_shape(out_dir / "figures.json", "ascender-dist figures", exc) from None
    table4_json = out_dir / "table4_clusters.json"
    if table4_json.exists():
        try:
            table4 = table4_markdown(read_saved_json(table4_json, (), "ascender-dist figures"), seed_of_dir)
        except FOREIGN_SHAPE as exc:
            raise foreign_shape(table4_json, "ascender-dist figures", exc) from None
        (out_dir / "table4_clusters.md").write_text(table4)
    # the numbers were computed where "provenance" says; only the drawing happened here
    summary["redraw_provenance"] = report_provenance()
    (out_dir / "figures.json").write_text(json.dumps(_json_safe(summary), indent=1))
    return summary


def _safe(name: str) -> str:
    import re

    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", name)


def _json_safe(x):
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, np.ndarray):
        return _json_safe(x.tolist())
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x


def _check_chosen(chosen: Optional[Sequence[int]], available: list[int], flag: str, what: str) -> None:
    """A ConfigError naming ``flag`` when it picks a number the model does not have (Figure 1 would
    otherwise be drawn for none of them, with exit status 0)."""
    from ascender_dist.config.errors import ConfigError

    missing = [c for c in (chosen or []) if c not in available]
    if missing:
        raise ConfigError(flag, f"{missing[0]} is not one of {what}: {', '.join(map(str, available))}")


def _ints(text: Optional[str], flag: str) -> Optional[list[int]]:
    """``"0,2"`` -> [0, 2]; None when not given; a ConfigError naming ``flag`` otherwise."""
    from ascender_dist.config.errors import ConfigError

    if text is None:
        return None
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise ConfigError(flag, f"expected comma-separated integers, got {text!r}") from None


def _checked_arguments(args, models: list) -> dict:
    """The make_figures keyword arguments from the command line, each bad value a ConfigError
    naming its flag (before any model is loaded)."""
    from ascender_dist.config.errors import ConfigError

    for flag in ("examples", "max_tokens", "cluster_examples", "cluster_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')}", f"must be >= 1 (got {value})")
    if args.text is not None and not args.text.strip():
        raise ConfigError("--text", "is empty: no tokens to draw")
    seen = set()
    for _, directory in models:
        key = directory.resolve()
        if key in seen:
            raise ConfigError(str(directory), "given twice (one model per directory)")
        seen.add(key)
    return dict(num_examples=args.examples, max_tokens=args.max_tokens, text=args.text,
                layers=_ints(args.layers, "--layers"), heads=_ints(args.heads, "--heads"),
                cluster_examples=args.cluster_examples, cluster_tokens=args.cluster_tokens)


def figures_main(argv: Optional[Sequence[str]] = None) -> int:
    """``ascender-dist figures``: Figures 1 and 4 and Table 4 from consolidated directories. Exit 2 on a user error."""
    p = argparse.ArgumentParser(prog="ascender-dist figures", description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="*", help="consolidated directories (labelled by architecture)")
    p.add_argument("--model", action="append", default=[], metavar="LABEL=DIR",
                   help="a consolidated directory and its label; repeat a label for several seeds")
    p.add_argument("--out", required=True)
    p.add_argument("--examples", type=int, default=1, help="Figure 1: validation sequences to draw")
    p.add_argument("--max-tokens", type=int, default=32, help="Figure 1: tokens per drawn sequence (at most model.seq_length)")
    p.add_argument("--text", default=None, help="Figure 1 / Table 4 input text instead of validation data")
    p.add_argument("--layers", default=None, help="Figure 1: comma-separated layer numbers (default: all)")
    p.add_argument("--heads", default=None, help="Figure 1: comma-separated heads (default: all)")
    p.add_argument("--cluster-examples", type=int, default=8, help="Table 4 / Fig. 4b: validation sequences")
    p.add_argument("--cluster-tokens", type=int, default=None, help="Table 4: tokens per sequence (default: seq_length)")
    p.add_argument("--redraw", action="store_true",
                   help="draw Figure 4 and write Table 4 again from --out's figures.json and table4_clusters.json "
                        "(no models; Figure 1 needs them)")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    from ascender_dist.config.errors import UserError
    from ascender_dist.logs import quiet_library_warnings

    quiet_library_warnings()
    setup_cli_logging()
    if args.redraw:
        try:
            summary = redraw(Path(args.out))
        except UserError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"redrew Figure 4 for {sorted(summary['figure4'])} and Table 4 in {args.out}")
        return 0
    models = [(None, Path(d)) for d in args.dirs] + _parse_models(args.model)
    if not models:
        print("error: give consolidated directories (positional or --model LABEL=DIR)", file=sys.stderr)
        return 2
    try:
        summary = make_figures(models, Path(args.out), **_checked_arguments(args, models))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(summary['figure1'])} Figure 1 PNGs, Figure 4 for {sorted(summary['figure4'])}, "
          f"Table 4 ({'yes' if summary['table4'] else 'no'}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(figures_main())
