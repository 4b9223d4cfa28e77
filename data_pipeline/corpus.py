"""A default training corpus that needs no download.

Every Python install carries megabytes of real, varied text: the standard library's ``.py``
sources (code, comments, docstrings) and its bundled documentation (``pydoc_data.topics``, the
language reference used by ``help()``). That is enough to train a tokenizer and a small model
on a machine with no network, and it is deterministic: the same Python version and the same
``max_bytes`` give byte-identical output.

Output is JSONL, one document per line: ``{"text": ..., "source": ...}``.
"""

from __future__ import annotations

import ast
import inspect
import io
import json
import tokenize
import sysconfig
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from ._io import atomic_write_bytes, refuse_existing
from .errors import DataError

# Test suites contain deliberately broken files (bad encodings, syntax errors) and are poor prose.
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_root() -> Path:
    """The directory holding the standard library sources (not the venv, which has none)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files(root: Path | None = None) -> list[Path]:
    """All stdlib ``.py`` files outside test and site-packages dirs, sorted by relative path for determinism."""
    root = Path(root) if root is not None else stdlib_root()
    files = [
        p for p in root.rglob("*.py")
        if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def pydoc_topic_documents() -> Iterator[dict]:
    """The language-reference topics that ``help()`` shows, one document per topic, sorted by name."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some minimal distro builds strip pydoc_data
        return
    for name in sorted(topics):
        text = topics[name].strip()
        if text:
            yield {"text": text, "source": f"pydoc_data.topics:{name}"}


def _read_source(path: Path) -> str | None:
    """A source file's text, or None when it is not UTF-8 (rare in the stdlib; skipped, not fatal)."""
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def _module_docstring(text: str) -> str | None:
    """The module docstring, read from the first tokens only (no import: importing stdlib modules has
    side effects; no full ``ast.parse``: parsing every file would dominate the build time)."""
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.ENCODING}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type in skip:
                continue
            if tok.type != tokenize.STRING:
                return None
            value = ast.literal_eval(tok.string)
            return inspect.cleandoc(value) if isinstance(value, str) else None
    except (tokenize.TokenError, SyntaxError, ValueError):
        return None
    return None


def stdlib_documents(root: Path | None = None) -> Iterator[dict]:
    """Documentation first (module docstrings), then full sources, each in sorted file order."""
    root = Path(root) if root is not None else stdlib_root()
    files = stdlib_source_files(root)
    for path in files:
        text = _read_source(path)
        doc = _module_docstring(text) if text else None
        if doc and len(doc) >= 80:  # one-line docstrings add nothing beyond the source itself
            yield {"text": doc, "source": f"docstring:{path.relative_to(root).as_posix()}"}
    for path in files:
        text = _read_source(path)
        if text and text.strip():
            yield {"text": text, "source": f"stdlib:{path.relative_to(root).as_posix()}"}


def iter_default_documents(root: Path | None = None) -> Iterator[dict]:
    """The full default document stream, in its fixed order: pydoc topics, docstrings, sources."""
    yield from pydoc_topic_documents()
    yield from stdlib_documents(root)


def build_default_corpus(out_path: Path, max_bytes: int = 6_000_000, *, root: Path | None = None,
                         progress: bool = True) -> Path:
    """Write the default corpus as JSONL and return its path.

    Documents are taken whole, in the fixed order of :func:`iter_default_documents`, until the
    UTF-8 size of their texts would exceed ``max_bytes`` (a document that does not fit is skipped,
    later smaller ones may still fit). Deterministic for a given Python version and ``max_bytes``.
    The file is written to a temporary name and renamed, so a failed build never clobbers a corpus;
    an existing ``out_path`` is refused, not replaced.
    """
    if max_bytes <= 0:
        raise DataError(str(out_path), f"max_bytes must be > 0 (got {max_bytes})")
    out_path = Path(out_path)
    refuse_existing(out_path, "a corpus is never replaced: choose another --out or remove it")
    lines: list[str] = []
    total, smallest = 0, None  # smallest: of the documents that did not fit
    bar = tqdm(total=max_bytes, unit="B", unit_scale=True, desc="build-corpus", disable=not progress)
    for doc in iter_default_documents(root):
        size = len(doc["text"].encode("utf-8"))
        if total + size > max_bytes:
            smallest = size if smallest is None else min(smallest, size)
            continue
        lines.append(json.dumps(doc, ensure_ascii=False))
        total += size
        bar.update(size)
        if max_bytes - total < 64:
            break
    bar.close()
    if not lines and smallest is not None:
        raise DataError(str(out_path), f"no document fits in max_bytes {max_bytes} (the smallest has {smallest} "
                                       "bytes): give a larger --max-bytes")
    if not lines:
        raise DataError(str(out_path), f"no standard-library documents found under {root or stdlib_root()}")
    atomic_write_bytes(out_path, ("\n".join(lines) + "\n").encode("utf-8"))
    return out_path
