"""The tokenizer's identity (its sha256, which checkpoints record in meta.json), not only its size, is
checked by export-hf and by evaluate: a tokenizer of the same size trained on other text gives
other ids for the same text, so shipping it, or scoring data made with it, is silently wrong."""

from __future__ import annotations

import json
import shutil

import pytest

from ascender_dist.tools.convert import ConversionError
from ascender_dist.tools.hf_export import export_hf
from data_pipeline.tokenizer import tokenizer_sha256
from tests.helpers.errors import one_line

from .data_fixtures import make_dataset
from .export_fixtures import VOCAB, run_with_tokenizer, two_tokenizers, write_run  # noqa: F401  (fixtures)

SEQ = 128  # the default config's model.seq_length


# ----------------------------------------------------------------------------- export-hf
def test_export_refuses_a_same_size_tokenizer_trained_on_other_text(run_with_tokenizer, two_tokenizers, tmp_path):
    ours, other = two_tokenizers
    with pytest.raises(ConversionError) as info:
        export_hf(run_with_tokenizer, tmp_path / "hf", tokenizer=str(other))
    one_line(info.value, str(other), tokenizer_sha256(other)[:12], str(run_with_tokenizer / "meta.json"),
             tokenizer_sha256(ours)[:12], "not the tokenizer this model was trained with")
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.tmp*"))
    out = export_hf(run_with_tokenizer, tmp_path / "hf", tokenizer=str(ours))
    assert json.loads((out / "ascender_dist.json").read_text())["tokenizer_sha256"] == tokenizer_sha256(ours)


def test_export_refuses_the_runs_own_tokenizer_file_once_replaced(run_with_tokenizer, two_tokenizers, tmp_path):
    """Without --tokenizer the run's data.tokenizer is exported: another file at that path is refused too."""
    ours, other = two_tokenizers
    shutil.copyfile(other, ours)
    # with its sidecar: a model replaced behind its own sidecar fails the load's check instead (test_data_bad_input4)
    shutil.copyfile(other.with_suffix(".json"), ours.with_suffix(".json"))
    with pytest.raises(ConversionError) as info:
        export_hf(run_with_tokenizer, tmp_path / "hf")
    one_line(info.value, str(ours), "not the tokenizer this model was trained with")
    ours.with_suffix(".json").write_bytes(b"{}")  # no record: still refused by the run's own record
    with pytest.raises(ConversionError) as info:
        export_hf(run_with_tokenizer, tmp_path / "hf2")
    one_line(info.value, str(ours), "not the tokenizer this model was trained with")


def test_older_checkpoints_without_the_hash_are_checked_by_size_only(two_tokenizers, tmp_path):
    """As docs/export_and_eval.md says: a meta.json without tokenizer_sha256 cannot tell them apart."""
    ours, other = two_tokenizers
    old = write_run(tmp_path / "old", ours, record_sha=False)
    out = export_hf(old, tmp_path / "hf", tokenizer=str(other))
    assert (out / "tokenizer.json").is_file()


def test_a_named_tokenizer_that_cannot_be_read_is_one_line(run_with_tokenizer, tmp_path):
    for bad, needle in [(tmp_path / "missing.model", "not found"), (tmp_path, "not a file")]:
        with pytest.raises(ConversionError) as info:
            export_hf(run_with_tokenizer, tmp_path / "hf", tokenizer=str(bad))
        one_line(info.value, str(bad), needle)


# ----------------------------------------------------------------------------- evaluate
def _manifest(directory, tokenizer) -> str:
    """A val split of 4 samples whose manifest and shards say they were made with ``tokenizer``."""
    make_dataset(directory, [2], [4], seq_length=SEQ, tokenizer_sha256=tokenizer_sha256(tokenizer), vocab_size=VOCAB)
    return str(directory / "manifest.json")


def _evaluate(run_dir, manifest: str, out, capsys) -> tuple[int, str]:
    """``ascender-dist evaluate RUN --manifest M``: its exit status and last line on stderr."""
    from ascender_dist.tools.evaluate import evaluate_main

    code = evaluate_main([str(run_dir), "--manifest", manifest, "--out", str(out), "--device", "cpu"])
    return code, (capsys.readouterr().err.strip().splitlines() or [""])[-1]  # after transformers' loading bar


@pytest.fixture(params=["export", "consolidated, data.tokenizer moved"])
def evaluated_run(request, two_tokenizers, tmp_path):
    """An export of the run (its tokenizer.model), or the consolidated run whose data.tokenizer no
    longer resolves (meta.json's tokenizer_sha256 still says which tokenizer it was)."""
    ours = two_tokenizers[0]
    if request.param == "export":
        return export_hf(write_run(tmp_path / "cons", ours), tmp_path / "hf", tokenizer=str(ours))
    return write_run(tmp_path / "cons", ours, data_tokenizer=str(tmp_path / "moved" / "tokenizer.model"))


def test_evaluate_refuses_val_data_made_with_another_tokenizer(evaluated_run, two_tokenizers, tmp_path, capsys):
    ours, other = two_tokenizers
    code, err = _evaluate(evaluated_run, _manifest(tmp_path / "other-data", other), tmp_path / "eval", capsys)
    assert code == 2, err
    assert err.startswith("error: ")
    one_line(err, "tokenizer mismatch", tokenizer_sha256(other)[:12], tokenizer_sha256(ours)[:12], kind=str)
    code, err = _evaluate(evaluated_run, _manifest(tmp_path / "our-data", ours), tmp_path / "eval", capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "eval" / "results.json").read_text())["runs"][0]["val_samples"] == 4


def test_evaluate_names_an_export_tokenizer_it_cannot_read(run_with_tokenizer, two_tokenizers, tmp_path, capsys):
    hf = export_hf(run_with_tokenizer, tmp_path / "hf", tokenizer=str(two_tokenizers[0]))
    (hf / "tokenizer.model").unlink()
    (hf / "tokenizer.model").mkdir()  # exists, cannot be read as a file
    code, err = _evaluate(hf, _manifest(tmp_path / "data", two_tokenizers[0]), tmp_path / "eval", capsys)
    assert code == 2
    one_line(err, str(hf / "tokenizer.model"), "cannot read the tokenizer", kind=str)
