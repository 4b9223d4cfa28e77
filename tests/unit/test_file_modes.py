"""Every file we write honours the umask (0644 under the usual 0022), written atomically as before:
manifests, tokenizer.model, consolidated model.safetensors, checkpoint side files."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(params=[0o022, 0o027, 0o002])
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def test_current_umask_is_read_without_changing_it(umask):
    from data_pipeline._io import current_umask

    assert current_umask() == umask and current_umask() == umask


def test_atomic_writes_and_weights_files_get_the_umask_mode(umask, tmp_path):
    from ascender_dist.training.checkpoint import atomic_write_text
    from ascender_dist.training.weights import read_weights_file, write_weights_file
    from data_pipeline._io import atomic_write_bytes, atomic_write_json

    expected = 0o666 & ~umask
    atomic_write_bytes(tmp_path / "a.bin", b"x")
    atomic_write_json(tmp_path / "manifest.json", {"a": 1})
    atomic_write_text(tmp_path / "latest", "step_00000001")
    write_weights_file({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    for name in ("a.bin", "manifest.json", "latest", "model.safetensors"):
        assert _mode(tmp_path / name) == expected, (name, oct(_mode(tmp_path / name)))
    assert torch.equal(read_weights_file(tmp_path / "model.safetensors")["w"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "latest", "manifest.json", "model.safetensors"]


def test_tokenizer_and_shard_manifest_are_readable_by_the_group(tmp_path):
    from tests.helpers.data import make_tiny_dataset

    previous = os.umask(0o022)
    try:
        data = make_tiny_dataset(tmp_path, corpus_bytes=100_000, vocab_size=512)
    finally:
        os.umask(previous)
    for path in (Path(data["tokenizer"]), Path(data["manifest"]), tmp_path / "corpus.jsonl",
                 *sorted((tmp_path / "shards").iterdir())):
        if path.is_file():
            assert _mode(path) == 0o644, (path, oct(_mode(path)))
