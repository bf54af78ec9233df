"""flash_attn_varlen_func through the Hopper (Gluon) forward: checks and timings on an H200.

    PYTHONPATH=src python benchmarks/varlen_gluon.py --check --bench --out $OUT
    PYTHONPATH=src python benchmarks/varlen_gluon.py --check --small     # under compute-sanitizer

--check: ragged packed sequences (empty ones, Sq != Sk, causal rows that see no key, lengths off the
tile sizes), head dims 64/128/256, bf16 and fp16, GQA, MQA, causal or not; outputs and LSEs
written into NaN-filled buffers by gluon_forward.gluon_varlen_forward, the public call's result
bit for bit the same, each sequence held to the test suite's rule (tests/helpers.py) and compared
bit for bit with flash_attn_func on that sequence alone (reported); one backward through the
public call (gradient rule). e4m3 (d128/d256): each sequence against float64 attention of the
dequantized tensors under the prefill-fp8 rule of fuzz_gpu (_check_e4m3: 2x the portable e4m3
kernel's error on that sequence), the ratio to 2x textbook bf16's error reported.
--check also runs packed sequences on page pools (block_table; pages shuffled, every unused slot
NaN): the same rules per sequence, the direct call bit for bit the public one and the contiguous
packed call on the same keys; page sizes no TMA box fits (not multiples of 16) gathered into packed
rows first where the queries reuse the keys enough (bit for bit the contiguous packed call), else
left to the portable kernel. e4m3 page pools (any page size: the keys are gathered into the packed
layouts first) are held to the e4m3 rule and compared bit for bit with the contiguous e4m3 call.
--bench: CUDA-graph replays (do_bench median), 32/8 heads, at equal lengths (SDPA flash / cuDNN
and flash_attn_func on the same problem) and ragged ones: the Gluon varlen call against the
portable kernel's (the route before), TFLOP/s as FlashAttention-2 counts them; at d128 also the
keys on shuffled page pools of 16/64/256 keys (Gluon and portable), e4m3 pools of 16/256 keys
(Gluon, the per-sequence portable route before, and the gather's copies alone).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from helpers import assert_grads_match_reference, assert_matches_reference  # noqa: E402

import flashtile  # noqa: E402
from flashtile.kernels import forward, gluon_forward  # noqa: E402

import fuzz_gpu  # noqa: E402

DEV = "cuda"
F8 = torch.float8_e4m3fn


def offsets(lens):
    return torch.tensor([0] + list(lens), device=DEV).cumsum(0).to(torch.int32)


def routes():
    """Count the calls attention_forward hands to the Gluon varlen kernel: through
    gluon_varlen_forward, or (plain 16-bit packed calls since f392a57) the cached plan of
    packed_forward, where it takes the call."""
    count = [0]
    original, planned = gluon_forward.gluon_varlen_forward, gluon_forward.packed_forward

    def counted(*a, **kw):
        count[0] += 1
        return original(*a, **kw)

    def counted_plan(*a, **kw):
        result = planned(*a, **kw)
        count[0] += result is not None
        return result
    gluon_forward.gluon_varlen_forward, gluon_forward.packed_forward = counted, counted_plan
    return count


CASES_16 = [  # (head dim, dtype, heads, heads_k, causal, lens_q, lens_k)
    (128, torch.bfloat16, 8, 2, True, [37, 1, 0, 200, 65, 300], [300, 17, 9, 200, 1, 129]),
    (128, torch.bfloat16, 8, 2, False, [37, 1, 0, 200, 65, 300], [300, 17, 9, 200, 1, 129]),
    (64, torch.bfloat16, 6, 1, True, [129, 700, 3], [129, 700, 3]),
    (64, torch.float16, 4, 4, False, [191, 64, 385], [20, 640, 385]),
    (256, torch.bfloat16, 4, 2, True, [100, 0, 257], [300, 5, 257]),
    (256, torch.float16, 4, 2, False, [100, 1, 257], [3000, 5, 257]),
    (128, torch.float16, 8, 8, True, [1024, 1000, 1], [1024, 1000, 2048]),
    (64, torch.bfloat16, 8, 2, True, [1, 2, 3, 190, 191, 192, 193], [1, 2, 3, 190, 191, 192, 193]),
]
CASES_8 = [  # (head dim, heads, heads_k, causal, lens_q, lens_k[, page size of e4m3 pools])
    (128, 8, 2, True, [37, 1, 0, 700, 65, 300], [300, 17, 9, 700, 1, 129]),
    (128, 8, 2, False, [37, 1, 0, 700, 65, 300], [300, 17, 9, 700, 1, 129]),
    (256, 4, 2, True, [100, 0, 257], [300, 5, 257]),
    (256, 4, 2, False, [100, 1, 257], [3000, 5, 257]),
]
CASES_8_PAGED = [
    (128, 8, 2, True, [37, 1, 0, 700, 65, 300], [300, 17, 9, 700, 1, 129], 16),
    (128, 8, 2, False, [37, 1, 0, 700, 65, 300], [300, 17, 9, 700, 1, 129], 1),
    (128, 8, 8, True, [1024, 1000, 1], [1024, 1000, 2048], 256),
    (256, 4, 2, True, [100, 0, 257], [300, 5, 257], 3),
    (256, 4, 2, False, [100, 1, 257], [3000, 5, 257], 64),
]


def check16(cases, count) -> int:
    failures = 0
    for d, dtype, h, hk, causal, lens_q, lens_k in cases:
        cu_q, cu_k = offsets(lens_q), offsets(lens_k)
        q = torch.randn(sum(lens_q), h, d, device=DEV, dtype=dtype)
        k = torch.randn(sum(lens_k), hk, d, device=DEV, dtype=dtype)
        v = torch.randn_like(k)
        label = f"d{d} {str(dtype)[6:]} {h}/{hk} causal={causal} q{lens_q} k{lens_k}"
        try:
            out = torch.full_like(q, float("nan"))
            lse = torch.full((h, q.shape[0]), float("nan"), device=DEV)
            gluon_forward.gluon_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                               softmax_scale=d ** -0.5, causal=causal, out=out, lse=lse)
            before = count[0]
            pub, pub_lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                               causal=causal, return_attn_probs=True)
            assert count[0] == before + 1, "the public call did not take the Gluon kernel"
            assert torch.equal(pub, out) and torch.equal(pub_lse, lse), "public call differs from the direct one"
            same = 0
            for i in range(len(lens_q)):
                qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
                if qs.stop == qs.start:
                    continue
                assert_matches_reference(out[None, qs], lse[None, :, qs], q[None, qs], k[None, ks], v[None, ks],
                                         causal=causal)
                alone, alone_lse, _ = flashtile.flash_attn_func(q[None, qs], k[None, ks], v[None, ks], causal=causal,
                                                                return_attn_probs=True)
                same += bool(torch.equal(alone[0], out[qs]) and torch.equal(alone_lse[0], lse[:, qs]))
            print(f"ok   {label}: {same} of {sum(n > 0 for n in lens_q)} sequences bit for bit flash_attn_func's",
                  flush=True)
        except Exception as exc:
            failures += 1
            print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    return failures


CASES_PAGED = [  # (head dim, dtype, heads, heads_k, causal, lens_q, lens_k, page size)
    (128, torch.bfloat16, 8, 2, True, [37, 1, 0, 200, 65, 300], [300, 17, 9, 200, 1, 129], 16),
    (64, torch.float16, 4, 4, False, [191, 64, 385], [20, 640, 385], 256),
    (256, torch.bfloat16, 4, 2, True, [100, 0, 257], [300, 5, 257], 32),
    (128, torch.bfloat16, 8, 2, False, [37, 1, 0, 200, 65, 300], [300, 17, 9, 200, 1, 129], 48),
    (256, torch.float16, 4, 2, False, [100, 1, 257], [3000, 5, 257], 256),
    (128, torch.float16, 8, 8, True, [1024, 1000, 1], [1024, 1000, 2048], 128),
    (64, torch.bfloat16, 8, 2, True, [1, 2, 3, 190, 191, 192, 193], [1, 2, 3, 190, 191, 192, 193], 64),
    (128, torch.bfloat16, 8, 2, True, [537, 1, 400, 265], [600, 17, 400, 300], 3),  # gathered first
    (128, torch.bfloat16, 8, 2, True, [1, 1, 2, 1], [300, 17, 200, 129], 3),  # portable: too few queries
    (64, torch.float16, 4, 1, False, [700, 7, 0, 400], [400, 1, 9, 260], 1),  # gathered first
]


def check_paged(cases, count) -> int:
    failures = 0
    for d, dtype, h, hk, causal, lens_q, lens_k, page in cases:
        cu_q, cu_k = offsets(lens_q), offsets(lens_k)
        q = torch.randn(sum(lens_q), h, d, device=DEV, dtype=dtype)
        k = torch.randn(sum(lens_k), hk, d, device=DEV, dtype=dtype)
        v = torch.randn_like(k)
        k_pool, v_pool, table = fuzz_gpu._varlen_pools(k, v, lens_k, page, nan_fill=True)
        label = f"paged {page} d{d} {str(dtype)[6:]} {h}/{hk} causal={causal} q{lens_q} k{lens_k}"
        try:
            # pages no TMA box fits: gathered into packed rows first where that pays, else the portable kernel
            gathered = page % 16 != 0 and forward._gathering_pays(q, k_pool, table, max(lens_k))
            gluon = page % 16 == 0 or gathered
            before = count[0]
            pub, pub_lse, _ = flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, max(lens_q),
                                                               max(lens_k), causal=causal, return_attn_probs=True,
                                                               block_table=table)
            assert count[0] == before + gluon, f"the public call took the {'portable' if gluon else 'Gluon'} kernel"
            assert not pub.isnan().any(), "NaN in the output"
            note = "portable kernel (page size not a multiple of 16, too few queries to gather)"
            if gathered:
                flat, flat_lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                                     causal=causal, return_attn_probs=True)
                same = torch.equal(flat, pub) and torch.equal(flat_lse, pub_lse)
                assert same, "the gathered route differs from the contiguous packed call"
                note = "gathered, bit for bit the contiguous packed call"
            elif gluon:
                out = torch.full_like(q, float("nan"))
                lse = torch.full((h, q.shape[0]), float("nan"), device=DEV)
                gluon_forward.gluon_varlen_forward(q, k_pool, v_pool, cu_q, cu_k, max(lens_q), max(lens_k),
                                                   softmax_scale=d ** -0.5, causal=causal, out=out, lse=lse,
                                                   block_table=table)
                assert torch.equal(pub, out) and torch.equal(pub_lse, lse), "public call differs from the direct one"
                flat, flat_lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                                     causal=causal, return_attn_probs=True)
                same = torch.equal(flat, out) and torch.equal(flat_lse, lse)
                note = f"{'bit for bit' if same else 'NOT bit for bit'} the contiguous packed call"
            for i in range(len(lens_q)):
                qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
                if qs.stop == qs.start:
                    continue
                assert_matches_reference(pub[None, qs], pub_lse[None, :, qs], q[None, qs], k[None, ks],
                                         v[None, ks], causal=causal)
            print(f"ok   {label}: {note}", flush=True)
        except Exception as exc:
            failures += 1
            print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    return failures


def check_backward() -> int:
    lens_q, lens_k = [300, 1, 130], [300, 40, 400]
    cu_q, cu_k = offsets(lens_q), offsets(lens_k)
    q = torch.randn(sum(lens_q), 8, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(sum(lens_k), 2, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(sum(lens_k), 2, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    try:
        out = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
        dout = torch.randn_like(out)
        out.backward(dout)
        for i in range(len(lens_q)):
            qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
            assert_grads_match_reference((q.grad[None, qs], k.grad[None, ks], v.grad[None, ks]), q.detach()[None, qs],
                                         k.detach()[None, ks], v.detach()[None, ks], dout[None, qs],
                                         out=out.detach()[None, qs], causal=True)
        print("ok   backward d128 bf16 8/2 causal through the Gluon varlen forward's LSE", flush=True)
        return 0
    except Exception as exc:
        print(f"FAIL backward: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return 1


def check8(cases, count) -> int:
    """e4m3 packed sequences; cases with a page size put the keys on shuffled e4m3 pools (NaN in
    every unused slot), whose call must be bit for bit the contiguous packed call on the same keys."""
    failures = 0
    for d, h, hk, causal, lens_q, lens_k, *page in cases:
        cu_q, cu_k = offsets(lens_q), offsets(lens_k)
        seqs = []
        for lq, lk in zip(lens_q, lens_k):
            xs = [torch.randn(1, s, m, d, device=DEV) * sc for s, m, sc in ((lq, h, 2.0), (lk, hk, 3.0), (lk, hk, 1.0))]
            seqs.append([fuzz_gpu._e4m3_per_head(x, hk) for x in xs])
        packed = [torch.cat([seq[i][0][0] for seq in seqs]) for i in range(3)]
        ds = [torch.cat([seq[i][1] for seq in seqs]) for i in range(3)]
        label = f"e4m3 {f'paged {page[0]} ' if page else ''}d{d} {h}/{hk} causal={causal} q{lens_q} k{lens_k}"
        try:
            before = count[0]
            kw = dict(causal=causal, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2], return_attn_probs=True)
            out, lse, _ = flashtile.flash_attn_varlen_func(*packed, cu_q, cu_k, max(lens_q), max(lens_k), **kw)
            assert count[0] == before + 1, "the public call did not take the Gluon kernel"
            paged_note = ""
            if page:
                k_pool, v_pool, table = fuzz_gpu._varlen_pools(packed[1], packed[2], lens_k, page[0])
                flat, flat_lse = out, lse
                out, lse, _ = flashtile.flash_attn_varlen_func(packed[0], k_pool, v_pool, cu_q, cu_k, max(lens_q),
                                                               max(lens_k), block_table=table, **kw)
                assert count[0] == before + 2, "the paged call did not take the Gluon kernel"
                same_flat = torch.equal(flat, out) and torch.equal(flat_lse, lse)
                paged_note = f"; {'bit for bit' if same_flat else 'NOT bit for bit'} the contiguous packed call"
            worst_bf16 = 0.0
            same = 0
            for i, seq in enumerate(seqs):
                qs = slice(int(cu_q[i]), int(cu_q[i + 1]))
                if qs.stop == qs.start:
                    continue
                (q8, qd, dq), (k8, kd, dk), (v8, vd, dv) = seq
                kw = dict(causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, return_attn_probs=True)
                alone, alone_lse, _ = flashtile.flash_attn_func(q8, k8, v8, **kw)
                portable, portable_lse, _ = fuzz_gpu._portable(lambda: flashtile.flash_attn_func(q8, k8, v8, **kw))
                fuzz_gpu._check_e4m3(out[None, qs], lse[None, :, qs], portable, portable_lse, dq, dk, dv,
                                     dict(causal=causal))
                same += bool(torch.equal(alone[0], out[qs]))
                from flashtile.reference import attention as textbook
                ref, _ = textbook(dq, dk, dv, causal=causal)
                low, _ = textbook(dq.bfloat16(), dk.bfloat16(), dv.bfloat16(), causal=causal)
                worst_bf16 = max(worst_bf16, (out[None, qs].double() - ref).abs().max().item()
                                 / (2 * (low.double() - ref).abs().max().item() + 1e-6))
            print(f"ok   {label}: {same} sequences bit for bit flash_attn_func's; error {worst_bf16:.2f} of "
                  f"2x textbook bf16's{paged_note}", flush=True)
        except Exception as exc:
            failures += 1
            print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    return failures


def graph_time(fn) -> float:
    import triton
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=50, rep=300)


def portable(fn):
    """fn with packed calls on the portable Triton kernel (the route before the Gluon one)."""
    def run():
        saved = forward.GLUON_ENABLED
        forward.GLUON_ENABLED = False
        try:
            return fn()
        finally:
            forward.GLUON_ENABLED = saved
    return run


def bench(out_dir: str, head_dims=(64, 128, 256), e4m3_only: bool = False) -> list:
    """``e4m3_only``: the e4m3 calls, with the bf16 Gluon varlen call, flash_attn_func and SDPA
    cuDNN for reference."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rows = []
    heads, heads_k = 32, 8
    ragged = torch.randint(64, 8193, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    points = [(128, True, "equal 4 x 4096", [4096] * 4), (128, True, "equal 8 x 2048", [2048] * 8),
              (128, True, "ragged 16", ragged), (128, False, "equal 4 x 4096", [4096] * 4),
              (128, False, "ragged 16", ragged), (64, True, "equal 8 x 2048", [2048] * 8),
              (256, True, "equal 8 x 2048", [2048] * 8)]
    for d, causal, name, lens in points:
        if d not in head_dims:
            continue
        cu = offsets(lens)
        total, mx = sum(lens), max(lens)
        flops = sum(4 * n * n * d * heads / (2 if causal else 1) for n in lens)
        q = torch.randn(total, heads, d, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(total, heads_k, d, device=DEV, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        calls = {"bf16 varlen gluon": lambda: flashtile.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=causal)}
        if not e4m3_only:
            calls["bf16 varlen portable"] = portable(calls["bf16 varlen gluon"])
        if (d, causal) in gluon_forward.FP8_DISPATCH:
            qkv8 = [fuzz_gpu._e4m3_per_head(x.view(1, total, -1, d), heads_k) for x in (q, k, v)]
            # one descale per sequence and KV head (the whole batch's here: timing only)
            p8 = [x[0][0] for x in qkv8]
            ds = [x[1].expand(len(lens), heads_k).contiguous() for x in qkv8]
            calls["e4m3 varlen gluon"] = lambda: flashtile.flash_attn_varlen_func(
                *p8, cu, cu, mx, mx, causal=causal, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])

            def per_sequence():
                saved = forward.VARLEN_FP8_GLUON
                forward.VARLEN_FP8_GLUON = False
                try:
                    return calls["e4m3 varlen gluon"]()
                finally:
                    forward.VARLEN_FP8_GLUON = saved
            calls["e4m3 varlen per-sequence (before)"] = per_sequence
        if d == 128 and name in ("equal 4 x 4096", "ragged 16"):  # keys on shuffled page pools
            for page in (16, 64, 256):
                if not e4m3_only:
                    kp, vp, table = fuzz_gpu._varlen_pools(k, v, lens, page)
                    calls[f"bf16 varlen gluon P{page}"] = (
                        lambda kp=kp, vp=vp, table=table: flashtile.flash_attn_varlen_func(
                            q, kp, vp, cu, cu, mx, mx, causal=causal, block_table=table))
                    calls[f"bf16 varlen portable P{page}"] = portable(calls[f"bf16 varlen gluon P{page}"])
                if "e4m3 varlen gluon" in calls and page != 64:
                    kp8, vp8, table8 = fuzz_gpu._varlen_pools(p8[1], p8[2], lens, page)
                    calls[f"e4m3 varlen gluon P{page}"] = (
                        lambda kp8=kp8, vp8=vp8, table8=table8: flashtile.flash_attn_varlen_func(
                            p8[0], kp8, vp8, cu, cu, mx, mx, causal=causal, q_descale=ds[0], k_descale=ds[1],
                            v_descale=ds[2], block_table=table8))

                    def per_sequence_paged(call=calls[f"e4m3 varlen gluon P{page}"]):
                        saved = forward.VARLEN_FP8_GLUON
                        forward.VARLEN_FP8_GLUON = False
                        try:
                            return call()
                        finally:
                            forward.VARLEN_FP8_GLUON = saved
                    calls[f"e4m3 varlen per-sequence P{page} (before)"] = per_sequence_paged
                    calls[f"e4m3 gather P{page} (its copies alone)"] = (
                        lambda kp8=kp8, vp8=vp8, table8=table8: forward.paged_keys_packed(kp8, vp8, table8, cu, mx))
        if len(set(lens)) == 1:
            b = len(lens)
            qb, kb, vb = (x.view(b, mx, -1, d) for x in (q, k, v))
            calls["bf16 flash_attn_func"] = lambda: flashtile.flash_attn_func(qb, kb, vb, causal=causal)
            if "e4m3 varlen gluon" in calls:
                p8b = [x.view(b, mx, -1, d) for x in p8]
                dsb = [x[:b] for x in ds]
                calls["e4m3 flash_attn_func"] = lambda: flashtile.flash_attn_func(
                    *p8b, causal=causal, q_descale=dsb[0], k_descale=dsb[1], v_descale=dsb[2])
            qt, kt, vt = (x.transpose(1, 2) for x in (qb, kb, vb))
            backends = ((SDPBackend.FLASH_ATTENTION, "sdpa-flash"), (SDPBackend.CUDNN_ATTENTION, "sdpa-cudnn"))
            for backend, label in backends[1:] if e4m3_only else backends:
                def sdpa(backend=backend):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)
                calls[label] = sdpa
        times = {}
        for label, fn in calls.items():
            try:
                times[label] = graph_time(fn)
            except Exception as exc:
                print(f"d{d} {name} {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        for label, ms in times.items():
            rows.append(dict(head_dim=d, causal=causal, point=name, provider=label, ms=ms, tflops=flops / ms / 1e9,
                             vs_gluon_bf16=times["bf16 varlen gluon"] / ms if "bf16 varlen gluon" in times else None,
                             vs_sdpa_cudnn=times["sdpa-cudnn"] / ms if "sdpa-cudnn" in times else None,
                             vs_sdpa_flash=times["sdpa-flash"] / ms if "sdpa-flash" in times else None))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "varlen-gluon.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), heads=heads, heads_k=heads_k, ragged=ragged,
                       rows=rows), f, indent=1)
    return rows


def table(rows) -> None:
    def fmt(x):
        return f"{x:.3f}" if x is not None else "-"
    print(f"{'d':>3} {'mask':6} {'point':16} {'provider':34} {'ms':>7} {'TFLOP/s':>7} {'/gluon16':>8} "
          f"{'x cudnn':>7} {'x flash':>7}")
    for r in rows:
        print(f"{r['head_dim']:>3} {'causal' if r['causal'] else 'full':6} {r['point']:16} {r['provider']:34} "
              f"{r['ms']:7.3f} {r['tflops']:7.1f} {fmt(r['vs_gluon_bf16']):>8} {fmt(r['vs_sdpa_cudnn']):>7} "
              f"{fmt(r['vs_sdpa_flash']):>7}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--small", action="store_true", help="a few small check cases (compute-sanitizer)")
    ap.add_argument("--e4m3-only", action="store_true", help="only the e4m3 check cases and bench calls")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--head-dim", type=int, action="append", help="bench only these head dims (repeatable)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    count = routes()
    failures = 0
    if args.check:
        cases16, cases8 = ((CASES_16[:3], CASES_8[:2] + CASES_8_PAGED[:2]) if args.small
                           else (CASES_16, CASES_8 + CASES_8_PAGED))
        failures += check8(cases8, count)
        if not args.e4m3_only:
            failures += check16(cases16, count)
            failures += check_paged([CASES_PAGED[i] for i in (0, 2, 7, 8)] if args.small else CASES_PAGED, count)
        if not (args.small or args.e4m3_only):
            failures += check_backward()
        print(f"check: {failures} failed", flush=True)
    if args.bench:
        table(bench(args.out, tuple(args.head_dim or (64, 128, 256)), args.e4m3_only))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
