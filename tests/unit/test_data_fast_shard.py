"""The vectorised shard decoder against webdataset's general parser (the reference), and its
refusal (None -> general path) of anything outside the exact layout encode_shard writes."""

from __future__ import annotations


import numpy as np
import pytest

from data_pipeline.fast_shard import decode_regular_shard, probe_layout
from data_pipeline.loader import ShardChecks, ShardSpec, _decode_samples_and_meta, _parse_tar
from data_pipeline.shards import encode_shard, npy_bytes

from .data_fixtures import tar_of

META = {"tokenizer_sha256": "f" * 64, "seq_length": 9, "dtype": "uint16", "vocab_size": 70000}


def reference(data: bytes, seq: int) -> np.ndarray:
    return _decode_samples_and_meta(ShardSpec("x.tar", -1), _parse_tar("x.tar", data), ShardChecks(seq))[0]


@pytest.mark.parametrize("dtype,n", [(np.uint16, 1), (np.uint16, 37), (np.int32, 5)])
def test_fast_decoder_equals_webdataset_parser(dtype, n):
    rng = np.random.default_rng(n)
    rows = [rng.integers(0, 60000, 10) for _ in range(n)]
    data = encode_shard(rows, np.dtype(dtype), {**META, "dtype": np.dtype(dtype).name})
    arr, meta = decode_regular_shard(data, 9)
    ref = reference(data, 9)
    assert arr.dtype == ref.dtype and np.array_equal(arr, ref) and np.array_equal(arr, np.stack(rows))
    assert meta is not None and b'"seq_length": 9' in meta


def test_anything_irregular_goes_to_the_general_parser():
    good = encode_shard([np.arange(10)] * 4, np.dtype(np.uint16), META)
    row = npy_bytes(np.arange(10, dtype=np.uint16))
    cases = {
        "truncated": good[:5632],  # 4 samples + meta end at 5120; half of the end-of-archive blocks left
        "cut-in-member": good[:1500],
        "wrong-seq": encode_shard([np.arange(12)] * 3, np.dtype(np.uint16), META),
        "other-member": tar_of([("000000.tokens.npy", row), ("000000.txt", b"hi")]),
        "duplicate-key": tar_of([("000000.tokens.npy", row), ("000000.tokens.npy", row)]),
        "mixed-dtype": tar_of([("000000.tokens.npy", row),
                               ("000001.tokens.npy", npy_bytes(np.arange(10, dtype=np.int16)))]),
        "float": tar_of([("000000.tokens.npy", npy_bytes(np.arange(10, dtype=np.float32)))]),
        "empty": tar_of([]),
        "garbage": b"not a tar" * 200,
    }
    assert decode_regular_shard(good[:6144], 9) is not None  # record padding after the end blocks is optional
    for name, data in cases.items():
        assert decode_regular_shard(data, 9) is None, name


def reader(data: bytes):
    return lambda offset, length: data[offset:offset + length]


@pytest.mark.parametrize("dtype,n", [(np.uint16, 1), (np.uint16, 2), (np.uint16, 37), (np.int32, 5)])
def test_positioned_reads_equal_the_whole_shard_decode(dtype, n):
    rng = np.random.default_rng(n)
    rows = [rng.integers(0, 60000, 10) for _ in range(n)]
    data = encode_shard(rows, np.dtype(dtype), {**META, "dtype": np.dtype(dtype).name})
    layout = probe_layout(reader(data), len(data), n, 9)
    assert layout is not None and layout.meta == decode_regular_shard(data, 9)[1]
    got = np.stack([layout.read_row(reader(data), i) for i in range(n)])
    assert got.dtype == np.dtype(dtype) and np.array_equal(got, reference(data, 9))


def test_probe_refuses_other_layouts_and_wrong_counts():
    good = encode_shard([np.arange(10)] * 4, np.dtype(np.uint16), META)
    row = npy_bytes(np.arange(10, dtype=np.uint16))
    cases = {  # (bytes, the sample count a manifest would claim)
        "count-low": (good, 3),
        "count-high": (good, 5),
        "truncated": (good[:5632], 4),
        "cut-in-member": (good[:1500], 4),
        "wrong-seq": (encode_shard([np.arange(12)] * 3, np.dtype(np.uint16), META), 3),
        "other-member": (tar_of([("000000.tokens.npy", row), ("000000.txt", b"hi")]), 1),
        "other-member-each": (tar_of([("000000.tokens.npy", row), ("000000.txt", b"hi"),
                                      ("000001.tokens.npy", row), ("000001.txt", b"hi")]), 2),
        "duplicate-key": (tar_of([("000000.tokens.npy", row), ("000000.tokens.npy", row)]), 2),
        "mixed-dtype": (tar_of([("000000.tokens.npy", row),
                                ("000001.tokens.npy", npy_bytes(np.arange(10, dtype=np.int16)))]), 2),
        "float": (tar_of([("000000.tokens.npy", npy_bytes(np.arange(10, dtype=np.float32)))]), 1),
        "empty": (tar_of([]), 1),
        "garbage": (b"not a tar" * 200, 1),
    }
    assert probe_layout(reader(good), len(good), 4, 9) is not None
    assert probe_layout(reader(good[:6144]), 6144, 4, 9) is not None  # record padding is optional
    for name, (data, n) in cases.items():
        assert probe_layout(reader(data), len(data), n, 9) is None, name


def test_read_row_refuses_a_changed_sample_header():
    good = encode_shard([np.arange(10)] * 4, np.dtype(np.uint16), META)
    layout = probe_layout(reader(good), len(good), 4, 9)
    pos = layout.header_offset(2)
    size_changed = bytearray(good)
    size_changed[pos + 124:pos + 135] = b"00000000001"  # the tar header's size field
    npy_changed = bytearray(good)
    npy_changed[pos + 512 + 20] ^= 1  # a byte of the .npy header
    for data in (bytes(size_changed), bytes(npy_changed)):
        assert layout.read_row(reader(data), 2) is None
        assert np.array_equal(layout.read_row(reader(data), 3), np.arange(10))
