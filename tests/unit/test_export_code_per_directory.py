"""Exports whose directories share a name (``runs/small/hf``, ``runs/medium/hf``) each run their own
remote code when one process loads them, through ``evaluate`` and through the lm-eval adapter:
transformers imports a local directory's code under a package named after the directory, so without
care the second export would run the first one's code. Exports with the same code still load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .export_fixtures import two_tokenizers, write_run  # noqa: F401  (fixtures)

# appended to one export's modeling file: another version of the model's code, whose logits are one higher
LOGITS_PLUS_ONE = '''

_forward_before = AscenderDistForCausalLM.forward


def _forward_plus_one(self, *args, **kwargs):
    out = _forward_before(self, *args, **kwargs)
    out.logits = out.logits + 1.0
    return out


AscenderDistForCausalLM.forward = _forward_plus_one
'''


def _load_with_evaluate(path: Path):
    from ascender_dist.tools import evaluate as ev

    return ev.load_model(ev.parse_run(str(path), str(path.parent / "m.json")))


def _load_with_lm_eval(path: Path):
    from lm_eval.api.registry import get_model

    from ascender_dist.tools.lm_eval_adapter import register

    register()
    # the medium export's code is edited on purpose: trusted explicitly (require_own_code refuses it otherwise)
    return get_model("ascender-dist")(pretrained=str(path), device="cpu", dtype="float32",
                                      trust_export_code=True).model


@pytest.mark.parametrize("load", [_load_with_evaluate, _load_with_lm_eval], ids=["evaluate", "lm-eval"])
def test_exports_in_directories_of_one_name_each_run_their_own_code(two_tokenizers, tmp_path, load):  # noqa: F811
    from ascender_dist.tools.hf_export import export_hf

    run = write_run(tmp_path / "cons", two_tokenizers[0])
    small, medium, large = (export_hf(run, tmp_path / size / "hf", remote_code=True)
                            for size in ("small", "medium", "large"))
    with open(medium / "modeling_ascender_dist.py", "a", encoding="utf-8") as fh:
        fh.write(LOGITS_PLUS_ONE)
    ids = torch.arange(1, 17).unsqueeze(0)
    logits = {}
    for name, path in (("small", small), ("medium", medium), ("large", large)):  # one process, in this order
        with torch.no_grad():
            logits[name] = load(path).eval()(ids).logits
    torch.testing.assert_close(logits["medium"], logits["small"] + 1.0)  # the same weights, its own code
    torch.testing.assert_close(logits["large"], logits["small"])  # the same code as small: loads as before
