"""Ablation grids: every variant x seed is a real training run; paired statistics against a baseline.

    ascender-dist ablate configs/ablations/bias.yaml [--set train.train_steps=50] [--seeds 1,2]
                         [--only gpt,ascender] [--jobs 2] [--threads 1] [--report-only] [--dry-run]
                         [--ranks 8] [--hostfile FILE | --slurm] [--allow-mixed-commits]
    ascender-dist tables benchmarks/results/research/bias          (rebuild a report, no training)
    python -m ascender_dist.research.ablate configs/ablations/bias.yaml      (the same)

A grid file (``configs/ablations/*.yaml``)::

    name: bias                        # names the default output directories
    base: ../demo.yaml                # run config: inline mapping, a run-config YAML (relative to this
                                      #   file), or another grid file (its base + set + dataset)
    set: {train.train_steps: 300}     # dotted overrides applied to ``base`` for every run
    dataset:                          # optional: build corpus + tokenizer + shards once, point data.* at them
      {root: runs/ablations/data, corpus_bytes: 3000000, vocab_size: 2048, seq_length: 128}
    seeds: [1, 2, 3]                  # train.seed of every run: init AND data order (see below)
    baseline: gpt                     # a variant name; every other variant is compared with it
    compare_to: [ascender]            # optional further references (e.g. bias removal vs all-on)
    variants:                         # a named axis: option name -> dotted overrides
      gpt: {model.architecture: gpt}
      ascender: {model.architecture: ascender}
    axes:                             # crossed with the variants, all combinations
      model.ascender.k: [4, 8]        #   list: a dotted path and its values (name "k=4")
      taus:                           #   mapping: a named axis, option -> dotted overrides
        tau0.5: {model.ascender.tau_sep: 0.5, model.ascender.tau_coh: 0.5}
    standalone:                       # extra variants NOT crossed with the axes (e.g. a GPT baseline
      gpt: {model.architecture: gpt}  #   next to a grid over ASCender options)
    eval_iters: 32                    # validation micro-batches (in all) of the final val loss ("all": whole split)
    ranks: 1                          # ranks per run (per node with --hostfile / --slurm)
    equal_flops_of: gpt               # optional: steps per variant for equal training FLOPs
    runs_dir: runs/ablations/bias     # run directories (checkpoints, logs): large, not committed
    report_dir: runs/ablations/bias/report   # results.{json,md} and the figures

Variant names join the option names of every axis with ``,`` (``ascender,k=4,tau0.5``). Every
override path is checked against the run-config schema before anything runs, so a typo fails in one
line naming the grid file and the path.

**Pairing.** ``data_pipeline.StreamingLoader`` is seeded with ``train.seed`` (the trainer passes
``seed=cfg.train.seed``), so the training data order is a function of (seed, dataset, sequence length,
global batch size, data-parallel size). All variants of one seed therefore read the same batches in
the same order, which is what the paired tests assume; each run records a sha256 of every training
token it consumed (``data_sha256``) and the report checks that it agrees across the variants of a seed.
An axis that changes the data (``data.*``, ``model.seq_length``, ``train.global_batch_size``) breaks
the pairing: the report says so. The validation split is read unshuffled, so every run scores the
same validation sequences in the same order (the per-example comparison relies on it).

**Runs.** Each (variant, seed) is started through the ``deepspeed`` launcher, as training is
(``launch.py``: ``--ranks`` per node, GPUs when CUDA is present, ``--hostfile``, ``--slurm``), running
``run_entry.py --run-one`` on every rank: ``Trainer(cfg).fit()`` with callbacks that time the steps,
hash the training tokens and keep the validation curve, then ``Trainer.validate()`` over ``eval_iters``
micro-batches in all while a callback keeps each sequence's loss; rank 0 gathers them in validation order with a
document id per window and writes ``result.json`` (with its provenance: git commit, dirty flag,
command, versions, config and data hashes). A run whose ``result.json`` exists is skipped (resumable);
a run directory without one is wiped and run again. ``--dry-run`` lists every run with its cost from
``plan`` and its launch command.

**Report** (``report.py``). ``results.md`` / ``results.json`` / ``per_sequence.npz`` and the figures:
the metric per variant as mean +- std, the paired t interval and t-test over seeds with Holm over each
table (every seed's value and paired difference below 10 seeds), per-sequence comparisons resampling
whole documents, cost, omega and Connection reasoning tables; ``pareto.png``, ``ablation.png``,
``curves.png`` and ``connection.png``. ``ascender-dist tables DIR`` rebuilds them from the committed
files. Records of more than one commit are refused unless ``--allow-mixed-commits`` (then the first
line says so).
"""

from .collect import aggregate, collect_records, cost_table, data_pairing, omega_table, per_example_table  # noqa: F401
from .grid import (  # noqa: F401
    RESULT, AblationError, Grid, Variant, check_config_path, dotted_to_tree, ensure_dataset, expand_variants,
    load_grid, run_config, run_config_raw, run_dir,
)
from .launch import _status_kib, launch_run, run_grid, run_one  # noqa: F401
from .main import ablate_main  # noqa: F401
from .report import plot_ablation, plot_curves, plot_pareto, write_report  # noqa: F401
