"""Is a change to the CPU fast path bit-identical? Outputs and every gradient of one fwd+bwd over
a fixed set of configurations, saved at one commit and compared bit for bit with another.

A speed change that computes the same numbers leaves every training run, and so every research
result made before it, unchanged (benchmarks/results/research/neutral-commits.yaml records such
commits with this evidence); one that only agrees to rounding does not, and the runs must be
made again. The configurations cover both dtypes, causal and bidirectional attention, windowed and
full neighbourhoods, two kernel widths, the aux losses, ALiBi and short chunks, each at a length of
several chunks and at one that is not a multiple of the chunk.

    git worktree add /tmp/before HEAD        # the code before the change
    PYTHONPATH=/tmp/before .venv/bin/python benchmarks/fast_path_equality.py save /tmp/before.pt
    PYTHONPATH=. .venv/bin/python benchmarks/fast_path_equality.py save /tmp/after.pt
    .venv/bin/python benchmarks/fast_path_equality.py compare /tmp/before.pt /tmp/after.pt  # exit 1: differ

(~1 min on a 2-core CPU; PYTHONPATH picks which checkout's ascender_dist is imported.)
"""

from __future__ import annotations

import argparse
import sys

import torch

BASE = dict(d_z=32, d_a=32, k=8, window=64, num_global=2, causal=True)
CONFIGS = {  # name -> AscenderHParams overrides of BASE
    "causal": {},
    "bidirectional": dict(causal=False),
    "full-neighbourhoods": dict(window=0),
    "two-kernel-widths": dict(tau_coh=2.0),
    "aux-losses": dict(aux_crowding_weight=0.1, aux_compactness_weight=0.1, aux_alignment_weight=0.1),
    "alibi": dict(other_bias="alibi"),
    "16-row-chunks": dict(chunk_size=16),
}
LENGTHS = (300, 1000)


def fast_path_results(configs: dict = CONFIGS, lengths=LENGTHS, dtypes=(torch.float32, torch.float64)) -> dict:
    """{"<dtype>/<config>/<n>": [out, grads of q, k, v, z, h, grads of the per-head parameters]}."""
    from ascender_dist.models.ascender import AscenderHeadParams, AscenderHParams, ascender_attention

    results = {}
    for dtype in dtypes:
        for i, (name, over) in enumerate(configs.items()):
            for n in lengths:
                g = torch.Generator().manual_seed(i)

                def mk(d):  # [b, np, s, d]
                    return torch.randn(2, 4, n, d, generator=g, dtype=dtype).requires_grad_()

                q, k, v, z, h = mk(64), mk(64), mk(64), mk(32), mk(32)
                hp = AscenderHParams(**{**BASE, **over})
                params = AscenderHeadParams(hp, 4).to(dtype)
                out = ascender_attention(q, k, v, z, h, params, hp, step=10**6, impl="fast")
                (out * torch.randn(out.shape, generator=g, dtype=dtype)).sum().backward()
                grads = [x.grad for x in (q, k, v, z, h)] + [p.grad for p in params.parameters()]
                results[f"{str(dtype).removeprefix('torch.')}/{name}/{n}"] = [out.detach(), *grads]
    return results


def differing(a: dict, b: dict) -> list[str]:
    """Names of the tensors that are not bit-identical (or missing on one side)."""
    bad = [f"{key}: only in one file" for key in sorted(set(a) ^ set(b))]
    for key in sorted(set(a) & set(b)):
        for i, (x, y) in enumerate(zip(a[key], b[key], strict=True)):
            same = x is None and y is None or x is not None and y is not None and torch.equal(x, y)
            if not same:
                err = "" if x is None or y is None else f", max |diff| {(x - y).abs().max().item():.3g}"
                bad.append(f"{key} tensor {i}{err}")
    return bad


def _load_results(ap: argparse.ArgumentParser, path: str) -> dict:
    """A file written by ``save``, or a one-line error naming the file."""
    try:
        results = torch.load(path)
    except FileNotFoundError:
        ap.error(f"{path}: no such file (write it with: save {path})")
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same one-line error
        ap.error(f"{path}: not a file written by 'save' ({type(exc).__name__})")
    if not isinstance(results, dict) or not all(isinstance(v, list) for v in results.values()):
        ap.error(f"{path}: not a file written by 'save' (expected {{name: [tensors]}})")
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("save").add_argument("path")
    cmp = sub.add_parser("compare")
    cmp.add_argument("before")
    cmp.add_argument("after")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.cmd == "save":
        results = fast_path_results()
        torch.save(results, args.path)
        print(f"saved {len(results)} fwd+bwd results to {args.path}")
        return 0
    before, after = (_load_results(ap, path) for path in (args.before, args.after))
    bad = differing(before, after)
    print("\n".join(bad) if bad else f"bit-identical: {len(before)} fwd+bwd results, every output and gradient")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
