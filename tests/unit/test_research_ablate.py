"""Ablation grids: expansion into variants, one-line errors for bad paths, aggregation of run records.

No training here (tests/integration/test_research_figures.py runs a real grid end to end).
"""

import json
import math
import shlex
from pathlib import Path

import numpy as np
import pytest

from ascender_dist.config.errors import ConfigError
from ascender_dist.config.loader import to_dict
from ascender_dist.research import ablate
from ascender_dist.research.ablate import aggregate, expand_variants, load_grid

REPO = Path(__file__).resolve().parents[2]

BASE = {"model": {"architecture": "gpt", "preset": "debug", "vocab_size": 512},
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "train_steps": 5},
        "optimizer": {"warmup_steps": 1},
        "data": {"manifest": "data/manifest.json", "tokenizer": "data/tok.model"}}


def _write_grid(tmp_path, **grid) -> Path:
    import yaml

    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump({"name": "g", "base": BASE, **grid}, sort_keys=False))
    return path


# --------------------------------------------------------------------------------------- expansion


def test_all_combinations_of_three_boolean_axes():
    axes = {f"model.ascender.use_{b}": [True, False] for b in ("align", "sep", "coh")}
    variants = expand_variants({"asc": {"model.architecture": "ascender"}}, axes)
    assert len(variants) == 8
    names = [v.name for v in variants]
    assert len(set(names)) == 8
    assert names[0] == "asc,use_align=true,use_sep=true,use_coh=true"
    assert names[-1] == "asc,use_align=false,use_sep=false,use_coh=false"
    combos = {tuple(v.overrides[f"model.ascender.use_{b}"] for b in ("align", "sep", "coh")) for v in variants}
    assert combos == {(a, s, c) for a in (True, False) for s in (True, False) for c in (True, False)}
    assert all(v.overrides["model.architecture"] == "ascender" for v in variants)


def test_named_variants_alone_keep_their_names_and_order():
    variants = expand_variants({"gpt": {"model.architecture": "gpt"}, "asc": {"model.architecture": "ascender"},
                                "no_sep": {"model.architecture": "ascender", "model.ascender.use_sep": False}}, None)
    assert [v.name for v in variants] == ["gpt", "asc", "no_sep"]
    assert variants[2].overrides == {"model.architecture": "ascender", "model.ascender.use_sep": False}


def test_named_axis_and_value_axis_cross_with_variants():
    variants = expand_variants(
        {"gpt": {}, "asc": {"model.architecture": "ascender"}},
        {"model.ascender.k": [4, 8], "taus": {"t0.5": {"model.ascender.tau_sep": 0.5, "model.ascender.tau_coh": 0.5},
                                              "t2": {"model.ascender.tau_sep": 2.0, "model.ascender.tau_coh": 2.0}}})
    assert [v.name for v in variants][:4] == ["gpt,k=4,t0.5", "gpt,k=4,t2", "gpt,k=8,t0.5", "gpt,k=8,t2"]
    assert len(variants) == 8
    last = variants[-1]
    assert last.name == "asc,k=8,t2"
    assert last.overrides == {"model.architecture": "ascender", "model.ascender.k": 8,
                              "model.ascender.tau_sep": 2.0, "model.ascender.tau_coh": 2.0}


def test_axes_sharing_a_last_component_are_named_by_full_path():
    variants = expand_variants(None, {"model.ascender.causal": [True], "model.connection.causal": [True, False]})
    assert [v.name for v in variants] == ["model.ascender.causal=true,model.connection.causal=true",
                                          "model.ascender.causal=true,model.connection.causal=false"]


def test_no_variants_and_no_axes_is_one_base_variant():
    assert [v.name for v in expand_variants(None, None)] == ["base"]


@pytest.mark.parametrize("variants,axes,where,field", [
    (None, {"model.ascender.use_algn": [True, False]}, "g.yaml: axes.model.ascender.use_algn", "use_algn"),
    ({"a": {"model.ascendr.k": 4}}, None, "g.yaml: variants.a.model.ascendr.k", "ascendr"),
    (None, {"taus": {"t1": {"model.ascender.tau_sepp": 1.0}}}, "g.yaml: axes.taus.t1.model.ascender.tau_sepp",
     "tau_sepp"),
    (None, {"train.seed.x": [1]}, "g.yaml: axes.train.seed.x", None),
])
def test_invalid_axis_path_is_one_line_config_error_naming_it(variants, axes, where, field):
    with pytest.raises(ConfigError) as info:
        expand_variants(variants, axes, "g.yaml")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(where + ": ")
    if field:
        assert f"unknown config field {field!r}" in message


def test_typo_hint_names_the_intended_field():
    with pytest.raises(ConfigError, match=r"did you mean 'use_align'\?"):
        expand_variants(None, {"model.ascender.use_algn": [True]}, "g.yaml")


# ------------------------------------------------------------------------------------ grid files


def test_load_grid_checks_every_variant_config(tmp_path):
    path = _write_grid(tmp_path, seeds=[1, 2, 3], baseline="gpt", compare_to=["asc"],
                       variants={"gpt": {"model.architecture": "gpt"}, "asc": {"model.architecture": "ascender"}},
                       axes={"optimizer.lr": [1e-3, 2e-3]})
    # the baseline must be an expanded name
    with pytest.raises(ConfigError, match=r"baseline: 'gpt' is not a variant"):
        load_grid(path)
    path = _write_grid(tmp_path, seeds=[1, 2, 3], baseline="gpt,lr=0.001",
                       variants={"gpt": {"model.architecture": "gpt"}, "asc": {"model.architecture": "ascender"}},
                       axes={"optimizer.lr": [1e-3, 2e-3]})
    grid = load_grid(path)
    assert [v.name for v in grid.variants] == ["gpt,lr=0.001", "gpt,lr=0.002", "asc,lr=0.001", "asc,lr=0.002"]
    assert grid.seeds == [1, 2, 3] and grid.data_order_axes == []
    assert grid.runs_dir == Path("runs/ablations/g")


def test_bad_value_names_grid_variant_and_field(tmp_path):
    path = _write_grid(tmp_path, variants={"asc": {"model.architecture": "ascender", "model.ascender.k": 99}})
    with pytest.raises(ConfigError) as info:
        load_grid(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: variant asc: model.ascender.k: must be <= window")


def test_unknown_grid_key_and_bad_seeds(tmp_path):
    with pytest.raises(ConfigError, match=r"grid.yaml: seed: unknown grid key"):
        load_grid(_write_grid(tmp_path, seed=[1]))
    with pytest.raises(ConfigError, match=r"seeds: duplicate seeds"):
        load_grid(_write_grid(tmp_path, seeds=[1, 1]))


@pytest.mark.parametrize("argv,expected", [
    (["--seeds", "1,1"], "error: --seeds: duplicate seeds in [1, 1]"),
    (["--seeds", ""], "error: --seeds: expected comma-separated integers, got ''"),
    (["--jobs", "0"], "error: --jobs must be >= 1 (got 0)"),
    (["--ranks", "-2"], "error: --ranks must be >= 1 (got -2)"),
    (["--threads", "0"], "error: --threads must be >= 1 (got 0)"),
], ids=["dup-seeds", "empty-seeds", "jobs-0", "ranks-neg", "threads-0"])
def test_ablate_command_line_values_are_checked_like_the_grids_own(tmp_path, capsys, argv, expected):
    """--seeds 1,1 ran every variant twice into one run directory (the grid's own seeds: [1, 1] is
    refused); --jobs / --ranks / --threads 0 or less and --seeds '' fell back to the grid's values."""
    from ascender_dist.research.ablate import main as ablate_main_module

    assert ablate_main_module.ablate_main([str(_write_grid(tmp_path)), "--dry-run", *argv]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == expected and err.count("\n") == 1, err


@pytest.mark.parametrize("grid,expected", [
    ({"keep_checkpoints": "no"}, "keep_checkpoints: expected true or false, got 'no'"),
    ({"jobs": 2.9}, "jobs: expected a positive integer, got 2.9"),
    ({"threads": "1e3"}, "threads: expected a positive integer, got 1000.0"),  # YAML 1.2 reads 1e3 as a float
    ({"ranks": [2]}, "ranks: expected a positive integer, got [2]"),
    ({"dataset": {"root": "d", "val_fraction": 1.5}}, "dataset.val_fraction: expected a number in (0, 1), got 1.5"),
    ({"dataset": {"root": "d", "corpus_bytes": "3e5"}}, "dataset.corpus_bytes: expected a positive integer, got 300000.0"),
], ids=["keep-no", "jobs-float", "threads-str", "ranks-list", "val-fraction", "corpus-str"])
def test_the_grids_own_keys_are_typed_strictly(tmp_path, grid, expected):
    """bool('no') is True and int(2.9) is 2: such values changed what the grid did without a word."""
    with pytest.raises(ConfigError) as info:
        load_grid(_write_grid(tmp_path, **grid))
    assert str(info.value).endswith(expected) and "\n" not in str(info.value), str(info.value)


def test_a_metric_no_run_records_is_refused_before_any_run(tmp_path):
    """`metric: val_los` passed --dry-run and ended the report in a KeyError traceback after every run trained."""
    with pytest.raises(ConfigError) as info:
        load_grid(_write_grid(tmp_path, metric="val_los"))
    assert str(info.value).startswith(f"{tmp_path / 'grid.yaml'}: metric: 'val_los' is not a number each run "
                                      "records; one of val_loss, ")
    assert load_grid(_write_grid(tmp_path, metric="final_train_loss")).metric == "final_train_loss"


@pytest.mark.parametrize("axes,base_model,same", [
    ({"model.ascender.k": [4, 8]}, {}, "model.ascender.k"),  # a gpt model: no 'S' layer reads it
    ({"model.connection.rank": [4, 8]}, {"architecture": "connection", "connection": {"connection": "linear"}},
     "model.connection.rank"),
], ids=["ascender-setting-of-gpt", "rank-under-linear"])
def test_variants_that_differ_only_in_settings_their_models_never_read_are_refused(tmp_path, axes, base_model, same):
    """Such a grid trained the same runs under two labels and reported the seed noise as an effect."""
    base = {**BASE, "model": {**BASE["model"], **base_model}}
    path = tmp_path / "grid.yaml"
    import yaml

    path.write_text(yaml.safe_dump({"name": "g", "base": base, "axes": axes}, sort_keys=False))
    with pytest.raises(ConfigError) as info:
        load_grid(path)
    message = str(info.value)
    assert message.startswith(f"{path}: variant ") and f"differ only in {same}, which these models never read" in message
    with pytest.raises(ConfigError, match=r"variant b: trains the same runs as variant a: they have the same settings$"):
        load_grid(_write_grid(tmp_path, variants={"a": {}, "b": {}}))
    # a setting the model reads, varied in the same way, is a grid
    path.write_text(yaml.safe_dump({"name": "g", "base": {**base, "model": {**base["model"], "architecture": "ascender"}},
                                    "axes": {"model.ascender.k": [4, 8]}}, sort_keys=False))
    assert len(load_grid(path).variants) == 2


def test_a_variant_named_with_dots_only_stays_inside_runs_dir(tmp_path):
    from ascender_dist.research.ablate.grid import _safe, run_dir

    grid = load_grid(_write_grid(tmp_path, standalone={"..": {}}))
    out = run_dir(grid, grid.variants[0], 1)
    assert out == grid.runs_dir / "__" / "seed1"  # not runs_dir/../seed1
    assert _safe(".") == "_" and _safe("") == "_" and _safe("a.b") == "a.b" and _safe("...x") == "...x"


def test_same_seed_means_same_data_settings_for_every_variant(tmp_path):
    """The loader is seeded by train.seed: for one seed, all variants share seed and data section."""
    path = _write_grid(tmp_path, seeds=[1, 2], variants={"asc": {"model.architecture": "ascender"}},
                       axes={"model.ascender.use_sep": [True, False]}, standalone={"gpt": {}})
    grid = load_grid(path)
    for seed in grid.seeds:
        cfgs = [ablate.run_config(grid, v, seed) for v in grid.variants]
        assert {c.train.seed for c in cfgs} == {seed}
        assert len({json.dumps(to_dict(c.data)) for c in cfgs}) == 1
        assert len({(c.model.seq_length, c.train.global_batch_size, c.train.micro_batch_size) for c in cfgs}) == 1
        assert len({c.output_dir for c in cfgs}) == len(cfgs)  # one directory per run


def test_axis_over_data_settings_is_flagged(tmp_path):
    grid = load_grid(_write_grid(tmp_path, axes={"train.global_batch_size": [4, 8]}))
    assert grid.data_order_axes == ["train.global_batch_size"]


def test_dataset_section_points_data_at_the_built_files(tmp_path):
    grid = load_grid(_write_grid(tmp_path, dataset={"root": "runs/x/data", "vocab_size": 512}))
    cfg = ablate.run_config(grid, grid.variants[0], 1)
    assert cfg.data.manifest == "runs/x/data/shards/manifest.json"
    assert cfg.data.tokenizer == "runs/x/data/tokenizer.model"


def test_base_may_be_a_path_relative_to_the_grid(tmp_path):
    import yaml

    (tmp_path / "base.yaml").write_text(yaml.safe_dump(BASE))
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump({"base": "base.yaml", "set": {"train.train_steps": 7}}))
    grid = load_grid(path, overrides=["optimizer.lr=5e-4"])
    cfg = ablate.run_config(grid, grid.variants[0], 3)
    assert cfg.train.train_steps == 7 and cfg.optimizer.lr == 5e-4 and cfg.train.seed == 3


def test_standalone_variants_are_not_crossed_and_base_can_be_another_grid(tmp_path):
    import yaml

    (tmp_path / "inner.yaml").write_text(yaml.safe_dump(
        {"name": "inner", "base": BASE, "set": {"train.train_steps": 9}, "seeds": [1], "variants": {"a": {}}}))
    outer = tmp_path / "outer.yaml"
    outer.write_text(yaml.safe_dump({"base": "inner.yaml", "set": {"model.architecture": "ascender"},
                                     "axes": {"model.ascender.use_sep": [True, False]},
                                     "standalone": {"gpt": {"model.architecture": "gpt"}}, "baseline": "gpt"}))
    grid = load_grid(outer)
    assert [v.name for v in grid.variants] == ["use_sep=true", "use_sep=false", "gpt"]
    cfgs = {v.name: ablate.run_config(grid, v, 1) for v in grid.variants}
    assert cfgs["gpt"].model.architecture == "gpt" and cfgs["use_sep=false"].model.architecture == "ascender"
    assert cfgs["use_sep=false"].model.ascender.use_sep is False
    assert {c.train.train_steps for c in cfgs.values()} == {9}
    outer.write_text(yaml.safe_dump({"base": "inner.yaml", "standalone": {"gpt": {"model.archtecture": "gpt"}}}))
    with pytest.raises(ConfigError, match=r"standalone.gpt.model.archtecture: unknown config field"):
        load_grid(outer)


@pytest.mark.parametrize("grid_file", sorted((REPO / "configs" / "ablations").glob("*.yaml")), ids=lambda p: p.name)
def test_committed_grids_load(grid_file):
    grid = load_grid(grid_file)
    assert grid.variants and grid.seeds
    assert grid.baseline in [v.name for v in grid.variants]


def test_cli_bad_path_exits_2_with_one_line(tmp_path, capsys):
    path = _write_grid(tmp_path, axes={"model.ascender.kk": [4]})
    assert ablate.ablate_main([str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "axes.model.ascender.kk" in err and err.startswith("error: ")


def test_cli_dry_run_lists_every_run(tmp_path, capsys):
    path = _write_grid(tmp_path, seeds=[1, 2], variants={"gpt": {}, "asc": {"model.architecture": "ascender"}})
    assert ablate.ablate_main([str(path), "--dry-run", "--runs-dir", str(tmp_path / "runs"), "--ranks", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    lines, commands = out[0::2], out[1::2]
    assert [tuple(line.split("\t")[:2]) for line in lines] == [("gpt", "seed 1"), ("asc", "seed 1"),
                                                               ("gpt", "seed 2"), ("asc", "seed 2")]
    assert all("pending" in line and "training FLOPs" in line and "on 2 H100" in line for line in lines)
    first = shlex.split(commands[0])
    assert Path(first[0]).name == "deepspeed" and first[1:5] == ["--hostfile", "/dev/null", "--num_accelerators", "2"]
    assert first[first.index("--run-one") + 1] == str(tmp_path / "runs" / "gpt" / "seed1" / "config.yaml")


def test_cli_dry_run_prints_hostfile_and_slurm_commands(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _write_grid(tmp_path, seeds=[1], variants={"gpt": {}})
    Path("hosts").write_text("node-1 slots=1\nnode-2 slots=1  # the second node\n")
    assert ablate.ablate_main([str(path), "--dry-run", "--runs-dir", str(tmp_path / "r"), "--hostfile", "hosts",
                               "--master-addr", "node-1", "--ranks", "4", "--set", "train.global_batch_size=16"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "on 8 H100" in lines[0]  # --ranks on each of the hostfile's hosts (DeepSpeed's --num_accelerators)
    cmd = shlex.split(lines[1])
    assert cmd[1:7] == ["--hostfile", "hosts", "--master_addr", "node-1", "--num_accelerators", "4"]
    assert ablate.ablate_main([str(path), "--dry-run", "--runs-dir", str(tmp_path / "r"), "--slurm"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[1].strip()
    # pasteable inside the allocation: the line first writes the hostfile the command reads
    prelude, mkdir, hostfile, launch = line.split("; ", 3)
    run = tmp_path / "r" / "gpt" / "seed1"
    assert prelude.startswith(f"export ABLATE_HOSTFILE={run / 'hostfile'} ABLATE_MASTER_ADDR=$(scontrol show")
    assert mkdir == f"mkdir -p {run}"
    assert hostfile == 'scontrol show hostnames "$SLURM_JOB_NODELIST" | sed \'s/$/ slots=1/\' > "$ABLATE_HOSTFILE"'
    cmd = shlex.split(launch)
    assert cmd[:5] == ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "bash", "-c"]
    inner = cmd[5]
    for part in ("--hostfile $ABLATE_HOSTFILE", "--no_ssh", "--node_rank $SLURM_NODEID",
                 "--master_addr $ABLATE_MASTER_ADDR", "run_entry.py --run-one"):
        assert part in inner


def test_a_layout_no_run_can_take_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    """docs/research.md's `--ranks 8` on bias.yaml (global batch 16 = 8 x 2) failed in every run, one
    after another after each launch, while --dry-run exited 0 and a hostfile's node count was ignored."""
    monkeypatch.chdir(tmp_path)
    path = _write_grid(tmp_path, seeds=[1], variants={"gpt": {}, "asc": {"model.architecture": "ascender"}})
    monkeypatch.setattr("ascender_dist.research.ablate.main.ensure_dataset", lambda *a: pytest.fail("data built"))
    monkeypatch.setattr("ascender_dist.research.ablate.main.run_grid", lambda *a, **k: pytest.fail("runs started"))
    for extra, world in ((["--ranks", "8"], 8), (["--dry-run", "--ranks", "8"], 8)):
        assert ablate.ablate_main([str(path), "--runs-dir", "r", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"error: gpt seed 1 on {world} ranks: train.global_batch_size: 4 is not a multiple of "
                       f"micro_batch_size x data-parallel size = 2 x {world}"), err
    Path("hosts").write_text("node-1 slots=8 max_slots=8\nnode-2 slots=8\n")  # slots: DeepSpeed's, not ours
    assert ablate.ablate_main([str(path), "--dry-run", "--runs-dir", "r", "--hostfile", "hosts"]) == 0
    capsys.readouterr()
    assert ablate.ablate_main([str(path), "--dry-run", "--runs-dir", "r", "--hostfile", "hosts", "--ranks", "2"]) == 2
    assert "gpt seed 1 on 4 ranks: " in capsys.readouterr().err
    Path("hosts").write_text("node-1\n")
    assert ablate.ablate_main([str(path), "--dry-run", "--runs-dir", "r", "--hostfile", "hosts"]) == 2
    assert capsys.readouterr().err.strip() == "error: hosts:1: expected '<host> slots=<N>', got 'node-1'"


def test_a_failed_run_starts_no_queued_run(tmp_path, monkeypatch):
    from ascender_dist.research.ablate import launch

    grid = load_grid(_write_grid(tmp_path, seeds=[1, 2], variants={"gpt": {}, "asc": {"model.architecture": "ascender"}}))
    grid.runs_dir = tmp_path / "runs"
    started = []

    def failing(grid_, v, s, *rest):
        started.append((v.name, s))
        raise ablate.AblationError(f"{v.name} seed {s}: run failed")

    monkeypatch.setattr(launch, "launch_run", failing)
    with pytest.raises(ablate.AblationError, match="gpt seed 1: run failed"):
        launch.run_grid(grid, jobs=1, progress=False, launcher=launch.Launcher(cuda=False))
    assert started == [("gpt", 1)]  # three more were queued


def test_a_hostfile_run_takes_one_job_at_a_time_whatever_the_grid_says(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("ascender_dist.research.ablate.launch.Launcher.use_cuda", lambda self: True)
    path = _write_grid(tmp_path, seeds=[1], variants={"gpt": {}}, jobs=2)
    Path("hosts").write_text("node-1 slots=1\nnode-2 slots=1\n")
    assert ablate.ablate_main([str(path), "--dry-run", "--runs-dir", "r", "--hostfile", "hosts"]) == 0, \
        capsys.readouterr().err
    assert ablate.ablate_main([str(path), "--dry-run", "--runs-dir", "r", "--hostfile", "hosts", "--jobs", "2"]) == 2


def test_concurrent_gpu_runs_get_disjoint_devices(monkeypatch, caplog):
    from ascender_dist.research.ablate.launch import Launcher, launch_command

    gpu = Launcher(ranks=2, cuda=True, gpu_ids=list(range(6)))
    cmds = [launch_command(gpu, ["--run-one", "c.yaml"], 29500, slot) for slot in range(3)]
    assert [c[c.index("--include") + 1] for c in cmds] == ["localhost:0,1", "localhost:2,3", "localhost:4,5"]
    assert not any("--num_accelerators" in c for c in cmds)
    gpu.check_jobs(3)
    assert not caplog.records
    # more slots than GPU groups: slots wrap round (runs share GPUs) and the grid warns
    assert gpu.device_ids(3) == [0, 1] and gpu.device_ids(5) == [4, 5]
    gpu.check_jobs(4)
    assert "concurrent runs share GPUs" in caplog.text
    with pytest.raises(ablate.AblationError, match="--ranks 8 needs 8 GPUs, this host has 6"):
        Launcher(ranks=8, cuda=True, gpu_ids=list(range(6))).device_ids(0)
    with pytest.raises(ablate.AblationError, match="--jobs 2 with --hostfile"):
        Launcher(ranks=2, hostfile="hosts", cuda=True, gpu_ids=list(range(8))).check_jobs(2)
    cpu = Launcher(ranks=2, cuda=False)
    cpu.check_jobs(4)  # CPU processes share the cores, no device to split
    # this machine alone even where DeepSpeed's default hostfile (/job/hostfile) exists
    assert launch_command(cpu, [], 29500, 1)[1:5] == ["--hostfile", "/dev/null", "--num_accelerators", "2"]
    # an allocation that shows some GPUs: slots take the visible ones in groups (--include is physical)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert [Launcher(ranks=2, cuda=True).device_ids(k) for k in (0, 1)] == [[4, 5], [6, 7]]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f3a")
    with pytest.raises(ablate.AblationError, match="not UUIDs"):
        Launcher(ranks=1, cuda=True).device_ids(0)


def test_connection_statistics_add_up_over_data_parallel_ranks():
    from ascender_dist.research.ablate.launch import merge_connection_stats

    rank0 = {"1": {"max_steps": 2, "steps_hist": [0, 1, 5], "slot_load": [1.0, 2.0]}}
    rank1 = {"1": {"max_steps": 2, "steps_hist": [1, 0, 3], "slot_load": [0.5, 4.0]}}
    merged = merge_connection_stats([rank0, rank1])
    assert merged == {"1": {"max_steps": 2, "steps_hist": [1, 1, 8], "slot_load": [1.5, 6.0]}}
    assert merge_connection_stats([rank0]) == rank0 and merge_connection_stats([{}, {}]) == {}


def test_validation_order_and_document_blocks():
    from ascender_dist.research.ablate.launch import document_blocks, order_validation

    # 2 ranks, micro-batch 2: rank 0 reads rows 0,1 then 4,5; rank 1 rows 2,3 then 6,7
    values, index = order_validation([[0, 1, 4, 5], [2, 3, 6, 7]], 2)
    assert values == [0, 1, 2, 3, 4, 5, 6, 7] and index == list(range(8))
    eos = 9
    # packed windows of 6 tokens: a window goes with the document of its middle token (index 3)
    windows = [[1, 2, 9, 3, 4, 5],  # doc 0 ends early: the middle token is in doc 1
               [5, 5, 5, 5, 5, 5],  # doc 1 continues
               [5, 5, 5, 5, 9, 6],  # doc 1 ends after the middle
               [6, 9, 7, 9, 8, 8],  # doc 2 ends before the middle token, which is doc 3's EOS
               [8, 8, 8, 8, 8, 8]]  # doc 4 continues
    assert document_blocks(windows, eos) == [1, 1, 1, 3, 4]
    # no EOS at all: one document; EOS only at window ends: one document per window
    assert document_blocks([[5] * 4] * 3, eos) == [0, 0, 0]
    assert document_blocks([[5, 5, 5, 9]] * 3, eos) == [0, 1, 2]


# ---------------------------------------------------------------------------------- aggregation


def _records():
    """3 configs x 3 seeds; 'asc' is 0.1 lower than 'gpt' on every seed, 'noisy' differs by seed."""
    rng = np.random.default_rng(0)
    examples = {s: rng.normal(5.0, 0.3, 40) for s in (1, 2, 3)}
    shift = {"gpt": {1: 0.0, 2: 0.0, 3: 0.0}, "asc": {1: -0.1, 2: -0.1, 3: -0.1}, "noisy": {1: 0.2, 2: -0.3, 3: 0.05}}
    out = []
    for cfg in ("gpt", "asc", "noisy"):
        for s in (1, 2, 3):
            ex = examples[s] + shift[cfg][s] + 0.01 * s
            out.append({"config": cfg, "seed": s, "val_loss": float(ex.mean()), "val_example_losses": ex.tolist(),
                        "final_train_loss": float(ex.mean()) + 0.5, "train_losses": [7.0, 6.0, float(ex.mean())],
                        "params": 1000 + (100 if cfg != "gpt" else 0), "flops_per_token": 6000.0,
                        "training_flops": 6000.0 * 300, "tokens_per_s": 100.0 * s, "median_step_time_s": 0.1 * s,
                        "peak_rss_mib": 500.0, "data_sha256": f"seed{s}",
                        "omega": {"1": [[0.1, 0.2, 0.3], [0.1, 0.2, 0.3]]} if cfg != "gpt" else {}})
    return out


def test_aggregate_means_and_paired_differences():
    md, obj = aggregate(_records(), "gpt", ["asc"], n_resamples=2000, n_permutations=2000)
    main = {e["config"]: e for e in obj["main"]["configs"]}
    recs = _records()
    for cfg in ("gpt", "asc", "noisy"):
        vals = [r["val_loss"] for r in recs if r["config"] == cfg]
        assert main[cfg]["mean"] == pytest.approx(np.mean(vals))
        assert main[cfg]["std"] == pytest.approx(np.std(vals, ddof=1))
    asc = main["asc"]["comparison"]
    assert asc["mean_diff"] == pytest.approx(-0.1) and asc["interval"] == "paired t"
    assert asc["ci_low"] is asc["ci_high"] is asc["p_value"] is None  # constant differences: sd 0, undefined
    assert asc["p_randomization"] == pytest.approx(0.25)  # exact test, 3 pairs: the floor 2 / 2^3
    assert obj["exact_p_floor"] == pytest.approx(0.25)
    assert main["noisy"]["comparison"]["mean_diff"] == pytest.approx((0.2 - 0.3 + 0.05) / 3)
    # vs the second reference, the baseline appears as a treatment with the opposite sign
    vs_asc = {e["config"]: e for e in obj["vs"]["asc"]["configs"]}
    assert vs_asc["gpt"]["comparison"]["mean_diff"] == pytest.approx(0.1)
    assert "### val_loss vs gpt" in md and "### val_loss vs asc" in md


def test_aggregate_per_example_cost_omega_and_pairing():
    md, obj = aggregate(_records(), "gpt", ["asc"], n_resamples=2000, n_permutations=2000)
    per = {e["config"]: e for e in obj["per_example"]["gpt"]["configs"]}
    assert per["asc"]["n_sequences"] == 40 and per["asc"]["paired_seeds"] == [1, 2, 3]
    assert per["asc"]["comparison"]["mean_diff"] == pytest.approx(-0.1)
    assert per["asc"]["comparison"]["p_value"] < 0.01  # 40 sequences, every one 0.1 lower
    cost = {e["config"]: e for e in obj["cost"]["configs"]}
    assert cost["gpt"]["tokens_per_s_mean"] == pytest.approx(200.0) and cost["asc"]["params"] == 1100
    omega = {e["config"]: e for e in obj["omega"]["configs"]}
    assert set(omega) == {"asc", "noisy"} and omega["asc"]["mean"] == pytest.approx([0.1, 0.2, 0.3])
    assert obj["data_pairing"] == {str(s): {"identical": True, "configs": ["asc", "gpt", "noisy"]} for s in (1, 2, 3)}
    train = {e["config"]: e for e in obj["final_train_loss"]["configs"]}
    assert train["asc"]["comparison"]["mean_diff"] == pytest.approx(-0.1)
    json.dumps(ablate.report._json_safe(obj), allow_nan=False)


def test_aggregate_flags_differing_data_and_missing_seeds():
    recs = _records()
    recs[1]["data_sha256"] = "other"  # gpt seed 2 read other data
    recs = [r for r in recs if not (r["config"] == "noisy" and r["seed"] == 3)]
    md, obj = aggregate(recs, "gpt", n_resamples=500, n_permutations=500)
    assert obj["data_pairing"]["2"]["identical"] is False and obj["data_pairing"]["1"]["identical"] is True
    noisy = {e["config"]: e for e in obj["main"]["configs"]}["noisy"]
    assert noisy["n"] == 2 and noisy["comparison"]["paired_seeds"] == [1, 2]


def test_a_seed_whose_runs_recorded_no_data_hash_is_not_called_paired():
    """Records without data_sha256 (older runs) made a set {None}, read as identical data (found by a
    review): the pairing is unknown there."""
    recs = _records()
    for r in recs:
        if r["seed"] == 1:
            r.pop("data_sha256", None)
    _, obj = aggregate(recs, "gpt", n_resamples=200, n_permutations=200)
    assert obj["data_pairing"]["1"]["identical"] is None and obj["data_pairing"]["2"]["identical"] is True


def test_write_report_from_synthetic_records(tmp_path):
    grid = ablate.Grid(name="syn", path="syn.yaml", base={}, seeds=[1, 2, 3], baseline="gpt",
                       variants=[ablate.Variant(n, {}) for n in ("gpt", "asc", "noisy")], compare_to=["asc"],
                       report_dir=tmp_path / "report")
    recs = [{**r, "steps": 3, "tokens": 300, "val_sequences": 40} for r in _records()]
    full = ablate.write_report(grid, recs, n_resamples=500, n_permutations=500)
    for name in ("pareto.png", "ablation.png", "curves.png"):
        assert (tmp_path / "report" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "report" / "results.md").read_text()
    assert "| asc | 3 |" in md and "2/2^3 = 0.25" in md
    saved = json.loads((tmp_path / "report" / "results.json").read_text())
    assert saved["missing_runs"] == [] and len(saved["records"]) == 9
    assert "val_example_losses" not in saved["records"][0]
    front = {p["cost"]: p["front"] for p in full["pareto"]}
    # equal FLOPs for all: only the lowest loss is on the FLOPs front
    assert front["training_flops"] == ["asc"]
    assert all(math.isfinite(v["quality"]) for v in full["pareto"][0]["points"].values())


def _noisy_records():
    """_records() with 'asc' no longer exactly 0.1 lower on every seed (its p is then defined)."""
    recs = _records()
    for r in recs:
        if r["config"] == "asc":
            r["val_loss"] += 0.01 * r["seed"] ** 2
            r["val_example_losses"] = (np.asarray(r["val_example_losses"]) + 0.01 * r["seed"] ** 2).tolist()
    return recs


def test_a_report_adjusts_p_over_its_distinct_comparisons_per_test():
    """asc − gpt (main table) and gpt − asc (vs asc) are one comparison: the family is the 3 distinct
    comparisons, not two tables of 2 each adjusted on their own."""
    from ascender_dist.research.stats import holm

    md, obj = aggregate(_noisy_records(), "gpt", ["asc"], n_resamples=300, n_permutations=300)
    for tables in ([obj["main"], obj["vs"]["asc"]], list(obj["per_example"].values())):
        ref = lambda t: t.get("baseline", t.get("reference"))  # noqa: E731
        by_pair = {frozenset((ref(t), e["config"])): e["comparison"] for t in tables for e in t["configs"]
                   if e["comparison"]}
        assert len(by_pair) == 3 and all(t["holm_m"] == 3 for t in tables)
        pairs = list(by_pair)
        expected = dict(zip(pairs, holm([by_pair[k]["p_value"] for k in pairs])))
        for t in tables:
            for e in t["configs"]:
                if e["comparison"]:
                    assert e["comparison"]["p_holm"] == pytest.approx(expected[frozenset((ref(t), e["config"]))])
        assert all("3 comparisons of the report's" in t["multiple_comparisons"] for t in tables)
    assert md.count("| p Holm (m=3) |") == 4  # two over-seed and two per-sequence tables
    assert "Holm over the report's 3 distinct comparisons" in md


def test_a_diverged_run_is_left_out_and_named_not_an_error(tmp_path):
    """A NaN run (val loss, per-sequence losses, train loss) raised in _group: the grid could not be
    reported. It is left out of every statistic and named, in the tables and in the report."""
    grid = ablate.Grid(name="syn", path="syn.yaml", base={}, seeds=[1, 2, 3], baseline="gpt",
                       variants=[ablate.Variant(n, {}) for n in ("gpt", "asc", "noisy")], compare_to=["asc"],
                       report_dir=tmp_path / "report")
    recs = [{**r, "steps": 3, "tokens": 300, "val_sequences": 40} for r in _noisy_records()]
    bad = next(r for r in recs if r["config"] == "noisy" and r["seed"] == 2)
    bad.update(val_loss=math.nan, final_train_loss=math.nan, val_example_losses=[math.nan] * 40,
               train_losses=[7.0, math.nan, math.nan])
    full = ablate.write_report(grid, recs, n_resamples=300, n_permutations=300)
    noisy = {e["config"]: e for e in full["tables"]["main"]["configs"]}["noisy"]
    assert noisy["diverged"] == [2] and noisy["n"] == 2 and noisy["comparison"]["paired_seeds"] == [1, 3]
    per_seq = {e["config"]: e for e in full["tables"]["per_example"]["gpt"]["configs"]}["noisy"]
    assert per_seq["paired_seeds"] == [1, 3] and "seed(s) 2: per-sequence losses not finite" in per_seq["note"]
    md = (tmp_path / "report" / "results.md").read_text()
    assert "| noisy | 2 (+1 diverged) |" in md and "noisy: 1 diverged run(s) left out of the statistics" in md
    assert math.isfinite(full["pareto"][0]["points"]["noisy"]["quality"])
    rebuilt = ablate.report.rebuild(tmp_path / "report", n_resamples=300, n_permutations=300)  # NaN -> null
    assert {e["config"]: e for e in rebuilt["tables"]["main"]["configs"]}["noisy"]["diverged"] == [2]
    assert (tmp_path / "report" / "results.md").read_text() == md


# ------------------------------------------------------------------------------- efficiency (Table 2)


def test_attention_flops_are_softmax_blocks_plus_registered_extras():
    from ascender_dist.config.resolve import config_from_dict
    from ascender_dist.research import efficiency

    raw = {"model": {"preset": "debug", "vocab_size": 512}}
    gpt = config_from_dict({**raw, "model": {**raw["model"], "architecture": "gpt"}})
    asc = config_from_dict({**raw, "model": {**raw["model"], "architecture": "ascender"}})
    h, s, layers = 64, 128, 2
    per_layer = 2 * (4 * h * h + 4 * h) + 4 * s * h  # QKV + output projections with biases, scores + values
    assert efficiency.attention_flops_per_token(gpt.model) == per_layer * layers
    # + ASCender's extras per layer, 67712 (written out term by term in test_counting)
    assert efficiency.attention_flops_per_token(asc.model) == (per_layer + 67712) * layers
    with pytest.raises(ConfigError, match=r"--rows: unknown row 'flash'"):
        efficiency.row_config("flash", "debug", 8, 512, [])


def test_efficiency_table_renders_rows_and_ablation_throughput():
    from ascender_dist.research import efficiency

    row = {"row": "gpt", "params": 1000, "attention_flops_per_token": 1.0e5, "attention_flops_per_token_counted": 9e4,
           "training_flops_per_token": 1e6, "train_step_peak_mib": 12.5, "tokens_per_s": 1000.0, "latency_ms": 4.0,
           "seq_length": 128, "device": "cpu", "load_average": [1.0, 1.0, 1.0]}
    ablation = {"source": "x.json", "configs": [{"config": "gpt", "n": 3, "tokens_per_s_mean": 900.0,
                                                 "tokens_per_s_std": 10.0, "median_step_time_s": 0.2,
                                                 "peak_rss_mib_mean": 600.0}]}
    md = efficiency.render([row], ablation, {"preset": "debug", "batch": 8, "vocab": 512, "threads": 1},
                           {"git_commit": "b" * 40, "git_dirty": False})
    assert "| gpt | 1,000 | 1e+05 | 9e+04 | 1e+06 | 12.5 | 1000 [1000-1000] | n/a | 4.0 |" in md
    assert f"Measured at commit {'b' * 12}." in md
    assert "on an unrecorded number of cores" in md  # not the rendering machine's
    machine = {"git_commit": "b" * 40, "machine": {"cpu": "x", "logical_cpus": 96}}
    assert "1.0-1.0 on 96 cores" in efficiency.render([row], ablation, {"preset": "debug", "batch": 8, "vocab": 512,
                                                                          "threads": 1}, machine)
    assert "| gpt | 3 | 900 ± 10 | 0.200 | 600 |" in md
    assert "training runs of `x.json` (commit not recorded)" in md
    md = efficiency.render([row], {**ablation, "commits": ["a" * 40]}, {"preset": "debug", "batch": 8, "vocab": 512,
                                                                         "threads": 1})  # fmt: skip
    assert f"training runs of `x.json` (commit {'a' * 12})" in md


def test_efficiency_command_writes_both_tables_with_provenance(tmp_path, monkeypatch):
    """The command's own glue, each row's measurement (a child process, ~10 s) replaced by a stub."""
    from ascender_dist.research import efficiency

    measured = {"params": 1000, "attention_flops_per_token": 1.0e5, "attention_flops_per_token_counted": 9e4,
                "training_flops_per_token": 1e6, "train_step_peak_mib": 12.5, "tokens_per_s": 1000.0,
                "latency_ms": 4.0, "seq_length": 128, "device": "cpu", "load_average": [1.0, 1.0, 1.0]}
    monkeypatch.setattr(efficiency, "_run_child", lambda spec, threads, timeout: dict(measured))
    assert efficiency.efficiency_main(["--out", str(tmp_path), "--rows", "gpt,connection"]) == 0
    table = json.loads((tmp_path / "table2.json").read_text())
    assert [r["row"] for r in table["rows"]] == ["gpt", "connection"]
    hashes = [r["config_sha256"] for r in table["rows"]]
    assert len(set(hashes)) == 2 and all(len(h) == 64 for h in hashes)  # each row's resolved config
    # the git state is read before the tables are written (inside a checkout they made it "dirty")
    seen = []
    monkeypatch.setattr(efficiency, "report_provenance", lambda: seen.append((tmp_path / "again" / "table2.md").exists())
                        or {"git_commit": "x", "git_dirty": False})
    assert efficiency.efficiency_main(["--out", str(tmp_path / "again"), "--rows", "gpt"]) == 0
    assert seen == [False]
    assert {"git_commit", "git_dirty", "versions", "command"} <= set(table["provenance"])
    assert "| connection |" in (tmp_path / "table2.md").read_text()


def test_efficiency_rounds_rotate_the_rows_and_take_ratios_within_a_round(tmp_path, monkeypatch):
    """Every row once per round in fresh processes, the order rotated from round to round; the table
    gives the median over the rounds and each row's throughput over gpt's in the same round (a drift
    of the shared machine during one round moves both)."""
    from ascender_dist.research import efficiency

    calls = []
    speeds = {"gpt": 1000.0, "ascender": 500.0, "connection": 1100.0}

    def child(spec, threads, timeout):
        calls.append(spec["row"])
        slow = 2.0 if len(calls) > 6 else 1.0  # the machine slows down from round 3 on: ratios unmoved
        return {"params": 1, "attention_flops_per_token": 1.0, "attention_flops_per_token_counted": 1.0,
                "training_flops_per_token": 1.0, "train_step_peak_mib": 1.0, "tokens_per_s": speeds[spec["row"]] / slow,
                "train_step_s": 1.0, "latency_ms": 1.0, "seq_length": 8, "device": "cpu", "load_average": [1.0] * 3}

    monkeypatch.setattr(efficiency, "_run_child", child)
    assert efficiency.efficiency_main(["--out", str(tmp_path), "--rows", "gpt,ascender,connection"]) == 0
    assert calls[:9] == ["gpt", "ascender", "connection", "ascender", "connection", "gpt", "connection", "gpt",
                         "ascender"]
    assert len(calls) == 15  # 5 rounds x 3 rows
    rows = {r["row"]: r for r in json.loads((tmp_path / "table2.json").read_text())["rows"]}
    assert rows["ascender"]["vs_gpt"] == {"median": 0.5, "min": 0.5, "max": 0.5}
    assert rows["gpt"]["tokens_per_s"] == 500.0 and rows["gpt"]["tokens_per_s_max"] == 1000.0
    assert len(rows["connection"]["rounds"]) == 5
    assert "| ascender |" in (tmp_path / "table2.md").read_text()
    assert (tmp_path / "table2.png").stat().st_size > 0


def test_efficiency_rewrite_draws_the_tables_again_from_the_json(tmp_path, capsys, monkeypatch):
    """--rewrite: table2.md and table2.png from a committed table2.json, no measurement (a refused child)."""
    from ascender_dist.research import efficiency

    row = {"row": "gpt", "params": 1, "attention_flops_per_token": 1.0, "attention_flops_per_token_counted": 1.0,
           "training_flops_per_token": 1.0, "train_step_peak_mib": 1.0, "tokens_per_s": 1000.0, "tokens_per_s_min": 900.0,
           "tokens_per_s_max": 1100.0, "latency_ms": 1.0, "seq_length": 8, "device": "cpu",
           "vs_gpt": {"median": 1.0, "min": 1.0, "max": 1.0}}
    row["rounds"] = [dict(row, tokens_per_s=t) for t in (900.0, 1000.0, 1100.0, 1000.0, 1000.0)]
    settings = {"preset": "debug", "batch": 8, "vocab": 512, "threads": 1, "rounds": 5}
    (tmp_path / "table2.json").write_text(json.dumps({"settings": settings, "rows": [row], "ablation": None,
                                                      "provenance": {"git_commit": "c" * 40, "git_dirty": False}}))
    monkeypatch.setattr(efficiency, "_run_child", lambda *a: pytest.fail("--rewrite measured"))
    assert efficiency.efficiency_main(["--out", str(tmp_path), "--rewrite"]) == 0
    md = (tmp_path / "table2.md").read_text()
    assert "| gpt |" in md and "1000 [900-1100]" in md and "Measured at commit cccccccccccc." in md
    assert (tmp_path / "table2.png").stat().st_size > 0
    assert efficiency.efficiency_main(["--out", str(tmp_path / "none"), "--rewrite"]) == 2
    assert "table2.json not found" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--repeats", "0"], "error: --repeats must be >= 1 (got 0)"),
    (["--rounds", "3"], "error: --rounds must be >= 5 (got 3)"),
    (["--vocab", "0"], "error: --vocab must be >= 1 (got 0)"),
    (["--batch", "-1"], "error: --batch must be >= 1 (got -1)"),
    (["--timeout", "0"], "error: --timeout must be > 0 seconds (got 0.0)"),
])
def test_efficiency_refuses_bad_arguments_before_measuring(tmp_path, capsys, args, message):
    """--repeats 0 was an IndexError traceback from the child, --vocab 0 a ConfigError traceback."""
    from ascender_dist.research import efficiency

    assert efficiency.efficiency_main(["--out", str(tmp_path), "--rows", "gpt", *args]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == message
    assert not (tmp_path / "table2.md").exists()


def test_a_failed_or_slow_measurement_is_one_line(tmp_path, capsys, monkeypatch):
    import subprocess

    from ascender_dist.research import efficiency

    def slow(spec, threads, timeout):
        raise subprocess.TimeoutExpired("measure", timeout)

    monkeypatch.setattr(efficiency, "_run_child", slow)
    assert efficiency.efficiency_main(["--out", str(tmp_path), "--rows", "gpt", "--timeout", "5"]) == 1
    assert "error: measuring gpt took longer than --timeout 5 s" in capsys.readouterr().err

    def failed(spec, threads, timeout):
        raise RuntimeError("measurement of gpt failed (exit 1): MemoryError")

    monkeypatch.setattr(efficiency, "_run_child", failed)
    assert efficiency.efficiency_main(["--out", str(tmp_path), "--rows", "gpt"]) == 1
    assert "error: measurement of gpt failed (exit 1): MemoryError" in capsys.readouterr().err


def test_equal_flops_grid_gives_each_variant_the_steps_of_the_reference_budget():
    from ascender_dist.models.counting import count_model

    grid = ablate.load_grid(REPO / "configs" / "ablations" / "architectures-equal-flops.yaml")
    assert grid.budget.startswith("equal training FLOPs") and "steps per variant" in grid.budget
    per_run = {}
    for v in grid.variants:
        cfg = ablate.run_config(grid, v, grid.seeds[0])
        flops = count_model(cfg.model, 2048, cfg.parallel.tensor_model_parallel_size).flops_per_token
        step = flops * cfg.train.global_batch_size * cfg.model.seq_length
        per_run[v.name] = (step * cfg.train.train_steps, step)
    budget = per_run["gpt"][0]
    for name, (total, step) in per_run.items():
        assert abs(total - budget) <= step / 2 + 1e-6 * budget, name  # within half a step of the budget
    assert ablate.load_grid(REPO / "configs" / "ablations" / "architectures.yaml").budget == "equal training tokens"


def test_per_sequence_table_with_every_row_in_one_document_names_no_resampling_unit():
    from ascender_dist.research.ablate.collect import per_example_table

    records = _records()
    for r in records:
        r["val_example_index"] = list(range(40))
        r["val_example_documents"] = [0] * 40  # all windows in one document: no per-document test possible
    md, table = per_example_table(records, "gpt", n_resamples=200, n_permutations=200)
    assert all(e["comparison"] is None for e in table["configs"])
    assert "No per-sequence test in this table." in md and "single validation sequences" not in md


def test_per_sequence_rows_too_short_for_the_bootstrap_get_a_note_not_an_abort():
    """Records without document ids and fewer validation sequences than the percentile bootstrap takes
    (stats.BOOTSTRAP_MIN_N): the row says so; the whole report aborted with its ValueError."""
    from ascender_dist.research.ablate.collect import per_example_table
    from ascender_dist.research.stats import BOOTSTRAP_MIN_N

    records = _records()
    for r in records:
        r["val_example_losses"] = r["val_example_losses"][:BOOTSTRAP_MIN_N - 1]
        r["val_example_index"] = list(range(BOOTSTRAP_MIN_N - 1))
    md, table = per_example_table(records, "gpt", n_resamples=200, n_permutations=200)
    notes = [e["note"] for e in table["configs"] if e["config"] != "gpt"]
    assert notes and all(f"{BOOTSTRAP_MIN_N - 1} validation sequences without document ids" in n for n in notes), notes
    for r in records:
        r["val_example_losses"] = _records()[0]["val_example_losses"][:BOOTSTRAP_MIN_N]
        r["val_example_index"] = list(range(BOOTSTRAP_MIN_N))
    md, table = per_example_table(records, "gpt", n_resamples=200, n_permutations=200)
    assert all(e["comparison"] is not None for e in table["configs"] if e["config"] != "gpt"), table


def test_a_run_stopped_early_by_a_signal_writes_no_result(tmp_path, monkeypatch):
    """A grid run that a signal or time budget stopped (Trainer.stop_reason) trained fewer steps than
    its grid says: recording it would put a shorter run beside full ones in the report."""
    import ascender_dist.training.trainer as trainer_module
    from ascender_dist.research.ablate.launch import AblationError, run_one
    from ascender_dist.training.callbacks import Throughput

    class Stopped:
        def __init__(self, cfg, callbacks=()):
            self.step, self.stop_reason = 0, None
            self.callbacks = [Throughput(1, 1.0, 1, None)]

        def fit(self):
            self.step, self.stop_reason = 3, "received SIGTERM on rank 0"
            return [1.0, 1.0, 1.0]

    monkeypatch.setattr(trainer_module, "Trainer", Stopped)
    config = tmp_path / "config.yaml"
    config.write_text(f"output_dir: {tmp_path / 'run'}\ntrain: {{train_steps: 10}}\n")
    with pytest.raises(AblationError, match=r"run: stopped at step 3 of 10 \(received SIGTERM on rank 0\); no "
                                            r"result is written: run the grid again"):
        run_one(config, tmp_path / "result.json")
    assert not (tmp_path / "result.json").exists()


def test_a_dataset_built_with_other_settings_is_not_reused(tmp_path):
    """Grids share one dataset root: shards of another sequence length or vocabulary (or, once recorded,
    corpus size) were reused silently. Settings that match reuse it without building anything."""
    from ascender_dist.research.ablate.grid import DATASET_RECORD, AblationError, dataset_settings, ensure_dataset

    root = tmp_path / "data"
    (root / "shards").mkdir(parents=True)
    (root / "shards" / "manifest.json").write_text(json.dumps({"seq_length": 128, "vocab_size": 2048}))
    spec = {"root": str(root), "corpus_bytes": 3000000, "vocab_size": 2048, "seq_length": 128}
    assert ensure_dataset(spec)["manifest"] == str(root / "shards" / "manifest.json")  # a legacy dataset
    with pytest.raises(AblationError, match=r"data: dataset built with seq_length 128, the grid asks for 256: "):
        ensure_dataset({**spec, "seq_length": 256})
    (root / DATASET_RECORD).write_text(json.dumps(dataset_settings(spec)))
    ensure_dataset({**spec, "samples_per_shard": 256})  # the default, spelled out
    with pytest.raises(AblationError, match=r"corpus_bytes 3000000, the grid asks for 1000000"):
        ensure_dataset({**spec, "corpus_bytes": "1000000"})  # numbers as numbers


def test_only_keeps_the_baseline_and_the_variants_compared_to_as_its_help_says(tmp_path):
    """--only asc dropped the baseline, and the grid file was blamed ("baseline: 'gpt' is not a variant")."""
    variants = {"gpt": {}, "asc": {"model.architecture": "ascender"}, "asc8": {"model.architecture": "ascender",
                                                                                "model.ascender.k": 8},
                "other": {"model.architecture": "ascender", "model.ascender.k": 2}}
    path = _write_grid(tmp_path, variants=variants, baseline="gpt", compare_to=["asc"])
    assert [v.name for v in load_grid(path, only=["asc8"]).variants] == ["gpt", "asc", "asc8"]
    assert [v.name for v in load_grid(path, only=["gpt"]).variants] == ["gpt", "asc"]
    with pytest.raises(ConfigError, match=r"--only nope: no such variant"):
        load_grid(path, only=["nope"])


def test_the_omega_table_takes_a_sample_std_and_a_shared_omega_once_per_layer():
    """ddof 0 here against ddof 1 everywhere else, and a shared ω (recorded once per head) counted as
    many values as heads: 40 for 10 distinct values in the omega-sharing grid."""
    import numpy as np

    from ascender_dist.research.ablate.collect import omega_table

    per_head = {"config": "heads", "omega": {"1": [[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]], "2": [[1.0, 1.0, 1.0], [3.0, 1.0, 1.0]]}}
    shared = {"config": "shared", "omega": {"1": [[0.0, 1.0, 2.0]] * 4, "2": [[2.0, 3.0, 4.0]] * 4}}
    _, obj = omega_table([per_head, shared], ["heads", "shared"])
    heads, one = obj["configs"]
    assert heads["n_heads"] == 4 and one["n_heads"] == 2
    values = np.array([[0, 1, 2], [2, 1, 0], [1, 1, 1], [3, 1, 1]], dtype=float)
    assert np.allclose(heads["std_over_heads"], values.std(0, ddof=1))
    assert np.allclose(one["mean"], [1.0, 2.0, 3.0]) and np.allclose(one["std_over_heads"], [2 ** 0.5] * 3)
