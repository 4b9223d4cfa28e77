"""benchmarks/fast_path_equality: the fast path is deterministic, and a one-ulp change is caught."""

import pytest
import torch

from benchmarks.fast_path_equality import CONFIGS, differing, fast_path_results, main


def _small():
    return fast_path_results({"causal": CONFIGS["causal"]}, lengths=(40,), dtypes=(torch.float64,))


def test_two_runs_are_bit_identical_and_a_one_ulp_change_is_named():
    a, b = _small(), _small()
    assert differing(a, b) == []
    key = next(iter(b))
    b[key][2] = b[key][2].clone()
    b[key][2].view(-1)[0] = torch.nextafter(b[key][2].view(-1)[0], torch.tensor(float("inf"), dtype=torch.float64))
    assert differing(a, b) == [f"{key} tensor 2, max |diff| {(a[key][2] - b[key][2]).abs().max().item():.3g}"]
    del b[key]
    assert differing(a, b) == [f"{key}: only in one file"]


def test_compare_names_a_missing_or_foreign_file_in_one_line(tmp_path, capsys):
    foreign = tmp_path / "foreign.pt"
    torch.save(torch.zeros(3), foreign)
    for path, words in ((tmp_path / "missing.pt", "no such file"), (foreign, "not a file written by 'save'")):
        with pytest.raises(SystemExit) as exit_:
            main(["compare", str(path), str(path)])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert str(path) in err and words in err
