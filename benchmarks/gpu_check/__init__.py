"""One command for a GPU machine: everything that needs a GPU, measured and written down with the GPU named.

    python -m benchmarks.gpu_check                                  # one H100 or H200: ~7 min; writes benchmarks/results/gpu/
    python -m benchmarks.gpu_check --cpu-dry-run --out /tmp/dry     # the same script on CPU at tiny sizes
    python -m benchmarks.gpu_check --out /tmp/gpu --archive $OUT/gpu_check.tar.gz   # a lent GPU machine (README)

At start-up it records which of the project's packages import there, with versions (``packages.py``; a lent
GPU machine lacks deepspeed, megatron-core and webdataset unless they travel as wheels: ``prepare_wheels.py``);
a section whose packages do not import is skipped with one line naming them.

Sections, run in this order, each under a time budget (``plan.py``); a section that fails records its
error line in its results and the next one still runs; the exit status is 1 if any section failed:

    tests      pytest on the Triton kernel tests (compiled for real on CUDA; TRITON_INTERPRET=1 and a
               quick ``-k`` subset in the dry run) and on every test marked ``cuda``; pass/fail/skip counts
    attention  one causal layer, fwd+bwd: ASCender (``impl="auto"``) vs SDPA under the first backend
               that runs (FlashAttention first), in rounds alternating the two (CUDA events; median and
               min of each and of the same-round ratio; the host's load average) and peak memory;
               ASCender's fwd+bwd also captured in a CUDA graph and replayed (time without launch overhead)
    training   one-rank training throughput (tokens/s) and MFU of the gpt / ascender / connection
               presets through the real trainer (``benchmarks/scaling.py``'s worker), bf16
    nccl       a 2-rank data-parallel training run when two GPUs exist (gloo on CPU in the dry run),
               otherwise one skip line

Files (in ``--out``): ``summary.{json,md}`` (machine: device name, torch / triton / CUDA versions, driver, the
packages' versions, git commit and dirty state, date; every section's status, time and budget; rewritten before and after each
section, unfinished ones marked, so a run killed at its time limit leaves a true summary) and
``<section>.{json,md}`` (+ ``attention.png`` when matplotlib is installed); ``--archive FILE.tar.gz``: the
same files in one archive, rewritten each time the summary is. The dry run writes the same files and claims
no GPU (device ``cpu``, no MFU, no CUDA memory, no driver).

A copy of the tree without its ``.git`` (a lent GPU machine) is named by ``ASCENDER_SOURCE_COMMIT=<hash>``
and, when known, ``ASCENDER_SOURCE_DIRTY=1`` or ``0`` (uncommitted changes travelled with the copy, or not);
without the latter its dirty state is recorded as unknown (``machine.py``).
"""
