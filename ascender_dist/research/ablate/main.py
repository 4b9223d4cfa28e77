"""The ``ascender-dist ablate`` command line (and the child mode that trains one run)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Optional, Sequence


from ascender_dist.config.errors import ConfigError, UserError
from ascender_dist.logs import setup_cli_logging

from .collect import collect_records
from .grid import RESULT, AblationError, ensure_dataset, load_grid, run_config, run_dir
from .launch import (Launcher, check_layouts, child_args, launch_command, run_grid, run_one, runs_stopped_on_signals,
                     slurm_prelude)
from .provenance import commit_label, commits_of, mixed_inputs_line, mixed_version_line
from .report import rebuild, write_report



# ============================================================================ CLI

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ascender-dist ablate", description=__doc__.split("\n\n")[0])
    p.add_argument("grid", nargs="?", help="grid YAML (configs/ablations/*.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a run-config field for every run, e.g. --set train.train_steps=20")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (replaces the grid's)")
    p.add_argument("--only", default=None, help="comma-separated variant names to run/report (with the grid's "
                                                "baseline and the variants they compare to); an axes grid's "
                                                "names hold commas themselves and are matched whole")
    p.add_argument("--jobs", type=int, default=None, help="runs at a time (default: grid 'jobs', else 1)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per run (default: grid 'threads', else 1)")
    p.add_argument("--runs-dir", default=None, help="override the grid's runs_dir (the report then goes to "
                                                    "RUNS_DIR/report unless --report-dir says otherwise)")
    p.add_argument("--report-dir", default=None, help="override the grid's report_dir")
    p.add_argument("--report-only", action="store_true", help="write the report from the finished runs only")
    p.add_argument("--dry-run", action="store_true",
                   help="check the grid; list every run, its estimated cost (plan) and launch command; train nothing")
    p.add_argument("--ranks", type=int, default=None,
                   help="ranks per run (per node with --hostfile/--slurm; default: grid 'ranks', else 1)")
    p.add_argument("--hostfile", default=None, help="DeepSpeed hostfile: runs span its hosts (ssh/pdsh mode)")
    p.add_argument("--slurm", action="store_true",
                   help="start each run with srun over the current SLURM allocation (one launcher per node)")
    p.add_argument("--master-addr", default=None, help="rendezvous host with --hostfile/--slurm")
    p.add_argument("--allow-mixed-commits", action="store_true",
                   help="report records of different git commits or library versions (the report's first line says so)")
    p.add_argument("--n-resamples", type=int, default=10_000)
    p.add_argument("--no-progress", action="store_true")
    # child mode
    p.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--eval-iters", default=None, help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # the deepspeed launcher's
    return p


def estimate(grid, variant, seed, ranks: int, world: int) -> str:
    """One-line cost estimate of a run from ``plan`` (analytic FLOPs; time on ``world`` H100s, ``ranks``
    per node, at 40% MFU: a GPU estimate, CPU runs take far longer)."""
    from ascender_dist.tools.plan import DEFAULT_VOCAB_SIZE, ClusterShape, plan

    cfg = run_config(grid, variant, seed)
    vocab = cfg.model.vocab_size or int((grid.dataset or {}).get("vocab_size") or DEFAULT_VOCAB_SIZE)
    shape = ClusterShape(nodes=world // ranks, gpus_per_node=ranks) if world % ranks == 0 else \
        ClusterShape(nodes=1, gpus_per_node=world)
    try:
        p = plan(cfg, shape, vocab_size=vocab)
    except ConfigError as exc:
        return f"plan: {exc}"
    return (f"{p.flops_per_token * p.tokens:.3g} training FLOPs, {p.total_params:,} params, "
            f"{p.memory.total / 2**30:.2f} GiB/GPU, ~{p.train_seconds:.3g} s on {world} H100 at 40% MFU")


def dry_run(grid, launcher: Launcher, jobs: Optional[int] = None) -> None:
    """Every run: name, seed, directory, done/pending, estimated cost, launch command, overrides."""
    port, jobs, k = 29500, max(1, jobs or grid.jobs), 0
    launcher.check_jobs(jobs)
    for s in grid.seeds:
        for v in grid.variants:
            directory = run_dir(grid, v, s)
            done = (directory / RESULT).exists()
            # job slots are taken as runs finish; the dry run shows them round robin
            cmd = shlex.join(launch_command(launcher, child_args(grid, v, s), port, k % jobs))
            k += 0 if done else 1
            print(f"{v.name}\tseed {s}\t{directory}\t{'done' if done else 'pending'}\t"
                  f"{estimate(grid, v, s, launcher.ranks, launcher.world_size())}\t{json.dumps(v.overrides)}")
            if launcher.slurm and not launcher.hostfile:
                cmd = slurm_prelude(directory, launcher.ranks, launcher.master_addr) + "; " + cmd
            print(f"    {cmd}")


def _child_main(args) -> int:
    from ascender_dist.logs import quiet_library_warnings

    quiet_library_warnings()
    setup_cli_logging()
    eval_iters = args.eval_iters
    if eval_iters is not None and eval_iters != "all":
        eval_iters = int(eval_iters)
    run_one(Path(args.run_one), Path(args.result), eval_iters)
    # end torch.distributed on every rank together, as the trainer's command does: a group left to
    # interpreter exit is torn down by each rank alone, and a rank > 0 (it returns before rank 0 has
    # written the result) died there with SIGABRT ("terminate called without an active exception")
    # in a CI run, which failed the run
    from ascender_dist.parallel.setup import shutdown_process_group

    shutdown_process_group()
    return 0


def _owns(setting: str, value, key: str) -> bool:
    """Whether a variant's ``setting`` (= ``value``) replaces what a --set of ``key`` writes: the same
    field, one inside it, or a list (any value but a mapping, which merges) that holds it."""
    if setting == key or setting.startswith((f"{key}.", f"{key}[")):
        return True
    return key.startswith((f"{setting}.", f"{setting}[")) and not isinstance(value, dict)


def _note_overridden_sets(grid, overrides: Sequence[str]) -> None:
    """A --set of a field that variants set too applies only to the others (a variant's own value
    wins): said once per such --set, not left to be found in the results."""
    from ascender_dist.config.loader import override_key

    for text in overrides:
        key = override_key(text)
        if key in grid.derived:  # e.g. equal_flops_of's steps per variant: computed from the --set value
            continue
        owners = [v.name for v in grid.variants if any(_owns(k, value, key) for k, value in v.overrides.items())]
        if owners:
            print(f"note: --set {text} does not apply to {', '.join(owners)}, which set {key} themselves",
                  file=sys.stderr)


def ablate_main(argv: Optional[Sequence[str]] = None) -> int:
    """``ascender-dist ablate``: run (or resume) a grid, then write its report. Exit 2 on a user error."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.run_one:
        return _child_main(args)
    if not args.grid:
        print("error: a grid file is required (configs/ablations/*.yaml)", file=sys.stderr)
        return 2
    setup_cli_logging()
    try:
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds is not None else None
    except ValueError:
        print(f"error: --seeds: expected comma-separated integers, got {args.seeds!r}", file=sys.stderr)
        return 2
    for flag in ("jobs", "ranks", "threads"):  # 0 or less would fall back to the grid's value unnoticed
        value = getattr(args, flag)
        if value is not None and value < 1:
            print(f"error: --{flag} must be >= 1 (got {value})", file=sys.stderr)
            return 2
    if args.n_resamples < 1:  # read only by the report, after every run has trained
        print(f"error: --n-resamples must be >= 1 (got {args.n_resamples})", file=sys.stderr)
        return 2
    try:
        grid = load_grid(args.grid, args.overrides, seeds, args.only.split(",") if args.only else None)
        if (args.only or args.seeds) and not (args.runs_dir or args.report_dir) and not args.dry_run:
            raise ConfigError("--only" if args.only else "--seeds",
                              f"reports a part of the grid, which would replace its full report in "
                              f"{grid.report_dir}: give --report-dir (or --runs-dir) for this part")
        if args.runs_dir:  # another set of runs: never the grid's own report
            grid.runs_dir = Path(args.runs_dir)
            grid.report_dir = grid.runs_dir / "report"
        if args.report_dir:
            grid.report_dir = Path(args.report_dir)
        _note_overridden_sets(grid, args.overrides)
        launcher = Launcher(ranks=max(1, args.ranks or grid.ranks), hostfile=args.hostfile, slurm=args.slurm,
                            master_addr=args.master_addr)
        jobs = args.jobs
        if jobs is None and (args.hostfile or args.slurm):
            jobs = 1  # each run spans the hosts; the grid's own `jobs` is for one host
        if args.dry_run or not args.report_only:
            check_layouts(grid, launcher.world_size())  # before any dataset is built or run started
        if args.dry_run:
            dry_run(grid, launcher, jobs)
            return 0
        if not args.report_only:
            if grid.dataset is not None:
                ensure_dataset(grid.dataset)
            with runs_stopped_on_signals():
                run_grid(grid, jobs, args.threads, progress=not args.no_progress, launcher=launcher)
        records = collect_records(grid)
        if not records:
            print(f"error: {grid.runs_dir}: no finished runs to report", file=sys.stderr)
            return 2
        if not any(r.get("config") == grid.baseline for r in records):  # every comparison is against it
            print(f"error: {grid.runs_dir}: the baseline {grid.baseline!r} has no finished run to compare with "
                  "(run it first)", file=sys.stderr)
            return 2
        by_commit = commits_of(records)  # one clean or dirty commit: reported in the first line, not refused
        if (len(by_commit) > 1 or "unrecorded" in by_commit) and not args.allow_mixed_commits:
            commits = ", ".join(f"{commit_label(c)}: {len(r)} runs" for c, r in by_commit.items())
            print(f"error: {grid.runs_dir}: records of more than one commit, or without one ({commits}); "
                  "re-run them on one commit, or pass --allow-mixed-commits", file=sys.stderr)
            return 2
        mixed = mixed_version_line(records) or mixed_inputs_line(records)
        if mixed and not args.allow_mixed_commits:
            print(f"error: {grid.runs_dir}: {mixed.strip('*')} (or pass --allow-mixed-commits)", file=sys.stderr)
            return 2
        write_report(grid, records, n_resamples=args.n_resamples, n_permutations=args.n_resamples)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {grid.report_dir}/results.md, results.json, per_sequence.npz and the figures")
    return 0


def tables_main(argv: Optional[Sequence[str]] = None) -> int:
    """``ascender-dist tables DIR``: rebuild DIR's results.md, results.json and figures from its
    results.json and per_sequence.npz, without training. Exit 2 on a user error."""
    description = " ".join(tables_main.__doc__.split("\n\n")[0].split())  # the first paragraph, one line
    p = argparse.ArgumentParser(prog="ascender-dist tables", description=description)
    p.add_argument("directory", help="a report directory (results.json, per_sequence.npz); with --index, a folder "
                                     "of report directories")
    p.add_argument("--n-resamples", type=int, default=10_000)
    p.add_argument("--index", action="store_true",
                   help="write DIRECTORY/results.md, the index of the reports below it (run commits, state of the "
                        "code since, every comparison), from their results.json alone")
    p.add_argument("--grids", default="configs/ablations", help="with --index: the grid YAMLs, to list those not run")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.n_resamples < 1:
        p.error(f"--n-resamples must be >= 1 (got {args.n_resamples})")
    setup_cli_logging()
    directory = Path(args.directory)
    if args.index:
        if not Path(args.grids).is_dir():  # the index lists the grids not run from there: none would be listed
            print(f"error: --grids {args.grids}: not a directory of grid YAMLs", file=sys.stderr)
            return 2
        return _index_main(directory, Path(args.grids))
    if not (directory / "results.json").is_file():
        print(f"error: {directory / 'results.json'}: not found (a report directory written by ablate)",
              file=sys.stderr)
        return 2
    try:
        full = rebuild(directory, n_resamples=args.n_resamples, n_permutations=args.n_resamples)
    except AblationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (KeyError, ValueError) as exc:
        print(f"error: {directory / 'results.json'}: not a results.json written by ablate ({exc})", file=sys.stderr)
        return 2
    if full.get("mixed_commits"):
        print(full["mixed_commits"].strip("*"), file=sys.stderr)
    print(f"wrote {directory}/results.md, results.json and the figures")
    return 0


def _index_main(directory: Path, grids: Path) -> int:
    from .index import write_index

    try:
        out = write_index(directory, grids)
    except AblationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
