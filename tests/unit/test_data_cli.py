"""The data-pipeline command line end to end on tiny inputs, and its one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from data_pipeline.cli import main
from data_pipeline.shards import load_manifest
from data_pipeline.tokenizer import Tokenizer
from tests.helpers.procs import children, has_signal, spawned_children

from .data_fixtures import text_file  # noqa: F401


def test_full_pipeline_through_cli(tmp_path, text_file, capsys):
    corpus = tmp_path / "corpus.jsonl"
    assert main(["--quiet", "build-corpus", "--out", str(corpus), "--max-bytes", "60000"]) == 0
    cfg = tmp_path / "tok.yaml"
    cfg.write_text("vocab_size: 4.5e2\nmodel_type: bpe\nspecial_tokens: ['<|im_start|>']\npad_vocab_to_multiple_of: 64\n")
    assert main(["--quiet", "train-tokenizer", "--input", str(corpus), str(text_file), "--out-prefix",
                 str(tmp_path / "tok"), "--config", str(cfg), "--vocab-size", "420"]) == 0
    tok = Tokenizer.load(tmp_path / "tok.model")
    assert (tok.vocab_size, tok.padded_vocab_size) == (420, 448)  # flag beats YAML, YAML pad multiple kept
    assert tok.sp.piece_to_id("<|im_start|>") > 3
    assert main(["--quiet", "shard", "--input", str(corpus), "--tokenizer", str(tmp_path / "tok.model"),
                 "--out-dir", str(tmp_path / "ds"), "--seq-length", "32", "--samples-per-shard", "50",
                 "--val-fraction", "0.2"]) == 0
    m = load_manifest(tmp_path / "ds")
    assert m.tokenizer_sha256 == tok.sha256 and m.num_samples("val") > 0
    capsys.readouterr()
    assert main(["--quiet", "inspect", str(tmp_path / "ds"), "--tokenizer", str(tmp_path / "tok.model"),
                 "--json", "--sample", "3", "--top", "5"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["splits"]["train"]["samples"] == m.num_samples("train")
    assert len(summary["top_tokens"]) == 5 and len(summary["sample_ids"]) == 33
    assert isinstance(summary["sample_text"], str) and summary["sample_text"]
    assert main(["--quiet", "inspect", str(tmp_path / "ds")]) == 0
    assert "sample 0 of train" in capsys.readouterr().out


def test_cli_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe not utf8")
    assert main(["--quiet", "train-tokenizer", "--input", str(bad), "--out-prefix", str(tmp_path / "t"),
                 "--vocab-size", "300"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "bad.txt" in err and "UTF-8" in err and "\n" not in err
    assert main(["inspect", str(tmp_path / "nowhere")]) == 2
    assert "manifest not found" in capsys.readouterr().err


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "data_pipeline", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "build-corpus" in out.stdout and "inspect" in out.stdout


def test_tokenizer_settings_yaml_is_type_checked(tmp_path, text_file, capsys):
    for i, (text, needle) in enumerate([("tokenizer: 5\n", ":tokenizer: expected a mapping"),
                                        ("tokenizer:\n", ":tokenizer: expected a mapping"),
                                        ("vocab_size: .inf\n", ":vocab_size: expected int"),
                                        ("vocab_size: true\n", ":vocab_size: expected int"),
                                        ("vocab_size: 300\nmodel_type: [bpe]\n", ":model_type: expected str"),
                                        ("1: 2\nfoo: 3\n", "unknown key")]):
        cfg = tmp_path / f"tok{i}.yaml"
        cfg.write_text(text)
        assert main(["--quiet", "train-tokenizer", "--input", str(text_file), "--out-prefix", str(tmp_path / "t"),
                     "--config", str(cfg)]) == 2, text
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {cfg}") and needle in err and "\n" not in err, err


def test_shard_out_dir_that_is_a_file(tmp_path, text_file, capsys):
    from data_pipeline.tokenizer import train_tokenizer

    model = train_tokenizer([text_file], tmp_path / "tok", 400, progress=False)
    target = tmp_path / "afile"
    target.write_text("x")
    assert main(["--quiet", "shard", "--input", str(text_file), "--tokenizer", str(model), "--out-dir", str(target),
                 "--seq-length", "16"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {target}: output directory is an existing file"


def test_inspect_malformed_manifest_is_one_line(tmp_path, capsys):
    (tmp_path / "manifest.json").write_text(json.dumps({"version": "1", "shards": []}))
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "manifest.json: version: expected an integer" in err and "\n" not in err


def test_negative_input_sentence_size_is_one_line(tmp_path, text_file, capsys):
    cfg = tmp_path / "tok.yaml"
    cfg.write_text("vocab_size: 300\ninput_sentence_size: -1\n")
    common = ["--quiet", "train-tokenizer", "--input", str(text_file), "--out-prefix", str(tmp_path / "t")]
    for extra in (["--vocab-size", "300", "--input-sentence-size", "-1"], ["--config", str(cfg)]):
        assert main(common + extra) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"error: {tmp_path / 't'}: input_sentence_size must be 0 (every line) or above 100 (got -1)"
    assert not list(tmp_path.glob("t.*"))


def test_bad_shard_sizes_and_workers_are_refused(tmp_path, text_file, capsys):
    from data_pipeline.tokenizer import train_tokenizer

    model = train_tokenizer([text_file], tmp_path / "tok", 400, progress=False)
    common = ["--quiet", "shard", "--input", str(text_file), "--tokenizer", str(model), "--seq-length", "16",
              "--out-dir", str(tmp_path / "ds")]
    jobs = ["--job-index", "0", "--job-count", "2"]
    for extra, expected in [(["--shard-max-bytes", "-5"], "write_shards: shard_max_bytes must be >= 1 (got -5)"),
                            (["--shard-max-bytes", "0"], "write_shards: shard_max_bytes must be >= 1 (got 0)"),
                            (["--shard-max-bytes", "0", "--workers", "2"], "shard_max_bytes must be >= 1 (got 0)"),
                            (["--shard-max-bytes", "0", *jobs], "shard_max_bytes must be >= 1 (got 0)"),
                            (["--samples-per-shard", "0", *jobs], "samples_per_shard must be >= 1 (got 0)"),
                            (["--workers", "-2"], "shard: --workers must be >= 1 (got -2)"),
                            (["--workers", "0", *jobs], "shard: --workers must be >= 1 (got 0)")]:
        assert main(common + extra) == 2, extra
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and err.endswith(expected) and "\n" not in err, err
        assert not (tmp_path / "ds").exists() or not any((tmp_path / "ds").iterdir()), extra
    assert main(["--quiet", "merge", str(tmp_path / "ds"), "--workers", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: merge: --workers must be >= 1 (got 0)"


def test_quiet_is_taken_before_or_after_the_step():
    """docs/data.md: every step with progress bars (--quiet to silence); after the step's name it was
    refused as an unrecognized argument."""
    from data_pipeline.cli import _parser

    steps = {"build-corpus": ["--out", "c.jsonl"], "train-tokenizer": ["--input", "c", "--out-prefix", "t"],
             "shard": ["--input", "c", "--tokenizer", "t.model", "--out-dir", "d", "--seq-length", "8"],
             "merge": ["d"], "inspect": ["d"]}
    for step, rest in steps.items():
        assert _parser().parse_args([step, *rest, "--quiet"]).quiet is True, step
        assert _parser().parse_args(["--quiet", step, *rest]).quiet is True, step
        assert _parser().parse_args([step, *rest]).quiet is False, step


def test_both_shard_sizes_are_refused_not_one_ignored(tmp_path, text_file, capsys):
    """--samples-per-shard won and --shard-max-bytes was dropped without a word (exit 0)."""
    import pytest

    from data_pipeline.errors import DataError
    from data_pipeline.shards import write_shards
    from data_pipeline.tokenizer import train_tokenizer

    model = train_tokenizer([text_file], tmp_path / "tok", 400, progress=False)
    with pytest.raises(SystemExit) as info:
        main(["shard", "--input", str(text_file), "--tokenizer", str(model), "--seq-length", "16", "--out-dir",
              str(tmp_path / "ds"), "--samples-per-shard", "200", "--shard-max-bytes", "100000", "--quiet"])
    assert info.value.code == 2
    assert "argument --shard-max-bytes: not allowed with argument --samples-per-shard" in capsys.readouterr().err
    with pytest.raises(DataError, match="give samples_per_shard or shard_max_bytes, not both"):
        write_shards([text_file], Tokenizer.load(model), tmp_path / "ds2", 16, samples_per_shard=200,
                     shard_max_bytes=100_000, progress=False)
    assert not (tmp_path / "ds").exists() and not (tmp_path / "ds2").exists()


def test_a_tokenizer_or_corpus_that_exists_is_refused_not_replaced(tmp_path, text_file, capsys):
    """train-tokenizer replaced a tokenizer that shards and checkpoints recorded the hash of (they no
    longer loaded), build-corpus a user's own JSONL: both refuse, before any work, and keep the file."""
    from data_pipeline.tokenizer import train_tokenizer

    model = train_tokenizer([text_file], tmp_path / "tok", 400, progress=False)
    before = {p.name: p.read_bytes() for p in tmp_path.glob("tok.*")}
    assert main(["--quiet", "train-tokenizer", "--input", str(text_file), "--out-prefix", str(tmp_path / "tok"),
                 "--vocab-size", "300"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {model}: exists; not replaced (shards and checkpoints made with a tokenizer") \
        and "\n" not in err
    assert {p.name: p.read_bytes() for p in tmp_path.glob("tok.*")} == before
    # a run cut short before its .model (written last) left its sidecars: made again
    (tmp_path / "half.json").write_text(json.dumps({"model_file": "half.model", "sha256": "0" * 64}))
    (tmp_path / "half.vocab").write_text("<unk>\t0\n")
    assert main(["--quiet", "train-tokenizer", "--input", str(text_file), "--out-prefix", str(tmp_path / "half"),
                 "--vocab-size", "400"]) == 0
    assert json.loads((tmp_path / "half.json").read_text())["vocab_size"] == 400
    # a user's own file there, such as the corpus itself named corpus.json, was written over (exit 0)
    corpus = tmp_path / "corpus.json"
    corpus.write_text(text_file.read_text())
    for taken in (corpus, tmp_path / "notes.vocab"):
        taken.write_text(taken.read_text() if taken.exists() else "mine")
        kept = taken.read_text()
        assert main(["--quiet", "train-tokenizer", "--input", str(text_file), "--out-prefix",
                     str(taken.with_suffix("")), "--vocab-size", "300"]) == 2
        assert capsys.readouterr().err.strip() == (f"error: {taken}: exists; not replaced (not a sidecar of a "
                                                   "tokenizer trained there: choose another --out-prefix)")
        assert taken.read_text() == kept and not taken.with_suffix(".model").exists()
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"text": "my precious data"}\n')
    assert main(["--quiet", "build-corpus", "--out", str(mine), "--max-bytes", "2000"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {mine}: exists; not replaced (a corpus is never replaced: "
                                               "choose another --out or remove it)")
    assert mine.read_text() == '{"text": "my precious data"}\n'


def test_a_reserved_piece_as_special_token_or_two_names_for_one_list_are_refused(tmp_path, text_file, capsys):
    """--special-token '</s>' trained a tokenizer without eos (eos_id -1, stored in shards as 65535),
    '<unk>' failed in sentencepiece's words; a YAML giving special_tokens and user_defined_symbols
    silently dropped one list. A tokenizer without eos is refused by shard."""
    common = ["--quiet", "train-tokenizer", "--input", str(text_file), "--out-prefix", str(tmp_path / "t"),
              "--vocab-size", "300"]
    for piece, pid in (("</s>", 3), ("<s>", 2), ("<pad>", 0), ("<unk>", 1)):
        assert main(common + ["--special-token", piece]) == 2
        assert capsys.readouterr().err == (f"error: --special-token {piece}: a reserved piece (id {pid}); "
                                           "reserved: <pad> <unk> <s> </s>\n")
    assert main(common + ["--special-token", ""]) == 2
    assert capsys.readouterr().err == "error: --special-token: an empty special token\n"
    cfg = tmp_path / "tk.yaml"
    cfg.write_text('vocab_size: 300\nspecial_tokens: ["<x>"]\nuser_defined_symbols: ["<y>"]\n')
    assert main(["--quiet", "train-tokenizer", "--input", str(text_file), "--out-prefix", str(tmp_path / "t"),
                 "--config", str(cfg)]) == 2
    assert capsys.readouterr().err == (f"error: {cfg}:special_tokens: special_tokens and user_defined_symbols are "
                                       "one setting (two names): give one\n")
    assert not list(tmp_path.glob("t.*"))


def test_shard_refuses_a_tokenizer_without_an_end_of_document_piece(tmp_path, text_file, capsys):
    import sentencepiece as spm

    buf = __import__("io").BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text_file.read_text().splitlines()), model_writer=buf,
                                   vocab_size=300, eos_id=-1, minloglevel=2, hard_vocab_limit=False)
    model = tmp_path / "noeos.model"
    model.write_bytes(buf.getvalue())
    assert main(["--quiet", "shard", "--input", str(text_file), "--tokenizer", str(model), "--seq-length", "16",
                 "--out-dir", str(tmp_path / "ds")]) == 2
    assert capsys.readouterr().err == (f"error: {model}: has no end-of-document piece (eos_id -1): shards separate "
                                       "documents with it; train one with eos\n")
    assert not (tmp_path / "ds").exists()


def test_size_flags_take_whole_numbers_written_as_in_yaml(tmp_path, capsys):
    """--max-bytes 1e6 was refused by argparse ('invalid int value') although docs/data.md says numbers
    like 1e4 are accepted; 2.5 is still refused."""
    out = tmp_path / "c.jsonl"
    assert main(["--quiet", "build-corpus", "--out", str(out), "--max-bytes", "2e4"]) == 0
    text_bytes = sum(len(json.loads(line)["text"].encode()) for line in out.read_text().splitlines())
    assert 10_000 < text_bytes <= 20_000
    with pytest.raises(SystemExit):
        main(["--quiet", "build-corpus", "--out", str(tmp_path / "d.jsonl"), "--max-bytes", "2.5e3x"])
    assert "expected a whole number, got '2.5e3x'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--quiet", "train-tokenizer", "--input", str(out), "--out-prefix", str(tmp_path / "t"),
              "--vocab-size", "300.5"])
    assert "expected a whole number, got '300.5'" in capsys.readouterr().err
    from data_pipeline.cli import _count

    assert _count("9007199254740993") == 9007199254740993 and _count("6_000_000") == 6_000_000  # exact


def test_a_vocabulary_smaller_than_the_corpus_characters_names_the_size_needed(tmp_path, text_file, capsys):
    """sentencepiece's own message leaked C++ source lines and named --character_coverage, a flag this
    command does not have."""
    assert main(["--quiet", "train-tokenizer", "--input", str(text_file), "--out-prefix", str(tmp_path / "t"),
                 "--vocab-size", "20"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: vocab_size 20: below the ") and "pieces this corpus needs" in err, err
    assert "trainer_interface" not in err and "character_coverage" not in err and err.count("\n") == 1


def _wait_for_children_ignoring_sigint(pid: int, count: int, deadline: float) -> None:
    """Until ``pid`` has ``count`` pool workers (spawned children; multiprocessing's resource tracker is
    one more child) and every child ignores SIGINT: a Ctrl-C before a spawned worker's initializer ran
    interrupts its start-up with a traceback, which no fixed sleep rules out under load."""
    import signal
    import time

    while time.monotonic() < deadline:
        try:
            kids, workers = children(pid), spawned_children(pid)
            if len(workers) >= count and all(has_signal(c, "SigIgn", signal.SIGINT) for c in kids):
                return
        except (OSError, StopIteration):  # a process that came or went while being read
            pass
        time.sleep(0.1)
    raise AssertionError(f"the shard run's {count} pool workers never started")


@pytest.mark.parametrize("signame,status,workers,group", [
    ("SIGTERM", 143, 1, False), ("SIGINT", 130, 1, False), ("SIGTERM", 143, 2, False),
    ("SIGINT", 130, 2, False), ("SIGINT", 130, 2, True), ("SIGTERM", 143, 2, True)])
def test_a_stopped_shard_run_removes_its_temporary_directory_in_one_line(tmp_path, text_file, signame, status,
                                                                          workers, group):
    """SIGTERM (timeout, scancel, docker stop) left OUT/.shards-tmp-* behind, SIGINT printed a
    KeyboardInterrupt traceback. The input is a FIFO nobody writes: the run waits in open().
    With --workers, SIGINT to the main process alone waited for the pool forever, and a terminal's
    Ctrl-C (group: the signal reaches the workers too) printed the workers' tracebacks."""
    import os
    import signal
    import time

    from data_pipeline.tokenizer import train_tokenizer

    model = train_tokenizer([text_file], tmp_path / "tok", 400, progress=False)
    fifo, out = tmp_path / "in.txt", tmp_path / "ds"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-m", "data_pipeline", "--quiet", "shard", "--input", str(fifo),
                             str(text_file), "--tokenizer", str(model), "--seq-length", "16", "--out-dir", str(out),
                             "--workers", str(workers)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # xdist workers ignore it
                            start_new_session=group)
    deadline = time.monotonic() + 60
    temporaries = ".shards-tmp-*" if workers == 1 else ".parts-tmp-*"  # --workers: a worker waits in open()
    while not list(out.glob(temporaries)) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert list(out.glob(temporaries)), "the run never made its temporary directory"
    if workers == 1:
        time.sleep(0.5)
    else:  # the pool's workers spawned and past their initializer (SIGINT ignored): under load that takes
        _wait_for_children_ignoring_sigint(proc.pid, workers, deadline)  # longer than any fixed sleep
    if group:  # what a terminal does: the whole foreground process group
        os.killpg(proc.pid, getattr(signal, signame))
    else:
        proc.send_signal(getattr(signal, signame))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == status
    assert err == f"error: data-pipeline shard: stopped by {signame} (its temporary files were removed)\n"
    assert not list(out.glob(".shards-tmp-*")) and not list(out.glob(".parts-tmp-*"))


def test_inspect_refuses_negative_counts(tmp_path, capsys):
    """inspect --top -1 listed every row but one (a slice from the end) instead of refusing."""
    for flag in ("--top", "--sample"):
        assert main(["--quiet", "inspect", str(tmp_path), flag, "-1"]) == 2
        assert capsys.readouterr().err == f"error: {flag}: must be >= 0 (got -1)\n"


def test_a_shard_size_below_one_sample_is_refused(tmp_path, text_file, capsys):
    """--shard-max-bytes 10 wrote one sample per shard (11,868 shards of ~10 KiB each) without a word."""
    from data_pipeline.tokenizer import train_tokenizer

    model = train_tokenizer([text_file], tmp_path / "tok", 400, progress=False)
    assert main(["--quiet", "shard", "--input", str(text_file), "--tokenizer", str(model), "--seq-length", "16",
                 "--out-dir", str(tmp_path / "ds"), "--shard-max-bytes", "10"]) == 2
    assert capsys.readouterr().err == ("error: write_shards: shard_max_bytes 10 is below one sample's shard (10240 "
                                       "bytes for 17 tokens of uint16): give at least 10240\n")
    assert not list((tmp_path / "ds").glob("*")) and not list((tmp_path / "ds").glob(".*"))  # nothing written
    assert main(["--quiet", "shard", "--input", str(text_file), "--tokenizer", str(model), "--seq-length", "16",
                 "--out-dir", str(tmp_path / "ds"), "--shard-max-bytes", "10240"]) == 0


def test_a_ctrl_c_while_the_pool_workers_start_is_one_line(tmp_path, text_file):
    """A terminal's Ctrl-C in the first second of a --workers run, while the spawned workers still
    import (before their initializer ignores SIGINT), printed their KeyboardInterrupt tracebacks. They
    start with SIGINT blocked (inherited from the submit that started them) until they ignore it."""
    import os
    import signal
    import time

    from data_pipeline.tokenizer import train_tokenizer

    model = train_tokenizer([text_file], tmp_path / "tok", 400, progress=False)
    fifo, out = tmp_path / "in.txt", tmp_path / "ds"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-m", "data_pipeline", "--quiet", "shard", "--input", str(fifo),
                             str(text_file), "--tokenizer", str(model), "--seq-length", "16", "--out-dir", str(out),
                             "--workers", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), start_new_session=True)
    deadline, workers = time.monotonic() + 60, []
    while len(workers) < 2 and time.monotonic() < deadline and proc.poll() is None:
        try:
            workers = spawned_children(proc.pid)
        except OSError:  # a process that came or went while being read
            pass
        time.sleep(0.01)
    assert len(workers) == 2, "the shard run's pool workers never started"
    held_off = {c: has_signal(c, "SigBlk", signal.SIGINT) or has_signal(c, "SigIgn", signal.SIGINT) for c in workers}
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert all(held_off.values()), f"a worker took SIGINT while it started: {held_off}"
    assert proc.returncode == 130
    assert err == "error: data-pipeline shard: stopped by SIGINT (its temporary files were removed)\n"
