"""ascender / connection (mixed pattern) checkpoints -> Hugging Face trust_remote_code directories.

Tiny models trained on 2 ranks (ascender at TP=2; connection with the pattern SCA, RMSNorm, swiglu,
untied head), consolidated and exported through the CLI, loaded with ``AutoModelForCausalLM``:
logits match our megatron model (TP=1, consolidated weights) within 1e-4, also in a Python that
cannot import ascender_dist (the export carries its own copy of the layer math).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.multiproc import REPO_ROOT
from tests.helpers.single_rank import single_rank_group  # noqa: F401  (fixture)
from tests.integration.test_conversion import cli

pytestmark = pytest.mark.slow

TOKENS = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def exports(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name in ("ascender-tiny", "connection-tiny"):
        proc = cli("export-hf", "--consolidated", sources["consolidated"][name], "--out", str(root / name))
        assert "wrote" in proc.stdout
        out[name] = root / name
    return out


def _megatron_logits(consolidated: str, tokens: torch.Tensor, steps=None) -> tuple[torch.Tensor, ...]:
    """As test_conversion's _our_logits (megatron TP=1, consolidated weights), at step 0 (a freshly
    built model) and at the step the checkpoint's weights last ran with (ASCender's Separation
    warm-up reads the step), or at each of ``steps``."""
    from ascender_dist.config.resolve import derive
    from ascender_dist.training.engine import build_run_model
    from ascender_dist.parallel.setup import init_model_parallel
    from ascender_dist.tools.convert import read_consolidated
    from ascender_dist.training.layer_stats import last_training_step, set_training_step
    from ascender_dist.training.weights import load_canonical_state, pad_vocab

    state, cfg, meta = read_consolidated(Path(consolidated))
    init_model_parallel(1, 1, seed=0)
    derived = derive(cfg, 1, meta["vocab_size"])
    model = build_run_model(cfg, derived).eval()
    load_canonical_state(model, cfg, pad_vocab(state, derived.vocab_size, derived.padded_vocab_size))
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    out = []
    with torch.no_grad():
        for step in steps if steps is not None else (0, last_training_step(meta["step"])):
            set_training_step(model, step)
            out.append(model(tokens, positions, None)[..., : meta["vocab_size"]])
    return tuple(out)


@pytest.mark.parametrize("name", ["ascender-tiny", "connection-tiny"])
def test_remote_code_export_logits_match_megatron(sources, exports, single_rank_group, name):
    from transformers import AutoModelForCausalLM

    out = exports[name]
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_ascender_dist.AscenderDistForCausalLM"
    assert config["layer_pattern"] == {"ascender-tiny": "SS", "connection-tiny": "SCA"}[name]
    for file in ("configuration_ascender_dist.py", "modeling_ascender_dist.py", "ascender_dist_kernels.py",
                 "asd_ascender_attention.py", "asd_ascender_kernels_function.py", "asd_connection_layer.py",
                 "model.safetensors", "tokenizer.model"):
        assert (out / file).is_file(), file
    assert "ascender_dist." not in (out / "ascender_dist_kernels.py").read_text().replace("ascender_dist_kernels", "")
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(hf).__name__ == "AscenderDistForCausalLM"
    with torch.no_grad():
        theirs = hf(TOKENS).logits
    plain, stepped = _megatron_logits(sources["consolidated"][name], TOKENS)
    assert theirs.shape == stepped.shape == (2, 24, 500)
    assert (theirs - stepped).abs().max().item() < 1e-4
    assert (theirs - plain).abs().max().item() < 1e-4  # Separation on from step 0: the step does not matter here


@pytest.mark.parametrize("starts_after", [0, 1], ids=["separation-on", "separation-off"])
def test_separation_warm_up_follows_the_step_the_weights_last_ran_with(sources, tmp_path, single_rank_group,
                                                                       starts_after):
    """The ascender run re-configured so that Separation joins exactly at the step its weights last
    ran with (saved at N: N - 1), or one step later: the export must switch it on, or leave it off,
    as our megatron model at that step does, and differ from the model one step on the other side
    (an ascender_step of N, or of 0, fails one of the two)."""
    import yaml

    from ascender_dist.tools.hf_export import export_hf
    from ascender_dist.training.layer_stats import last_training_step
    from transformers import AutoModelForCausalLM

    source = Path(sources["consolidated"]["ascender-tiny"])
    step = last_training_step(json.loads((source / "meta.json").read_text())["step"])
    assert step >= 1  # a boundary before it exists
    start = step + starts_after
    consolidated = tmp_path / "cons"
    shutil.copytree(source, consolidated)
    raw = yaml.safe_load((consolidated / "config.yaml").read_text())
    assert raw["model"]["ascender"].get("separation_start_step", 0) == 0  # what the other tests see
    raw["model"]["ascender"]["separation_start_step"] = start
    (consolidated / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    out = export_hf(consolidated, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert (config["ascender_step"], config["ascender"]["separation_start_step"]) == (step, start)
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(TOKENS).logits
    other_side = step - 1 if starts_after == 0 else step + 1  # Separation off (on) there
    same, other = _megatron_logits(str(consolidated), TOKENS, steps=(step, other_side))
    assert (theirs - same).abs().max().item() < 1e-4
    assert (same - other).abs().max().item() > 1e-3  # the two sides of the boundary are told apart


def test_export_loads_without_ascender_dist_installed(exports, tmp_path):
    """A fresh interpreter in which `import ascender_dist` fails: model, tokenizer and generate()."""
    script = f"""
import sys, json
sys.modules["ascender_dist"] = None
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
out = {{}}
for name, path in { {k: str(v) for k, v in exports.items()}!r}.items():
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()
    ids = tok("def main():\\n    return 1\\n", return_tensors="pt")["input_ids"]
    gen = model.generate(ids, max_new_tokens=3, do_sample=False)
    tokens = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(tokens).logits
    torch.save(logits, {str(tmp_path)!r} + f"/{{name}}.pt")
    out[name] = {{"roundtrip": tok.decode(ids[0]), "new": gen.shape[1] - ids.shape[1]}}
print(json.dumps(out))
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    from transformers import AutoModelForCausalLM

    for name, value in result.items():
        assert value["roundtrip"] == "def main():\n    return 1\n" and value["new"] == 3
        model = AutoModelForCausalLM.from_pretrained(exports[name], trust_remote_code=True,
                                                     dtype=torch.float32).eval()
        with torch.no_grad():  # every logit, not a sum in which errors could cancel
            torch.testing.assert_close(torch.load(tmp_path / f"{name}.pt"), model(TOKENS).logits, rtol=0, atol=1e-5)


def test_tokenizer_matches_training_tokenizer(sources, exports):
    from transformers import AutoTokenizer

    from data_pipeline.tokenizer import Tokenizer

    ours = Tokenizer.load(Path(sources["data"]["tokenizer"]))
    tok = AutoTokenizer.from_pretrained(exports["ascender-tiny"], trust_remote_code=True)
    for text in ("x = [i ** 2 for i in range(10)]\n", "\tindent  two  spaces\n\n", "unicode: é ✓ 漢字"):
        assert tok(text)["input_ids"] == ours.encode(text)
        assert tok.decode(ours.encode(text)) == text
    assert (tok.eos_token_id, tok.pad_token_id) == (ours.eos_id, ours.pad_id)


def test_gpt_keeps_the_standard_export_and_can_be_forced_to_remote_code(sources, tmp_path, single_rank_group):
    from transformers import AutoModelForCausalLM

    from ascender_dist.tools.hf_export import export_hf

    gpt = sources["consolidated"]["gpt-tiny"]
    standard = export_hf(gpt, tmp_path / "neox")
    assert json.loads((standard / "config.json").read_text())["model_type"] == "gpt_neox"
    assert not (standard / "modeling_ascender_dist.py").exists()
    remote = export_hf(gpt, tmp_path / "remote", remote_code=True)
    a = AutoModelForCausalLM.from_pretrained(standard, dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(remote, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(a).__name__ == "GPTNeoXForCausalLM" and type(b).__name__ == "AscenderDistForCausalLM"
    with torch.no_grad():
        assert (a(TOKENS).logits - b(TOKENS).logits).abs().max().item() < 1e-4


def test_bad_inputs_fail_in_one_line(sources, tmp_path):
    from ascender_dist.tools.convert import ConversionError
    from ascender_dist.tools.hf_export import export_hf

    proc = cli("export-hf", "--consolidated", str(tmp_path / "missing"), "--out", str(tmp_path / "x"), check=False)
    assert proc.returncode == 2 and "not a consolidated directory" in proc.stderr.strip().splitlines()[-1]
    with pytest.raises(ConversionError, match="no standard Hugging Face class"):
        export_hf(sources["consolidated"]["ascender-tiny"], tmp_path / "y", remote_code=False)
    assert not (tmp_path / "y").exists()


def test_left_padded_batch_equals_each_row_alone(exports):
    """Batched generation pads on the left (the export's tokenizer does by default): rows then run on
    their own tokens (no padding mask in S/C). Right-padded rows score, and generating from them is
    refused in one line that says how to pad."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = exports["connection-tiny"]
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()
    texts = ["def main(argv):\n    return 0\n", "import os"]
    batch = tok(texts, return_tensors="pt", padding=True)
    assert batch["attention_mask"][1, 0] == 0  # really left padded
    with torch.no_grad():
        batched = model(**batch).logits
        generated = model.generate(**batch, max_new_tokens=3, do_sample=False)
        for row, text in enumerate(texts):
            ids = tok(text, return_tensors="pt")["input_ids"]
            alone = model(ids).logits[0]
            assert (batched[row, -ids.shape[1]:] - alone).abs().max().item() < 1e-5
            single = model.generate(ids, max_new_tokens=3, do_sample=False)
            assert generated[row, -3:].tolist() == single[0, -3:].tolist()
        right = tok(texts, return_tensors="pt", padding=True, padding_side="right")
        assert right["attention_mask"][1, -1] == 0
        for new_tokens in (1, 2):  # one new token too: it would be predicted at a pad (found by a review)
            with pytest.raises(ValueError, match=r"generate\(\) needs padding_side='left'"):
                model.generate(**right, max_new_tokens=new_tokens, do_sample=False)
