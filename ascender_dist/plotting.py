"""matplotlib, imported only by the commands that draw (it is in the ``research`` extra, not the core
install): a missing matplotlib ends the command with one line naming the extra."""

from __future__ import annotations

from pathlib import Path

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


def plot_round_ratios(path, title: str,
                      panels: list[tuple[str, list[tuple[str, list[float]]], dict[str, float]]]) -> None:
    """A PNG at ``path``: per panel (y label, [(row label, one ratio per round)], {line label: y}), each
    round's ratio as a dot and the median as a bar, so the spread between rounds is in view beside the
    table's median and minimum; the lines mark a baseline or a target."""
    import statistics

    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels) + 1.5, 4.0), squeeze=False)
    for ax, (ylabel, rows, lines) in zip(axes[0], panels):
        for i, (_, values) in enumerate(rows):
            ax.bar(i, statistics.median(values), 0.6, color=f"C{i}", alpha=0.45)
            ax.plot([i] * len(values), values, "o", color=f"C{i}", ms=4)
        for j, (label, y) in enumerate(lines.items()):
            ax.axhline(y, color="k", ls=("--", ":")[j % 2], lw=1, label=label)
        top = max([*lines.values(), *(max(values) for _, values in rows)])
        ax.set_xticks(range(len(rows)), [label for label, _ in rows], rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, 1.25 * top)
        ax.grid(True, axis="y", alpha=0.3)
        if lines:
            ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"{title}\n(bars: median; dots: one per round)", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
