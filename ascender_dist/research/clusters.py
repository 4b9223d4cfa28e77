"""Cluster quality of attention-induced token groupings against pseudo-labels (paper Table 4).

Three pieces, all on numpy arrays (pass ``tensor.detach().cpu().numpy()``):

* :func:`attention_groups` turns one attention map ``[s, s]`` into a token grouping;
* :func:`pseudo_labels_from_tokens` gives every token a coarse lexical class to compare against;
* :func:`cluster_quality` scores a grouping with scikit-learn: NMI and ARI against the pseudo-labels
  (external agreement), Calinski-Harabasz and silhouette of the grouping in a feature space such as
  the latent coordinates ``z`` or the attention rows (internal compactness/separation).
"""

from __future__ import annotations

import keyword
import re
import string
import unicodedata
from collections.abc import Iterable

import numpy as np
from sklearn import metrics
from sklearn.cluster import SpectralClustering

__all__ = [
    "TOKEN_CLASSES",
    "attention_groups",
    "cluster_quality",
    "pseudo_labels_from_tokens",
    "token_class",
]


# --------------------------------------------------------------------------------------------- quality


def _labels(values, name: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array of labels, got shape {arr.shape}")
    return arr


def cluster_quality(features, predicted_labels, pseudo_labels, *, silhouette_metric: str = "euclidean",
                    silhouette_sample_size: int | None = None, seed: int = 0) -> dict:
    """Score a grouping: ``{"nmi", "ari", "calinski_harabasz", "silhouette", ...}``.

    * ``nmi`` / ``ari``: agreement of ``predicted_labels`` with ``pseudo_labels`` (label names do not
      matter; 1.0 = the same partition). NMI uses scikit-learn's arithmetic-mean normalisation.
    * ``calinski_harabasz`` / ``silhouette``: how compact and separated the predicted groups are in
      ``features`` (``[n, d]``; pseudo-labels are not used). Both need ``2 <= n_clusters <= n - 1``;
      outside that range, or with ``features=None``, they are NaN and ``notes`` says why.

    Also returned: ``n_samples``, ``n_clusters`` (predicted), ``n_pseudo_classes`` and ``notes`` (a dict
    from metric name to the reason it is NaN; empty when all four are defined).
    ``silhouette_sample_size`` subsamples (seeded) for long sequences, silhouette being O(n^2).
    """
    pred = _labels(predicted_labels, "predicted_labels")
    pseudo = _labels(pseudo_labels, "pseudo_labels")
    if pred.size != pseudo.size:
        raise ValueError(f"predicted_labels has {pred.size} entries but pseudo_labels has {pseudo.size}")
    if pred.size == 0:
        raise ValueError("cluster_quality: no samples")
    n = int(pred.size)
    n_clusters = int(np.unique(pred).size)
    out = {
        "nmi": float(metrics.normalized_mutual_info_score(pseudo, pred)),
        "ari": float(metrics.adjusted_rand_score(pseudo, pred)),
        "calinski_harabasz": float("nan"),
        "silhouette": float("nan"),
        "n_samples": n,
        "n_clusters": n_clusters,
        "n_pseudo_classes": int(np.unique(pseudo).size),
        "notes": {},
    }
    reason = None
    if features is None:
        reason = "no features given"
    else:
        x = np.asarray(features, dtype=np.float64)
        if x.ndim == 1:
            x = x[:, None]
        if x.ndim != 2 or x.shape[0] != n:
            raise ValueError(f"features must be [n_samples={n}, n_features], got shape {x.shape}")
        if not np.all(np.isfinite(x)):
            raise ValueError("features contain non-finite values")
        if n_clusters < 2:
            reason = f"{n_clusters} predicted cluster(s): needs at least 2"
        elif n_clusters > n - 1:
            reason = f"{n_clusters} predicted clusters for {n} samples: needs at most n_samples - 1"
    if reason is not None:
        out["notes"] = {"calinski_harabasz": reason, "silhouette": reason}
        return out
    out["calinski_harabasz"] = float(metrics.calinski_harabasz_score(x, pred))
    out["silhouette"] = float(metrics.silhouette_score(
        x, pred, metric=silhouette_metric,
        sample_size=silhouette_sample_size if silhouette_sample_size and silhouette_sample_size < n else None,
        random_state=seed))
    return out


# --------------------------------------------------------------------------------------------- groups


def attention_groups(attn, method: str = "argmax", k: int | None = None, *, seed: int = 0) -> np.ndarray:
    """Token groups ``[s]`` (ints ``0..m-1``) from one attention map ``attn[query, key]`` of shape ``[s, s]``.

    * ``"argmax"``: a token's group is the key it attends to most (``k`` is ignored); groups are
      renumbered ``0..m-1`` in order of key position, so ``m`` = number of distinct argmax keys.
    * ``"spectral"``: scikit-learn ``SpectralClustering`` into ``k`` groups on the symmetrised affinity
      ``(A + A^T) / 2`` with ``random_state=seed`` (deterministic). Needs ``2 <= k < s`` and ``A >= 0``
      (post-softmax probabilities, not logits).

    For multi-head maps pick a head or average heads first; the function takes exactly one map.
    """
    a = np.asarray(attn, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"attn must be one square map [s, s] (pick or average heads first), got {a.shape}")
    if a.shape[0] == 0:
        raise ValueError("attn is empty")
    if not np.all(np.isfinite(a)):
        raise ValueError("attn contains non-finite values (masked logits? pass post-softmax probabilities)")
    if method == "argmax":
        _, groups = np.unique(a.argmax(axis=1), return_inverse=True)
        return groups.astype(np.int64)
    if method == "spectral":
        s = a.shape[0]
        if k is None or not 2 <= k < s:
            raise ValueError(f"spectral grouping needs an integer k with 2 <= k < s={s}, got k={k}")
        if np.any(a < 0):
            raise ValueError("spectral grouping needs a non-negative affinity: pass post-softmax attention")
        affinity = 0.5 * (a + a.T)
        model = SpectralClustering(n_clusters=int(k), affinity="precomputed", random_state=seed)
        return model.fit_predict(affinity).astype(np.int64)
    raise ValueError(f"unknown method {method!r}: expected 'argmax' or 'spectral'")


# --------------------------------------------------------------------------------------- pseudo-labels

TOKEN_CLASSES = ("identifier", "keyword", "punctuation", "number", "whitespace", "string", "other")
_CLASS_INDEX = {name: i for i, name in enumerate(TOKEN_CLASSES)}

# Word-boundary / whitespace markers of common subword vocabularies: sentencepiece "▁",
# GPT-2 byte-level BPE "Ġ" (space), "Ċ" (newline), "ĉ" (tab).
_MARKERS = "\u2581\u0120\u010a\u0109"
_STRIP = _MARKERS + string.whitespace
_QUOTES = set("'\"`")
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_NUMBER = re.compile(
    r"(?:\d[\d_]*(?:\.[\d_]*)?|\.\d[\d_]*)(?:[eE][+-]?\d+)?[jJ]?"
    r"|0[xX][0-9a-fA-F_]+|0[oO][0-7_]+|0[bB][01_]+"
)
_KEYWORDS = frozenset(keyword.kwlist)


def _is_punct(text: str) -> bool:
    return all(unicodedata.category(ch)[0] in "PS" for ch in text)


def token_class(token: str) -> str:
    """The pseudo-label class of one token string (see :func:`pseudo_labels_from_tokens`)."""
    byte = _BYTE_PIECE.fullmatch(token)
    if byte is not None:  # sentencepiece byte-fallback piece
        return "whitespace" if chr(int(byte.group(1), 16)) in string.whitespace else "other"
    core = token.strip(_STRIP)
    if not core:
        return "whitespace"
    if _QUOTES.intersection(core):
        return "string"
    if core in _KEYWORDS:
        return "keyword"
    if _NUMBER.fullmatch(core):
        return "number"
    if core.isidentifier():
        return "identifier"
    if _is_punct(core):
        return "punctuation"
    return "other"


def pseudo_labels_from_tokens(token_strings: Iterable[str]) -> np.ndarray:
    """Integer pseudo-labels (indices into :data:`TOKEN_CLASSES`) for a sequence of token strings.

    The rule, applied to each token on its own (no context), in this order:

    0. a sentencepiece byte piece ``<0xNN>`` is ``whitespace`` if that byte is whitespace, else ``other``;
    1. strip whitespace and subword boundary markers (``▁``, ``Ġ``, ``Ċ``, ``ĉ``) from both ends;
       nothing left -> ``whitespace`` (spaces, newlines, indentation);
    2. contains a quote character ``'`` ``"`` or a backtick -> ``string`` (a string-literal piece);
    3. a Python keyword (``keyword.kwlist``, case-sensitive) -> ``keyword``;
    4. a Python numeric literal (int, float, exponent, imaginary, hex/octal/binary) -> ``number``;
    5. ``str.isidentifier()`` -> ``identifier`` (in prose: a word);
    6. only Unicode punctuation/symbol characters -> ``punctuation`` (operators, brackets);
    7. anything else (mixed pieces such as ``foo(``) -> ``other``.

    On prose, keywords coincide with a few function words (``if``, ``in``, ``and``, ``for``...) and
    apostrophes count as string pieces; the classes are a coarse, deterministic proxy, not a parser.
    """
    return np.fromiter((_CLASS_INDEX[token_class(t)] for t in token_strings), dtype=np.int64)
