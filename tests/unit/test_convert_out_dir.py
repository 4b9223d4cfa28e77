"""consolidate / export-hf / evaluate never lose data and refuse bad input in one line:
an ``--out`` that is the input, inside it, holding it, a file or someone else's directory; a
``--tag`` that does not exist; a consolidated directory whose config.yaml does not fit its weights."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from ascender_dist.cli import main
from tests.helpers.errors import one_line as _one_line
from tests.helpers.fs_events import record_syncs_renames_and_deletes
from ascender_dist.config.resolve import config_from_dict
from ascender_dist.tools.convert import (ConversionError, check_consolidate_out, consolidate, is_consolidated_output,
                                         read_consolidated, resolve_tag, write_consolidated)
from ascender_dist.tools.hf_export import (LM_EVAL_EXPORT_SUBDIR, check_export_out, check_weights_fit_config,
                                           export_hf, is_export_output)

META = {"format": 1, "step": 3, "architecture": "gpt", "world_size": 1, "vocab_size": 96, "padded_vocab_size": 128,
        "data": {"consumed_samples": 8, "seed": 1}, "versions": {"megatron-core": "0.16.1", "deepspeed": "0.19.8"},
        "code": {"git_commit": "c0de" * 10, "git_dirty": False, "git_changes_sha256": None}}




def _tree(directory) -> dict:
    """Every file under ``directory`` and its bytes: what must survive a refused command."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def checkpoint(tmp_path):
    """A training checkpoint directory with two complete tags (what resolve_tag and the checks read)."""
    ck = tmp_path / "ck"
    for step in (2, 4):
        tag = ck / f"step_0000000{step}"
        tag.mkdir(parents=True)
        (tag / "COMPLETE").write_text(f"{step}\n")
        (tag / "meta.json").write_text(json.dumps({**META, "step": step}))
        (tag / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    (ck / "latest").write_text("step_00000004")
    return ck


@pytest.fixture
def consolidated(tmp_path):
    """A real consolidated directory of the default (tiny gpt) model, written by write_consolidated."""
    from ascender_dist.hf.modeling_ascender_dist import AscenderDistForCausalLM
    from ascender_dist.tools.hf_export import remote_code_config

    cfg = config_from_dict({"name": "tiny"})
    model = AscenderDistForCausalLM(remote_code_config(cfg, META, META["vocab_size"], tied=True))
    state = {name.removeprefix("model."): t for name, t in model.state_dict().items() if name != "lm_head.weight"}
    out = tmp_path / "cons"
    write_consolidated(out, state, cfg, META)
    return out


# ----------------------------------------------------------------------------- --out (defects 1, 2)
def test_consolidate_refuses_an_out_that_is_or_holds_or_is_inside_the_checkpoint(checkpoint, tmp_path):
    before = _tree(checkpoint)
    for out, needle in [(checkpoint, "output is the input directory"),
                        (checkpoint / "step_00000004", "inside the input directory"),
                        (checkpoint / "consolidated", "inside the input directory"),
                        (tmp_path, "contains the input")]:
        with pytest.raises(ConversionError) as info:
            check_consolidate_out(out, checkpoint)
        _one_line(info.value, str(out), needle)
    assert _tree(checkpoint) == before


def test_consolidate_checks_out_before_any_work(checkpoint, tmp_path, monkeypatch):
    """On every re-launched rank, before the process group and the gather (which would take minutes)."""
    monkeypatch.setattr("ascender_dist.tools.convert._setup", lambda *a: pytest.fail("started the conversion"))
    before = _tree(checkpoint)
    with pytest.raises(ConversionError) as info:
        consolidate(checkpoint, checkpoint)
    _one_line(info.value, "output is the input directory")
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ConversionError) as info:
        consolidate(checkpoint, afile)
    _one_line(info.value, str(afile), "existing file")
    assert afile.read_text() == "x" and not list(tmp_path.glob(".afile.tmp*"))
    assert _tree(checkpoint) == before


def test_consolidate_command_on_a_rank_exits_2_in_one_line(checkpoint, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr("ascender_dist.tools.convert._setup", lambda *a: pytest.fail("started the conversion"))
    out = checkpoint / "step_00000004"
    assert main(["consolidate", "--checkpoint", str(checkpoint), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and str(out) in err and "inside the input directory" in err and "\n" not in err
    assert (out / "COMPLETE").is_file() and (out / "mp_rank_00_model_states.pt").read_bytes() == b"weights"


def test_both_tools_refuse_a_foreign_non_empty_directory_and_replace_their_own(consolidated, tmp_path):
    keep = tmp_path / "keepme"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    with pytest.raises(ConversionError) as info:
        check_consolidate_out(keep, tmp_path / "ck")
    _one_line(info.value, str(keep), "not a previous consolidate output")
    with pytest.raises(ConversionError) as info:
        export_hf(consolidated, keep)
    _one_line(info.value, str(keep), "not a previous export-hf output")
    assert (keep / "notes.txt").read_text() == "mine" and not list(tmp_path.glob(".keepme.tmp*"))
    (tmp_path / "empty").mkdir()
    check_consolidate_out(tmp_path / "empty", tmp_path / "ck")  # an empty directory is fine
    assert is_consolidated_output(consolidated)
    check_consolidate_out(consolidated, tmp_path / "ck")  # re-running into a previous output replaces it
    hf = export_hf(consolidated, tmp_path / "hf")
    assert export_hf(consolidated, hf) == hf and (hf / "config.json").is_file()


def test_replacing_a_previous_output_that_holds_a_users_files_is_refused(consolidated, tmp_path):
    """A model card or evaluation results added to a previous export (or consolidated directory) were
    deleted with it when the command ran again into the same --out (exit 0)."""
    hf = export_hf(consolidated, tmp_path / "hf")
    (hf / "README.md").write_text("model card")
    (hf / "eval").mkdir()
    (hf / "eval" / "results.json").write_text("{}")
    before = _tree(hf)
    with pytest.raises(ConversionError) as info:
        export_hf(consolidated, hf)
    _one_line(info.value, str(hf), "holds README.md, eval/, which the new output does not: replacing it would "
                                   "delete them")
    assert _tree(hf) == before and not list(tmp_path.glob(".hf.tmp*"))
    (hf / "README.md").unlink()
    (hf / "eval" / "results.json").unlink()
    (hf / "eval").rmdir()
    assert export_hf(consolidated, hf) == hf  # only its own files: replaced
    # the lm-eval adapter's export cache inside a consolidated run is derived from the weights: it may go
    (consolidated / LM_EVAL_EXPORT_SUBDIR).mkdir()
    (consolidated / f"{LM_EVAL_EXPORT_SUBDIR}.lock").write_text("")
    from ascender_dist.tools.convert import staged_output

    with staged_output(consolidated) as tmp:
        for name in ("meta.json", "config.yaml", "model.safetensors"):
            (tmp / name).write_bytes((consolidated / name).read_bytes())
    assert not (consolidated / LM_EVAL_EXPORT_SUBDIR).exists() and is_consolidated_output(consolidated)


def test_a_users_file_in_a_previous_output_is_refused_before_any_work(consolidated, tmp_path):
    """The refusal above came only after every rank had merged (or exported) the whole model into
    the staging folder: hours for a large model, thrown away. The checks that run before the launch
    now know what each tool writes; the lm-eval cache's crash leftovers are not a user's files."""
    hf = export_hf(consolidated, tmp_path / "hf")
    marker = json.loads((hf / "ascender_dist.json").read_text())
    assert {"config.json", "model.safetensors"} <= set(marker["files"])
    assert marker["trained_code"] == META["code"]  # the training commit survives consolidation and export
    (hf / "README.md").write_text("model card")
    with pytest.raises(ConversionError) as info:
        check_export_out(hf, consolidated)
    _one_line(info.value, str(hf), "holds README.md, which the new output does not: replacing it would delete them")
    (consolidated / "eval_results.json").write_text("{}")
    (consolidated / f".{LM_EVAL_EXPORT_SUBDIR}.tmp.4242").mkdir()  # a crashed lm-eval export's staging folder
    with pytest.raises(ConversionError) as info:
        check_consolidate_out(consolidated, tmp_path / "ck")
    _one_line(info.value, str(consolidated), "holds eval_results.json, which the new output does not")
    (consolidated / "eval_results.json").unlink()
    for name in (LM_EVAL_EXPORT_SUBDIR, f"{LM_EVAL_EXPORT_SUBDIR}.lock", f".{LM_EVAL_EXPORT_SUBDIR}.old.17"):
        (consolidated / name).mkdir()
    check_consolidate_out(consolidated, tmp_path / "ck")  # its own files and the lm-eval cache's only
    # a user's entries that only start like the cache's names are the user's (they were deleted unasked:
    # found by a review)
    for name in ("hf-export-results/", "hf-export.md", f"{LM_EVAL_EXPORT_SUBDIR}-scores/"):
        path = consolidated / name.rstrip("/")
        path.mkdir() if name.endswith("/") else path.write_text("kept")
        with pytest.raises(ConversionError) as info:
            check_consolidate_out(consolidated, tmp_path / "ck")
        _one_line(info.value, str(consolidated), f"holds {name}, which the new output does not")
        shutil.rmtree(path) if name.endswith("/") else path.unlink()


def test_an_export_replaces_a_previous_one_that_wrote_other_files(consolidated, tmp_path):
    """A remote-code export (its vendored modules) replaced by a standard GPT-NeoX one, or a cache
    written by an older version vendoring another module: the early check let them through as the
    previous export's own files, then the swap refused them as a user's, after the whole export
    (and every later lm-eval refresh of that cache failed the same way)."""
    from ascender_dist.hf.modeling_ascender_dist import AscenderDistForCausalLM
    from ascender_dist.tools.hf_export import remote_code_config

    cfg = config_from_dict({"name": "learned", "model": {"position_embedding_type": "learned_absolute"}})
    model = AscenderDistForCausalLM(remote_code_config(cfg, META, META["vocab_size"], tied=True))
    learned = tmp_path / "learned"
    write_consolidated(learned, {name.removeprefix("model."): t for name, t in model.state_dict().items()
                                 if name != "lm_head.weight"}, cfg, META)
    hf = export_hf(learned, tmp_path / "hf", without_tokenizer=True)
    remote_only = {p.name for p in hf.iterdir()} - {"config.json", "model.safetensors", "ascender_dist.json"}
    assert any(name.endswith(".py") for name in remote_only), remote_only
    check_export_out(hf, consolidated)
    export_hf(consolidated, hf, without_tokenizer=True)  # the standard export: none of those files
    assert not remote_only & {p.name for p in hf.iterdir()} and is_export_output(hf)
    (hf / "README.md").write_text("model card")  # a user's file is still refused
    with pytest.raises(ConversionError):
        export_hf(learned, hf, without_tokenizer=True)


def test_export_hf_refuses_its_input_as_out(consolidated, tmp_path):
    before = _tree(consolidated)
    for out, needle in [(consolidated, "output is the input directory"),
                        (consolidated / "sub", "inside the input directory"),
                        (tmp_path, "contains the input")]:
        with pytest.raises(ConversionError) as info:
            export_hf(consolidated, out)
        _one_line(info.value, str(out), needle)
    assert _tree(consolidated) == before and is_consolidated_output(consolidated)


def test_export_hf_may_write_the_lm_eval_cache_inside_the_input(consolidated):
    from ascender_dist.tools.lm_eval_adapter import EXPORT_SUBDIR

    assert LM_EVAL_EXPORT_SUBDIR == EXPORT_SUBDIR  # hf_directory() exports a consolidated run there
    check_export_out(consolidated / EXPORT_SUBDIR, consolidated)


# ----------------------------------------------------------------------------- --tag (defect 3)
def test_a_missing_tag_says_so_and_lists_the_tags(checkpoint):
    with pytest.raises(ConversionError) as info:
        resolve_tag(checkpoint, "step_5")
    message = _one_line(info.value, str(checkpoint / "step_5"), "no such checkpoint tag",
                        "available: step_00000002, step_00000004")
    assert "did not finish" not in message
    assert resolve_tag(checkpoint, "step_00000002") == checkpoint / "step_00000002"
    assert resolve_tag(checkpoint, "step_2") == checkpoint / "step_00000002"  # as the docs write tags: step_N


# ----------------------------------------------------------------------------- config.yaml vs weights (defect 4)
def _edit_ffn(consolidated, size: int) -> None:
    path = consolidated / "config.yaml"
    raw = yaml.safe_load(path.read_text())
    raw["model"]["ffn_hidden_size"] = size
    path.write_text(yaml.safe_dump(raw, sort_keys=False))


def test_config_that_does_not_fit_the_weights_is_one_line(consolidated):
    check_weights_fit_config(*read_consolidated(consolidated), consolidated)  # the real one fits
    _edit_ffn(consolidated, 128)  # the weights have 4 * 64 = 256
    with pytest.raises(ConversionError) as info:
        check_weights_fit_config(*read_consolidated(consolidated), consolidated)
    _one_line(info.value, str(consolidated / "config.yaml"), "decoder.layers.0.mlp.linear_fc1.weight",
              "(256, 64)", "(128, 64)")


def test_export_hf_standard_architecture_refuses_a_config_that_does_not_fit(consolidated, tmp_path):
    _edit_ffn(consolidated, 128)
    with pytest.raises(ConversionError) as info:
        export_hf(consolidated, tmp_path / "hf")  # a gpt GPT-NeoX expresses: the path without remote code
    _one_line(info.value, str(consolidated / "config.yaml"), "linear_fc1.weight")
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.tmp*"))


def test_reshard_refuses_a_model_override_the_weights_do_not_fit_before_launching(consolidated, tmp_path, capsys,
                                                                                  monkeypatch):
    """`reshard --set model.num_query_groups=2` launched the ranks, which each failed naming
    checkpoint.init_from (a field never set) and left an empty --out."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr("ascender_dist.cli._relaunch", lambda *a: pytest.fail("launched"))
    out = tmp_path / "resharded"
    assert main(["reshard", "--consolidated", str(consolidated), "--out", str(out),
                 "--set", "model.ffn_hidden_size=128"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {consolidated / 'model.safetensors'}: weights do not fit the model of "
                          f"{consolidated / 'config.yaml'} with --set model.ffn_hidden_size=128"), err  # the culprit
    assert "linear_fc1.weight has shape (256, 64), the model needs (128, 64)" in err, err
    assert "\n" not in err and not out.exists()


def test_evaluate_refuses_a_config_that_does_not_fit(consolidated):
    from ascender_dist.tools.evaluate import load_model, parse_run

    _edit_ffn(consolidated, 128)
    with pytest.raises(ConversionError) as info:
        load_model(parse_run(str(consolidated), None))
    _one_line(info.value, str(consolidated / "config.yaml"), "linear_fc1.weight")


def test_reshard_refuses_a_directory_of_training_checkpoints_and_its_own_input(checkpoint, tmp_path, capsys):
    from ascender_dist.tools.convert import check_reshard_out

    consolidated = tmp_path / "consolidated"
    consolidated.mkdir()
    before = _tree(checkpoint)
    # checked before the command relaunches itself: latest would move back to the consolidated step
    assert main(["reshard", "--consolidated", str(consolidated), "--out", str(checkpoint)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {checkpoint}: already holds training checkpoints (newest step_00000004): reshard into " \
                  "a new directory"
    assert _tree(checkpoint) == before
    for out in (consolidated, consolidated / "ck"):
        with pytest.raises(ConversionError) as info:
            check_reshard_out(out, consolidated)
        _one_line(info.value, "is or is inside the input directory")
    check_reshard_out(tmp_path / "new", consolidated)  # a new directory is fine


# ----------------------------------------------------------------------------- replacing an output (defect A)
class Crash(BaseException):
    """A kill at that moment: nothing of the exporter's error handling catches it."""


def _fail_moving_the_new_output_in(monkeypatch, error: BaseException) -> list:
    """Make the rename that moves a finished staging directory (``.<out>.tmp*``) into place raise
    ``error`` (os.replace and os.rename both: Path.rename / Path.replace go through them). With the
    previous output renamed aside first, that is the second directory rename. Returns the renames
    of directories seen, as (source name, target name)."""
    import os

    renames = []

    def wrap(real):
        def rename(src, dst, *args, **kwargs):
            if os.path.isdir(src):
                renames.append((os.path.basename(src), os.path.basename(dst)))
                if os.path.basename(src).startswith(f".{os.path.basename(dst)}.tmp"):
                    raise error
            return real(src, dst, *args, **kwargs)
        return rename

    monkeypatch.setattr(os, "replace", wrap(os.replace))
    monkeypatch.setattr(os, "rename", wrap(os.rename))
    return renames


def _load_export(directory) -> None:
    """Load an export of the tiny gpt (GPT-NeoX, no remote code) as transformers does."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(directory))


def _no_leftovers(parent, name: str) -> None:
    assert sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")) == []


def test_a_failed_swap_keeps_the_previous_export_loadable(consolidated, tmp_path, monkeypatch):
    hf = export_hf(consolidated, tmp_path / "hf")
    marker = hf / "ascender_dist.json"  # a mark of the first export that the second would not write
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "note": "first export"}))
    before = _tree(hf)
    renames = _fail_moving_the_new_output_in(monkeypatch, OSError(5, "Input/output error"))
    with pytest.raises(ConversionError) as info:
        export_hf(consolidated, hf)
    _one_line(info.value, str(hf), "Input/output error", "previous output is kept")
    assert len(renames) == 3 and renames[0][0] == "hf"  # aside, (failed) in, back
    monkeypatch.undo()
    assert _tree(hf) == before
    _load_export(hf)
    _no_leftovers(tmp_path, "hf")


def test_a_crash_between_the_renames_leaves_the_previous_export_aside(consolidated, tmp_path, monkeypatch):
    """A kill after the previous export was renamed aside, before the new one is in: the previous
    export is whole under its aside name (the old code had deleted it by then)."""
    hf = export_hf(consolidated, tmp_path / "hf")
    before = _tree(hf)
    _fail_moving_the_new_output_in(monkeypatch, Crash("killed between the renames"))
    with pytest.raises(Crash):
        export_hf(consolidated, hf)
    monkeypatch.undo()
    kept = [p for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith(".hf.old.")]
    assert not hf.exists() and len(kept) == 1 and _tree(kept[0]) == before
    _load_export(kept[0])
    assert export_hf(consolidated, hf) == hf and is_export_output(hf)  # the next run writes it again


def test_a_failed_consolidated_swap_keeps_the_previous_output_readable(consolidated, monkeypatch):
    state, cfg, meta = read_consolidated(consolidated)
    before = _tree(consolidated)
    _fail_moving_the_new_output_in(monkeypatch, OSError(28, "No space left on device"))
    with pytest.raises(ConversionError) as info:
        write_consolidated(consolidated, state, cfg, {**meta, "step": 99})
    _one_line(info.value, str(consolidated), "No space left on device")
    monkeypatch.undo()
    assert _tree(consolidated) == before and read_consolidated(consolidated)[2]["step"] == META["step"]
    _no_leftovers(consolidated.parent, consolidated.name)


def test_a_write_error_is_one_line_and_leaves_no_temporary_directory(consolidated, tmp_path, monkeypatch):
    """Disk full while writing the weights: one line naming --out, the previous export untouched,
    no staging directory left behind (the old code left ``.hf.tmp`` and a traceback)."""
    import errno

    hf = export_hf(consolidated, tmp_path / "hf")
    before = _tree(hf)

    def disk_full(path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr("ascender_dist.tools.hf_export.honour_umask", disk_full)
    with pytest.raises(ConversionError) as info:
        export_hf(consolidated, hf)
    _one_line(info.value, str(hf), "No space left on device")
    assert _tree(hf) == before
    _no_leftovers(tmp_path, "hf")


# ----------------------------------------------------------------------------- durability before the old output goes
@pytest.mark.parametrize("tool", ["consolidate", "export-hf"])
def test_outputs_are_synced_before_the_previous_output_is_deleted(consolidated, tmp_path, monkeypatch, tool):
    """Every file of the new output and its directory are fsynced before it is renamed in, the parent
    directory (the renames) after that, and all of it before the previous output is deleted: a power
    loss then never leaves an output whose files were not written while the old one is gone."""
    import os

    if tool == "consolidate":
        state, cfg, meta = read_consolidated(consolidated)
        out = consolidated

        def write():
            write_consolidated(out, state, cfg, {**meta, "step": 99})
    else:
        out = export_hf(consolidated, tmp_path / "hf")

        def write():
            export_hf(consolidated, out)
    out = out.resolve()
    events = record_syncs_renames_and_deletes(monkeypatch)
    write()
    monkeypatch.undo()
    staged = out.with_name(f".{out.name}.tmp.{os.getpid()}")
    aside = str(out.with_name(f".{out.name}.old.{os.getpid()}"))
    moved_aside = events.index(("replace", str(out), aside))
    deleted = events.index(("rmtree", aside), moved_aside)  # the previous output, moved aside, then deleted
    moved_in = events.index(("replace", str(staged), str(out)))
    synced = [e[1] for e in events[:deleted] if e[0] == "fsync"]
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    if tool == "consolidate":
        assert [str(f) for f in files] == ["config.yaml", "meta.json", "model.safetensors"]
        assert read_consolidated(out)[2]["step"] == 99
    for name in files:
        assert str(staged / name) in synced[:moved_in], name
    assert str(staged) in [e[1] for e in events[:moved_in] if e[0] == "fsync"]  # its entries, before the rename
    assert str(out.parent) in [e[1] for e in events[moved_in:deleted] if e[0] == "fsync"]  # the renames
