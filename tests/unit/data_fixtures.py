"""Shared helpers for the data_pipeline tests (a module, not a conftest, to avoid collisions).

Synthetic datasets make sample identity visible: sample ``i`` of the whole dataset stores
``i // 256`` and ``i % 256`` in its first two tokens, so a test can read back exactly which
samples a loader produced, in which order.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.shards import Manifest, ShardInfo, encode_shard, token_dtype
from data_pipeline._io import sha256_bytes

FAKE_SHA = "f" * 64
SEQ = 8
VOCAB = 300

TEXT = (
    "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n    return a + b\n\n"
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.\n"
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "for i in range(10):\n    print(i * i, end=' ')\n# comment with numbers 12345 and symbols {}[]()\n"
)


def sample_tokens(i: int, seq_length: int = SEQ) -> np.ndarray:
    """Tokens of synthetic sample ``i``: its id in the first two positions, a filler after."""
    row = np.full(seq_length + 1, 7, dtype=np.int64)
    row[0], row[1] = 4 + i // 256, i % 256
    return row


def sample_ids(tokens) -> list[int]:
    """Recover synthetic sample ids from a ``[n, seq+1]`` batch."""
    t = np.asarray(tokens)
    return ((t[:, 0] - 4) * 256 + t[:, 1]).tolist()


def make_dataset(out_dir: Path, train_counts, val_counts=(), seq_length: int = SEQ,
                 tokenizer_sha256: str = FAKE_SHA, vocab_size: int = VOCAB, first_id: int = 0) -> Manifest:
    """Write synthetic shards with the given per-shard sample counts plus a manifest; return it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size)
    meta = {"tokenizer_sha256": tokenizer_sha256, "seq_length": seq_length, "dtype": dtype.name,
            "vocab_size": vocab_size}
    shards, next_id = [], first_id
    for split, counts in (("train", train_counts), ("val", val_counts)):
        for j, n in enumerate(counts):
            rows = [sample_tokens(next_id + k, seq_length) for k in range(n)]
            next_id += n
            data = encode_shard(rows, dtype, meta) if n else _empty_tar()
            name = f"syn-{split}-{j:06d}.tar"
            (out_dir / name).write_bytes(data)
            shards.append(ShardInfo(name, split, n, n * (seq_length + 1), sha256_bytes(data), len(data)))
    m = Manifest(seq_length=seq_length, tokenizer_sha256=tokenizer_sha256, vocab_size=vocab_size,
                 padded_vocab_size=vocab_size, eos_id=3, pad_id=0, dtype=dtype.name, shards=shards)
    m.save(out_dir / "manifest.json")
    return m


def tar_of(members) -> bytes:
    """A ustar archive of ``members`` [(name, payload bytes)], in order."""
    import io
    import tarfile
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tf.addfile(info, io.BytesIO(payload))
    return buf.getvalue()


def _empty_tar() -> bytes:
    """A valid tar archive with no members."""
    import io
    import tarfile
    buf = io.BytesIO()
    tarfile.open(fileobj=buf, mode="w").close()
    return buf.getvalue()


def loader(src, **kw):
    """A StreamingLoader with test defaults (override any keyword)."""
    from data_pipeline.loader import StreamingLoader
    args = dict(seq_length=SEQ, micro_batch_size=2, global_batch_size=8, dp_rank=0, dp_size=1, seed=3,
                shuffle_buffer=16)
    args.update(kw)
    return StreamingLoader(src, **args)


def run_global(make, dp_size: int, steps: int, state=None, micro_batch_size: int = 2, global_batch_size: int = 8):
    """Sample ids of ``steps`` global batches as a data-parallel group of ``dp_size`` ranks sees them,
    concatenated rank by rank within each batch (= the global batch order). Returns (ids, rank-0 state)."""
    loaders = [make(dp_rank=r, dp_size=dp_size, micro_batch_size=micro_batch_size,
                    global_batch_size=global_batch_size) for r in range(dp_size)]
    if state is not None:
        for ld in loaders:
            ld.load_state_dict(state)
    iters = [iter(ld) for ld in loaders]
    micro = global_batch_size // dp_size // micro_batch_size
    ids = []
    for _ in range(steps):
        for it in iters:
            for _ in range(micro):
                ids += sample_ids(next(it)["tokens"])
    return ids, loaders[0].state_dict()


class ThreadRanks:
    """``world`` ranks as threads; ``all_gather`` returns every rank's object in rank order."""

    def __init__(self, world: int):
        self.world, self.slots = world, [None] * world
        self.barrier = threading.Barrier(world, timeout=30)
        self.local = threading.local()

    def rank(self) -> int:
        return self.local.rank

    def all_gather(self, obj) -> list:
        self.slots[self.local.rank] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return out

    def run(self, fn) -> list:
        """``fn(rank)`` on every rank at once: its result, or the exception it raised."""
        results: list = [None] * self.world

        def body(rank):
            self.local.rank = rank
            try:
                results[rank] = fn(rank)
            except Exception as e:  # compared by the test
                results[rank] = e

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a rank hung"
        return results


@pytest.fixture
def text_file(tmp_path) -> Path:
    """A small UTF-8 text file, enough to train a ~400-piece tokenizer in well under a second."""
    p = tmp_path / "text.txt"
    p.write_text(TEXT * 20, encoding="utf-8")
    return p


@pytest.fixture
def tiny_tokenizer(tmp_path, text_file):
    """A trained 400-piece BPE tokenizer, padded to a multiple of 128 (512)."""
    from data_pipeline.tokenizer import Tokenizer, train_tokenizer
    model = train_tokenizer([text_file], tmp_path / "tok", 400, progress=False)
    return Tokenizer.load(model)
