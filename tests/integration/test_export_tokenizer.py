"""Every export (GPT-NeoX, Llama, ASCender, Connection) carries a fast tokenizer that gives our ids.

The exports are made through the CLI from the session's tiny trained runs (``sources``), each
without ``--tokenizer`` (the run's ``data.tokenizer`` is taken). A fresh interpreter with the Hub
offline and ``import ascender_dist`` blocked loads each with ``AutoTokenizer`` and
``AutoModelForCausalLM``: ids and decoded text must equal sentencepiece's (our
``data_pipeline.tokenizer.Tokenizer``) on the strings below, config.json's bos/eos/pad ids the
tokenizer's, and ``generate`` must run. lm-eval, through its own ``hf`` model and through our
``ascender-dist`` model, must see the same ids.
"""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.multiproc import REPO_ROOT
from tests.integration.test_conversion import cli

pytestmark = pytest.mark.slow

STRINGS = [
    "",
    "  two leading spaces",
    "repeated    spaces  and trailing   ",
    "def foo(x):\n    if x:\n        return [i ** 2 for i in range(10)]\n\treturn None\n\n\n",
    "digits 0123456789 and 3.14159e-10",
    "non-Latin: héllo wörld 漢字 テスト Ωμέγα кириллица 😀",
    "literal special text </s> <s> <pad>",
    "\n\n   \t mixed\r\nwhitespace ",
]
EXPORTS = {"gpt-tiny": "GPTNeoXForCausalLM", "llama-tiny": "LlamaForCausalLM",
           "ascender-tiny": "AscenderDistForCausalLM", "connection-tiny": "AscenderDistForCausalLM"}

SCRIPT = """
import json, sys
sys.modules["ascender_dist"] = None  # the export must not need the project
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
exports, strings = json.loads(sys.argv[1]), json.loads(sys.argv[2])
out = {}
for name, path in exports.items():
    remote = "auto_map" in json.load(open(path + "/config.json"))  # the standard architectures need no remote code
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=remote)
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=remote, dtype=torch.float32).eval()
    ids = [tok(text)["input_ids"] for text in strings]
    # room for the 4 new tokens inside the trained context (the remote-code model refuses positions past it)
    prompt = torch.tensor([tok(strings[3])["input_ids"][: model.config.max_position_embeddings - 4]])
    gen = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, min_new_tokens=4,
                         do_sample=False)
    out[name] = {"class": type(model).__name__, "fast": tok.is_fast, "remote": remote, "ids": ids,
                 "decoded": [tok.decode(i) for i in ids],
                 "tokenizer_ids": [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id],
                 "config_ids": [model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id],
                 "generated": gen[0, prompt.shape[1]:].tolist(), "prompt_kept": gen[0, :prompt.shape[1]].tolist()
                 == prompt[0].tolist()}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def exports(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_tok")
    for name in EXPORTS:
        cli("export-hf", "--consolidated", sources["consolidated"][name], "--out", str(root / name))
    return {name: root / name for name in EXPORTS}


def _offline_env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return env


def test_every_export_loads_offline_with_our_ids_and_generates(sources, exports):
    from data_pipeline._io import umask_mode
    from data_pipeline.tokenizer import Tokenizer

    ours = Tokenizer.load(Path(sources["data"]["tokenizer"]))
    for path in exports.values():
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model"):
            assert (path / name).is_file(), path / name
        for file in path.iterdir():  # a group sharing the export directory can read every file (umask 022 here)
            assert stat.S_IMODE(file.stat().st_mode) == umask_mode(), (file, oct(file.stat().st_mode))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps({k: str(v) for k, v in exports.items()}),
                           json.dumps(STRINGS)], cwd=REPO_ROOT, env=_offline_env(), capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("{"), proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1])
    expected_ids = [ours.encode(text) for text in STRINGS]
    assert any(any(ours.sp.is_byte(i) for i in ids) for ids in expected_ids)  # the byte fallback is exercised
    for name, hf_class in EXPORTS.items():
        r = result[name]
        assert r["class"] == hf_class and r["fast"] and r["remote"] == (hf_class == "AscenderDistForCausalLM"), name
        assert r["ids"] == expected_ids, name
        assert r["decoded"] == [ours.decode(ids) for ids in expected_ids] == STRINGS, name
        assert r["tokenizer_ids"] == r["config_ids"] == [ours.bos_id, ours.eos_id, ours.pad_id] == [2, 3, 0], name
        assert r["prompt_kept"] and len(r["generated"]) == 4 and all(0 <= t < 500 for t in r["generated"]), name
        config = json.loads((exports[name] / "config.json").read_text())
        assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (2, 3, 0), name


def test_lm_eval_sees_our_ids(sources, exports):
    """lm-eval's own ``hf`` model and our ``ascender-dist`` model encode requests as sentencepiece,
    context and continuation split as lm-eval splits them (trailing context spaces moved over)."""
    from lm_eval.api.registry import get_model

    from ascender_dist.tools.lm_eval_adapter import register
    from data_pipeline.tokenizer import Tokenizer

    register()
    ours = Tokenizer.load(Path(sources["data"]["tokenizer"]))
    pairs = [("def add(a, b):\n    return", " a + b"), ("x =  ", "1"), ("漢字 テスト", " 😀"), ("", "import os")]
    for name in ("gpt-tiny", "llama-tiny", "connection-tiny"):
        models = [get_model("ascender-dist")(pretrained=str(exports[name]), device="cpu", dtype="float32")]
        if name != "connection-tiny":  # the standard architectures load with plain `--model hf`
            models.append(get_model("hf")(pretrained=str(exports[name]), device="cpu", dtype="float32"))
        for lm in models:
            for text in STRINGS[1:]:
                assert lm.tok_encode(text) == ours.encode(text), (name, type(lm).__name__, text)
                assert lm.tok_decode(ours.encode(text)) == text
            for context, continuation in pairs[:3]:
                context_ids, continuation_ids = lm._encode_pair(context, continuation)
                whole = ours.encode(context + continuation)
                assert context_ids + continuation_ids == whole, (name, context)
                assert context_ids == ours.encode(context.rstrip()), (name, context)
        # our model scores an empty context after EOS, as our documents end (lm-eval's `hf` would take BOS)
        assert models[0].prefix_token_id == ours.eos_id


def test_export_without_a_tokenizer_says_so_and_sets_no_foreign_ids(sources, tmp_path):
    """No --tokenizer and the run's data.tokenizer gone (consolidated on another machine): one error line
    asking for --tokenizer (it exited 0 with an export that never stops at EOS); with --no-tokenizer a
    one-line warning, and config.json carries no special ids at all rather than transformers' defaults
    (another tokenizer's)."""
    import shutil

    import yaml

    source = tmp_path / "consolidated"
    shutil.copytree(sources["consolidated"]["gpt-tiny"], source)
    config = yaml.safe_load((source / "config.yaml").read_text())
    config["data"]["tokenizer"] = str(tmp_path / "gone.model")
    (source / "config.yaml").write_text(yaml.safe_dump(config))
    proc = cli("export-hf", "--consolidated", str(source), "--out", str(tmp_path / "hf"), check=False)
    assert proc.returncode == 2 and not (tmp_path / "hf").exists(), proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {source / 'meta.json'}: the run was trained with a tokenizer (sha256 "
        f"{json.loads((source / 'meta.json').read_text())['tokenizer_sha256'][:12]}...), but its data.tokenizer "
        f"{tmp_path / 'gone.model'} is not a file here: pass --tokenizer PATH/tokenizer.model (or --no-tokenizer for "
        "the weights alone)")
    proc = cli("export-hf", "--consolidated", str(source), "--out", str(tmp_path / "hf"), "--no-tokenizer")
    assert proc.stderr.strip().splitlines()[-1].startswith("warning: no tokenizer in the export")
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert all(exported.get(key) is None for key in ("bos_token_id", "eos_token_id", "pad_token_id")), exported
