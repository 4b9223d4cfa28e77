"""The machine a result was measured or trained on: CPU model, its widest vector instruction set,
logical CPUs. Recorded with research results and printed by the benchmarks, because float32 kernels
round differently on different CPUs (an AVX-512 and an AVX2 EPYC give the same code's ASCender runs
validation losses up to 5e-3 apart after 200 steps: benchmarks/results/research/README.md)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

# widest first: the first one the CPU reports is its vector ISA
VECTOR_ISAS = (("avx512f", "avx512"), ("avx2", "avx2"), ("avx", "avx"), ("sse4_2", "sse4.2"),
               ("asimd", "neon"), ("neon", "neon"))


def _cpuinfo_field(name: str):
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == name:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name with its x86 family and model numbers when /proc/cpuinfo has them
    ("AMD EPYC family 26 model 2"), else what the platform reports. Cloud VMs often show a bare
    "AMD EPYC" for several generations (Zen 3 / 4 / 5 are families 25 / 25 / 26), whose kernels
    run at different relative speeds, so the numbers are what tells the benchmark rows apart."""
    name = _cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown CPU"
    family, model = _cpuinfo_field("cpu family"), _cpuinfo_field("model")
    return f"{name} family {family} model {model}" if family and model else name


def vector_isa() -> str:
    """The widest SIMD instruction set the CPU reports ("avx512", "avx2", ..., "unknown")."""
    flags = set((_cpuinfo_field("flags") or _cpuinfo_field("Features") or "").split())
    return next((name for flag, name in VECTOR_ISAS if flag in flags), "unknown")


def machine_record() -> dict:
    """``{"cpu": model, "isa": widest vector ISA, "logical_cpus": n}``."""
    return {"cpu": cpu_model(), "isa": vector_isa(), "logical_cpus": os.cpu_count()}


def machine_line(record: dict) -> str:
    """One phrase for a table header: "AMD EPYC (avx512, 2 logical CPUs)"."""
    return f"{record.get('cpu', 'unknown CPU')} ({record.get('isa', '?')}, {record.get('logical_cpus', '?')} logical CPUs)"
