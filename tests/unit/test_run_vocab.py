"""print-config and plan on a fresh clone: every committed run config works before its tokenizer
exists, with the vocabulary the run will have (stated as such) and one line naming the command that
makes the missing tokenizer; an ablation grid is one line pointing to `ascender-dist ablate`."""

from pathlib import Path

import pytest
import yaml

from ascender_dist.cli import main as cli_main
from ascender_dist.config import ConfigError, derive, load_config
from ascender_dist.config.resolve import config_from_dict
from ascender_dist.models.counting import count_model
from ascender_dist.tools.plan import plan_main
from ascender_dist.tools.run_vocab import run_vocab

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RUN_CONFIGS = [CONFIGS / "demo.yaml", *sorted((CONFIGS / "scaling").glob("*.yaml"))]
GRIDS = sorted((CONFIGS / "ablations").glob("*.yaml"))


@pytest.fixture
def fresh_clone(tmp_path, monkeypatch):
    """A working directory without data/ or runs/: relative tokenizer paths do not exist."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: p.name)
def test_print_config_and_plan_before_the_tokenizer_exists(path, fresh_clone, capsys):
    raw = yaml.safe_load(path.read_text())
    vocab = raw["model"]["vocab_size"]
    tokenizer = raw["data"]["tokenizer"]
    assert not Path(tokenizer).exists()
    assert cli_main(["print-config", "--config", str(path)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert f"# vocab size (before padding): {vocab} (model.vocab_size, the size the run will have)" in out
    hint = [line for line in out.splitlines() if "does not exist yet" in line]
    assert len(hint) == 1 and hint[0].startswith(f"# {tokenizer} does not exist yet; make it with: "
                                                 "data-pipeline train-tokenizer ")
    assert f"--out-prefix {tokenizer[:-len('.model')]} --vocab-size {vocab}" in hint[0]
    cfg = load_config(path)
    params = count_model(cfg.model, vocab, cfg.parallel.tensor_model_parallel_size).total_params
    assert f"# parameters: {params:,} total" in out
    gpus = "2" if path.name == "demo.yaml" else "8"  # the demo runs on 2 ranks
    assert plan_main(["--config", str(path), "--gpus-per-node", gpus]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert f"- vocab size {vocab} (model.vocab_size, the size the run will have)" in out
    assert f"| {params:,} (vocab {vocab} padded to" in out
    assert sum("does not exist yet; make it with: data-pipeline train-tokenizer" in line
               for line in out.splitlines()) == 1


def test_scaling_time_matches_the_readme(fresh_clone, capsys):
    """The README's gpt-large row (6.8 h on one 8 x H100 node at MFU 0.4) comes from the stated vocab."""
    assert plan_main(["--config", str(CONFIGS / "scaling" / "gpt-large.yaml")]) == 0
    assert "| 6.8 h at MFU 0.4" in capsys.readouterr().out


@pytest.mark.parametrize("path", GRIDS, ids=lambda p: p.name)
def test_ablation_grid_is_one_line_pointing_to_ablate(path, capsys):
    for command in (["print-config", "--config", str(path)], ["plan", "--config", str(path)]):
        assert cli_main(command) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, err
        assert err == (f"error: {path}: an ablation grid (base + variants/axes), not a run config: "
                       f"run it with `ascender-dist ablate {path}`\n")


def _cfg(model: dict, tokenizer: str = "") -> object:
    return config_from_dict({"model": {"architecture": "gpt", "preset": "debug", **model},
                             "data": {"tokenizer": tokenizer}})


def test_vocab_sources_in_the_trainer_order(tmp_path):
    from data_pipeline.tokenizer import train_tokenizer

    corpus = tmp_path / "c.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 200, encoding="utf-8")
    model = str(train_tokenizer([corpus], tmp_path / "tok", 300, progress=False))
    from data_pipeline.tokenizer import Tokenizer

    pieces = Tokenizer.load(Path(model)).vocab_size
    found = run_vocab(_cfg({}, model), None, 50304)
    assert (found.size, found.hint) == (pieces, None) and str(model) in found.source
    found = run_vocab(_cfg({}, model), 999, 50304)  # the file wins over --vocab-size, as in training
    assert found.size == pieces
    found = run_vocab(_cfg({}, str(tmp_path / "missing.model")), 777, 50304)
    assert found.size == 777 and found.source.startswith("--vocab-size")
    assert "missing.model does not exist yet" in found.hint and "--vocab-size 777" in found.hint
    found = run_vocab(_cfg({}), None, 50304)
    assert found.size == 50304 and found.source.startswith("ASSUMED") and found.hint is None
    found = run_vocab(_cfg({"vocab_size": 100}, model), None, 50304)
    assert found.size == 100 and f"has {pieces} pieces, more than model.vocab_size 100" in found.hint
    for bad in (0, 2**31, 10**29):  # the bound model.vocab_size has (plan's too): 10**29 printed a count
        with pytest.raises(ConfigError, match=r"--vocab-size: must be in \[1, 2\*\*31\)"):
            run_vocab(_cfg({}), bad, 50304)
    with pytest.raises(ConfigError, match=rf"data.tokenizer: {tmp_path} is not a file"):  # not "make it with"
        run_vocab(_cfg({}, str(tmp_path)), None, 50304)


def test_training_refuses_a_tokenizer_larger_than_the_stated_vocab():
    cfg = _cfg({"vocab_size": 4096}, "tok.model")
    assert derive(cfg, 1, 4000).padded_vocab_size == 4096  # fewer pieces: some rows unused, allowed
    with pytest.raises(ConfigError, match=r"^model.vocab_size: 4096 is smaller than the tokenizer's 5000 pieces"):
        derive(cfg, 1, 5000)


def test_print_config_and_plan_assume_one_vocab_size(tmp_path, capsys):
    """print-config assumed 32000 and plan 50304 for one config without a vocab: two parameter counts."""
    import re

    path = tmp_path / "run.yaml"
    path.write_text("model:\n  preset: small\ntrain:\n  micro_batch_size: 4\n  global_batch_size: 32\n")
    assert cli_main(["print-config", "--config", str(path)]) == 0
    printed = capsys.readouterr().out
    assert cli_main(["plan", "--config", str(path)]) == 0
    planned = capsys.readouterr().out
    assert "# vocab size (before padding): 50304 (ASSUMED" in printed
    params = re.search(r"# parameters: ([\d,]+) total", printed).group(1)
    assert params in planned, (params, planned[:400])
