"""Decode steps through flash_attn_varlen_func on page pools (a few queries a sequence, as vLLM's
FlashAttention backend batches them): the split-KV decode route (interface._varlen_decode) against
the prefill kernels the call ran before, on an H200.

    PYTHONPATH=src python benchmarks/varlen_decode.py [--out DIR] [--rounds N] [--small]

First the checks: ragged query lengths (0 among them) and key lengths (0 among them) on shuffled
pools whose unused slots hold NaN, 16-bit at head dims 64/128/256 (causal, full, window + softcap,
ALiBi) and e4m3 (per-sequence descales): each sequence against float64 attention (16-bit: the test
suite's rule; e4m3: on the dequantized inputs, 2x textbook bf16's error, LSE within 1e-3), and a
call captured in a CUDA graph replayed as the key lengths change in place, each replay against
float64 on the keys it covers. ``--small``: the checks on small shapes only (the sanitizer's run);
``--check-only``: no timing. Then CUDA-graph replays in balanced rounds: the shipped call, the same
with seqused_k instead of cu_seqlens_k (vLLM's form), the call with the route off
(interface.VARLEN_DECODE_MAX_QUERIES and _WIDE_QUERIES = 0), and flash_attn_with_kvcache on the
same pools with q as (B, Sq, H, D). The checks also cover seqused_k reading fewer keys than are stored. Writes
varlen-decode.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from helpers import assert_matches_reference  # noqa: E402

import flashtile  # noqa: E402
from flashtile import interface  # noqa: E402
from flashtile.reference import attention as textbook  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fuzz_gpu  # noqa: E402
from varlen_gather import graph_rounds  # noqa: E402
from varlen_paged_fp8 import quantize  # noqa: E402

DEV = "cuda"


def offsets(lens):
    return torch.tensor([0] + lens, device=DEV).cumsum(0).to(torch.int32)


def case_tensors(lens_q, lens_k, heads, heads_k, d, page, fp8, dtype=torch.bfloat16):
    """Packed q (and e4m3 descales), pools and table; also the dequantized packed tensors."""
    cu_q, cu_k = offsets(lens_q), offsets(lens_k)
    if fp8:
        q, qd, dq = quantize(torch.randn(sum(lens_q), heads, d, device=DEV) * 2, cu_q, heads_k)
        k, kd, dk = quantize(torch.randn(sum(lens_k), heads_k, d, device=DEV), cu_k, heads_k)
        v, vd, dv = quantize(torch.randn(sum(lens_k), heads_k, d, device=DEV), cu_k, heads_k)
        descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
        plain = (dq, dk, dv)
    else:
        q = torch.randn(sum(lens_q), heads, d, device=DEV, dtype=dtype)
        k = torch.randn(sum(lens_k), heads_k, d, device=DEV, dtype=dtype)
        v = torch.randn_like(k)
        descales, plain = {}, (q, k, v)
    k_pool, v_pool, table = fuzz_gpu._varlen_pools(k, v, lens_k, page, nan_fill=True)
    return cu_q, cu_k, q, k_pool, v_pool, table, descales, plain


def check_sequences(out, lse, plain, cu_q, cu_k, fp8, kw):
    worst = 0.0
    for b in range(len(cu_q) - 1):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if sq.stop == sq.start:
            continue
        kwb = dict(kw)
        if "alibi_slopes" in kwb:
            kwb["alibi_slopes"] = kwb["alibi_slopes"][b:b + 1]
        q, k, v = (t[s].unsqueeze(0) for t, s in zip(plain, (sq, sk, sk)))
        if not fp8:
            err, budget = assert_matches_reference(out[sq].unsqueeze(0), lse[:, sq].unsqueeze(0), q, k, v, **kwb)
        else:
            ref, ref_lse = textbook(q.double(), k.double(), v.double(), **kwb)
            low, _ = textbook(*(t.to(torch.bfloat16) for t in (q, k, v)), **kwb)
            err = (out[sq].double() - ref[0]).abs().max().item() if torch.isfinite(out[sq]).all() else math.inf
            budget = 2 * (low.double() - ref).abs().max().item() + 1e-6
            seen = torch.isfinite(ref_lse[0])
            assert torch.isinf(lse[:, sq][~seen]).all() and (out[sq].transpose(0, 1)[~seen] == 0).all(), \
                f"sequence {b}: rows without keys not (0, +inf)"
            # Hopper's e4m3 MMAs accumulate with about 13 bits of mantissa, not fp32's 24: LSE within
            # 2^-12 of the row's largest sum of |q_d k_d| terms (scaled), at least 1e-3
            # (e4m3-rows-probe-h200-20261204: the prefill kernels' LSE errors are the same)
            group = q.shape[2] // k.shape[2]
            terms = torch.einsum("bqhd,bkhd->bhqk", q.double().abs(), k.double().abs().repeat_interleave(group, 2))
            terms = terms.amax(-1)[0] * kwb.get("softmax_scale", q.shape[-1] ** -0.5) if k.shape[1] else 0 * ref_lse[0]
            lse_err = (lse[:, sq].double() - ref_lse[0]).abs()
            tol = torch.clamp(terms * 2.0 ** -12, min=1e-3)
            assert (lse_err[seen] <= tol[seen]).all(), \
                f"sequence {b}: LSE error {lse_err[seen].max().item():.3g} (output error {err:.3g} of {budget:.3g})"
            assert err <= budget, f"sequence {b}: error {err:.3g} over {budget:.3g}"
        worst = max(worst, err / budget if budget else 0.0)
    return worst


CHECKS = [  # (d, heads, heads_k, page, fp8, dtype, kw, lens_q, lens_k)
    (128, 32, 8, 16, False, torch.bfloat16, dict(causal=True), [1, 0, 3, 2, 16], [700, 17, 0, 4000, 9]),
    (128, 32, 8, 1, False, torch.bfloat16, dict(), [1, 1, 1, 1], [5, 1, 3000, 0]),
    (64, 8, 1, 3, False, torch.float16, dict(window_size=(100, 2), softcap=20.0), [4, 1, 7], [900, 3, 64]),
    (256, 16, 2, 64, False, torch.bfloat16, dict(causal=True, alibi=True), [2, 5, 1], [1000, 5, 0]),
    (128, 12, 2, 256, False, torch.float16, dict(causal=True), [8] * 3, [8, 300, 2500]),
    (128, 32, 8, 16, True, None, dict(causal=True), [1, 0, 3, 2], [700, 17, 0, 4000]),
    (128, 16, 2, 1, True, None, dict(softcap=30.0), [1, 4, 1], [5, 1500, 2]),
    (256, 8, 2, 16, True, None, dict(causal=True), [2, 1], [333, 2048]),
    # past 16 queries while a KV head's rows stay within VARLEN_DECODE_MAX_ROWS
    (128, 32, 8, 16, False, torch.bfloat16, dict(causal=True), [64, 0, 17, 40], [700, 5, 3000, 40]),
    (128, 12, 2, 1, False, torch.float16, dict(window_size=(50, 0), softcap=15.0), [40, 23, 1], [900, 23, 4000]),
    (64, 16, 4, 3, False, torch.bfloat16, dict(causal=True, alibi=True), [33, 64], [2000, 70]),
    (128, 32, 8, 16, True, None, dict(causal=True), [64, 20, 0], [1500, 20, 9]),
    # mixed batches (a long chunk among decode steps): prefill kernels and decode split
    (128, 32, 8, 16, False, torch.bfloat16, dict(causal=True), [1, 300, 0, 3, 1, 1, 1, 16, 1, 2],
     [700, 1200, 5, 4000, 9, 300, 64, 16, 1, 2]),
    (128, 12, 2, 1, False, torch.float16, dict(window_size=(100, 0), softcap=20.0), [1, 1, 200, 2, 1, 1],
     [900, 3, 2500, 40, 1, 700]),
    (128, 32, 8, 16, True, None, dict(causal=True), [1, 300, 0, 3, 1, 1, 17, 1], [700, 1200, 5, 4000, 9, 300, 64, 2]),
    (128, 12, 2, 1, False, torch.bfloat16, dict(causal=True), [1, 200, 9, 2, 1, 16, 0, 1],
     [900, 2500, 40, 1, 700, 33, 5, 0]),
    (128, 12, 2, 16, True, None, dict(causal=True), [1, 200, 9, 2, 1, 16, 0, 1], [900, 2500, 40, 1, 700, 33, 5, 0]),
]
SMALL_CHECKS = [
    (128, 8, 2, 16, False, torch.bfloat16, dict(causal=True), [1, 0, 3], [70, 17, 200]),
    (64, 4, 1, 3, False, torch.float16, dict(window_size=(20, 1), softcap=10.0), [2, 1], [90, 3]),
    (128, 8, 2, 1, True, None, dict(causal=True), [1, 2, 0], [50, 7, 3]),
    (128, 8, 2, 16, False, torch.bfloat16, dict(causal=True), [40, 0, 17], [200, 3, 17]),
    (128, 8, 2, 16, False, torch.bfloat16, dict(causal=True), [1, 100, 0, 2, 1, 1], [50, 300, 3, 17, 0, 9]),
    # two decode launches (7 queries > 16 // group 4), the chunk gathered from 1-key pages (300 x 4 rows)
    (128, 8, 2, 1, False, torch.bfloat16, dict(causal=True), [1, 300, 0, 7, 1, 1], [50, 400, 3, 17, 0, 9]),
]


def run_checks(small: bool) -> list:
    records = []
    for d, h, hk, page, fp8, dtype, kw, lens_q, lens_k in (SMALL_CHECKS if small else CHECKS):
        kw = dict(kw)
        if kw.pop("alibi", False):
            kw["alibi_slopes"] = torch.rand(len(lens_q), h, device=DEV)
        cu_q, cu_k, q, k_pool, v_pool, table, descales, plain = case_tensors(lens_q, lens_k, h, hk, d, page, fp8,
                                                                            dtype)
        label = f"{'e4m3' if fp8 else str(dtype)[6:]} d{d} {h}/{hk} page {page} {sorted(kw)} q{lens_q} k{lens_k}"
        try:
            out, lse, _ = flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, max(lens_q), max(lens_k),
                                                           block_table=table, return_attn_probs=True, **descales, **kw)
            worst = check_sequences(out, lse, plain, cu_q, cu_k, fp8, kw)
            # vLLM's form of the same call: the key counts as seqused_k, no cu_seqlens_k
            out, lse, _ = flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, None, max(lens_q), max(lens_k),
                                                           block_table=table, return_attn_probs=True,
                                                           seqused_k=cu_k[1:] - cu_k[:-1], **descales, **kw)
            worst = max(worst, check_sequences(out, lse, plain, cu_q, cu_k, fp8, kw))
            records.append({"case": label, "err_over_budget": worst, "ok": True})
            print(f"ok   {label}: {worst:.3f} of the budget", flush=True)
        except Exception as exc:  # a failing check is a result here
            records.append({"case": label, "error": f"{type(exc).__name__}: {str(exc)[:300]}", "ok": False})
            print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    records += seqused_checks()
    # one capture, replayed as the key lengths change in place (bf16 and e4m3), each replay against
    # float64 on the keys its lengths cover (eager calls on short caches may run another plan: one
    # launch without the split, so replays and eager calls need not agree bit for bit)
    step = ([1, 2, 1], [300, 40, 1000], ([300, 40, 1000], [299, 39, 999], [0, 5, 2], [1, 40, 512]))
    mixed = ([1, 100, 1, 1, 2, 1], [300, 400, 1000, 40, 90, 5],  # split: prefill kernels + decode
             ([300, 400, 1000, 40, 90, 5], [299, 101, 999, 39, 89, 4], [0, 50, 2, 1, 0, 5], [1, 400, 512, 3, 2, 1]))
    for fp8, seqused, (lens_q, lens_k, news) in ((False, False, step), (True, False, step), (False, True, step),
                                                 (False, True, mixed), (True, False, mixed)):
        max_q, max_k = max(lens_q), max(lens_k)
        cu_q, cu_k, q, k_pool, v_pool, table, descales, plain = case_tensors(lens_q, lens_k, 8, 2, 128, 16, fp8)
        first_k = cu_k.clone()
        used = cu_k[1:] - cu_k[:-1]

        def call():
            if seqused:  # vLLM's graphs: seqused_k changed in place, no cu_seqlens_k
                return flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, None, max_q, max_k,
                                                        block_table=table, causal=True, return_attn_probs=True,
                                                        seqused_k=used)[:2]
            return flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, max_q, max_k, block_table=table,
                                                    causal=True, return_attn_probs=True, **descales)[:2]
        call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed, graphed_lse = call()
        worst = 0.0
        label = (f"CUDA graph replay as the key lengths change ({'e4m3' if fp8 else 'bf16'}"
                 f"{', seqused_k' if seqused else ''}{', mixed batch' if lens_q is mixed[0] else ''})")
        try:
            for new in news:  # (within the keys written)
                cu_k.copy_(offsets(new))
                used.copy_(torch.tensor(new, device=DEV, dtype=torch.int32))
                graph.replay()
                torch.cuda.synchronize()
                # sequence b's first new[b] keys, at first_k[b] in the packed tensors
                starts = first_k[:-1].tolist()
                keys = [torch.cat([t[s:s + n] for s, n in zip(starts, new)]) for t in plain[1:]]
                worst = max(worst, check_sequences(graphed, graphed_lse, (plain[0], *keys), cu_q, offsets(new), fp8,
                                                   dict(causal=True)))
            records.append({"case": label, "err_over_budget": worst, "ok": True})
            print(f"ok   {label}: 4 replays, {worst:.3f} of the budget", flush=True)
        except Exception as exc:
            records.append({"case": label, "error": f"{type(exc).__name__}: {str(exc)[:300]}", "ok": False})
            print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    return records


def seqused_checks() -> list:
    """seqused_k reading fewer keys than the pools (or packed keys) hold, the keys past them finite
    noise: on page pools without cu_seqlens_k, and on packed keys (FlashAttention-3's form), through
    the decode route (<= 16 queries) and the prefill kernels."""
    records = []
    for paged, lens_q in ((True, [1, 3, 0, 16]), (True, [40, 3, 0, 17]), (False, [1, 3, 0, 16]),
                          (False, [40, 3, 0, 17])):
        stored, used = [900, 64, 33, 4100], [700, 1, 33, 4000]
        label = f"seqused_k < stored keys, {'page pools (16)' if paged else 'packed keys'}, q{lens_q}"
        cu_q, cu_stored = offsets(lens_q), offsets(stored)
        q = torch.randn(sum(lens_q), 16, 128, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(sum(stored), 4, 128, device=DEV, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        seqused = torch.tensor(used, dtype=torch.int32, device=DEV)
        try:
            if paged:
                k_pool, v_pool, table = fuzz_gpu._varlen_pools(k, v, stored, 16, nan_fill=True)
                out, lse, _ = flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, None, max(lens_q), max(stored),
                                                               block_table=table, seqused_k=seqused, causal=True,
                                                               return_attn_probs=True)
            else:
                out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_stored, max(lens_q), max(stored),
                                                               seqused_k=seqused, causal=True, return_attn_probs=True)
            starts = cu_stored[:-1].tolist()
            keys = [torch.cat([t[s:s + n] for s, n in zip(starts, used)]) for t in (k, v)]
            worst = check_sequences(out, lse, (q, *keys), cu_q, offsets(used), False, dict(causal=True))
            records.append({"case": label, "err_over_budget": worst, "ok": True})
            print(f"ok   {label}: {worst:.3f} of the budget", flush=True)
        except Exception as exc:
            records.append({"case": label, "error": f"{type(exc).__name__}: {str(exc)[:300]}", "ok": False})
            print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    return records


POINTS = [  # (B, Sq, keys, heads, heads_k, page, fp8)
    (64, 1, 4096, 32, 8, 16, False), (64, 1, 4096, 32, 8, 1, False), (16, 4, 8192, 32, 8, 16, False),
    (16, 16, 8192, 32, 8, 16, False), (128, 1, 2048, 12, 2, 16, False), (8, 1, 32768, 32, 8, 16, False),
    (64, 1, 4096, 32, 8, 16, True), (16, 4, 8192, 32, 8, 16, True), (16, 1, 8192, 32, 8, 1, True),
    (16, 32, 8192, 32, 8, 16, False), (64, 24, 2048, 12, 2, 16, False), (16, 64, 8192, 32, 8, 16, True),
]


MIXED_POINTS = [  # (decode steps, their keys, chunks, chunk queries, chunk keys, heads, heads_k, page, fp8)
    (64, 4096, 1, 512, 8192, 32, 8, 16, 0), (32, 8192, 2, 1024, 16384, 32, 8, 16, 0),
    (128, 2048, 1, 256, 4096, 12, 2, 16, 0), (64, 4096, 1, 512, 8192, 32, 8, 1, 0),
    (64, 4096, 1, 512, 8192, 32, 8, 16, 1), (16, 8192, 4, 2048, 8192, 32, 8, 16, 0),
    (2, 4096, 6, 1024, 4096, 32, 8, 16, 0),
]


def mixed_rows(points, rounds: int) -> list:
    """Mixed batches (vLLM's chunked prefill order: decode steps first, then chunks), CUDA-graph
    replays: the shipped split, the whole batch through the prefill kernels (no split), and the two
    parts as separate calls (decode steps alone through the route, chunks alone)."""
    rows = []
    for n_dec, dec_keys, n_chunk, chunk_q, chunk_keys, h, hk, page, fp8 in points:
        fp8 = bool(fp8)
        lens_q, lens_k = [1] * n_dec + [chunk_q] * n_chunk, [dec_keys] * n_dec + [chunk_keys] * n_chunk
        parts = {name: (max(lk), case_tensors(lq, lk, h, hk, 128, page, fp8)) for name, lq, lk in (
            ("batch", lens_q, lens_k), ("decodes", lens_q[:n_dec], lens_k[:n_dec]),
            ("chunks", lens_q[n_dec:], lens_k[n_dec:]))}
        shipped_fill = interface.MIXED_BATCH_FILL

        def call(name, max_q, fill=None, keys=None):
            max_k, (cu_q, cu_k, q, k_pool, v_pool, table, descales, _) = parts[name]
            cu_k = cu_k if keys is None else offsets(keys)

            def run():
                interface.MIXED_BATCH_FILL = shipped_fill if fill is None else fill
                try:
                    return flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, max_q, max_k,
                                                            block_table=table, causal=True, **descales)
                finally:
                    interface.MIXED_BATCH_FILL = shipped_fill
            return run
        med = graph_rounds({"shipped": call("batch", chunk_q), "no split": call("batch", chunk_q, 10 ** 9),
                            "decodes alone": call("decodes", 1), "chunks alone": call("chunks", chunk_q),
                            # the split's two launches by themselves: the prefill kernels on the batch
                            # with the decode steps' keys 0, the decode on (B, 16) blocks
                            "prefill part": call("batch", chunk_q, 10 ** 9, [0] * n_dec + lens_k[n_dec:]),
                            "decode part": call("decodes", interface.VARLEN_DECODE_MAX_QUERIES)}, rounds)
        rec = {"decodes": [n_dec, dec_keys], "chunks": [n_chunk, chunk_q, chunk_keys], "heads": [h, hk],
               "page": page, "fp8": fp8, "us": med, "speedup": round(med["no split"] / med["shipped"], 2),
               "parts_us": round(med["decodes alone"] + med["chunks alone"], 1)}
        rows.append(rec)
        print(f"{n_dec:3d} x 1 on {dec_keys:5d} + {n_chunk} x {chunk_q:4d} on {chunk_keys:5d}  {h}/{hk} P{page:<3d} "
              f"{'e4m3' if fp8 else 'bf16'}  shipped {med['shipped']:8.1f}  no split {med['no split']:8.1f}  "
              f"parts {med['decodes alone']:.1f} + {med['chunks alone']:.1f} = {rec['parts_us']:.1f} us  "
              f"speedup {rec['speedup']:.2f}x  (prefill part {med['prefill part']:.1f}, decode part "
              f"{med['decode part']:.1f})", flush=True)
        parts.clear()
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--max-queries", type=int, default=None,
                    help="the route up to this many queries a sequence whatever the rows, timed as 'shipped' "
                         "(default: the shipped rule)")
    ap.add_argument("--points", default="", help="B,Sq,keys,heads,heads_k,page,fp8(0/1);... instead of POINTS")
    ap.add_argument("--no-checks", action="store_true")
    ap.add_argument("--mixed", action="store_true", help="also time MIXED_POINTS (mixed batches)")
    ap.add_argument("--mixed-only", action="store_true", help="time only MIXED_POINTS")
    args = ap.parse_args()
    torch.manual_seed(0)
    checks = [] if args.no_checks else run_checks(args.small)
    ok = all(c["ok"] for c in checks)
    print(f"checks: {sum(c['ok'] for c in checks)} of {len(checks)} passed", flush=True)
    rows = []
    points = [tuple(int(x) for x in p.split(",")) for p in args.points.split(";")] if args.points else POINTS
    for batch, sq, sk, h, hk, page, fp8 in ([] if args.small or args.check_only or args.mixed_only else points):
        fp8 = bool(fp8)
        cu_q, cu_k, q, k_pool, v_pool, table, descales, _ = case_tensors([sq] * batch, [sk] * batch, h, hk, 128,
                                                                         page, fp8)
        # (VARLEN_DECODE_MAX_QUERIES, VARLEN_DECODE_WIDE_QUERIES): shipped, forced, route off
        shipped = (interface.VARLEN_DECODE_MAX_QUERIES, interface.VARLEN_DECODE_WIDE_QUERIES)
        route = shipped if args.max_queries is None else (args.max_queries, 0)

        def with_route(limits, call):
            interface.VARLEN_DECODE_MAX_QUERIES, interface.VARLEN_DECODE_WIDE_QUERIES = limits
            try:
                return call()
            finally:
                interface.VARLEN_DECODE_MAX_QUERIES, interface.VARLEN_DECODE_WIDE_QUERIES = shipped

        def varlen(limits):
            return lambda: with_route(limits, lambda: flashtile.flash_attn_varlen_func(
                q, k_pool, v_pool, cu_q, cu_k, sq, sk, block_table=table, causal=True, **descales))
        lengths = torch.full((batch,), sk, dtype=torch.int32, device=DEV)
        kv_descales = {}
        if fp8:
            kv_descales = dict(k_descale=descales["k_descale"], v_descale=descales["v_descale"],
                               q_descale=descales["q_descale"])

        def kvcache():
            return flashtile.flash_attn_with_kvcache(q.view(batch, sq, h, 128), k_pool, v_pool, cache_seqlens=lengths,
                                                     block_table=table, causal=True, **kv_descales)
        used = cu_k[1:] - cu_k[:-1]

        def seqused():  # vLLM's form: the key counts as seqused_k, no cu_seqlens_k
            return with_route(route, lambda: flashtile.flash_attn_varlen_func(
                q, k_pool, v_pool, cu_q, None, sq, sk, block_table=table, causal=True, seqused_k=used, **descales))
        med = graph_rounds({"shipped": varlen(route), "seqused_k": seqused, "prefill kernels": varlen((0, 0)),
                            "kvcache": kvcache}, args.rounds)
        nbytes = 2 * batch * sk * hk * 128 * (1 if fp8 else 2)
        rec = {"route_limits": list(route), "batch": batch, "seqlen_q": sq, "keys": sk, "heads": [h, hk],
               "page": page, "fp8": fp8, "us": med,
               "speedup": round(med["prefill kernels"] / med["shipped"], 2),
               "shipped_gbps": round(nbytes / med["shipped"] / 1e3, 1)}
        rows.append(rec)
        print(f"B{batch:<4d} Sq{sq:<3d} {sk:6d} keys {h}/{hk} P{page:<3d} {'e4m3' if fp8 else 'bf16'}  shipped "
              f"{med['shipped']:8.1f} us ({rec['shipped_gbps']:6.1f} GB/s)  prefill kernels {med['prefill kernels']:8.1f} us"
              f"  kvcache {med['kvcache']:8.1f} us  seqused_k {med['seqused_k']:8.1f} us"
              f"  speedup {rec['speedup']:.2f}x", flush=True)
        torch.cuda.empty_cache()
    mixed = mixed_rows(MIXED_POINTS, args.rounds) if (args.mixed or args.mixed_only) and not args.small else []
    if args.out:
        with open(os.path.join(args.out, "varlen-decode.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "checks": checks, "points": rows, "mixed": mixed}, f,
                      indent=1)
    print("PASS" if ok else "FAIL", "checks")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
