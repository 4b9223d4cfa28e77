"""``ascender-dist evaluate`` never loses finished results and fails early where it can: what lm-eval
would stop at (no tokenizer, the wrong one, an ``OUT/hf/NAME`` it must not replace) and a run without
validation data are one line before any model runs; a failure once some runs finished (lm-eval or
an export failing on a later run) still writes results.json / results.md with what finished and the
error, then exits non-zero with one line; a partial export directory is one line naming it."""

from __future__ import annotations

import math
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from ascender_dist.tools import evaluate as ev
from tests.helpers.errors import one_line
from tests.helpers.lm_eval_task import TASK, write_task

from .export_fixtures import two_tokenizers, write_run  # noqa: F401  (fixtures)

VAL = {"val_loss": 5.0, "perplexity": 148.4, "val_samples": 4, "val_tokens": 512, "val_seconds": 0.1}


def _write_task(directory: Path) -> Path:
    return write_task(directory, [("import", [" os", " 1"], 0)])


@pytest.fixture
def stubbed(monkeypatch):
    """Validation and lm-eval replaced by recorders: ``calls`` lists what ran, in order. The task
    manager is a stand-in knowing TASK (lm-eval's own takes seconds to index its tasks)."""
    calls: list = []

    def load_model(run, device="cpu"):
        calls.append(("load", run.name))
        run.parameters = 1234
        return object()

    def validation_loss(run, model, *args, **kwargs):
        calls.append(("val", run.name))
        return dict(VAL)

    def lm_eval_tasks(run, hf_dir, tasks, manager, **kwargs):
        calls.append(("lm-eval", run.name))
        return {TASK: {"acc": 0.5, "samples": 1}}

    manager = SimpleNamespace(all_tasks=[TASK], match_tasks=lambda names: [], load=lambda names: None)
    monkeypatch.setattr(ev, "load_model", load_model)
    monkeypatch.setattr(ev, "validation_loss", validation_loss)
    monkeypatch.setattr(ev, "lm_eval_tasks", lm_eval_tasks)
    monkeypatch.setattr(ev, "task_manager", lambda include: manager)
    return calls


def _run(argv, capsys) -> tuple[int, str, str]:
    code = ev.evaluate_main([*map(str, argv), "--device", "cpu"])
    captured = capsys.readouterr()
    return code, captured.out, (captured.err.strip().splitlines() or [""])[-1]


# ----------------------------------------------------------------------------- checked before any model runs
def test_a_runs_missing_tokenizer_with_a_local_task_fails_before_any_validation(two_tokenizers, tmp_path, capsys,
                                                                                monkeypatch):
    """The review's scenario, with lm-eval's real task manager and a local task: the old code
    computed the validation loss first, then exited 2 at the export without writing anything."""
    calls: list = []
    monkeypatch.setattr(ev, "load_model", lambda run, device="cpu": calls.append("load") or object())
    monkeypatch.setattr(ev, "validation_loss", lambda *a, **k: calls.append("val") or dict(VAL))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    missing = tmp_path / "moved" / "tokenizer.model"
    run = write_run(tmp_path / "cons", two_tokenizers[0], data_tokenizer=str(missing))
    out = tmp_path / "eval"
    code, _, err = _run([run, "--manifest", tmp_path / "m.json", "--tasks", TASK,
                         "--include-path", _write_task(tmp_path / "tasks"), "--out", out], capsys)
    assert code == 2 and calls == [], (calls, err)
    one_line(err, "lm-eval needs the tokenizer", str(missing), str(run / "config.yaml"), kind=str)
    assert not (out / "results.json").exists()  # nothing was computed: nothing to keep


def test_a_tokenizer_that_is_not_the_runs_is_refused_before_any_validation(two_tokenizers, tmp_path, capsys,
                                                                           stubbed):
    ours, other = two_tokenizers
    run = write_run(tmp_path / "cons", ours, data_tokenizer=str(other))  # trained with ours, names the other
    code, _, err = _run([run, "--manifest", tmp_path / "m.json", "--tasks", TASK, "--out", tmp_path / "eval"],
                        capsys)
    assert code == 2 and stubbed == []
    one_line(err, str(other), "not the tokenizer this model was trained with", kind=str)


def test_an_export_target_that_must_not_be_replaced_is_refused_before_any_validation(two_tokenizers, tmp_path,
                                                                                     capsys, stubbed):
    run = write_run(tmp_path / "cons", two_tokenizers[0])
    out = tmp_path / "eval"
    (out / "hf" / "cons").mkdir(parents=True)
    (out / "hf" / "cons" / "notes.txt").write_text("mine")
    code, _, err = _run([run, "--manifest", tmp_path / "m.json", "--tasks", TASK, "--out", out], capsys)
    assert code == 2 and stubbed == []
    one_line(err, str(out / "hf" / "cons"), "not a previous export-hf output", kind=str)
    assert (out / "hf" / "cons" / "notes.txt").read_text() == "mine"
    code, _, err = _run([f"a/b={run}", "--manifest", tmp_path / "m.json", "--tasks", TASK, "--out", out], capsys)
    assert code == 2 and stubbed == []
    one_line(err, "run name 'a/b'", kind=str)


def test_a_previous_export_given_as_another_run_is_not_exported_over(two_tokenizers, tmp_path, capsys, stubbed):
    """Comparing a new checkpoint with last time's export of the same --out: the new run's export
    went to OUT/hf/NAME, replaced the baseline there before it was scored, and the baseline's row
    held the new model's scores (exit 0)."""
    from ascender_dist.tools.hf_export import export_hf

    run = write_run(tmp_path / "cons", two_tokenizers[0])
    out = tmp_path / "eval"
    previous = export_hf(run, out / "hf" / "new", tokenizer=two_tokenizers[0])
    before = (previous / "model.safetensors").read_bytes()
    code, _, err = _run([f"new={run}", f"baseline={previous}", "--manifest", tmp_path / "m.json", "--tasks", TASK,
                         "--out", out], capsys)
    assert code == 2 and stubbed == [], (code, err, stubbed)
    one_line(err, str(previous), "run 'new' would export its model there for lm-eval, over run 'baseline''s input",
             kind=str)
    assert (previous / "model.safetensors").read_bytes() == before


def test_a_bad_eval_batch_size_fails_before_any_validation(two_tokenizers, tmp_path, capsys, stubbed):
    run = write_run(tmp_path / "cons", two_tokenizers[0])
    code, _, err = _run([run, "--manifest", tmp_path / "m.json", "--tasks", TASK, "--eval-batch-size", "x",
                         "--out", tmp_path / "eval"], capsys)
    assert code == 2 and stubbed == []  # the old code parsed it after every validation loss
    one_line(err, "--eval-batch-size 'x'", kind=str)


def test_an_export_without_manifest_fails_before_loading_the_model(two_tokenizers, tmp_path, capsys, stubbed):
    from ascender_dist.tools.hf_export import export_hf

    hf = export_hf(write_run(tmp_path / "cons", two_tokenizers[0]), tmp_path / "hf")
    code, _, err = _run([hf, "--out", tmp_path / "eval"], capsys)
    assert code == 2 and stubbed == []  # the old code loaded the whole model first
    one_line(err, "hf: no validation data", "--manifest", kind=str)


# ----------------------------------------------------------------------------- failures once results exist
def _two_runs(tmp_path, tokenizer) -> list[str]:
    run = write_run(tmp_path / "cons", tokenizer)
    shutil.copytree(run, tmp_path / "cons2")
    return [f"first={run}", f"second={tmp_path / 'cons2'}"]


def test_an_lm_eval_crash_on_the_second_run_keeps_every_finished_result(two_tokenizers, tmp_path, capsys,
                                                                        stubbed, monkeypatch):
    def lm_eval_tasks(run, hf_dir, tasks, manager, **kwargs):
        stubbed.append(("lm-eval", run.name))
        if run.name == "second":
            raise RuntimeError("CUDA error: device-side assert triggered\n  deep inside lm-eval")
        return {TASK: {"acc": 0.5, "samples": 1}}

    monkeypatch.setattr(ev, "lm_eval_tasks", lm_eval_tasks)
    out = tmp_path / "eval"
    code, stdout, err = _run([*_two_runs(tmp_path, two_tokenizers[0]), "--manifest", tmp_path / "m.json",
                              "--tasks", TASK, "--out", out], capsys)
    assert code == 1
    one_line(err, "run second", "RuntimeError", "device-side assert", kind=str)
    assert err.startswith("error: ")
    report = json.loads((out / "results.json").read_text())  # the old code wrote nothing
    runs = {r["name"]: r for r in report["runs"]}
    assert runs["first"]["val_loss"] == runs["second"]["val_loss"] == VAL["val_loss"]
    assert runs["first"]["tasks"] == {TASK: {"acc": 0.5, "samples": 1}} and "tasks" not in runs["second"]
    assert report["error"] == err[len("error: "):] and report["failed_run"] == "second"
    assert "Traceback" in report["traceback"] and "Traceback" not in stdout
    assert "| first |" in (out / "results.md").read_text() and "| first |" in stdout


def test_an_export_failure_on_the_second_run_keeps_every_finished_result(two_tokenizers, tmp_path, capsys, stubbed,
                                                                         monkeypatch):
    from ascender_dist.tools.convert import ConversionError

    real = ev.hf_dir_for

    def hf_dir_for(run, out):
        if run.name == "second":
            raise ConversionError(out / "hf" / "second", "writing the output failed (No space left on device)")
        return real(run, out)

    monkeypatch.setattr(ev, "hf_dir_for", hf_dir_for)
    out = tmp_path / "eval"
    code, _, err = _run([*_two_runs(tmp_path, two_tokenizers[0]), "--manifest", tmp_path / "m.json",
                         "--tasks", TASK, "--out", out], capsys)
    assert code == 2
    one_line(err, str(out / "hf" / "second"), "No space left on device", kind=str)
    report = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in report["runs"]] == ["first", "second"] and "traceback" not in report
    assert report["runs"][0]["tasks"][TASK]["acc"] == 0.5 and report["error"] == err[len("error: "):]
    assert (out / "hf" / "first" / "config.json").is_file()  # the first run's real export


def test_a_validation_failure_on_the_second_run_keeps_the_first(two_tokenizers, tmp_path, capsys, stubbed,
                                                                monkeypatch):
    def validation_loss(run, model, *args, **kwargs):
        if run.name == "second":
            raise ev.EvaluationError("second: the validation split is empty")
        return dict(VAL)

    monkeypatch.setattr(ev, "validation_loss", validation_loss)
    out = tmp_path / "eval"
    code, _, err = _run([*_two_runs(tmp_path, two_tokenizers[0]), "--manifest", tmp_path / "m.json", "--out", out],
                        capsys)
    assert code == 2 and err == "error: second: the validation split is empty"
    report = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in report["runs"]] == ["first"] and report["runs"][0]["val_loss"] == VAL["val_loss"]
    assert report["failed_run"] == "second"


# ----------------------------------------------------------------------------- a partial export (finding 4)
@pytest.mark.parametrize("removed", ["configuration_ascender_dist.py", "asd_connection_layer.py"])
def test_a_partial_remote_code_export_is_one_line_naming_it(two_tokenizers, tmp_path, removed):
    from ascender_dist.tools.hf_export import export_hf

    # "hf", the name other tests' exports have: load_model imports each export's own code
    # (lm_eval_adapter.remote_code_path), so a complete "hf" loaded earlier in the process cannot hide
    # this one's missing file
    hf = export_hf(write_run(tmp_path / "cons", two_tokenizers[0]), tmp_path / "hf", remote_code=True)
    (hf / removed).unlink()
    with pytest.raises(ev.EvaluationError) as info:
        ev.load_model(ev.parse_run(str(hf), str(tmp_path / "m.json")))
    one_line(info.value, str(hf), "cannot load the Hugging Face export", removed)


@pytest.mark.parametrize("extra,message", [
    (["--device", "gpu"], "--device 'gpu': expected cpu, cuda or cuda:N"),
    (["--batch-size", "0"], "--batch-size must be >= 1 (got 0)"),
    (["--val-samples", "-3"], "--val-samples must be >= 1 (got -3)"),
    # lm-eval's own errors came after every run's validation loss, as crashes naming no flag
    (["--limit", "nan"], "--limit nan: expected a fraction in (0, 1) or a whole number of examples >= 1"),
    (["--limit", "inf"], "--limit inf: expected a fraction in (0, 1) or a whole number of examples >= 1"),
    (["--limit", "0"], "--limit 0.0: expected a fraction in (0, 1) or a whole number of examples >= 1"),
    (["--limit", "-3"], "--limit -3.0: expected a fraction in (0, 1) or a whole number of examples >= 1"),
    (["--limit", "2.5"], "--limit 2.5: expected a fraction in (0, 1) or a whole number of examples >= 1"),
    (["--num-fewshot", "-2"], "--num-fewshot must be >= 0 (got -2)"),
])
def test_bad_options_are_one_line_before_any_run_is_read(tmp_path, extra, message):
    """--device gpu was a torch traceback; --val-samples -3 --batch-size 0 evaluated every sample in
    one batch (an out-of-memory on real data)."""
    args = ev._parser().parse_args([str(tmp_path / "missing"), "--out", str(tmp_path / "o"), *extra])
    with pytest.raises(ev.EvaluationError) as info:
        ev.evaluate(args)
    assert str(info.value) == message


def test_good_lm_eval_limits_pass_the_check():
    for limit in (None, 0.25, 1.0, 40.0):
        ev.check_lm_eval_arguments(limit, 0)


def test_cuda_without_a_device_is_one_line(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = ev._parser().parse_args([str(tmp_path / "missing"), "--device", "cuda", "--out", str(tmp_path / "o")])
    with pytest.raises(ev.EvaluationError) as info:
        ev.evaluate(args)
    assert str(info.value) == "--device cuda: no CUDA device is available here (use --device cpu)"


def test_a_run_directory_with_an_equals_sign_is_a_directory_not_name_equals_dir(tmp_path, two_tokenizers):
    """Sweep folders (lr=3e-4/gpt-small) were split at '=': '3e-4/gpt-small: run directory not found'."""
    run = write_run(tmp_path / "sweep" / "lr=3e-4" / "gpt-small", two_tokenizers[0])
    parsed = ev.parse_run(str(run), None)
    assert parsed.name == "gpt-small" and Path(parsed.path) == run
    named = ev.parse_run(f"mine={run}", None)  # NAME=DIR still works
    assert named.name == "mine" and Path(named.path) == run


def test_a_runs_recorded_pipe_manifest_is_refused_not_run(tmp_path, two_tokenizers, monkeypatch):
    """A consolidated directory is files anyone could have written: its config.yaml's
    data.manifest 'pipe:cmd' ran cmd as whoever evaluated the run (webdataset's gopen)."""
    import yaml

    monkeypatch.chdir(tmp_path)
    run = write_run(tmp_path / "cons", two_tokenizers[0])
    raw = yaml.safe_load((run / "config.yaml").read_text())
    raw["data"]["manifest"] = "pipe:touch PWNED; cat /dev/null"
    (run / "config.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ev.EvaluationError) as info:
        ev.parse_run(str(run), None)
    assert str(info.value) == (f"{run / 'config.yaml'}: data.manifest 'pipe:touch PWNED; cat /dev/null' is a URL or "
                               "command, not a local path: evaluate reads a run's own data from local manifests "
                               "only (pass --manifest)")
    assert not (tmp_path / "PWNED").exists()
    assert ev.parse_run(str(run), str(tmp_path / "m.json")).manifest == str(tmp_path / "m.json")  # the user's own


def test_a_non_finite_validation_loss_is_an_error_not_a_nan_in_results(tmp_path):
    """Weights with a NaN (a corrupt file, a diverged run) gave val_loss NaN in the table and a
    results.json that is not valid JSON; evaluate now stops with one line naming the run."""
    import types

    import torch

    from tests.helpers.data import SEQ_LENGTH, make_tiny_dataset

    data = make_tiny_dataset(tmp_path / "data", corpus_bytes=120_000)
    run = ev.Run("diverged", tmp_path / "diverged", "consolidated", seq_length=SEQ_LENGTH, manifest=data["manifest"],
                 tokenizer=data["tokenizer"])

    def model(tokens, value=float("nan")):  # [b, s] -> logits [b, s, V]
        return types.SimpleNamespace(logits=torch.full((*tokens.shape, 640), value))

    with pytest.raises(ev.EvaluationError) as info:
        ev.validation_loss(run, model, max_samples=2)
    assert str(info.value) == (f"{run.path}: diverged's validation loss is nan (non-finite weights or logits)")
    finite = ev.validation_loss(run, lambda tokens: model(tokens, 0.0), max_samples=2)
    assert finite["val_loss"] == pytest.approx(math.log(640))

    def one_sure_wrong_token(tokens):  # a finite loss past exp's range (~709.8 nats): math.exp overflowed
        logits = torch.zeros(*tokens.shape, 640)
        logits[..., 0] = 1000.0  # every label but token 0 costs ~1000 nats
        return types.SimpleNamespace(logits=logits)

    diverged = ev.validation_loss(run, one_sure_wrong_token, max_samples=2)
    assert 709.8 < diverged["val_loss"] < 1001 and diverged["perplexity"] is None, diverged
    json.dumps(diverged, allow_nan=False)


def test_an_export_without_a_sequence_length_names_its_config_json(tmp_path):
    """'hx: unknown sequence length' named neither the file nor the key that was missing."""
    run = ev.Run("hx", tmp_path / "hx", "hf", manifest=str(tmp_path / "m.json"))
    with pytest.raises(ev.EvaluationError) as info:
        ev.check_validation_input(run)
    assert str(info.value) == (f"{tmp_path / 'hx' / 'config.json'}: no max_position_embeddings (nor n_positions): "
                               "the sequence length of hx is unknown")
