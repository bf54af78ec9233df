"""Packed sequences of different lengths dealt from a work list (gluon_forward.with_work_list)
against the unlisted deal, on an H200.

    PYTHONPATH=src python benchmarks/work_list.py [--out DIR] [--rounds N] [--small] [--check-only]

Checks: ragged packed batches (sequences without rows and sequences with rows but no keys among
them; contiguous, on page pools, e4m3, windowed; head dims 64/128/256, causal and full) through
gluon_varlen_forward's shipped dispatch, which lists them (asserted), into NaN-filled outputs: the
output and LSE bit for bit the unlisted deal's (a tile's arithmetic does not depend on the CTA that
runs it), every sequence against float64 (varlen_decode.check_sequences: the test suite's rule;
e4m3 on the dequantized inputs), rows without keys 0 with LSE +inf; and a CUDA graph of a listed call
replayed after cu_seqlens_q changed in place, bit for bit an eager unlisted call on the new offsets;
mixed batches (e4m3 pools, 16-bit pools of 1- and 3-key pages) whose prefill part gathers room for
the sequences with keys only, bit for bit the batch-sized gather. ``--small``: small shapes only (the
sanitizer's run). Timing (CUDA graphs, balanced rounds): the mixed batches of
varlen_decode.MIXED_POINTS and MIXED_EXTRA through flash_attn_varlen_func on page pools (the shipped
split against the other choice of decode launches and against no gather; the parts called apart), and ragged packed
prefill through flash_attn_varlen_func, listed against unlisted. Writes work-list.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import flashtile
from flashtile import interface
from flashtile.kernels import forward, gluon_forward

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fuzz_gpu  # noqa: E402
from varlen_decode import MIXED_POINTS, case_tensors, check_sequences, offsets  # noqa: E402
from varlen_gather import graph_rounds  # noqa: E402

DEV = "cuda"
LISTS = []  # work lists made, counted by the wrapper below
_made = gluon_forward.packed_work_list


def _counted(*args):
    LISTS.append(args)
    return _made(*args)


gluon_forward.packed_work_list = _counted


def unlisted(fn):
    """``fn`` run with the unlisted deal (and the packed plans made again on both sides of it)."""
    def run():
        shipped = gluon_forward.WORK_LIST_MIN_EMPTY
        gluon_forward.WORK_LIST_MIN_EMPTY = 1 << 60
        gluon_forward._PACKED.clear()
        try:
            return fn()
        finally:
            gluon_forward.WORK_LIST_MIN_EMPTY = shipped
            gluon_forward._PACKED.clear()
    return run


CHECKS = [  # (d, dtype, causal, heads, heads_k, page (0: packed), window, lens_q, lens_k)
    (128, "bf16", True, 32, 8, 0, None, [1] * 40 + [700, 0, 3, 300], [50] * 40 + [900, 10, 0, 300]),
    (128, "fp16", False, 16, 2, 0, None, [2] * 30 + [513, 1, 0, 129], [7] * 30 + [600, 0, 40, 129]),
    (64, "bf16", True, 24, 8, 0, None, [1] * 50 + [777, 2, 192], [64] * 50 + [1000, 0, 200]),
    (256, "bf16", True, 16, 4, 0, None, [1] * 30 + [300, 65, 0], [20] * 30 + [300, 0, 9]),
    (256, "bf16", False, 16, 2, 0, None, [1] * 30 + [300, 7], [4000] + [20] * 29 + [300, 0]),
    (128, "bf16", True, 32, 8, 16, None, [1] * 40 + [700, 0, 3, 300], [50] * 40 + [900, 10, 0, 300]),
    (64, "bf16", False, 16, 2, 32, None, [1] * 60 + [400, 2], [33] * 60 + [500, 0]),
    (128, "bf16", True, 32, 8, 0, (256, 0), [1] * 40 + [1500, 3], [900] * 40 + [2000, 0]),
    (128, "fp8", True, 32, 8, 0, None, [1] * 40 + [700, 0, 3, 300], [50] * 40 + [900, 10, 0, 300]),
    (128, "fp8", True, 32, 8, 16, None, [1] * 40 + [700, 3], [50] * 40 + [900, 0]),
]
SMALL_CHECKS = [
    (128, "bf16", True, 32, 4, 0, None, [1] * 8 + [200, 0, 2], [30] * 8 + [260, 3, 0]),
    (64, "bf16", True, 48, 8, 16, None, [1] * 8 + [250, 2], [40] * 8 + [250, 0]),
    (128, "fp8", True, 64, 8, 0, None, [1] * 8 + [300, 1], [30] * 8 + [300, 0]),
]
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _case(d, dtype, heads, heads_k, page, lens_q, lens_k):
    """Packed q, k, v (e4m3 from random values: unit descales), pools and table for page > 0, and the
    16-bit (dequantized) packed tensors the reference reads."""
    cu_q, cu_k = offsets(lens_q), offsets(lens_k)
    q = torch.randn(sum(lens_q), heads, d, device=DEV)
    k = torch.randn(sum(lens_k), heads_k, d, device=DEV)
    v = torch.randn_like(k)
    if dtype == "fp8":
        q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
        plain = tuple(t.to(torch.bfloat16) for t in (q, k, v))
    else:
        q, k, v = (t.to(_DTYPES[dtype]) for t in (q, k, v))
        plain = (q, k, v)
    table = None
    if page:
        k, v, table = fuzz_gpu._varlen_pools(k, v, lens_k, page, nan_fill=True)
    return cu_q, cu_k, q, k, v, table, plain


def _forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, table, fp8):
    """gluon_varlen_forward's shipped dispatch into NaN-filled out and LSE."""
    batch, heads, heads_k = cu_q.shape[0] - 1, q.shape[1], k.shape[-2]
    out = torch.full(q.shape, float("nan"), device=DEV, dtype=torch.bfloat16 if fp8 else q.dtype)
    lse = torch.full((heads, q.shape[0]), float("nan"), device=DEV)
    extra = {}
    if fp8:
        ones = torch.ones(batch, heads_k, 1, device=DEV)
        extra = dict(descales=forward.fp8_kernel_descales(torch.ones(batch, heads, 1, device=DEV), ones, ones),
                     scale_blocks=(1 << max(max_q, 128).bit_length(), 1 << max(max_k, 128).bit_length()))
    return gluon_forward.gluon_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=q.shape[-1] ** -0.5,
                                              causal=causal, out=out, lse=lse, block_table=table,
                                              window_size=window or (-1, -1), **extra)


def e4m3_sequences(out, lse, q, k, v, table, plain, cu_q, cu_k, lens_k, kw):
    """Each sequence of an e4m3 call (P rounded to e4m3) by GPU fuzzing's rule (fuzz_gpu._check_e4m3:
    float64 on the dequantized inputs, the budget from the portable e4m3 kernel's error on the
    sequence alone, itself bounded by what e4m3 P explains). Returns 0 (no budget ratio kept)."""
    for b in range(cu_q.shape[0] - 1):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if sq.stop == sq.start or lens_k[b] == 0:  # (rows without keys: checked by the caller)
            continue
        if table is None:
            k8, v8 = k[sk].unsqueeze(0), v[sk].unsqueeze(0)
        else:  # the sequence's keys gathered from its pages
            k8, v8 = (pool[table[b].long()].flatten(0, 1)[:lens_k[b]].unsqueeze(0) for pool in (k, v))
        portable, portable_lse, _ = fuzz_gpu._portable(lambda: flashtile.flash_attn_func(
            q[sq].unsqueeze(0), k8, v8, return_attn_probs=True, **kw))
        dq, dk, dv = (t[s].unsqueeze(0).double() for t, s in zip(plain, (sq, sk, sk)))
        fuzz_gpu._check_e4m3(out[sq].unsqueeze(0), lse[:, sq].unsqueeze(0), portable, portable_lse, dq, dk, dv, kw)
    return 0.0


def run_checks(small: bool) -> list:
    records = []
    for d, dtype, causal, h, hk, page, window, lens_q, lens_k in (SMALL_CHECKS if small else CHECKS):
        fp8 = dtype == "fp8"
        label = (f"{dtype} d{d} {'causal' if causal else 'full'} {h}/{hk} {f'page {page}' if page else 'packed'}"
                 f"{f' window {window}' if window else ''} {len(lens_q)} sequences")
        try:
            cu_q, cu_k, q, k, v, table, plain = _case(d, dtype, h, hk, page, lens_q, lens_k)
            args = (q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal, window, table, fp8)
            made = len(LISTS)
            out, lse = _forward(*args)
            assert len(LISTS) == made + 1, "the shipped dispatch did not list this batch"
            ref_out, ref_lse = unlisted(lambda: _forward(*args))()
            assert len(LISTS) == made + 1
            torch.cuda.synchronize()
            valid = torch.isfinite(ref_lse) | torch.isinf(ref_lse)
            assert torch.equal(out, ref_out), "output differs from the unlisted deal's"
            assert torch.equal(lse[valid], ref_lse[valid]) and valid.all(), "LSE differs from the unlisted deal's"
            kw = dict(causal=causal, softmax_scale=d ** -0.5)
            if window:
                kw["window_size"] = window
            worst = (e4m3_sequences(out, lse, q, k, v, table, plain, cu_q, cu_k, lens_k, kw) if fp8
                     else check_sequences(out, lse, plain, cu_q, cu_k, False, kw))
            for b in range(len(lens_q)):  # rows with no keys: 0, +inf
                rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
                if lens_k[b] == 0 and lens_q[b]:
                    assert (out[rows] == 0).all() and torch.isposinf(lse[:, rows]).all(), f"sequence {b}: keyless rows"
            records.append({"case": label, "err_over_budget": worst, "ok": True})
            print(f"ok   {label}: bit for bit unlisted, {worst:.3f} of the budget", flush=True)
        except Exception as exc:  # a failing check is a result here
            records.append({"case": label, "error": f"{type(exc).__name__}: {str(exc)[:300]}", "ok": False})
            print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    records.append(graph_check())
    if not small:
        for page, dtype in ((16, None), (1, torch.bfloat16), (3, torch.float16)):
            records.append(mixed_gather_check(page, dtype))
    return records


def mixed_gather_check(page: int, dtype) -> dict:
    """A mixed batch on page pools through flash_attn_varlen_func whose prefill part gathers the
    chunks' keys into room for total_q // 17 sequences (interface._mixed_batch's keyed_sequences),
    not the batch's, and runs the listed Gluon kernel (asserted): e4m3 pools (``dtype`` None), and
    16-bit pools of pages no TMA box fits, where the longest chunk's rows (x the group) now decide
    the gather (forward.GATHER_MIN_ROWS) and the batch's average rows a sequence, the decode steps'
    among them, sent it to the portable kernel before. Into memory the caching allocator last held
    as NaN: each sequence against float64, and bit for bit the same call with the gather sized by
    the batch."""
    fp8 = dtype is None
    label = (f"{'e4m3' if fp8 else str(dtype)[6:]} mixed batch on {page}-key pages, the chunks gathered "
             "for the Gluon kernel")
    if fp8:
        lens_q, lens_k = [1] * 40 + [300, 2, 250], [50] * 40 + [700, 9, 4000]  # room for 32 of 43
    else:
        # room for 90 of 124 sequences of the longest's 2800 keys: 1.44 GB of copies at 4000 keys
        # passed GATHER_BYTES (1 GiB) and went to the portable kernel (work-list-h200-20261205)
        lens_q, lens_k = [1] * 120 + [1100, 2, 300, 17], [50] * 120 + [1500, 9, 700, 2800]
    try:
        cu_q, cu_k, q, k_pool, v_pool, table, descales, plain = case_tensors(lens_q, lens_k, 32, 8, 128, page, fp8,
                                                                            dtype or torch.bfloat16)

        def call():
            torch.full((64 << 20,), float("nan"), device=DEV)  # freed at once: the call's outputs reuse it
            return flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, max(lens_q), max(lens_k),
                                                    block_table=table, causal=True, return_attn_probs=True,
                                                    **descales)[:2]
        made = len(LISTS)
        out, lse = call()
        assert len(LISTS) == made + 1, "the prefill part did not reach the listed Gluon kernel"
        torch.cuda.synchronize()
        worst = check_sequences(out, lse, plain, cu_q, cu_k, fp8, dict(causal=True))
        # the batch-sized copies pass GATHER_BYTES here: lifted, so that they reach the same kernel
        sized, bound = forward._gathered_sequences, forward.GATHER_BYTES
        forward._gathered_sequences = lambda block_table, keyed: block_table.shape[0]
        forward.GATHER_BYTES = 1 << 40
        try:
            made = len(LISTS)
            ref_out, ref_lse = call()
            assert len(LISTS) == made + 1, "the batch-sized gather did not reach the listed Gluon kernel"
        finally:
            forward._gathered_sequences, forward.GATHER_BYTES = sized, bound
        torch.cuda.synchronize()
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse), "differs from the batch-sized gather's"
        print(f"ok   {label}: {worst:.3f} of the budget, bit for bit the batch-sized gather", flush=True)
        return {"case": label, "err_over_budget": worst, "ok": True}
    except Exception as exc:
        print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return {"case": label, "error": f"{type(exc).__name__}: {str(exc)[:300]}", "ok": False}


def graph_check() -> dict:
    """A listed call captured once, replayed after cu_seqlens_q changed in place (same total rows,
    the longest within max_seqlen_q): the list is made again on the device at each replay."""
    label = "CUDA graph of a listed call replayed as cu_seqlens_q changes"
    splits = ([1] * 32 + [500, 0, 11], [3] * 32 + [300, 100, 47], [0] * 32 + [511, 0, 32], [16] * 32 + [1, 0, 30])
    lens_k = [40] * 32 + [600, 9, 511]
    try:
        cu_q, cu_k, q, k, v, _, _ = _case(128, "bf16", 32, 8, 0, splits[0], lens_k)
        args = (q, k, v, cu_q, cu_k, 511, 600, True, None, None, False)
        _forward(*args)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        made = len(LISTS)
        with torch.cuda.graph(graph):
            out, lse = _forward(*args)
        assert len(LISTS) == made + 1, "not listed"
        for lens in splits:
            assert sum(lens) == q.shape[0], "a split of other than the captured rows"
            cu_q.copy_(offsets(lens))
            graph.replay()
            ref_out, ref_lse = unlisted(lambda: _forward(*args))()
            torch.cuda.synchronize()
            for b in range(len(lens)):
                rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
                assert torch.equal(out[rows], ref_out[rows]) and torch.equal(lse[:, rows], ref_lse[:, rows]), \
                    f"split {lens[32:]}: sequence {b} differs"
        print(f"ok   {label}: {len(splits)} replays bit for bit", flush=True)
        return {"case": label, "ok": True}
    except Exception as exc:
        print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return {"case": label, "error": f"{type(exc).__name__}: {str(exc)[:300]}", "ok": False}


# mixed batches past varlen_decode.MIXED_POINTS (decode steps of one query there): (decode steps,
# their queries, their keys, chunks, chunk queries, chunk keys, heads, heads_k, page, fp8)
MIXED_EXTRA = [
    (128, 1, 2048, 1, 256, 4096, 12, 2, 16, 1), (128, 1, 2048, 1, 256, 4096, 12, 2, 1, 0),
    (64, 4, 4096, 1, 512, 8192, 32, 8, 16, 0), (64, 4, 4096, 1, 512, 8192, 12, 2, 16, 0),
]


def patched(fn, owner, name, value):
    """``fn`` run with owner.name set to ``value`` (the packed plans made again on both sides)."""
    def run():
        shipped = getattr(owner, name)
        setattr(owner, name, value)
        gluon_forward._PACKED.clear()
        try:
            return fn()
        finally:
            setattr(owner, name, shipped)
            gluon_forward._PACKED.clear()
    return run


def mixed_rows(rounds: int) -> list:
    """The shipped split against the other choice of decode launches (one for all short sequences,
    MIXED_FIRST_ROWS 0, where two are shipped; two, MIXED_PADDED_ROWS 0, where one is), against no
    gather for the prefill part on pages no TMA box fits (GATHER_MIN_ROWS past any batch), and
    against its two parts called apart."""
    rows = []
    points = [(p[0], 1, *p[1:]) for p in MIXED_POINTS] + MIXED_EXTRA
    for n_dec, dec_q, dec_keys, n_chunk, chunk_q, chunk_keys, h, hk, page, fp8 in points:
        fp8 = bool(fp8)
        lens_q, lens_k = [dec_q] * n_dec + [chunk_q] * n_chunk, [dec_keys] * n_dec + [chunk_keys] * n_chunk
        parts = {name: (max(lq), max(lk), case_tensors(lq, lk, h, hk, 128, page, fp8)) for name, lq, lk in (
            ("batch", lens_q, lens_k), ("decodes", lens_q[:n_dec], lens_k[:n_dec]),
            ("chunks", lens_q[n_dec:], lens_k[n_dec:]))}

        def call(name):
            max_q, max_k, (cu_q, cu_k, q, k_pool, v_pool, table, descales, _) = parts[name]
            return lambda: flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, max_q, max_k,
                                                            block_table=table, causal=True, **descales)
        timed = {"shipped": call("batch")}
        if interface.VARLEN_DECODE_MAX_QUERIES * (h // hk) <= interface.MIXED_PADDED_ROWS and not fp8:
            timed["two decode launches"] = patched(call("batch"), interface, "MIXED_PADDED_ROWS", 0)
        else:
            timed["one decode launch"] = patched(call("batch"), interface, "MIXED_FIRST_ROWS", 0)
        if page % 16 and not fp8:
            timed["no gather"] = patched(call("batch"), forward, "GATHER_MIN_ROWS", 1 << 60)
        med = graph_rounds({**timed, "decodes alone": call("decodes"), "chunks alone": call("chunks")}, rounds)
        rec = {"decodes": [n_dec, dec_q, dec_keys], "chunks": [n_chunk, chunk_q, chunk_keys], "heads": [h, hk],
               "page": page, "fp8": fp8, "us": med, "parts_us": round(med["decodes alone"] + med["chunks alone"], 1)}
        rows.append(rec)
        others = "  ".join(f"{k} {med[k]:.1f} ({med[k] / med['shipped']:.3f}x)" for k in timed if k != "shipped")
        print(f"mixed {n_dec:3d} x {dec_q} on {dec_keys:5d} + {n_chunk} x {chunk_q:4d} on {chunk_keys:5d} {h}/{hk} "
              f"P{page:<3d} {'e4m3' if fp8 else 'bf16'}  shipped {med['shipped']:8.1f} us  {others}  "
              f"parts apart {rec['parts_us']:.1f} us ({med['shipped'] / rec['parts_us']:.2f}x)", flush=True)
        parts.clear()
        torch.cuda.empty_cache()
    return rows


def route_rows() -> list:
    """Which kernel each mixed point's calls reach: every forward._gluon_varlen call (the packed Gluon
    route's gate) with whether it launched, and the variant each gluon_varlen_forward launch took."""
    seen = []
    gate, launch_fn = forward._gluon_varlen, gluon_forward.gluon_varlen_forward

    def gated(*args, **kwargs):
        result = gate(*args, **kwargs)
        seen.append(("gluon_varlen", "launched" if result is not None else "declined",
                     str(args[0].dtype), kwargs.get("block_table") is not None))
        return result

    def launched(*args, **kwargs):
        before = len(LISTS)
        result = launch_fn(*args, **kwargs)
        seen.append(("gluon_varlen_forward", "listed" if len(LISTS) > before else "unlisted"))
        return result
    forward._gluon_varlen, gluon_forward.gluon_varlen_forward = gated, launched
    rows = []
    try:
        for n_dec, dec_keys, n_chunk, chunk_q, chunk_keys, h, hk, page, fp8 in MIXED_POINTS:
            lens_q, lens_k = [1] * n_dec + [chunk_q] * n_chunk, [dec_keys] * n_dec + [chunk_keys] * n_chunk
            cu_q, cu_k, q, k_pool, v_pool, table, descales, _ = case_tensors(lens_q, lens_k, h, hk, 128, page,
                                                                           bool(fp8))
            seen.clear()
            flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, chunk_q, max(lens_k), block_table=table,
                                             causal=True, **descales)
            torch.cuda.synchronize()
            rows.append({"point": [n_dec, n_chunk, chunk_q, page, fp8], "calls": list(seen)})
            print(f"route {n_dec} x 1 + {n_chunk} x {chunk_q} P{page} {'e4m3' if fp8 else 'bf16'}: {seen}", flush=True)
            del q, k_pool, v_pool
            torch.cuda.empty_cache()
    finally:
        forward._gluon_varlen, gluon_forward.gluon_varlen_forward = gate, launch_fn
    return rows


def _ragged(n, low, high, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (n,), generator=g).tolist()


PREFILL_POINTS = [  # (name, d, dtype, causal, heads, heads_k, lengths)
    ("16 x 64-7005 32/8 causal", 128, "bf16", True, 32, 8, _ragged(16, 64, 7005, 1)),
    ("64 x 64-7005 16/16 causal", 128, "bf16", True, 16, 16, _ragged(64, 64, 7005, 2)),
    ("32 x 100-4000 32/8 full", 128, "bf16", False, 32, 8, _ragged(32, 100, 4000, 3)),
    ("16 x 64-7005 16/16 d64 causal", 64, "bf16", True, 16, 16, _ragged(16, 64, 7005, 4)),
    ("16 x 64-4000 16/16 d256 causal", 256, "bf16", True, 16, 16, _ragged(16, 64, 4000, 5)),
    ("16 x 64-7005 32/8 e4m3 causal", 128, "fp8", True, 32, 8, _ragged(16, 64, 7005, 6)),
    ("64 x 1-300 + 2 x 4096 32/8 causal", 128, "bf16", True, 32, 8, _ragged(64, 1, 300, 7) + [4096, 4096]),
]


def prefill_rows(rounds: int) -> list:
    rows = []
    for name, d, dtype, causal, h, hk, lens in PREFILL_POINTS:
        cu_q, cu_k, q, k, v, _, _ = _case(d, dtype, h, hk, 0, lens, lens)

        def call():
            return flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens), max(lens), causal=causal)
        made = len(LISTS)
        med = graph_rounds({"listed": call, "unlisted": unlisted(call)}, rounds)
        flops = sum(4 * n * n * d * h / (2 if causal else 1) for n in lens)
        rec = {"point": name, "us": med, "listed_lists": len(LISTS) > made,
               "speedup": round(med["unlisted"] / med["listed"], 3),
               "tflops": {key: round(flops / t / 1e6, 1) for key, t in med.items()}}
        rows.append(rec)
        print(f"prefill {name:36s} listed {med['listed']:9.1f} us ({rec['tflops']['listed']:5.1f} TFLOP/s)  unlisted "
              f"{med['unlisted']:9.1f} us  {rec['speedup']:.3f}x{'' if rec['listed_lists'] else '  (not listed)'}",
              flush=True)
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--routes", action="store_true", help="also report the kernels the mixed points reach")
    ap.add_argument("--mixed-only", action="store_true", help="time the mixed batches only")
    ap.add_argument("--gather-checks-only", action="store_true", help="only the mixed batches' gather checks")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.gather_checks_only:
        checks = [mixed_gather_check(page, dtype) for page, dtype in ((16, None), (1, torch.bfloat16),
                                                                       (3, torch.float16))]
        print(f"checks: {sum(c['ok'] for c in checks)} of {len(checks)} passed", flush=True)
        return 0 if all(c["ok"] for c in checks) else 1
    checks = run_checks(args.small)
    ok = all(c["ok"] for c in checks)
    print(f"checks: {sum(c['ok'] for c in checks)} of {len(checks)} passed", flush=True)
    timed = not (args.small or args.check_only)
    routes = route_rows() if args.routes else []
    mixed = mixed_rows(args.rounds) if timed else []
    prefill = prefill_rows(args.rounds) if timed and not args.mixed_only else []
    if args.out:
        with open(os.path.join(args.out, "work-list.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "mixed_batch_fill": interface.MIXED_BATCH_FILL,
                       "checks": checks, "routes": routes, "mixed": mixed, "prefill": prefill}, f, indent=1)
    print("PASS" if ok else "FAIL", "checks")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
