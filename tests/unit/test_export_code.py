"""The code a remote-code export carries: the sha256 that keeps the lm-eval export cache honest
(``export_code_sha256``) covers every source file hf/vendor.py copies into an export, and no file of
an export reads like an import of ascender_dist to transformers releases that scan imports by regex
(they would refuse to load it where ascender-dist is not installed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ascender_dist.hf.vendor import VENDORED_CONFIG, vendor_kernels
from ascender_dist.tools.hf_export import export_code_sha256

ROOT = Path(__file__).resolve().parents[2]
HEADER = re.compile(r"^# Vendored by ascender-dist export-hf from \S+ \((\S+)\); do not edit\.$")
# transformers' dynamic_module_utils.get_imports before it parsed the AST: any line that starts
# with an import statement counts, docstrings and comments included
OLD_TRANSFORMERS_IMPORT = re.compile(r"^\s*(?:from|import)\s+ascender_dist", flags=re.MULTILINE)


def _vendored_sources(out: Path) -> dict[str, Path]:
    """{file written into an export: the source file it is a copy of}, from the copies' headers."""
    written = vendor_kernels(out)
    sources = {}
    for name in written:
        if name == "ascender_dist_kernels.py":  # generated, from nothing but vendor.py's lists
            continue
        match = HEADER.match((out / name).read_text().splitlines()[0])
        assert match, f"{name}: no vendoring header"
        sources[name] = ROOT / (match.group(1).replace(".", "/") + ".py")
    return sources


def test_every_vendored_source_file_is_in_the_export_code_hash(tmp_path, monkeypatch):
    """Whatever vendor.py ships (also after a module is added there), editing its source changes
    export_code_sha256(): the lm-eval export cache is then exported again, not re-used with old math."""
    sources = _vendored_sources(tmp_path)
    assert {f"asd_config_{m}.py" for m in VENDORED_CONFIG} <= set(sources)  # the ones the review found missing
    before = export_code_sha256()
    for name, source in sorted(sources.items()):
        assert source.is_file(), (name, source)
        real = Path.read_bytes

        def edited(path, source=source, real=real):
            data = real(path)
            return data + b"\n# edited\n" if Path(path).resolve() == source.resolve() else data

        monkeypatch.setattr(Path, "read_bytes", edited)  # as if the file were edited (no real file touched)
        assert export_code_sha256() != before, f"{source.relative_to(ROOT)} (shipped as {name}) is not hashed"
        monkeypatch.undo()
    assert export_code_sha256() == before


MIXED = {"num_layers": 3, "layer_pattern": "SCA",
         "ascender": {"d_z": 4, "d_a": 4, "k": 4, "window": 8, "num_global": 1},
         "connection": {"num_slots": 4, "rank": 4, "max_steps": 3, "causal_chunk_size": 8}}


def _consolidated(out: Path, model: dict) -> Path:
    """A consolidated directory of a tiny model (``model``: config overrides), fresh weights."""
    from ascender_dist.config.resolve import config_from_dict
    from ascender_dist.hf.modeling_ascender_dist import AscenderDistForCausalLM
    from ascender_dist.tools.convert import write_consolidated
    from ascender_dist.tools.hf_export import remote_code_config, remote_code_state

    meta = {"format": 1, "step": 3, "architecture": "gpt", "world_size": 1, "vocab_size": 96,
            "padded_vocab_size": 128, "data": {"consumed_samples": 8, "seed": 1},
            "versions": {"megatron-core": "0.16.1", "deepspeed": "0.19.8"}}
    cfg = config_from_dict({"name": "tiny", "model": model})
    config = remote_code_config(cfg, meta, 96, tied=True)
    fixed = remote_code_state({}, config)  # the buffers export-hf derives from the config
    state = {name.removeprefix("model."): t for name, t in AscenderDistForCausalLM(config).state_dict().items()
             if name != "lm_head.weight" and name not in fixed}
    write_consolidated(out, state, cfg, meta)
    return out


@pytest.fixture
def remote_code_export(tmp_path) -> Path:
    """A remote-code export (every file export-hf writes for one) of a tiny model with all three
    layer kinds, so the ASCender and Connection math and the kernels travel."""
    from ascender_dist.tools.hf_export import export_hf

    return export_hf(_consolidated(tmp_path / "cons", MIXED), tmp_path / "hf")


def test_no_export_file_reads_like_an_import_of_ascender_dist(remote_code_export):
    files = sorted(remote_code_export.glob("*.py"))
    names = {p.name for p in files}
    assert {"modeling_ascender_dist.py", "asd_ascender_kernels.py", "asd_connection_layer.py",
            "asd_config_errors.py"} <= names, names
    found = [f"{p.name}:{p.read_text()[:m.start()].count(chr(10)) + 1}: {m.group(0).strip()}"
             for p in files for m in OLD_TRANSFORMERS_IMPORT.finditer(p.read_text())]
    assert found == []


def test_the_old_regex_catches_a_docstring_import_line():
    """The scan above is not vacuous: the kernels docstring line the review found reads as an import."""
    assert OLD_TRANSFORMERS_IMPORT.search('"""Kernels.\n\n    from ascender_dist.models.ascender.kernels import x\n"""')


@pytest.mark.parametrize("model,remote", [(MIXED, True), ({}, False)], ids=["remote-code", "gpt-neox"])
def test_export_hf_says_how_to_load_the_export(tmp_path, capsys, model, remote):
    """A remote-code export loads only with trust_remote_code=True: the success line says so."""
    from ascender_dist.cli import main

    out = tmp_path / "hf"
    assert main(["export-hf", "--consolidated", str(_consolidated(tmp_path / "cons", model)), "--out", str(out)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("wrote "))
    hint = f"AutoModelForCausalLM.from_pretrained({str(out)!r}" + (", trust_remote_code=True)" if remote else ")")
    assert hint in line, line


def test_a_remote_code_export_is_recognised_as_this_installations_code(remote_code_export):
    """What the lm-eval adapter's cache check requires of every export it re-uses (a mismatch
    would re-export on every load, or, worse, a check that passes anything would trust any code)."""
    from ascender_dist.tools.hf_export import code_is_installed_code, installed_code_digests

    assert {p.name for p in remote_code_export.glob("*.py")} == set(installed_code_digests())
    assert code_is_installed_code(remote_code_export)
    vendored = remote_code_export / "asd_connection_layer.py"
    vendored.write_text(vendored.read_text() + "\n# edited\n")
    assert not code_is_installed_code(remote_code_export)


def test_evaluate_and_the_lm_eval_model_run_only_this_installations_export_code(remote_code_export, tmp_path, capsys):
    """An export whose Python files are not the ones this installation writes (another version's,
    edited, from elsewhere) would run them under trust_remote_code: refused in one line before any
    model loads, unless trusted explicitly."""
    from ascender_dist.tools.evaluate import evaluate_main
    from ascender_dist.tools.lm_eval_adapter import AdapterError, require_own_code

    def run(*flags):
        code = evaluate_main([f"tiny={remote_code_export}", "--no-val", "--out", str(tmp_path / "o"), *flags])
        return code, capsys.readouterr().err.strip().splitlines()

    assert run()[0] == 0
    require_own_code(remote_code_export)
    modeling = remote_code_export / "modeling_ascender_dist.py"
    modeling.write_text(modeling.read_text() + "\nimport os  # anything at all\n")
    code, err = run()
    assert code == 2 and len(err) == 1 and "its Python code is not what this ascender-dist installation writes" in err[0]
    assert str(remote_code_export) in err[0]
    with pytest.raises(AdapterError, match="trust_export_code=True"):
        require_own_code(remote_code_export)
    require_own_code(remote_code_export, trusted=True)
    assert run("--trust-export-code")[0] == 0


def test_a_damaged_json_or_weights_file_is_named_not_called_foreign_code(remote_code_export):
    """A truncated tokenizer_config.json was reported as "its Python code is not what this installation
    writes" (with --trust-export-code as the way out), and a truncated model.safetensors was a
    SafetensorError traceback from inside the lm-eval model's loading."""
    from ascender_dist.tools.lm_eval_adapter import AdapterError, check_weights_readable, require_own_code

    require_own_code(remote_code_export)
    check_weights_readable(remote_code_export)
    (remote_code_export / "tokenizer_config.json").write_text("[" * 200_000)  # nesting past the stack
    with pytest.raises(AdapterError, match="tokenizer_config.json: unreadable JSON, truncated or damaged"):
        require_own_code(remote_code_export)
    (remote_code_export / "tokenizer_config.json").write_text('{"model_max_length": 12')
    with pytest.raises(AdapterError) as info:
        require_own_code(remote_code_export)
    message = str(info.value)
    assert message.startswith(f"{remote_code_export / 'tokenizer_config.json'}: unreadable JSON, truncated or "
                              "damaged (JSONDecodeError") and "\n" not in message, message
    weights = remote_code_export / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(AdapterError, match=r"model\.safetensors: unreadable safetensors file, truncated or corrupt"):
        check_weights_readable(remote_code_export)
