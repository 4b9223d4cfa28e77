"""matplotlib, imported only by the commands that draw (it is in the ``research`` extra, not the core
install): a missing matplotlib ends the command with one line naming the extra."""

from __future__ import annotations

EXTRA_HINT = "pip install 'ascender-dist[research]'"


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend; SystemExit (one line) when absent."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"error: this command draws figures and needs matplotlib: {EXTRA_HINT}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
