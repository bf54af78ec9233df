"""vLLM's ``out=`` on the decode route: the row move writing into ``out`` (shipped) against the
result copied there after the call (interface._decode_into returning None: the route before
2026-12-05), for decode steps through flash_attn_varlen_func on page pools of 16 keys, as vLLM's
FlashAttention backend calls it (seqused_k, cu_seqlens_k None), replayed from CUDA graphs.

    PYTHONPATH=src python benchmarks/out_into.py --out $OUT [--rounds N]
    PYTHONPATH=src TRITON_INTERPRET=1 python benchmarks/out_into.py --smoke   (CPU: the check only)

Each point first checks that both give the same bits, then times both (varlen_gather.graph_rounds:
CUDA graphs replayed by do_bench in rounds of alternating order).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import flashtile
from flashtile import interface

sys.path.insert(0, os.path.dirname(__file__))

POINTS = [(1, 32, 8, 8192), (16, 32, 8, 8192), (64, 32, 8, 4096), (16, 12, 2, 16384), (128, 12, 2, 2048)]


def make_call(batch, heads, heads_k, keys, device, page=16, d=128):
    dtype = torch.bfloat16
    q = torch.randn(batch, heads, d, device=device, dtype=dtype)
    pages = keys // page
    table = torch.randperm(batch * pages, device=device).view(batch, pages).to(torch.int32)
    k_pool = torch.randn(batch * pages, page, heads_k, d, device=device, dtype=dtype)
    v_pool = torch.randn_like(k_pool)
    cu_q = torch.arange(batch + 1, device=device, dtype=torch.int32)
    used = torch.full((batch,), keys, device=device, dtype=torch.int32)
    out = torch.empty_like(q)

    def call():
        return flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, None, 1, keys, block_table=table,
                                                seqused_k=used, causal=True, out=out)
    return call, out


def copied(call):
    def run():
        shipped = interface._decode_into
        interface._decode_into = lambda *a: None
        try:
            return call()
        finally:
            interface._decode_into = shipped
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    points = [(2, 4, 2, 64)] if args.smoke else POINTS
    rows, ok = [], True
    for batch, heads, heads_k, keys in points:
        call, out = make_call(batch, heads, heads_k, keys, device, d=32 if args.smoke else 128)
        call()
        shipped = out.clone()
        copied(call)()
        same = torch.equal(out, shipped)
        ok &= same
        row = dict(batch=batch, heads=heads, heads_k=heads_k, keys=keys, same_bits=same)
        if not args.smoke:
            from varlen_gather import graph_rounds
            med = graph_rounds({"into": call, "copied": copied(call)}, args.rounds)
            row.update(into_us=med["into"], copied_us=med["copied"], copied_over_into=med["copied"] / med["into"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "out-into-smoke.json" if args.smoke else "out-into.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
                   "rows": rows}, f, indent=1)
    print("PASS" if ok else "FAIL", "same bits")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
