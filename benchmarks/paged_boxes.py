"""Probe: the Gluon prefill forward on page pools (chunked prefill through flash_attn_with_kvcache)
with pages smaller than a key tile, as a function of the TMA box size (keys a box carries,
forced here through ``gluon_forward.PAGED_BOX_ROWS``) and of the pool's order (pages in sequence order,
i.e. the contiguous cache's very bytes, or shuffled), against the contiguous cache in the same run; "shipped" rows: the box size the dispatch picks
(``gluon_forward.page_box_rows``), "decode-kernel" rows: the same pool through the split-KV
decode kernel (the route turned off); ``--stages``: the shipped box sizes (and the contiguous cache)
again with that many K/V ring slots.

    PYTHONPATH=src python benchmarks/paged_boxes.py --out $OUT [--points 'B,H,Hk,ctx,Sq;...']
        [--pages 16,32,64] [--boxes 16,32,64] [--stages 3] [--head-dim 128] [--full]

Every timed call is checked against float64 attention (chunked_prefill.check: the first KV head
of the first and last sequence, error / budget of the accuracy rule). Timing: one call replayed
from a CUDA graph, do_bench median (chunked_prefill.graph_time). Writes paged-boxes.json.
"""

from __future__ import annotations

import argparse
import dataclasses
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


_SEQUSED_K = gf.with_seqused_k
_PAGED_VARIANT = gf.paged_variant


def force_stages(stages: int) -> None:
    """The seqused_k schedules (contiguous and paged) with ``stages`` K/V ring slots: two with the
    Q prefetch as with_seqused_k has it, more without (the third slot takes the second Q buffer's
    room); 0: as shipped."""
    def staged(variant, seqk):
        return dataclasses.replace(variant, stages=stages,
                                   prefetch_q=seqk.prefetch_q if stages == 2 else False)
    if stages:
        gf.with_seqused_k = lambda v: staged(_SEQUSED_K(v), _SEQUSED_K(v))
        gf.paged_variant = lambda v, page: staged(_PAGED_VARIANT(v, page), _SEQUSED_K(v))
    else:
        gf.with_seqused_k, gf.paged_variant = _SEQUSED_K, _PAGED_VARIANT
    force_box_rows(gf.PAGED_BOX_ROWS)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--points", default=POINTS)
    parser.add_argument("--pages", default="16,32,64")
    parser.add_argument("--boxes", default="16,32,64")
    parser.add_argument("--stages", default="", help="ring slots to force too (shipped box sizes)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--full", action="store_true", help="non-causal calls")
    args = parser.parse_args()
    device = torch.device("cuda")
    pages = [int(x) for x in args.pages.split(",")]
    boxes = [int(x) for x in args.boxes.split(",")]
    shipped = gf.PAGED_BOX_ROWS
    records = []
    for text in args.points.split(";"):
        batch, heads, heads_k, ctx, seqlen_q = (int(x) for x in text.split(","))
        d, causal = args.head_dim, not args.full
        q, k, v, lengths, flops = point_tensors(text, device, d, causal)
        rec = {"point": text, "flops": flops, "runs": {}}

        def run(name, fn):
            try:
                out = fn()
                torch.cuda.synchronize()
                err = check(out, q, k, v, causal)
                us = graph_time(fn) * 1e3
                rec["runs"][name] = {"us": us, "tflops": flops / us / 1e6, "check": err}
            except Exception as exc:  # a failing call is a result here
                rec["runs"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                torch.cuda.synchronize()

        force_box_rows(shipped)
        run("contiguous", lambda: flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths,
                                                                   causal=causal))
        for page in pages:
            ordered = (k.view(-1, page, heads_k, d), v.view(-1, page, heads_k, d),
                       torch.arange(batch * ctx // page, device=device, dtype=torch.int32).view(batch, -1))
            shuffled = page_pools(k, v, page, spare=0)
            k_pool, v_pool, table = shuffled
            force_box_rows(shipped)
            rows = gf.page_box_rows(page, gf.dispatch_variant(d, "bf16", causal, ctx).block_n)
            run(f"page{page}-shuffled-shipped(box{rows})",
                lambda: flashtile.flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=lengths,
                                                         block_table=table, causal=causal))
            saved, dec.PREFILL_MIN_QUERIES = dec.PREFILL_MIN_QUERIES, 1 << 30
            run(f"page{page}-shuffled-decode-kernel",
                lambda: flashtile.flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=lengths,
                                                         block_table=table, causal=causal))
            dec.PREFILL_MIN_QUERIES = saved
            for order, (k_pool, v_pool, table) in (("ordered", ordered), ("shuffled", shuffled)):
                for rows in boxes:
                    if page % rows or rows > 128:
                        continue
                    force_box_rows(rows)
                    run(f"page{page}-{order}-box{rows}",
                        lambda: flashtile.flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=lengths,
                                                                 block_table=table, causal=causal))
            ordered = shuffled = k_pool = v_pool = None
        force_box_rows(shipped)
        for stages in [int(x) for x in args.stages.split(",") if x]:
            force_stages(stages)
            run(f"contiguous-s{stages}", lambda: flashtile.flash_attn_with_kvcache(
                q, k, v, cache_seqlens=lengths, causal=causal))
            for page in pages:
                k_pool, v_pool, table = page_pools(k, v, page, spare=0)
                run(f"page{page}-shuffled-shipped-s{stages}",
                    lambda: flashtile.flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=lengths,
                                                             block_table=table, causal=causal))
                k_pool = v_pool = None
            force_stages(0)
        base = rec["runs"]["contiguous"].get("us")
        print(f"B{batch} {heads}/{heads_k} ctx{ctx} Sq{seqlen_q} d{d} {'causal' if causal else 'full'}",
              flush=True)
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
