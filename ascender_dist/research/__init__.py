"""Research toolkit: significance statistics, cluster quality of attention groupings, ablation tables.

Pure computation on numpy arrays (scipy for resampling, scikit-learn for cluster metrics); no
training-stack imports. See docs/research.md.
"""

try:
    import matplotlib  # noqa: F401
    import scipy  # noqa: F401
    import sklearn  # noqa: F401
except ImportError as exc:  # the core install leaves them out
    raise ImportError(f"the research tools need the research extra: pip install 'ascender-dist[research]' "
                      f"({exc})") from None

from .clusters import TOKEN_CLASSES, attention_groups, cluster_quality, pseudo_labels_from_tokens, token_class
from .stats import (
    EXACT_MAX_N,
    PairedComparison,
    approximate_randomization_test,
    cliffs_delta,
    cohens_dz,
    compare_paired,
    compare_per_document,
    compare_per_example,
    document_bootstrap_ci,
    document_bootstrap_level,
    document_randomization_test,
    hedges_g,
    hedges_gz,
    hedges_j,
    holm,
    paired_bootstrap_ci,
    paired_t_ci,
    paired_t_test,
    summarize,
)
from .tables import pareto_front, results_table, summary_table

__all__ = [
    "EXACT_MAX_N",
    "TOKEN_CLASSES",
    "PairedComparison",
    "approximate_randomization_test",
    "attention_groups",
    "cliffs_delta",
    "cluster_quality",
    "cohens_dz",
    "compare_paired",
    "compare_per_document",
    "compare_per_example",
    "document_bootstrap_ci",
    "document_bootstrap_level",
    "document_randomization_test",
    "holm",
    "hedges_g",
    "hedges_gz",
    "hedges_j",
    "paired_bootstrap_ci",
    "paired_t_ci",
    "paired_t_test",
    "pareto_front",
    "pseudo_labels_from_tokens",
    "results_table",
    "summarize",
    "summary_table",
    "token_class",
]
