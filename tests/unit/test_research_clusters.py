"""Cluster quality, attention groupings and token pseudo-labels against scikit-learn and hand cases."""

import keyword
import math

import numpy as np
import pytest
from sklearn import metrics

from ascender_dist.research.clusters import (
    TOKEN_CLASSES,
    attention_groups,
    cluster_quality,
    pseudo_labels_from_tokens,
    token_class,
)


def _blobs(seed=0, per=10):
    rng = np.random.default_rng(seed)
    centres = np.array([[0.0, 0.0], [5.0, 0.0], [0.0, 5.0]])
    x = np.concatenate([c + rng.normal(0, 0.5, (per, 2)) for c in centres])
    return x, np.repeat(np.arange(3), per)


def test_perfect_and_permuted_labels_score_one():
    x, y = _blobs()
    q = cluster_quality(x, y, y)
    assert q["nmi"] == pytest.approx(1.0) and q["ari"] == pytest.approx(1.0)
    renamed = np.array([7, 2, 9])[y]  # the same partition under other label names
    q2 = cluster_quality(x, renamed, y)
    assert q2["nmi"] == pytest.approx(1.0) and q2["ari"] == pytest.approx(1.0)
    assert q2["calinski_harabasz"] == pytest.approx(q["calinski_harabasz"])
    assert q2["silhouette"] == pytest.approx(q["silhouette"])
    assert q["notes"] == {} and q["n_clusters"] == 3 and q["n_pseudo_classes"] == 3 and q["n_samples"] == 30


def test_internal_indices_equal_scikit_learn_directly():
    x, _ = _blobs(seed=1)
    pred = np.random.default_rng(2).integers(0, 4, x.shape[0])
    pseudo = np.arange(x.shape[0]) % 3
    q = cluster_quality(x, pred, pseudo)
    assert q["calinski_harabasz"] == pytest.approx(metrics.calinski_harabasz_score(x, pred))
    assert q["silhouette"] == pytest.approx(metrics.silhouette_score(x, pred))
    assert q["nmi"] == pytest.approx(metrics.normalized_mutual_info_score(pseudo, pred))
    assert q["ari"] == pytest.approx(metrics.adjusted_rand_score(pseudo, pred))
    cos = cluster_quality(x, pred, pseudo, silhouette_metric="cosine")
    assert cos["silhouette"] == pytest.approx(metrics.silhouette_score(x, pred, metric="cosine"))


@pytest.mark.parametrize("pred, features, reason", [
    (np.zeros(30, int), "x", "1 predicted cluster(s): needs at least 2"),
    (np.arange(30), "x", "30 predicted clusters for 30 samples"),
    (np.arange(30) % 3, None, "no features given"),
])
def test_undefined_internal_indices_are_nan_with_a_reason(pred, features, reason):
    x, y = _blobs()
    q = cluster_quality(x if features == "x" else None, pred, y)
    assert math.isnan(q["calinski_harabasz"]) and math.isnan(q["silhouette"])
    assert reason in q["notes"]["silhouette"] and reason in q["notes"]["calinski_harabasz"]
    assert math.isfinite(q["nmi"]) and math.isfinite(q["ari"])


def test_cluster_quality_rejects_mismatched_inputs():
    x, y = _blobs()
    with pytest.raises(ValueError, match="30 entries but pseudo_labels has 29"):
        cluster_quality(x, y, y[:-1])
    with pytest.raises(ValueError, match=r"features must be \[n_samples=30"):
        cluster_quality(x[:-1], y, y)


def test_argmax_groups_follow_the_most_attended_key():
    attn = np.full((5, 5), 0.1)
    for query, key in enumerate([3, 3, 1, 1, 4]):
        attn[query, key] = 0.6
    # keys 1, 3, 4 become groups 0, 1, 2 (renumbered by key position)
    assert attention_groups(attn).tolist() == [1, 1, 0, 0, 2]


def _block_attention(sizes=(4, 6, 5), seed=0):
    rng = np.random.default_rng(seed)
    s = sum(sizes)
    labels = np.repeat(np.arange(len(sizes)), sizes)
    logits = np.where(labels[:, None] == labels[None, :], 3.0, 0.0) + rng.normal(0, 0.3, (s, s))
    attn = np.exp(logits)
    return attn / attn.sum(1, keepdims=True), labels


def test_spectral_groups_recover_blocks_deterministically():
    attn, labels = _block_attention()
    groups = attention_groups(attn, "spectral", k=3, seed=0)
    assert metrics.adjusted_rand_score(labels, groups) == pytest.approx(1.0)
    assert np.array_equal(groups, attention_groups(attn, "spectral", k=3, seed=0))
    q = cluster_quality(attn, groups, labels)  # attention rows as the feature space
    assert q["ari"] == pytest.approx(1.0) and q["silhouette"] > 0.5


@pytest.mark.parametrize("attn, method, k, match", [
    (np.ones((2, 3, 3)), "argmax", None, "one square map"),
    (np.ones((4, 4)), "spectral", None, "2 <= k < s=4"),
    (np.ones((4, 4)), "spectral", 4, "2 <= k < s=4"),
    (-np.ones((4, 4)), "spectral", 2, "non-negative"),
    (np.ones((4, 4)), "kmeans", 2, "unknown method"),
])
def test_attention_groups_rejects_bad_input(attn, method, k, match):
    with pytest.raises(ValueError, match=match):
        attention_groups(attn, method, k)


def test_pseudo_label_rule_on_code_tokens():
    cases = {
        "\u2581def": "keyword", "\u0120return": "keyword", "None": "keyword", "If": "identifier",
        "\u2581foo_bar": "identifier", "x1": "identifier", "\u00e9t\u00e9": "identifier",
        "(": "punctuation", "\u2581+=": "punctuation", "->": "punctuation", "\u2581": "whitespace",
        "\n": "whitespace", "    ": "whitespace", "\u010a": "whitespace", "<0x0A>": "whitespace",
        "<0xE2>": "other", "42": "number", "\u25811.5e-3": "number", "0x1F": "number", "3j": "number",
        "\u2581\"hello": "string", "world'": "string", "f\"": "string", "foo(": "other",
    }
    for tok, cls in cases.items():
        assert token_class(tok) == cls, tok
    labels = pseudo_labels_from_tokens(list(cases))
    assert labels.dtype == np.int64
    assert [TOKEN_CLASSES[i] for i in labels] == list(cases.values())
    assert all(token_class(kw) == "keyword" for kw in keyword.kwlist)
