"""Command-line tools that work on a run config without training (``plan``)."""
