"""Packed 16-bit sequences on page pools whose pages no TMA box fits (sizes that are no multiple of
16; SGLang's default is 1): gathered into packed rows then the Gluon forward, against the portable
kernel reading the pages in place (the route before), on an H200.

    PYTHONPATH=src python benchmarks/varlen_gather.py [--out DIR] [--rounds N] [--long]

Per point (32/8 heads, d128, bf16, shuffled pages whose unused slots hold NaN): the public call with
the gather forced (forward.GATHER_MIN_ROWS = 0) and with it refused (inf), each output and LSE
compared bit for bit with the contiguous packed call on the same keys (the gathered route) or held
to the test suite's rule per sequence (the portable one); then CUDA-graph replays of both in
balanced rounds (do_bench medians), the gather's two copies alone, and whether the shipped rule
(GATHER_MIN_ROWS) would gather there. ``--long``: instead, chunks of few queries on long keys
and decode-like batches (LONG_POINTS), where the rule's bound on query rows a sequence is tested.
Writes varlen-gather.json under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from helpers import assert_matches_reference  # noqa: E402

import flashtile  # noqa: E402
from flashtile.kernels import forward  # noqa: E402

import fuzz_gpu  # noqa: E402

DEV = "cuda"
# (name, causal, query lengths, key lengths, page size)
POINTS = [
    ("causal 4 x 4096", True, [4096] * 4, [4096] * 4, 1),
    ("causal 4 x 4096", True, [4096] * 4, [4096] * 4, 8),
    ("full 4 x 4096", False, [4096] * 4, [4096] * 4, 1),
    ("causal 8 x 1024", True, [1024] * 8, [1024] * 8, 1),
    ("chunk 1024 of 4096, B8", True, [1024] * 8, [4096] * 8, 1),
    ("chunk 512 of 8192, B2", True, [512] * 2, [8192] * 2, 1),
    ("chunk 256 of 8192, B2", True, [256] * 2, [8192] * 2, 1),
]


LONG_POINTS = [
    ("chunk 512 of 32768, B1", True, [512], [32768], 1),
    ("chunk 512 of 65536, B1", True, [512], [65536], 1),
    ("chunk 256 of 32768, B2", True, [256] * 2, [32768] * 2, 1),
    ("chunk 128 of 8192, B8", True, [128] * 8, [8192] * 8, 1),
    ("chunk 64 of 4096, B16", True, [64] * 16, [4096] * 16, 1),
    ("chunk 16 of 4096, B16", True, [16] * 16, [4096] * 16, 1),
    ("chunk 256 of 16384, B4", True, [256] * 4, [16384] * 4, 8),
]


def graph_rounds(timed: dict, rounds: int) -> dict:
    """Median us of each call in ``timed`` (name -> function), each captured in a CUDA graph after
    one eager call and replayed by do_bench in ``rounds`` rounds of alternating order."""
    graphs = {}
    for key, fn in timed.items():
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graphs[key] = graph
    times = {key: [] for key in graphs}
    for r in range(rounds):
        for key in (list(graphs) if r % 2 == 0 else list(graphs)[::-1]):
            times[key].append(1e3 * triton.testing.do_bench(graphs[key].replay, return_mode="median"))
    return {key: round(statistics.median(t), 1) for key, t in times.items()}


def ragged(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(64, 8192, (n,), generator=g).tolist()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--long", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    lens = ragged(16, 5)
    points = LONG_POINTS if args.long else POINTS + [("causal ragged 16", True, lens, lens, 1)]
    h, hk, d = 32, 8, 128
    rows, ok = [], True
    shipped_rows = forward.GATHER_MIN_ROWS
    for name, causal, lens_q, lens_k, page in points:
        cu_q = torch.tensor([0] + lens_q, device=DEV).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + lens_k, device=DEV).cumsum(0).to(torch.int32)
        q = torch.randn(sum(lens_q), h, d, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(sum(lens_k), hk, d, device=DEV, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        k_pool, v_pool, table = fuzz_gpu._varlen_pools(k, v, lens_k, page, nan_fill=True)
        mq, mk = max(lens_q), max(lens_k)

        def call(min_rows):
            def run():
                forward.GATHER_MIN_ROWS = min_rows
                try:
                    return flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, mq, mk, causal=causal,
                                                            block_table=table, return_attn_probs=True)[:2]
                finally:
                    forward.GATHER_MIN_ROWS = shipped_rows
            return run

        gathered, portable = call(0), call(math.inf)
        flat, flat_lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal,
                                                             return_attn_probs=True)
        out, lse = gathered()
        same = torch.equal(out, flat) and torch.equal(lse, flat_lse)
        p_out, p_lse = portable()
        for i in range(min(len(lens_q), 3)):  # the first sequences under the suite's rule (float64 is slow)
            qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
            assert_matches_reference(p_out[None, qs], p_lse[None, :, qs], q[None, qs], k[None, ks], v[None, ks],
                                     causal=causal)
        ok &= same

        def copies():
            forward._paged_rows(k_pool, table, cu_k, mk)
            forward._paged_rows(v_pool, table, cu_k, mk, zeros=True)

        med = graph_rounds({"gathered": gathered, "portable": portable, "copies": copies}, args.rounds)
        pays = forward._gathering_pays(q, k_pool, table, mk)
        rec = {"point": name, "page": page, "causal": causal, "lens_q": lens_q, "lens_k": lens_k,
               "us": med, "gathered_over_portable": round(med["portable"] / med["gathered"], 3),
               "gathered_bitwise_contiguous": same, "shipped_rule_gathers": pays}
        rows.append(rec)
        print(f"{name:26s} P{page:<2d} gathered {med['gathered']:8.1f} us (copies {med['copies']:6.1f})  portable "
              f"{med['portable']:8.1f} us  speedup {rec['gathered_over_portable']:.3f}x  bitwise "
              f"{'same' if same else 'DIFFERENT'}  rule {'gathers' if pays else 'portable'}", flush=True)
    if args.out:
        with open(os.path.join(args.out, "varlen-gather.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "heads": [h, hk], "head_dim": d, "rows": rows,
                       "gather_min_rows": shipped_rows, "all_bitwise": ok}, f, indent=1)
    print("PASS" if ok else "FAIL", "gathered route bit for bit the contiguous packed call")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
