"""lm-evaluation-harness model ``ascender-dist``: lm-eval's HFLM over our exports, remote code on.

Use it from the command line (this module registers the model, then runs lm-eval's own CLI with
the remaining arguments, so every lm-eval option works)::

    python -m ascender_dist.tools.lm_eval_adapter --model ascender-dist \\
        --model_args pretrained=exports/ascender-small-hf --tasks hellaswag,arc_easy --device cuda

or from Python (``import ascender_dist.tools.lm_eval_adapter`` registers it)::

    import lm_eval, ascender_dist.tools.lm_eval_adapter  # noqa: F401
    lm_eval.simple_evaluate(model="ascender-dist", model_args={"pretrained": "exports/x-hf"}, tasks=[...])

``pretrained`` is either a directory written by ``ascender-dist export-hf`` (remote-code model, or
GPT-NeoX / Llama for gpt) or a consolidated directory (``ascender-dist consolidate``), which is
exported on the fly into ``<dir>/.hf-export`` with the run's ``data.tokenizer`` (re-used while its
``ascender_dist.json`` records this ascender-dist version and code, the sha256 of the run's
config.yaml, meta.json and tokenizer, and the size and mtime of its model.safetensors, each equal to
what they are now; processes started together export it once, under a lock on
``<dir>/.hf-export.lock``). A run whose tokenizer file is not reachable is refused.
The tokenizer is the directory's AutoTokenizer when it has a ``tokenizer_config.json`` (every export
now ships a fast ``tokenizer.json`` with sentencepiece's ids), else our sentencepiece wrapper over its
``tokenizer.model`` (exports written before that). An empty context is scored after EOS
(``prefix_token_id``), as our documents are separated by EOS and never start with BOS.
Every other model argument is HFLM's (``batch_size``, ``dtype``, ``max_length``, ...);
``trust_remote_code`` is always on, for exports whose Python files are byte for byte the ones this
installation writes (``require_own_code``; ``trust_export_code=True`` runs another export's code),
and ``device`` defaults to cuda when available, else cpu.
Exports load through :func:`remote_code_path`, so each one runs its own code even when another
export of the same directory name (``runs/small/hf``, ``runs/medium/hf``) was loaded before.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Sequence

from ascender_dist.config.errors import UserError
from ascender_dist.locks import exclusive_lock
from ascender_dist.tools.hf_export import LM_EVAL_EXPORT_SUBDIR as EXPORT_SUBDIR  # the export cache's name

MODEL_NAME = "ascender-dist"
CODE_LINK_PREFIX = "ascender_dist_code_"  # + the code digest: the package transformers imports an export as


class AdapterError(UserError, ValueError):
    """A model directory lm-eval cannot use; ``str(e)`` is one line."""


def is_consolidated(path: Path) -> bool:
    path = Path(path)
    return (path / "meta.json").is_file() and (path / "model.safetensors").is_file() and \
        (path / "config.yaml").is_file()


def is_hf_export(path: Path) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def run_tokenizer(consolidated: Path) -> Path:
    """The run's ``data.tokenizer``, which its export carries. A run that names none, or whose file is
    not reachable from here (a relative path resolves against the working directory), is a one-line
    AdapterError: lm-eval cannot run an export without a tokenizer, and one cached without it would
    be what every later call found."""
    from ascender_dist.tools.convert import read_config_file

    config = Path(consolidated) / "config.yaml"
    data = read_config_file(config).get("data") or {}
    tokenizer = data.get("tokenizer") if isinstance(data, dict) else None
    if not tokenizer:
        raise AdapterError(f"{config}: data.tokenizer is not set, and lm-eval needs the tokenizer: pass an export "
                           "made with `ascender-dist export-hf --tokenizer PATH`")
    if not Path(tokenizer).is_file():
        raise AdapterError(f"{config}: data.tokenizer {tokenizer} is not a file here (a relative path resolves "
                           "against the working directory), and lm-eval needs the tokenizer: run from where it "
                           "resolves, or pass an export made with `ascender-dist export-hf --tokenizer PATH`")
    return Path(tokenizer)


def _cached_provenance(out: Path) -> Optional[dict]:
    """The cached export's ``ascender_dist.json``, or None when there is no whole export to read."""
    import json

    from ascender_dist.tools.hf_export import EXPORT_MARKER, is_export_output

    if not (is_export_output(out) and (out / "model.safetensors").is_file()):
        return None
    try:
        info = json.loads((out / EXPORT_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _cache_is_warm(consolidated: Path, out: Path, tokenizer: Path) -> bool:
    """The export cache ``out`` is what exporting now would write: its ``ascender_dist.json`` records
    exactly the provenance an export would record now (:func:`~ascender_dist.tools.hf_export.export_provenance`:
    this ascender-dist version and code, the sha256 of config.yaml, meta.json and the tokenizer
    ``tokenizer``, the size and mtime of the consolidated weights), and its Python files are the
    ones this installation writes (code_is_installed_code). Equality, not "newer": weights
    copied with ``rsync -a`` / ``cp -p`` keep their older mtime. A tokenizer-less export, or one of
    other files, is stale. An export is published whole: its marker file means the rest is there too."""
    from ascender_dist.tools.hf_export import code_is_installed_code, export_provenance

    info = _cached_provenance(out)
    if info is None:
        return False
    if not all(info.get(key) == value for key, value in export_provenance(consolidated, tokenizer).items()):
        return False
    # the marker is claims anyone who can read the run could copy: the Python that trust_remote_code
    # will run must be this installation's own, file by file (else it is exported again)
    return code_is_installed_code(out)


@contextmanager
def _export_lock(consolidated: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``<dir>/.hf-export.lock`` for checking and filling the export cache:
    processes started together on a cold cache export it once (the others wait, then find it warm)
    instead of replacing each other's output while it loads. Taken only on a cold cache, so a warm
    cache in a read-only directory still loads."""
    with exclusive_lock(consolidated / f"{EXPORT_SUBDIR}.lock", AdapterError, "the export cache lock"):
        yield


def _export(consolidated: Path, out: Path, tokenizer: Path) -> None:
    """Export a consolidated run into its cache ``out`` with ``tokenizer``."""
    from ascender_dist.tools.hf_export import export_hf

    export_hf(consolidated, out, tokenizer=str(tokenizer))


def require_own_code(export: Path, trusted: bool = False) -> None:
    """Refuse an export whose Python files (or an ``auto_map``) are not what this installation
    writes (hf_export.code_is_installed_code), unless ``trusted``: loading it with trust_remote_code
    would run that code (an export of another ascender-dist version, edited files, or a directory
    from elsewhere). A GPT-NeoX / Llama export has no code and passes."""
    from ascender_dist.tools.hf_export import code_is_installed_code, unreadable_json

    if trusted or code_is_installed_code(export):
        return
    problem = unreadable_json(export)
    if problem:  # a damaged file, not foreign code: say which
        raise AdapterError(problem)
    raise AdapterError(f"{export}: its Python code is not what this ascender-dist installation writes (an export "
                       "of another version, or edited files), and loading it would run that code: export it again "
                       "with this installation, or trust it explicitly (evaluate --trust-export-code; lm-eval "
                       "model_args trust_export_code=True)")


def check_weights_readable(export: Path) -> None:
    """Every ``*.safetensors`` header of ``export`` readable (evaluate's check): a truncated file was a
    traceback from inside transformers' loader."""
    from ascender_dist.tools.safetensors_header import UnreadableWeights, export_parameters

    try:
        export_parameters(export)
    except UnreadableWeights as exc:
        raise AdapterError(str(exc)) from None


def _flag(value) -> bool:
    """A model argument's truth (lm-eval passes model_args from the command line as strings)."""
    return value is True or str(value).strip().lower() in ("1", "true", "yes")


def hf_directory(path: str | Path) -> Path:
    """The Hugging Face directory for ``path`` (a consolidated one is exported next to itself, with the
    run's ``data.tokenizer``: :func:`run_tokenizer`)."""
    path = Path(path)
    if is_hf_export(path):
        return path
    if is_consolidated(path):
        out = path / EXPORT_SUBDIR
        tokenizer = run_tokenizer(path)  # before the cache: never one without a tokenizer
        if not _cache_is_warm(path, out, tokenizer):
            with _export_lock(path):  # other processes (accelerate launch) wait, then find it warm
                if not _cache_is_warm(path, out, tokenizer):
                    _export(path, out, tokenizer)
        return out
    raise AdapterError(f"{path}: neither a Hugging Face export (config.json + *.safetensors) nor a consolidated "
                       "directory (model.safetensors + meta.json + config.yaml)")


def _sha256_16(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def code_digest(export: Path) -> str:
    """16 hex digits of the sha256 of an export's Python files (names and bytes): the code that
    transformers imports from it."""
    parts = []
    for source in sorted(Path(export).glob("*.py")):
        data = source.read_bytes()
        parts.append(f"{source.name}\0{len(data)}\0".encode() + data)
    return _sha256_16(b"".join(parts))


def _remove_links(directory: Path, owner: int) -> None:
    """Remove ``directory`` (links only: rmtree never follows them), in the process that made it."""
    if os.getpid() == owner:  # not in a forked child exiting
        shutil.rmtree(directory, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def _links_directory() -> Path:
    """This process's directory of :func:`remote_code_path` links, removed at exit."""
    directory = Path(tempfile.mkdtemp(prefix="ascender-dist-remote-code-"))
    atexit.register(_remove_links, directory, os.getpid())
    return directory


def remote_code_path(export: str | Path) -> Path:
    """The path to give ``from_pretrained(..., trust_remote_code=True)`` for the export directory
    ``export``: a symlink to it whose name is its :func:`code_digest`.

    transformers imports a local directory's code under a package named after the directory
    (``transformers_modules.<name>``, which stays in ``sys.modules``; recent versions add a hash of
    each module's files, but map a config class to the first model class loaded for it and reuse
    that for every later export whose configuration file is the same), so two exports of one name
    (``runs/small/hf``, ``runs/medium/hf``) whose code differs would both run the code loaded first.
    Named by its code, each export imports its own; exports with the same code share it. The link's
    parent is named by the export's path, so each link leads to its own weights; links live in a
    directory of this process, removed at exit. A directory without Python files (a GPT-NeoX / Llama
    export) imports no code and is its own path."""
    if not any(Path(export).glob("*.py")):
        return Path(export)
    export = Path(export).resolve()
    link = _links_directory() / _sha256_16(str(export).encode()) / f"{CODE_LINK_PREFIX}{code_digest(export)}"
    if not link.is_symlink():
        link.parent.mkdir(parents=True, exist_ok=True)
        try:
            link.symlink_to(export, target_is_directory=True)
        except FileExistsError:  # another thread made it: the same name means the same target
            pass
    return link


def load_tokenizer(path: Path):
    """AutoTokenizer of an export, else our sentencepiece tokenizer over its tokenizer.model."""
    path = Path(path)
    if (path / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        # older exports name a remote-code tokenizer class: loaded as their own code, like the model
        return AutoTokenizer.from_pretrained(str(remote_code_path(path)), trust_remote_code=True)
    if (path / "tokenizer.model").is_file():
        from ascender_dist.hf.tokenization_ascender_dist import AscenderDistTokenizer

        # the trained context from the export's config.json, so that truncation=True truncates to it
        from ascender_dist.tools.convert import read_json_file

        config = path / "config.json"
        context = read_json_file(config).get("max_position_embeddings") if config.is_file() else None
        extra = {"model_max_length": context} if isinstance(context, int) else {}
        return AscenderDistTokenizer(vocab_file=str(path / "tokenizer.model"), **extra)
    raise AdapterError(f"{path}: no tokenizer (export with --tokenizer, or set data.tokenizer in the run)")


def _model_class():
    import torch
    from lm_eval.models.huggingface import HFLM

    class AscenderDistLM(HFLM):
        """HFLM with trust_remote_code, our tokenizer and consolidated-directory support."""

        def __init__(self, pretrained, tokenizer=None, device: Optional[str] = None, trust_export_code=False,
                     **kwargs):  # fmt: skip
            if isinstance(pretrained, (str, Path)):
                pretrained = hf_directory(pretrained)
                require_own_code(pretrained, _flag(trust_export_code))
                check_weights_readable(pretrained)
                if tokenizer is None:
                    tokenizer = load_tokenizer(pretrained)
                pretrained = str(remote_code_path(pretrained))  # its own code, whatever its directory's name
            kwargs["trust_remote_code"] = True
            if getattr(tokenizer, "eos_token_id", None) is not None:
                # our documents end with EOS and never start with BOS: score an empty context after EOS
                kwargs.setdefault("prefix_token_id", tokenizer.eos_token_id)
            if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
                device = "cuda" if torch.cuda.is_available() else "cpu"
            super().__init__(pretrained=pretrained, tokenizer=tokenizer, device=device, **kwargs)

    AscenderDistLM.__name__ = AscenderDistLM.__qualname__ = "AscenderDistLM"
    return AscenderDistLM


def register() -> type:
    """Register ``ascender-dist`` with lm-eval's model registry (idempotent); returns the class."""
    import lm_eval.models  # noqa: F401  (registers lm-eval's own models first: the registry is filled once)
    from lm_eval.api.registry import model_registry

    if MODEL_NAME in model_registry:
        return model_registry.get(MODEL_NAME)
    cls = _model_class()
    model_registry.register(MODEL_NAME)(cls)
    return cls


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m ascender_dist.tools.lm_eval_adapter <lm-eval arguments>``."""
    from lm_eval.__main__ import cli_evaluate

    register()
    sys.argv = ["lm-eval", *(sys.argv[1:] if argv is None else list(argv))]
    try:
        cli_evaluate()
    except UserError as exc:  # ours, or a conversion / config error of the on-the-fly export
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


# importing this module is enough for lm_eval.simple_evaluate(model="ascender-dist", ...)
try:
    AscenderDistLM = register()
except ImportError:  # lm-eval not installed: the helpers above still work
    AscenderDistLM = None

if __name__ == "__main__":
    sys.exit(main())
