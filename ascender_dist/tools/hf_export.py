"""Consolidated gpt weights -> a Hugging Face model directory of an architecture transformers ships.

Our GPT is megatron's: pre-norm, non-interleaved RoPE (rotate-half, as Hugging Face), exact GELU.
Two standard architectures express it without custom code:
  * GPT-NeoX: LayerNorm, GELU, biases, multi-head attention (QKV laid out per head as [q, k, v],
    which is megatron's per-group layout when every head is its own group), sequential residual;
  * Llama: RMSNorm, SwiGLU, no biases, grouped-query attention allowed (q/k/v split per group).
Everything else (ascender, connection, mixed ``model.layer_pattern``, or a gpt neither expresses,
e.g. LayerNorm + swiglu or learned absolute positions) is written for ``trust_remote_code``: the
plain-torch model of :mod:`ascender_dist.hf` (copied into the directory with vendored copies of
the ASCender / Connection math, see :mod:`ascender_dist.hf.vendor`) under parameter names that are
``model.`` + our canonical names.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Sequence

import torch

from ascender_dist.training.checkpoint import recorded_tokenizer_sha256
from ascender_dist.tools.convert import (LM_EVAL_EXPORT_SUBDIR, ConversionError, check_output_dir, read_consolidated,
                                        refuse_other_tokenizer, staged_output)
from data_pipeline._io import honour_umask


def pick_hf_architecture(cfg) -> str:
    m = cfg.model
    if m.position_embedding_type != "rope":
        raise ConversionError("model.position_embedding_type", "Hugging Face export needs rope")
    groups = m.num_query_groups or m.num_attention_heads
    if m.normalization == "LayerNorm" and m.activation == "gelu" and m.add_bias_linear and groups == m.num_attention_heads:
        return "gpt_neox"
    if m.normalization == "RMSNorm" and m.activation == "swiglu" and not m.add_bias_linear:
        return "llama"
    raise ConversionError("model", "no standard Hugging Face architecture matches: use LayerNorm + gelu + biases + "
                                   "multi-head attention (GPT-NeoX) or RMSNorm + swiglu + no biases (Llama)")


def _layer(state, i: int, name: str) -> torch.Tensor:
    return state[f"decoder.layers.{i}.{name}"]


def _lm_head(state) -> torch.Tensor:
    return state.get("output_layer.weight", state["embedding.word_embeddings.weight"])


def neox_state(state: dict, cfg) -> dict:
    out = {"gpt_neox.embed_in.weight": state["embedding.word_embeddings.weight"],
           "gpt_neox.final_layer_norm.weight": state["decoder.final_layernorm.weight"],
           "gpt_neox.final_layer_norm.bias": state["decoder.final_layernorm.bias"],
           "embed_out.weight": _lm_head(state)}
    pairs = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "pre_mlp_layernorm",
             "attention.query_key_value": "self_attention.linear_qkv", "attention.dense": "self_attention.linear_proj",
             "mlp.dense_h_to_4h": "mlp.linear_fc1", "mlp.dense_4h_to_h": "mlp.linear_fc2"}
    for i in range(cfg.model.num_layers):
        for hf, ours in pairs.items():
            for kind in ("weight", "bias"):
                out[f"gpt_neox.layers.{i}.{hf}.{kind}"] = _layer(state, i, f"{ours}.{kind}")
    return out


def neox_config(cfg, vocab_size: int, tied: bool, special_ids: dict | None = None):
    """``special_ids``: bos/eos/pad token ids of the tokenizer (None each without one, never
    transformers' defaults, which are another tokenizer's)."""
    from transformers import GPTNeoXConfig

    m = cfg.model
    return GPTNeoXConfig(
        vocab_size=vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, intermediate_size=m.ffn_hidden_size or 4 * m.hidden_size,
        hidden_act="gelu", rotary_pct=1.0, rope_theta=float(m.rotary_base), max_position_embeddings=m.seq_length,
        # transformers 5 reads the base from rope_parameters only (rope_theta alone falls back to 10000)
        rope_parameters={"rope_type": "default", "rope_theta": float(m.rotary_base), "partial_rotary_factor": 1.0},
        layer_norm_eps=m.layernorm_epsilon, use_parallel_residual=False, tie_word_embeddings=tied,
        attention_bias=True, hidden_dropout=0.0, attention_dropout=0.0, **_special_ids(special_ids),
    )


def _special_ids(special_ids: dict | None) -> dict:
    return {name: (special_ids or {}).get(name) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}


def llama_state(state: dict, cfg) -> dict:
    m = cfg.model
    heads, groups = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    hn = m.hidden_size // heads
    per_group = heads // groups
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
           "model.norm.weight": state["decoder.final_layernorm.weight"], "lm_head.weight": _lm_head(state)}
    for i in range(m.num_layers):
        qkv = _layer(state, i, "self_attention.linear_qkv.weight").view(groups, (per_group + 2) * hn, m.hidden_size)
        q, k, v = torch.split(qkv, [per_group * hn, hn, hn], dim=1)  # each [ng, rows, h]
        fc1 = _layer(state, i, "mlp.linear_fc1.weight")  # [gate; up]
        prefix = f"model.layers.{i}"
        out.update({
            f"{prefix}.input_layernorm.weight": _layer(state, i, "input_layernorm.weight"),
            f"{prefix}.post_attention_layernorm.weight": _layer(state, i, "pre_mlp_layernorm.weight"),
            f"{prefix}.self_attn.q_proj.weight": q.reshape(heads * hn, m.hidden_size),
            f"{prefix}.self_attn.k_proj.weight": k.reshape(groups * hn, m.hidden_size),
            f"{prefix}.self_attn.v_proj.weight": v.reshape(groups * hn, m.hidden_size),
            f"{prefix}.self_attn.o_proj.weight": _layer(state, i, "self_attention.linear_proj.weight"),
            f"{prefix}.mlp.gate_proj.weight": fc1[:ffn], f"{prefix}.mlp.up_proj.weight": fc1[ffn:],
            f"{prefix}.mlp.down_proj.weight": _layer(state, i, "mlp.linear_fc2.weight"),
        })
    return out


def llama_config(cfg, vocab_size: int, tied: bool, special_ids: dict | None = None):
    """``special_ids`` as in :func:`neox_config`."""
    from transformers import LlamaConfig

    m = cfg.model
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_query_groups or m.num_attention_heads,
        intermediate_size=m.ffn_hidden_size or 4 * m.hidden_size, hidden_act="silu", rms_norm_eps=m.layernorm_epsilon,
        rope_theta=float(m.rotary_base), max_position_embeddings=m.seq_length, tie_word_embeddings=tied,
        attention_bias=False, mlp_bias=False, **_special_ids(special_ids),
    )


# ----------------------------------------------------------------------------- remote code
REMOTE_CODE_ARCHITECTURE = "ascender_dist"
AUTO_MAP = {"AutoConfig": "configuration_ascender_dist.AscenderDistConfig",
            "AutoModelForCausalLM": "modeling_ascender_dist.AscenderDistForCausalLM"}


def standard_architecture(cfg) -> str | None:
    """gpt_neox / llama when a standard transformers class expresses the model, else None."""
    if cfg.model.architecture != "gpt":
        return None
    from ascender_dist.config.architectures import expand_layer_pattern

    if set(expand_layer_pattern(cfg.model)) != {"A"}:
        return None
    try:
        return pick_hf_architecture(cfg)
    except ConversionError:
        return None


def remote_code_config(cfg, meta: dict, vocab_size: int, tied: bool, special_ids: dict | None = None):
    """The :class:`AscenderDistConfig` of a consolidated run (every field from the run config;
    bos/eos/pad ids from ``special_ids``, the tokenizer's)."""
    from dataclasses import asdict

    from ascender_dist.hf.configuration_ascender_dist import AscenderDistConfig
    from ascender_dist.config.architectures import expand_layer_pattern
    from ascender_dist.training.layer_stats import last_training_step

    m = cfg.model
    config = AscenderDistConfig(
        vocab_size=vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups or m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size, max_position_embeddings=m.seq_length,
        layer_pattern=expand_layer_pattern(cfg.model), normalization=m.normalization, activation=m.activation,
        add_bias_linear=m.add_bias_linear, layernorm_epsilon=m.layernorm_epsilon,
        position_embedding_type=m.position_embedding_type, rotary_base=float(m.rotary_base),
        ascender=asdict(m.ascender), connection=asdict(m.connection), ascender_step=last_training_step(meta.get("step") or 0),
        initializer_range=m.init_method_std, tie_word_embeddings=tied,
        architectures=["AscenderDistForCausalLM"], auto_map=dict(AUTO_MAP), **_special_ids(special_ids),
    )
    config.ascender_dist = {"architecture": meta.get("architecture"), "step": meta.get("step"),
                            "preset": m.preset, "run_name": cfg.name, "precision": cfg.train.precision}
    return config


def fixed_buffers(module: torch.nn.Module) -> dict:
    """The persistent buffers of ``module`` (its state_dict less its parameters): what follows from the
    config and may be filled in when a checkpoint lacks it. A trained parameter (ASCender's omega,
    delta, kappa, tau_score) never is: filled with its init value, weights missing it would pass the
    fit check and evaluate an untrained model."""
    trained = {name for name, _ in module.named_parameters()}
    return {name: t for name, t in module.state_dict().items() if name not in trained}


def remote_code_state(state: dict, config) -> dict:
    """Canonical names -> ``model.`` + name (``lm_head.weight`` for the output layer), plus the
    persistent buffers our checkpoints do not hold because they follow from the config (ASCender's
    fixed per-head tensors, the Connection layers' fixed slots)."""
    from ascender_dist.hf.modeling_ascender_dist import _hparams, trained_buffer_dtype
    from ascender_dist.models.ascender import AscenderHeadParams, AscenderHParams
    from ascender_dist.models.connection import ConnectionHParams, make_fixed_slots

    out = {("lm_head.weight" if name == "output_layer.weight" else f"model.{name}"): t for name, t in state.items()}
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    dtype = trained_buffer_dtype(config)  # bf16 runs: the bf16-rounded values they trained with, in fp32
    for i, letter in enumerate(config.layer_pattern):
        prefix = f"model.decoder.layers.{i}.self_attention"
        if letter == "S":
            fixed = AscenderHeadParams(_hparams(AscenderHParams, config.ascender), config.num_attention_heads,
                                       dtype=dtype)
            for name, buf in fixed_buffers(fixed).items():
                out.setdefault(f"{prefix}.core_attention.params.{name}", buf.float())
        elif letter == "C":
            hp = _hparams(ConnectionHParams, config.connection)
            slots = make_fixed_slots(hp.num_slots, config.hidden_size, hp.slot_seed, dtype)
            out.setdefault(f"{prefix}.layer.slots", slots.float())
    return out


def _canonical_name(hf_name: str) -> str:
    """The consolidated (canonical) name of a :func:`remote_code_state` key, as model.safetensors has it."""
    return "output_layer.weight" if hf_name == "lm_head.weight" else hf_name.removeprefix("model.")


def _check_against_model(hf_state: dict, config, where, described_by: str = "the Hugging Face model") -> None:
    """Every tensor the Hugging Face model has, with its shape, and nothing else (built on meta).
    Tensors are named as model.safetensors names them; ``described_by`` says what defined the model."""
    from ascender_dist.hf.modeling_ascender_dist import AscenderDistForCausalLM

    with torch.device("meta"):
        model = AscenderDistForCausalLM(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = [_canonical_name(k) for k in sorted(set(expected) - set(hf_state))]
    extra = [_canonical_name(k) for k in sorted(set(hf_state) - set(expected))]
    wrong = [k for k in expected if k in hf_state and tuple(hf_state[k].shape) != expected[k]]  # model order
    if missing or extra or wrong:
        problems = [f"missing {missing[:3]}" if missing else "", f"unexpected {extra[:3]}" if extra else "",
                    f"{_canonical_name(wrong[0])} has shape {tuple(hf_state[wrong[0]].shape)}, the model needs "
                    f"{expected[wrong[0]]}" if wrong else ""]
        raise ConversionError(where, f"weights do not fit {described_by}: " + "; ".join(p for p in problems if p))


def check_weights_fit_config(state: dict, cfg, meta: dict, directory: Path, overrides: Sequence[str] = ()) -> None:
    """The consolidated weights of ``directory`` are exactly the tensors, with their shapes, of the model
    its config.yaml describes (built on the meta device: nothing allocated). Every consumer of a
    consolidated directory runs this before building or writing anything: a config.yaml edited by
    hand (ffn_hidden_size...) or weights of another run is then one line naming the first wrong
    tensor and the config file, not a size-mismatch traceback from load_state_dict nor an export
    that transformers refuses to load. ``overrides``: the ``--set`` texts applied to that config
    (reshard); those of model fields are named with it."""
    directory = Path(directory)
    model_sets = [text for text in overrides if text.split("=", 1)[0].strip().startswith("model.")]
    described = f"the model of {directory / 'config.yaml'}" + "".join(f" with --set {t}" for t in model_sets)
    embedding = state.get("embedding.word_embeddings.weight")
    if embedding is None or embedding.dim() != 2:
        raise ConversionError(directory / "model.safetensors", "no 2-d embedding.word_embeddings.weight tensor: "
                                                               "not consolidated weights")
    vocab = meta.get("vocab_size")
    if isinstance(vocab, int) and embedding.shape[0] != vocab:  # padding rows kept, or another tokenizer's
        raise ConversionError(directory / "model.safetensors", f"embedding.word_embeddings.weight has "
                              f"{embedding.shape[0]} rows, but {directory / 'meta.json'} says vocab_size {vocab}: "
                              "the vocabulary's padding rows kept, or weights of another run?")
    tied = not cfg.model.untie_embeddings_and_output_weights
    if tied and "output_layer.weight" in state:  # the exports would drop it and use the embedding
        raise ConversionError(directory / "model.safetensors", "holds a trained output_layer.weight but "
                              f"{directory / 'config.yaml'} ties the output layer to the embedding "
                              "(model.untie_embeddings_and_output_weights: false): weights of another run?")
    config = remote_code_config(cfg, meta, embedding.shape[0], tied)
    _check_against_model(remote_code_state(state, config), config, directory / "model.safetensors", described)


def write_remote_code(state: dict, cfg, meta: dict, out: Path, special_ids: dict | None, where) -> str:
    """Fill ``out`` with a trust_remote_code model directory (weights, config, code; the tokenizer
    is written by :func:`export_hf`, which checked the weights against the config first:
    :func:`check_weights_fit_config`); returns the architecture name."""
    import shutil

    from safetensors.torch import save_file

    import ascender_dist.hf as hf_package
    from ascender_dist.hf.vendor import VendorError, vendor_kernels

    tied = not cfg.model.untie_embeddings_and_output_weights
    vocab = state["embedding.word_embeddings.weight"].shape[0]
    config = remote_code_config(cfg, meta, vocab, tied, special_ids)
    hf_state = remote_code_state(state, config)
    source = Path(hf_package.__file__).parent
    for name in hf_package.REMOTE_CODE_FILES:
        shutil.copyfile(source / name, out / name)
    try:
        vendor_kernels(out)
    except VendorError as exc:
        raise ConversionError(where, f"cannot vendor the layer math: {exc}") from None
    config.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in hf_state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    honour_umask(out / "model.safetensors")  # safetensors writes 0600
    return REMOTE_CODE_ARCHITECTURE


def _load_tokenizer(tokenizer: Path):
    """The sentencepiece model ``tokenizer`` through the project's loader (a ``.vocab``, a directory or an
    unreadable file is refused); problems are one-line ConversionErrors naming it."""
    from data_pipeline.errors import DataError
    from data_pipeline.tokenizer import Tokenizer

    if not tokenizer.exists():
        raise ConversionError(tokenizer, "tokenizer model not found")
    if not tokenizer.is_file():
        raise ConversionError(tokenizer, "not a file (pass the sentencepiece .model file)")
    try:
        return Tokenizer.load(tokenizer)
    except DataError as exc:
        raise ConversionError(tokenizer, f"{exc.problem} (pass the sentencepiece .model file)") from None


def check_tokenizer(tokenizer: Path, cfg, meta: dict, meta_file: Path) -> None:
    """``tokenizer`` is a sentencepiece model and the one the model was trained with: its sha256 equals
    ``meta_file``'s ``tokenizer_sha256`` (what checkpoints record; two tokenizers of one size trained on
    other text give other ids for the same text). A meta.json without it (checkpoints of older
    versions, runs without a tokenizer) leaves the vocabulary as the only check: equal to meta.json's
    vocab_size when the run took its vocabulary from the tokenizer, never larger."""
    tok = _load_tokenizer(tokenizer)
    refuse_other_tokenizer(tokenizer, tok.sha256, meta, meta_file, trained="this model was",
                           note=f", data.tokenizer {cfg.data.tokenizer}" if cfg.data.tokenizer else "")
    vocab = meta.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool):
        return
    if tok.vocab_size > vocab or (not cfg.model.vocab_size and tok.vocab_size != vocab):
        raise ConversionError(tokenizer, f"vocab size {tok.vocab_size} does not match the model's {vocab} "
                                         "(meta.json vocab_size): not the tokenizer this model was trained with")


EXPORT_CODE = ("ascender_dist/hf", "ascender_dist/models", "ascender_dist/tools/hf_export.py",
               "ascender_dist/tools/hf_tokenizer.py",  # the remote code, the layer math, the exporter
               "ascender_dist/config/architectures.py",  # config.json's layer_pattern
               "ascender_dist/training/layer_stats.py")  # config.json's ascender_step
# plus every module hf/vendor.py may copy into an export (:func:`vendored_code`)


def vendored_code() -> list[str]:
    """The source files, relative to the repository root, that :mod:`ascender_dist.hf.vendor` may
    copy into a remote-code export, from its own lists (one source of truth): every module of its
    ``PACKAGES``, except that of the config package only its ``VENDORED_CONFIG`` modules go."""
    from ascender_dist.hf.vendor import PACKAGES, VENDORED_CONFIG

    root = Path(__file__).resolve().parents[2]
    files = set()
    for key, dotted in PACKAGES.items():
        package = root / dotted.replace(".", "/")
        if key == "config":
            files.update(package / f"{module}.py" for module in VENDORED_CONFIG)
        else:
            files.update(package.glob("*.py"))  # a sub-package (kernels) is a PACKAGES entry of its own
    return sorted(str(path.relative_to(root)) for path in files)


def export_code_files() -> list[Path]:
    """Every source file :func:`export_code_sha256` covers: :data:`EXPORT_CODE` and :func:`vendored_code`."""
    root = Path(__file__).resolve().parents[2]
    files = set()
    for entry in (*EXPORT_CODE, *vendored_code()):
        path = root / entry
        files.update(path.rglob("*.py") if path.is_dir() else [path])
    return sorted(files)


def export_code_sha256() -> str:
    """One sha256 over the source files an export is written from (the remote code, the layer math
    and hyper-parameter classes it vendors, the exporter): a git checkout keeps its package version
    between commits, so the version alone would keep a cache written by other code."""
    import hashlib

    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for source in export_code_files():
        digest.update(str(source.relative_to(root)).encode() + b"\0" + source.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def installed_code_digests() -> dict[str, str]:
    """sha256 of every ``.py`` file a remote-code export written now holds (the remote code copied
    and the layer math vendored), by file name: what an export directory's code must equal to be
    this installation's own."""
    import hashlib
    import shutil
    import tempfile

    import ascender_dist.hf as hf_package
    from ascender_dist.hf.vendor import vendor_kernels

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for name in hf_package.REMOTE_CODE_FILES:
            shutil.copyfile(Path(hf_package.__file__).parent / name, out / name)
        vendor_kernels(out)
        return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in out.glob("*.py")}


def unreadable_json(directory: Path) -> str | None:
    """"<file>: <why>" for the first JSON file of ``directory`` that does not parse (a truncated or
    damaged export), or None: code_is_installed_code cannot tell such a file from foreign code."""
    for path in sorted(Path(directory).rglob("*.json")):
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
            first_line = (str(exc).splitlines() or [""])[0]
            return f"{path}: unreadable JSON, truncated or damaged ({type(exc).__name__}: {first_line})"
    return None


def code_is_installed_code(directory: Path) -> bool:
    """Whether every Python file of the export ``directory`` is byte for byte one this installation
    writes, and no JSON file maps an Auto class elsewhere (config.json: our AUTO_MAP or none; any
    other, tokenizer_config.json included, none: transformers also follows an ``auto_map`` there,
    to a local directory or a Hub repo): then loading it with trust_remote_code runs only our own
    code. A marker's recorded provenance can be copied by anyone who can read the run; the files
    themselves cannot lie."""
    import hashlib

    directory = Path(directory)
    expected = installed_code_digests()
    try:
        for path in directory.rglob("*.py"):
            if expected.get(path.name) != hashlib.sha256(path.read_bytes()).hexdigest() or path.parent != directory:
                return False
        for path in directory.rglob("*.json"):
            content = json.loads(path.read_text(encoding="utf-8"))
            auto_map = content.get("auto_map") if isinstance(content, dict) else None
            allowed = (None, AUTO_MAP) if path == directory / "config.json" else (None,)
            if auto_map not in allowed:
                return False
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nesting past the stack
        return False
    return True


SOURCE_KEYS = ("config_sha256", "meta_sha256", "weights_size_mtime_ns")  # :func:`source_provenance`


def source_provenance(consolidated_dir: Path) -> dict:
    """What identifies the consolidated files an export is made from: the sha256 of config.yaml and
    meta.json (the step goes into config.json) and model.safetensors' [st_size, st_mtime_ns], compared
    for equality (``rsync -a`` / ``cp -p`` give new weights an older mtime than an export of the old
    ones, so "newer than the weights" is no test). Raises OSError."""
    from data_pipeline._io import sha256_file

    directory = Path(consolidated_dir)
    weights = (directory / "model.safetensors").stat()
    return {"config_sha256": sha256_file(directory / "config.yaml"),
            "meta_sha256": sha256_file(directory / "meta.json"),
            "weights_size_mtime_ns": [weights.st_size, weights.st_mtime_ns]}


def source_before_reading(consolidated_dir: Path) -> dict:
    """:func:`source_provenance` taken before an export reads the directory: a file replaced while it
    exports then leaves a marker that no longer matches (exported again next time), never one that
    matches newer files than the export holds. An unreadable file gives None entries, which match
    nothing; reading the directory then says what is wrong."""
    try:
        return source_provenance(consolidated_dir)
    except OSError:
        return dict.fromkeys(SOURCE_KEYS)


def export_provenance(consolidated_dir: Path, tokenizer: Path | None, source: dict | None = None) -> dict:
    """What an export is made of, recorded in its ``ascender_dist.json``: the ascender-dist version
    that wrote it and the sha256 of the code it was written from (the remote code and its vendored
    math), the consolidated files (:func:`source_provenance`; ``source`` when the caller took it
    already) and the sha256 of the tokenizer written (None without one). The lm-eval adapter's cache
    is re-used only while every entry equals what it would write now."""
    from data_pipeline._io import sha256_file
    from ascender_dist.versions import package_version

    try:
        source = source if source is not None else source_provenance(consolidated_dir)
        tokenizer_sha = sha256_file(Path(tokenizer)) if tokenizer else None
    except OSError as exc:
        where = exc.filename or Path(consolidated_dir) / "config.yaml"
        raise ConversionError(where, f"cannot read ({exc.strerror or exc})") from None
    return {"ascender_dist_version": package_version("ascender-dist"), "export_code_sha256": export_code_sha256(),
            **source, "tokenizer_sha256": tokenizer_sha}


EXPORT_MARKER = "ascender_dist.json"  # written last into every export: a previous export may be replaced


def is_export_output(directory: Path) -> bool:
    """``directory`` was written by :func:`export_hf` (its ``ascender_dist.json`` and config.json)."""
    return (Path(directory) / EXPORT_MARKER).is_file() and (Path(directory) / "config.json").is_file()


def exported_files(directory: Path) -> set[str] | None:
    """The names a previous export wrote (its marker's list, the marker itself included), or None
    when its marker predates the list or cannot be read."""
    try:
        files = json.loads((Path(directory) / EXPORT_MARKER).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    return {*files, EXPORT_MARKER} if isinstance(files, list) else None


def check_export_out(out_dir: Path, consolidated_dir: Path) -> None:
    """:func:`~ascender_dist.tools.convert.check_output_dir` for ``export-hf``. The one path inside the
    input allowed is the lm-eval adapter's export cache ``<consolidated>/.hf-export``."""
    cache = Path(out_dir).resolve() == Path(consolidated_dir).resolve() / LM_EVAL_EXPORT_SUBDIR
    check_output_dir(out_dir, consolidated_dir, "export-hf", is_export_output, EXPORT_MARKER, inside_source_ok=cache,
                     own_entries=exported_files)


def _write_model(out: Path, state: dict, cfg, meta: dict, standard: str | None, special_ids: dict | None,
                 where) -> str:
    """Fill ``out`` with config.json + model.safetensors of the standard class ``standard``
    (gpt_neox / llama), or of the remote-code model when None; returns the architecture name."""
    from safetensors.torch import save_file

    if standard is None:
        return write_remote_code(state, cfg, meta, out, special_ids, where)
    tied = not cfg.model.untie_embeddings_and_output_weights
    vocab = state["embedding.word_embeddings.weight"].shape[0]
    hf_state = neox_state(state, cfg) if standard == "gpt_neox" else llama_state(state, cfg)
    config = (neox_config if standard == "gpt_neox" else llama_config)(cfg, vocab, tied, special_ids)
    if tied:  # transformers re-ties on load; storing the head twice would fail its shared-tensor check
        hf_state.pop("embed_out.weight" if standard == "gpt_neox" else "lm_head.weight")
    config.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in hf_state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    honour_umask(out / "model.safetensors")  # safetensors writes 0600
    return standard


def export_hf(consolidated_dir: Path, out_dir: Path, tokenizer: str | None = None,
              remote_code: bool | None = None, without_tokenizer: bool = False) -> Path:
    """Write ``out_dir`` (config.json + model.safetensors [+ tokenizer]) for ``from_pretrained``.

    ``remote_code=None``: a gpt that GPT-NeoX or Llama expresses is written as that (loads without
    remote code); everything else as the trust_remote_code model of :mod:`ascender_dist.hf`.
    ``True`` forces the remote-code model for a gpt too; ``False`` refuses what the standard classes
    cannot hold. The tokenizer (the argument, else the run's ``data.tokenizer`` when that file
    exists) is written as a fast tokenizer that gives sentencepiece's ids
    (:mod:`ascender_dist.tools.hf_tokenizer`), and config.json takes its bos/eos/pad ids; without
    one those ids are left unset, which a run trained with a tokenizer (meta.json records its sha256)
    allows only with ``without_tokenizer``: an export that silently lacks it never stops at EOS.
    """
    out_dir = Path(out_dir)
    check_export_out(out_dir, Path(consolidated_dir))  # before reading anything
    source = source_before_reading(consolidated_dir)  # what the marker records: never newer than the export
    state, cfg, meta = read_consolidated(consolidated_dir)
    kind = standard_architecture(cfg)
    if remote_code is False and kind is None:
        if cfg.model.architecture != "gpt":
            raise ConversionError(Path(consolidated_dir) / "meta.json", f"architecture is {meta['architecture']!r}: "
                                  "no standard Hugging Face class; export it with remote code")
        pick_hf_architecture(cfg)  # raises with the reason (norm, activation, biases)
        raise ConversionError(Path(consolidated_dir) / "config.yaml", f"model.layer_pattern "
                              f"{cfg.model.layer_pattern!r} mixes in non-attention layers: no standard Hugging "
                              "Face class holds them; export it with remote code")
    use_remote = remote_code is True or kind is None
    if not tokenizer and cfg.data.tokenizer and Path(cfg.data.tokenizer).is_file():
        tokenizer = cfg.data.tokenizer
    if not tokenizer and recorded_tokenizer_sha256(meta) and not without_tokenizer:
        where = f"its data.tokenizer {cfg.data.tokenizer} is not a file here" if cfg.data.tokenizer else \
            "its config names no data.tokenizer"
        sha = recorded_tokenizer_sha256(meta)[:12]
        raise ConversionError(Path(consolidated_dir) / "meta.json",
                              f"the run was trained with a tokenizer (sha256 {sha}...), but {where}: pass "
                              "--tokenizer PATH/tokenizer.model (or --no-tokenizer for the weights alone)")
    special_ids = fast = None
    if tokenizer:  # converted before anything is written: a model with no exact fast tokenizer fails here
        check_tokenizer(Path(tokenizer), cfg, meta, Path(consolidated_dir) / "meta.json")
        from ascender_dist.tools.hf_tokenizer import fast_tokenizer, load_proto, special_tokens

        fast = fast_tokenizer(Path(tokenizer))
        special_ids = special_tokens(load_proto(Path(tokenizer))).config_ids()
    check_weights_fit_config(state, cfg, meta, Path(consolidated_dir))  # the standard classes too
    with staged_output(out_dir, own_entries=exported_files) as tmp:  # a failure leaves what out_dir held and no temporary directory
        kind = _write_model(tmp, state, cfg, meta, None if use_remote else kind, special_ids, Path(consolidated_dir))
        if tokenizer:
            from ascender_dist.tools.hf_tokenizer import write_hf_tokenizer

            write_hf_tokenizer(Path(tokenizer), tmp, cfg.model.seq_length, fast)
        written = sorted(entry.name for entry in tmp.iterdir())  # a re-export into it refuses any other entry early
        (tmp / EXPORT_MARKER).write_text(json.dumps({
            "files": written, "source": str(consolidated_dir), "architecture": kind, "model_architecture": meta.get("architecture"),
            "trust_remote_code": kind == REMOTE_CODE_ARCHITECTURE, "step": meta.get("step"),
            "trained_code": meta.get("code"),  # the commit that trained the weights (meta.json's code)
            "vocab_size": meta.get("vocab_size"), "preset": cfg.model.preset, "run_name": cfg.name,
            **export_provenance(consolidated_dir, Path(tokenizer) if tokenizer else None, source)},
            indent=1))
    return out_dir
