"""Probe: the Gluon prefill forward on page pools (chunked prefill through flash_attn_with_kvcache)
with pages smaller than a key tile, as a function of the TMA box size (keys a box carries,
forced here through ``gluon_forward.PAGED_BOX_ROWS``) and of the pool's order (pages in sequence order,
i.e. the contiguous cache's very bytes, or shuffled), against the contiguous cache in the same run; "shipped" rows: the box size the dispatch picks
(``gluon_forward.page_box_rows``).

    PYTHONPATH=src python benchmarks/paged_boxes.py --out $OUT [--points 'B,H,Hk,ctx,Sq;...']
        [--pages 16,32,64] [--boxes 16,32,64]

Every timed call is checked against float64 attention (chunked_prefill.check: the first KV head
of the first and last sequence, error / budget of the accuracy rule). Timing: one call replayed
from a CUDA graph, do_bench median (chunked_prefill.graph_time). Writes paged-boxes.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import flashtile
from flashtile.kernels import decode as dec
from flashtile.kernels import gluon_forward as gf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from chunked_prefill import check, graph_time, page_pools, point_tensors  # noqa: E402

POINTS = "1,32,8,32768,512;8,32,8,2048,128;4,12,2,4096,512;1,32,8,8192,2048"


def force_box_rows(rows: int) -> None:
    gf.PAGED_BOX_ROWS = rows if isinstance(rows, tuple) else (rows,)
    gf.with_page_boxes.cache_clear()
    gf._PLAIN.clear()
    dec._PLANS.clear()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--points", default=POINTS)
    parser.add_argument("--pages", default="16,32,64")
    parser.add_argument("--boxes", default="16,32,64")
    args = parser.parse_args()
    device = torch.device("cuda")
    pages = [int(x) for x in args.pages.split(",")]
    boxes = [int(x) for x in args.boxes.split(",")]
    shipped = gf.PAGED_BOX_ROWS
    records = []
    for text in args.points.split(";"):
        batch, heads, heads_k, ctx, seqlen_q = (int(x) for x in text.split(","))
        q, k, v, lengths, flops = point_tensors(text, device)
        rec = {"point": text, "flops": flops, "runs": {}}

        def run(name, fn):
            try:
                out = fn()
                torch.cuda.synchronize()
                err = check(out, q, k, v)
                us = graph_time(fn) * 1e3
                rec["runs"][name] = {"us": us, "tflops": flops / us / 1e6, "check": err}
            except Exception as exc:  # a failing call is a result here
                rec["runs"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                torch.cuda.synchronize()

        force_box_rows(shipped)
        run("contiguous", lambda: flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths,
                                                                   causal=True))
        for page in pages:
            ordered = (k.view(-1, page, heads_k, 128), v.view(-1, page, heads_k, 128),
                       torch.arange(batch * ctx // page, device=device, dtype=torch.int32).view(batch, -1))
            shuffled = page_pools(k, v, page, spare=0)
            k_pool, v_pool, table = shuffled
            force_box_rows(shipped)
            rows = gf.page_box_rows(page, gf.dispatch_variant(128, "bf16", True, ctx).block_n)
            run(f"page{page}-shuffled-shipped(box{rows})",
                lambda: flashtile.flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=lengths,
                                                         block_table=table, causal=True))
            for order, (k_pool, v_pool, table) in (("ordered", ordered), ("shuffled", shuffled)):
                for rows in boxes:
                    if page % rows or rows > 128:
                        continue
                    force_box_rows(rows)
                    run(f"page{page}-{order}-box{rows}",
                        lambda: flashtile.flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=lengths,
                                                                 block_table=table, causal=True))
            ordered = shuffled = k_pool = v_pool = None
        force_box_rows(shipped)
        base = rec["runs"]["contiguous"].get("us")
        print(f"B{batch} {heads}/{heads_k} ctx{ctx} Sq{seqlen_q}", flush=True)
        for name, r in rec["runs"].items():
            if "error" in r:
                print(f"  {name:28s} {r['error']}", flush=True)
            else:
                print(f"  {name:28s} {r['us']:9.1f} us {r['tflops']:6.1f} TFLOP/s "
                      f"x{base / r['us']:.3f} of contiguous  check {r['check']:.3f}", flush=True)
        records.append(rec)
        q = k = v = None
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "paged-boxes.json"), "w") as f:
        json.dump({"points": records}, f, indent=1)


if __name__ == "__main__":
    main()
