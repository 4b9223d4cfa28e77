"""Grid machinery found wrong by a review: finished runs reused on rebuilt data, a cut-short dataset
build keeping another vocabulary's tokenizer, provenance taken after training, two variants in one
run directory, a setting owned by two dimensions, --runs-dir overwriting the grid's report, --only
and an axes grid's names, --report-only without the baseline, and --set losing to a variant."""

from __future__ import annotations

import json

import pytest
import yaml

from ascender_dist.config.errors import ConfigError
from ascender_dist.config.loader import to_dict
from ascender_dist.research import ablate
from ascender_dist.research.ablate import load_grid
from ascender_dist.research.ablate.collect import collect_records
from ascender_dist.research.ablate.grid import RESULT, AblationError, expand_variants, run_config, run_dir
from ascender_dist.research.ablate.provenance import config_hash, file_sha256

BASE = {"model": {"architecture": "gpt", "preset": "debug", "vocab_size": 512},
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "train_steps": 5},
        "optimizer": {"warmup_steps": 1}}


def _grid(tmp_path, **grid):
    path = tmp_path / "grid.yaml"
    base = {**BASE, "data": {"manifest": str(tmp_path / "data" / "manifest.json"), "tokenizer": "tok.model"}}
    path.write_text(yaml.safe_dump({"name": "g", "base": base, "seeds": [1], **grid}, sort_keys=False))
    return path


def _finished(grid, variant: str, manifest_sha: str | None) -> None:
    v = grid.variant(variant)
    d = run_dir(grid, v, 1)
    d.mkdir(parents=True)
    provenance = {"config_sha256": config_hash(to_dict(run_config(grid, v, 1))), "data_manifest_sha256": manifest_sha}
    (d / RESULT).write_text(json.dumps({"config": variant, "seed": 1, "val_loss": 5.0, "provenance": provenance}))


def test_a_finished_run_on_data_rebuilt_since_is_refused(tmp_path):
    manifest = tmp_path / "data" / "manifest.json"
    manifest.parent.mkdir()
    manifest.write_text('{"shards": ["a"]}')
    grid = load_grid(_grid(tmp_path, variants={"gpt": {}}))
    grid.runs_dir = tmp_path / "runs"
    _finished(grid, "gpt", file_sha256(manifest))
    assert len(collect_records(grid)) == 1
    manifest.write_text('{"shards": ["b"]}')  # the dataset root removed and built again with other settings
    with pytest.raises(AblationError, match="was trained on data manifest sha256") as info:
        collect_records(grid)
    assert str(run_dir(grid, grid.variant("gpt"), 1)) in str(info.value) and "\n" not in str(info.value)


def test_variants_sharing_a_run_directory_are_refused(tmp_path):
    path = _grid(tmp_path, variants={"lr 1": {"optimizer.lr": 1e-3}, "lr_1": {"optimizer.lr": 2e-3}})
    with pytest.raises(ConfigError, match="variants 'lr 1' and 'lr_1' share the run directory name 'lr_1'"):
        load_grid(path)


@pytest.mark.parametrize("variants,axes", [
    ({"small": {"optimizer.lr": 1e-3}}, {"optimizer.lr": [1e-4, 2e-4]}),
    (None, {"optimizer.lr": [1e-4, 2e-4], "peak": {"hi": {"optimizer.lr": 1e-2}}}),
])
def test_a_setting_owned_by_two_dimensions_is_refused(variants, axes):
    """The later dimension won silently: 'small,lr=0.0001' trained at 1e-4, and two differently
    labelled variants at the same 1e-2."""
    with pytest.raises(ConfigError, match=r"both set optimizer.lr: one dimension of the grid must own each setting"):
        expand_variants(variants, axes)


def test_runs_dir_without_report_dir_reports_beside_those_runs(tmp_path, monkeypatch):
    from ascender_dist.research.ablate import main

    written = []
    monkeypatch.setattr(main, "write_report", lambda grid, records, **kw: written.append(grid.report_dir))
    path = _grid(tmp_path, variants={"gpt": {}}, report_dir=str(tmp_path / "grid-report"))
    grid = load_grid(path)
    grid.runs_dir = tmp_path / "other"
    _finished(grid, "gpt", None)
    assert ablate.ablate_main([str(path), "--report-only", "--runs-dir", str(tmp_path / "other"), "--no-progress",
                               "--allow-mixed-commits"]) == 0
    assert written == [tmp_path / "other" / "report"]  # never the grid's own report


def test_only_matches_an_axes_grids_names_whole(tmp_path):
    from ascender_dist.research.ablate.grid import match_only

    names = ["use_align=true,use_sep=true", "use_align=false,use_sep=true", "use_align=false,use_sep=false"]

    def only(text):
        return match_only(text.split(","), names)

    assert only("use_align=false,use_sep=true") == ["use_align=false,use_sep=true"]
    assert only("use_align=false,use_sep=true,use_align=false,use_sep=false") == names[1:]
    assert match_only(["gpt", "asc"], ["gpt", "asc"]) == ["gpt", "asc"]
    assert only("nope") == ["nope"]  # load_grid names it
    axes = {"model.ascender.use_align": [True, False], "model.ascender.use_sep": [True, False]}
    path = _grid(tmp_path, variants={"asc": {"model.architecture": "ascender"}}, axes=axes)
    wanted = load_grid(path).variants[3].name
    assert ablate.ablate_main([str(path), "--dry-run", "--only", wanted, "--runs-dir", str(tmp_path / "r")]) == 0


def test_report_only_without_a_finished_baseline_is_one_line(tmp_path, capsys):
    path = _grid(tmp_path, variants={"b2": {}, "gpt": {"optimizer.lr": 1e-3}}, baseline="b2")
    grid = load_grid(path)
    grid.runs_dir = tmp_path / "runs"
    _finished(grid, "gpt", None)
    rc = ablate.ablate_main([str(path), "--report-only", "--runs-dir", str(tmp_path / "runs"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == f"error: {tmp_path / 'runs'}: the baseline 'b2' has no finished run to compare with (run it first)"


def test_a_set_that_variants_override_is_said_once(tmp_path, capsys):
    path = _grid(tmp_path, variants={"a": {"optimizer.lr": 1e-3}, "b": {}})
    assert ablate.ablate_main([str(path), "--dry-run", "--set", "optimizer.lr=7e-4", "--runs-dir", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    assert "note: --set optimizer.lr=7e-4 does not apply to a, which set optimizer.lr themselves" in err


def test_provenance_is_taken_before_training(tmp_path, monkeypatch):
    """The commit and dirty flag were read after fit(): a commit made while a run trained was recorded."""
    from ascender_dist.research.ablate import launch, provenance
    from ascender_dist.training import trainer as trainer_module

    order = []
    monkeypatch.setattr(provenance, "run_provenance", lambda *a: order.append("provenance") or {})

    class Trains:
        def __init__(self, *a, **k):
            order.append("training")
            raise RuntimeError("stop here")

    monkeypatch.setattr(trainer_module, "Trainer", Trains)
    config = tmp_path / "config.yaml"
    config.write_text(f"output_dir: {tmp_path / 'run'}\n")
    with pytest.raises(RuntimeError, match="stop here"):
        launch.run_one(config, tmp_path / "result.json")
    assert order == ["provenance", "training"]


def test_a_cut_short_dataset_build_trains_its_tokenizer_again(tmp_path):
    """A build cut short after its tokenizer kept that tokenizer when built again with another vocabulary
    (dataset.json then recorded the new one); the whole build is made again with the grid's settings."""
    from ascender_dist.research.ablate.grid import DATASET_RECORD, ensure_dataset
    from data_pipeline.corpus import build_default_corpus
    from data_pipeline.tokenizer import Tokenizer, train_tokenizer

    root = tmp_path / "data"
    root.mkdir()
    build_default_corpus(root / "corpus.jsonl", max_bytes=150_000, progress=False)
    train_tokenizer([root / "corpus.jsonl"], root / "tokenizer", vocab_size=400, progress=False)  # then cut short
    out = ensure_dataset({"root": str(root), "corpus_bytes": 150_000, "vocab_size": 512, "seq_length": 64})
    assert Tokenizer.load(out["tokenizer"]).vocab_size == 512
    assert json.loads((root / DATASET_RECORD).read_text())["vocab_size"] == 512


def test_a_standalone_variant_sharing_a_run_directory_is_refused(tmp_path):
    path = _grid(tmp_path, variants={"lr_1": {"optimizer.lr": 1e-3}}, standalone={"lr 1": {"optimizer.lr": 2e-3}})
    with pytest.raises(ConfigError, match="variants 'lr_1' and 'lr 1' share the run directory name 'lr_1'"):
        load_grid(path)


def test_a_standalone_variant_named_like_a_crossed_one_is_refused(tmp_path):
    path = _grid(tmp_path, variants={"lr_1": {"optimizer.lr": 1e-3}}, standalone={"lr_1": {"optimizer.lr": 2e-3}})
    with pytest.raises(ConfigError, match="two variants are both named 'lr_1'"):
        load_grid(path)


def _mixture_grid(tmp_path):
    path = tmp_path / "grid.yaml"
    sources = [{"manifest": str(tmp_path / name / "manifest.json")} for name in ("a", "b")]
    base = {**BASE, "data": {"mixture": sources, "tokenizer": "tok.model"}}
    path.write_text(yaml.safe_dump({"name": "g", "base": base, "seeds": [1]}, sort_keys=False))
    return path


def test_a_grid_set_edits_a_list_item_by_index_as_run_configs_do(tmp_path):
    grid = load_grid(_mixture_grid(tmp_path), overrides=["data.mixture[1].weight=0.25"])
    assert [source["weight"] for source in grid.base["data"]["mixture"][1:]] == [0.25]
    assert "weight" not in grid.base["data"]["mixture"][0]


@pytest.mark.parametrize("override,message", [
    ("data.mixture[1].wieght=1", "--set data.mixture[1].wieght: unknown config field 'wieght' in data.mixture[1] "
                                 "(did you mean 'weight'?)"),
    ("train.train_steps[0]=1", "--set train.train_steps[0]: train.train_steps is not a list"),
    ("data.mixture[2].weight=1", "there is no item [2]"),
])
def test_a_bad_grid_set_of_a_list_item_is_one_line(tmp_path, override, message):
    with pytest.raises(ConfigError) as info:
        load_grid(_mixture_grid(tmp_path), overrides=[override])
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_set_of_the_steps_of_an_equal_flops_grid_is_its_budget_not_overridden(capsys):
    """equal_flops_of writes train.train_steps into every variant: a --set of it sets the budget."""
    assert ablate.ablate_main(["configs/ablations/architectures-equal-flops.yaml", "--dry-run", "--set",
                               "train.train_steps=30", "--runs-dir", "/nonexistent/runs"]) == 0
    assert "note: --set" not in capsys.readouterr().err


def test_a_variant_at_another_sequence_length_than_the_dataset_is_refused_when_loading(tmp_path):
    """The grid's shards have one sequence length: a variant at another one failed only when its run
    started, after the dataset was built and earlier variants had trained."""
    dataset = {"root": str(tmp_path / "data"), "seq_length": 64, "vocab_size": 512}
    assert load_grid(_grid(tmp_path, dataset=dataset, variants={"gpt": {"model.seq_length": 64}}))
    path = _grid(tmp_path, dataset=dataset, variants={"gpt": {"model.seq_length": 64},
                                                      "long": {"model.seq_length": 128}})
    with pytest.raises(ConfigError) as info:
        load_grid(path)
    assert str(info.value) == (f"{path}: variant long: model.seq_length: 128, but the grid's dataset is written at "
                               "dataset.seq_length 64: set them equal, or give the variant data of its own")
    own = str(tmp_path / "ctx128" / "manifest.json")  # a variant with data of its own is not held to the grid's
    assert load_grid(_grid(tmp_path, dataset=dataset, variants={"gpt": {"model.seq_length": 64},
                                                                "long": {"model.seq_length": 128, "data.manifest": own}}))


@pytest.mark.parametrize("grid,where", [
    ({"dataset": {"root": "~/abl-data"}}, "dataset.root"),
    ({"runs_dir": "~/runs"}, "runs_dir"),
    ({"report_dir": "~/report"}, "report_dir"),
])
def test_a_grid_path_starting_with_a_tilde_is_refused(tmp_path, grid, where):
    """No shell expands a grid file's values: the dataset was built in a directory named '~' in the
    working directory (run configs refuse such paths already)."""
    path = _grid(tmp_path, variants={"gpt": {}}, **grid)
    with pytest.raises(ConfigError, match=f"{where}: .*leading '~'"):
        load_grid(path)


def test_a_variant_whose_vocabulary_cannot_hold_the_grid_tokenizer_is_refused_when_loading(tmp_path):
    root = tmp_path / "data"
    dataset = {"root": str(root), "seq_length": 64, "vocab_size": 600}
    variants = {"gpt": {"model.seq_length": 64, "model.vocab_size": 512}}
    with pytest.raises(ConfigError, match="variant gpt: model.vocab_size: 512 is smaller than the grid dataset's "
                                          r"tokenizer \(dataset.vocab_size 600\)"):
        load_grid(_grid(tmp_path, dataset=dataset, variants=variants))
    own = {"data.tokenizer": str(tmp_path / "small.model")}  # its own tokenizer: not held to the grid's
    assert load_grid(_grid(tmp_path, dataset=dataset, variants={"gpt": {**variants["gpt"], **own}}))


def test_grids_sharing_a_dataset_root_take_turns_building_it(tmp_path):
    """Two grids started together on one dataset.root both found no manifest and built the corpus,
    tokenizer and shards over each other; the second now waits for the first's lock, then finds the
    dataset built and checks it. A built root takes no lock (it may be read-only)."""
    import fcntl
    import threading

    from ascender_dist.research.ablate.grid import DATASET_RECORD, dataset_settings, ensure_dataset

    root = tmp_path / "data"
    root.mkdir()
    spec = {"root": str(root), "seq_length": 64}
    done = []
    with open(root / ".build.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the other grid is building
        waiter = threading.Thread(target=lambda: done.append(ensure_dataset(spec)))
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive() and not done  # waits instead of building beside it
        (root / "shards").mkdir()  # what the other grid's build leaves
        (root / "shards" / "manifest.json").write_text(json.dumps({"seq_length": 64}))
        (root / DATASET_RECORD).write_text(json.dumps(dataset_settings(spec)))
    waiter.join(timeout=30)
    paths = {"manifest": str(root / "shards" / "manifest.json"), "tokenizer": str(root / "tokenizer.model")}
    assert done == [paths] and not (root / "corpus.jsonl").exists()  # found built: nothing built again
    (root / ".build.lock").unlink()
    assert ensure_dataset(spec) == paths and not (root / ".build.lock").exists()

def test_a_grid_files_list_item_key_is_refused_in_one_line(tmp_path):
    """The grid file's own keys build their trees whole: key[i] passed the path check and then failed as
    an unknown key 'mixture[1]'."""
    path = _grid(tmp_path, variants={"a": {}, "b": {"data.mixture[1].weight": 3.0}})
    with pytest.raises(ConfigError, match=r"variants\.b\.data\.mixture\[1\]\.weight: 'data.mixture\[1\]\.weight': a "
                                          "list item by index is for the command line's --set"):
        load_grid(path)


def test_a_set_of_a_list_item_a_variant_replaces_is_noted(tmp_path, capsys):
    """A variant that sets the whole list drops the --set's item without a word."""
    path = tmp_path / "grid.yaml"
    sources = [{"manifest": str(tmp_path / name / "manifest.json")} for name in ("a", "b")]
    base = {**BASE, "data": {"mixture": sources, "tokenizer": "tok.model"}}
    variants = {"both": {}, "only_a": {"data.mixture": sources[:1] + [{**sources[1], "weight": 0.5}]},
                "merged": {"data": {"num_workers": 1}}}
    path.write_text(yaml.safe_dump({"name": "g", "base": base, "seeds": [1], "variants": variants}, sort_keys=False))
    assert ablate.ablate_main([str(path), "--dry-run", "--set", "data.mixture[1].weight=0.25", "--runs-dir",
                               str(tmp_path / "r")]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: --set")]
    assert notes == ["note: --set data.mixture[1].weight=0.25 does not apply to only_a, which set "
                     "data.mixture[1].weight themselves"]


def test_what_every_run_would_refuse_is_refused_when_the_grid_loads(tmp_path):
    """--dry-run passed these, and then each run failed: eval_iters true (a bool is an int to
    isinstance), a pipeline-parallel base, a '~' path only a run's own load_config refused."""
    with pytest.raises(ConfigError, match="eval_iters: expected a positive integer or 'all', got True"):
        load_grid(_grid(tmp_path, variants={"gpt": {}}, eval_iters=True))
    pipeline = {"gpt": {"parallel.pipeline_model_parallel_size": 2, "model.num_layers": 2}}
    with pytest.raises(ConfigError, match="variant gpt: parallel.pipeline_model_parallel_size: must be 1"):
        load_grid(_grid(tmp_path, variants=pipeline))
    with pytest.raises(ConfigError, match=r"variant gpt: checkpoint.init_from: '~/w.safetensors' starts with '~'"):
        load_grid(_grid(tmp_path, variants={"gpt": {"checkpoint.init_from": "~/w.safetensors"}}))


def test_a_variant_preset_that_sets_nothing_is_refused(tmp_path):
    """Variants {preset: debug} and {preset: small} over a base giving every size trained one model."""
    sizes = {"model.num_layers": 2, "model.hidden_size": 64, "model.num_attention_heads": 4,
             "model.ffn_hidden_size": 256, "model.seq_length": 128}
    with pytest.raises(ConfigError, match="variant small: model.preset: 'small' sets nothing here"):
        load_grid(_grid(tmp_path, set=sizes, variants={"debug": {}, "small": {"model.preset": "small"}}))


def test_a_base_files_errors_name_that_file(tmp_path):
    """A typo in a base file was reported against the grid's first variant; a missing base file named
    neither the grid nor its base field."""
    (tmp_path / "base.yaml").write_text("model:\n  hiden_size: 64\n")
    grid = tmp_path / "grid.yaml"
    grid.write_text("name: g\nbase: base.yaml\nseeds: [1]\nvariants:\n  a: {}\n")
    with pytest.raises(ConfigError, match=rf"{grid}: base {tmp_path / 'base.yaml'}: model.hiden_size: .*"
                                          r"did you mean 'hidden_size'"):
        load_grid(grid)
    grid.write_text("name: g\nbase: missing.yaml\nseeds: [1]\nvariants:\n  a: {}\n")
    with pytest.raises(ConfigError, match=rf"^{grid}: base: missing.yaml: config file not found"):
        load_grid(grid)
