"""Benchmark scripts (importable so multi-rank workers can be named as ``benchmarks.<module>:<fn>``)."""
