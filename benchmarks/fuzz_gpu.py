"""Random calls of the public API on the GPU against the float64 reference: the kernels the CPU tests
cannot run (the Gluon forward, backward and decode, the GPU plans and key steps) under random
shapes and options.

    PYTHONPATH=src python benchmarks/fuzz_gpu.py --out $OUT [--seed S] [--seconds T] [--family F]

Families: ``prefill`` (flash_attn_func and its kv/qkv-packed forms, forward, and backward on half
the cases and on a quarter drawn wide enough for the fused Gluon backward, most of those with a
softcap, each case recording the fused backward's calls; some deterministic: run twice, the
gradients must match bit for bit; some with dropout, its mask taken from S_dmask; half the calls
without dropout ask for the output alone, as most callers do, so that they take the Gluon kernels
where those apply (return_attn_probs keeps a call off them), windows up to 3000 keys, short causal windows for the portable kernel's short-window tiles),
``varlen`` (flash_attn_varlen_func: backward on some cases, deterministic ones twice, a fifth of the
cases wide enough, 4-8 KV heads at d64/d128, for the Gluon packed backward, whose calls each case
records; or keys on page pools of any page size through block_table), ``mixed`` (serving batches
of decode steps among prefill chunks on page pools, through flash_attn_varlen_func or
flash_attn_with_kvcache's FlashAttention-3 packed form: mixed_case), ``kvcache``
(flash_attn_with_kvcache on contiguous or paged caches of any page size, appends, rotary, leftpad,
cache_batch_idx, splits, Sq 1..48), ``kvcache-long`` (the same at 32-128 sequence x KV-head pairs
with 16k-40k keys, contiguous or pages of 16: the long-cache plans), ``kvcache-fp8`` (the same on
e4m3 caches with per-key descales, paged ones included, appends quantized in place),
``kvcache-fp8-long`` (that at batch 1-64 with 16k-40k keys), ``prefill-fp8`` (the e4m3 forward:
flash_attn_func with (B, Hk) descales, or quantize_qkv's block scales with or without the Hadamard
rotation; budget in prefill_fp8_case), ``varlen-fp8`` (e4m3 packed sequences through
flash_attn_varlen_func with per-sequence descales, keys contiguous or on page pools; the LSE
by assert_e4m3_lse; calls the Gluon varlen forward takes, which round P to e4m3, by
prefill_fp8_case's rule; each varlen case records how many calls took that kernel), ``sinks``
(attention sinks, s_aux, on flash_attn_func forward and backward, decode steps on page pools and
flash_attn_with_kvcache: sinks_case). Every other case uses the test suite's accuracy rule
(tests/helpers.py: output within 2x the error of textbook attention in the input dtype, gradients
3x, LSE to fp32 rounding, rows without keys 0 / +inf). Cases run until
``--seconds`` have passed (new shapes compile kernels: the count depends on the cache). Writes
$OUT/fuzz-gpu-<seed>.json with every failing case's parameters; exit status 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from helpers import (assert_grads_match_reference, assert_matches_reference,  # noqa: E402
                     rotary_reference)

import flashtile  # noqa: E402

DEV = "cuda"
SCALE = 1.0  # length bounds times this (--scale: a small smoke run through the interpreter)
HEAD_DIMS = (40, 64, 80, 96, 111, 128, 192, 256)


def _n(bound: int) -> int:
    return max(1, int(bound * SCALE))


def _mask_options(rng, causal_p=0.5):
    kw = {}
    if rng.random() < causal_p:
        kw["causal"] = True
    if rng.random() < 0.15:  # windows from a few keys to past the Gluon kernels' 512-key rule at d128
        bound = rng.choice([300, 3000])
        kw["window_size"] = (rng.randint(0, _n(bound)), rng.choice([-1, rng.randint(0, _n(bound))]))
    if rng.random() < 0.15:
        kw["softcap"] = rng.choice([5.0, 30.0])
    return kw


def _same_bits(first, second, what):
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"deterministic backward: {name} differs between two runs ({what})"


def prefill_case(rng):
    b, hk = rng.randint(1, 3), rng.choice([1, 2, 4])
    h = hk * rng.choice([1, 2, 4])
    sq, sk = rng.randint(1, _n(2500)), rng.randint(1, _n(2500))
    if rng.random() < 0.4:
        sk = sq
    # the packed entry points: kv (B, Sk, 2, Hk, D), or qkv (B, S, 3, H, D) (needs Sq = Sk, H = Hk)
    packing = rng.choice(["none"] * 8 + ["kv", "qkv"])
    if packing == "qkv":
        sk, hk = sq, h
    d = rng.choice(HEAD_DIMS)
    dtype = rng.choice([torch.bfloat16, torch.float16])
    # some cases wide enough for the fused Gluon backward (a program per 128 keys of a KV head, one
    # an SM or more) at its head dims, most of them with a softcap
    wide = rng.random() < 0.25
    if wide:
        b, hk, d = 2, 8, rng.choice([64, 128])
        h = hk * rng.choice([1, 2])
        sk = rng.randint(_n(1100), _n(2500))
        sq = sk if packing == "qkv" or rng.random() < 0.5 else rng.randint(1, _n(2500))
        hk = h if packing == "qkv" else hk
    kw = _mask_options(rng)
    if wide and rng.random() < 0.6:
        kw["softcap"] = rng.choice([5.0, 30.0])
    if "window_size" not in kw and rng.random() < 0.1:
        # short causal windows, where the portable kernel takes its short-window tiles on sm_90
        # (forward.short_window_config: up to 2049-key spans at padded head dim 64, 513 at 128)
        kw["causal"] = True
        kw["window_size"] = (rng.randint(0, _n(2048 if d <= 64 else 512)), 0)
    if rng.random() < 0.1:
        kw["alibi_slopes"] = torch.rand(b, h, device=DEV) if rng.random() < 0.5 else torch.rand(h, device=DEV)
    backward = rng.random() < 0.5 or wide
    deterministic = backward and rng.random() < 0.4
    # dropout: the mask comes back as S_dmask's signs (return_attn_probs), and the reference applies it
    dropout_p = rng.choice([0.1, 0.3]) if rng.random() < 0.15 else 0.0
    dropout_seed = rng.randrange(1 << 30)  # the generator's state at each call: reruns draw the same mask
    # return_attn_probs (the LSE and S_dmask back) keeps a call off the Gluon kernels: half the calls
    # without dropout ask only for the output, as most callers do, and take them where they apply
    probs = dropout_p > 0 or rng.random() < 0.5
    params = dict(family="prefill", b=b, h=h, hk=hk, sq=sq, sk=sk, d=d, dtype=str(dtype), backward=backward,
                  deterministic=deterministic, packing=packing, dropout_p=dropout_p, probs=probs,
                  **{k: (v if not torch.is_tensor(v) else list(v.shape)) for k, v in kw.items()})

    def call(q, k, v):
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if DEV == "cuda" else []):
            torch.manual_seed(dropout_seed)
            result, grads = entry(q, k, v, dropout_p=dropout_p, deterministic=deterministic,
                                  return_attn_probs=probs, **kw)
            return (result if probs else (result, None, None)), grads

    def entry(q, k, v, **call_kw):
        if packing == "kv":
            kv = torch.stack((k, v), dim=2).detach().requires_grad_(backward)
            out = flashtile.flash_attn_kvpacked_func(q, kv, **call_kw)
            return out, lambda: (q.grad, kv.grad[:, :, 0], kv.grad[:, :, 1])
        if packing == "qkv":
            qkv = torch.stack((q, k, v), dim=2).detach().requires_grad_(backward)
            out = flashtile.flash_attn_qkvpacked_func(qkv, **call_kw)
            return out, lambda: qkv.grad.unbind(2)
        out = flashtile.flash_attn_func(q, k, v, **call_kw)
        return out, lambda: (q.grad, k.grad, v.grad)

    def run():
        fused = _gluon_backward_calls()
        before = fused.plain_calls
        try:
            _run()
        finally:  # how many backward calls took the fused Gluon kernel, for the record
            params["gluon_backward_calls"] = fused.plain_calls - before

    def _run():
        q = torch.randn(b, sq, h, d, device=DEV, dtype=dtype)
        k = torch.randn(b, sk, hk, d, device=DEV, dtype=dtype)
        v = torch.randn(b, sk, hk, d, device=DEV, dtype=dtype)
        qq, kk, vv = (t.clone().requires_grad_(backward) for t in (q, k, v))
        (out, lse, s_dmask), grads = call(qq, kk, vv)
        ref_kw = kw
        if dropout_p:
            assert s_dmask is not None and s_dmask.shape == (b, h, sq, sk), "S_dmask"
            ref_kw = dict(kw, dropout_p=dropout_p, dropout_mask=~torch.signbit(s_dmask))
        assert_matches_reference(out.detach(), None if lse is None else lse.detach(), q, k, v, **ref_kw)
        if backward:
            dout = torch.randn_like(out)
            out.backward(dout)
            first = [g.clone() for g in grads()]
            assert_grads_match_reference(first, q, k, v, dout, out=out, **ref_kw)
            if deterministic:  # the same call again gives the same bits
                qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
                (out, _, _), grads = call(qq, kk, vv)
                out.backward(dout)
                _same_bits(first, grads(), "flash_attn_func" if packing == "none" else packing)
    return params, run


def _varlen_pools(k, v, lens_k, page_size, nan_fill=False):
    """Packed keys and values (total_k, Hk, D) as sequences on shuffled pools of ``page_size``-key
    pages (the slots past each sequence and the spare pages hold noise, NaN in e4m3 pools and with
    ``nan_fill``), and the (B, max_pages) int32 table both pools share."""
    per_seq = max(-(-n // page_size) for n in lens_k)
    pages = len(lens_k) * per_seq + 2
    order = torch.randperm(pages, device=DEV)[:len(lens_k) * per_seq].view(len(lens_k), per_seq)
    pools = []
    for x in (k, v):
        if x.dtype == torch.float8_e4m3fn or nan_fill:
            pool = torch.full((pages, page_size, *x.shape[1:]), float("nan"), device=DEV).to(x.dtype)
        else:
            pool = torch.randn(pages, page_size, *x.shape[1:], device=DEV, dtype=x.dtype)
        start = 0
        for i, n in enumerate(lens_k):
            rows = pool[order[i].long()].flatten(0, 1)
            rows[:n] = x[start:start + n]
            pool[order[i].long()] = rows.view(per_seq, page_size, *x.shape[1:])
            start += n
        pools.append(pool)
    return pools[0], pools[1], order.to(torch.int32)


def _packed_inputs(lens_q, lens_k, h, hk, d, dtype):
    """Fresh packed q, k, v and their int32 offsets."""
    q = torch.randn(sum(lens_q), h, d, device=DEV, dtype=dtype)
    k = torch.randn(sum(lens_k), hk, d, device=DEV, dtype=dtype)
    v = torch.randn(sum(lens_k), hk, d, device=DEV, dtype=dtype)
    cu_q = torch.tensor([0] + lens_q, device=DEV).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device=DEV).cumsum(0).to(torch.int32)
    return q, k, v, cu_q, cu_k


def varlen_case(rng):
    n = rng.randint(1, 5)
    hk = rng.choice([1, 2])
    h = hk * rng.choice([1, 3, 4])
    d = rng.choice(HEAD_DIMS)
    dtype = rng.choice([torch.bfloat16, torch.float16])
    lens_q = [rng.randint(0 if rng.random() < 0.1 else 1, _n(1200)) for _ in range(n)]
    lens_q[0] = max(lens_q[0], 1)
    lens_k = [rng.randint(1, _n(1200)) if rng.random() < 0.5 else lq for lq in lens_q]
    kw = _mask_options(rng)
    wide = rng.random() < 0.2
    if wide:  # enough KV heads and keys for the Gluon packed backward (one CTA an SM or more)
        hk = rng.choice([4, 8])
        h = hk * rng.choice([1, 2])
        d = rng.choice([64, 128])
        lens_q = [rng.randint(1, _n(3000)) for _ in range(max(n, 3))]
        lens_k = [lq if rng.random() < 0.7 else rng.randint(1, _n(3000)) for lq in lens_q]
        n = len(lens_q)
    if rng.random() < 0.15:  # windows at the Gluon kernel's head dims (128: from 512-key spans, 256)
        d = rng.choice([128, 256])
        kw.pop("softcap", None)
        kw["window_size"] = (rng.randint(0, _n(3000)), rng.choice([-1, rng.randint(0, _n(3000))]))
    # keys on a page pool through block_table (forward only), or a backward (sometimes deterministic)
    page = rng.choice([1, 3, 16, 48, 64, 256]) if rng.random() < 0.4 else 0
    backward = not page and (wide or rng.random() < 0.4)
    deterministic = backward and rng.random() < 0.4
    params = dict(family="varlen", h=h, hk=hk, d=d, dtype=str(dtype), lens_q=lens_q, lens_k=lens_k, page=page,
                  backward=backward, deterministic=deterministic, **kw)

    def run():
        gluon_calls = _gluon_varlen_calls()
        backward_calls = _gluon_backward_calls()
        before, backward_before = gluon_calls.calls, backward_calls.calls
        try:
            _run()
        finally:  # which kernels the calls took, for the record
            params["gluon_varlen_calls"] = gluon_calls.calls - before
            params["gluon_varlen_backward_calls"] = backward_calls.calls - backward_before

    def _run():
        q, k, v, cu_q, cu_k = _packed_inputs(lens_q, lens_k, h, hk, d, dtype)

        def call(q_, k_, v_):
            if page:
                k_pool, v_pool, table = _varlen_pools(k_, v_, lens_k, page, nan_fill=True)
                with torch.no_grad():
                    return flashtile.flash_attn_varlen_func(q_, k_pool, v_pool, cu_q, cu_k, max(lens_q),
                                                            max(lens_k), return_attn_probs=True,
                                                            block_table=table, **kw)
            return flashtile.flash_attn_varlen_func(q_, k_, v_, cu_q, cu_k, max(lens_q), max(lens_k),
                                                    deterministic=deterministic, return_attn_probs=True,
                                                    **kw)

        qq, kk, vv = (t.clone().requires_grad_(backward) for t in (q, k, v))
        out, lse, _ = call(qq, kk, vv)
        dout = torch.randn_like(out)
        if backward:
            out.backward(dout)
            first = [qq.grad.clone(), kk.grad.clone(), vv.grad.clone()]
        for i in range(n):
            qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
            if qs.stop == qs.start:  # no queries: its keys get no gradient
                if backward:
                    assert (first[1][ks] == 0).all() and (first[2][ks] == 0).all(), "dk/dv of unseen keys"
                continue
            if backward:  # a sequence's keys get no gradient from other sequences' queries
                assert_grads_match_reference((first[0][None, qs], first[1][None, ks], first[2][None, ks]),
                                             q[None, qs], k[None, ks], v[None, ks], dout[None, qs],
                                             out=out[None, qs], **kw)
            assert_matches_reference(out.detach()[None, qs], lse.detach()[None, :, qs], q[None, qs],
                                     k[None, ks], v[None, ks], **kw)
        if deterministic:
            qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
            out, _, _ = call(qq, kk, vv)
            out.backward(dout)
            _same_bits(first, (qq.grad, kk.grad, vv.grad), "flash_attn_varlen_func")
    return params, run


def mixed_case(rng):
    """vLLM's and SGLang's serving batches on page pools: decode steps (mostly one query, some
    speculative ones of 2-16) among a few prefill chunks, through flash_attn_varlen_func (key
    offsets, or seqused_k without them, sometimes into a NaN-filled ``out``) or through
    flash_attn_with_kvcache's FlashAttention-3 packed form (page_table, cu_seqlens_q), each sequence
    against float64: the mixed split, its two decode launches and the gathers of pages no TMA box
    fits."""
    hk = rng.choice([1, 2, 8])
    h = hk * rng.choice([1, 4, 6, 8])
    d = rng.choice([64, 128, 256])
    dtype = rng.choice([torch.bfloat16, torch.float16])
    steps = rng.randint(2, max(2, _n(150)))
    lens_q = [1 if rng.random() < 0.8 else rng.randint(2, 16) for _ in range(steps)]
    lens_k = [rng.randint(lq, max(lq, _n(4000))) for lq in lens_q]
    for _ in range(rng.randint(1, 3)):  # chunks, placed among the steps
        at = rng.randint(0, len(lens_q))
        chunk = rng.randint(17, max(17, _n(1500)))
        lens_q.insert(at, chunk)
        lens_k.insert(at, rng.randint(chunk, max(chunk, _n(6000))))
    kw = _mask_options(rng, causal_p=0.8)
    page = rng.choice([1, 3, 16, 64])
    form = rng.choice(["offsets", "seqused", "fa3"])
    params = dict(family="mixed", h=h, hk=hk, d=d, dtype=str(dtype), lens_q=lens_q, lens_k=lens_k, page=page,
                  form=form, **kw)

    def run():
        q, k, v, cu_q, cu_k = _packed_inputs(lens_q, lens_k, h, hk, d, dtype)
        used = torch.tensor(lens_k, device=DEV, dtype=torch.int32)
        k_pool, v_pool, table = _varlen_pools(k, v, lens_k, page, nan_fill=True)
        with torch.no_grad():
            if form == "fa3":
                out, lse = flashtile.flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=used, page_table=table,
                                                             cu_seqlens_q=cu_q, max_seqlen_q=max(lens_q),
                                                             return_softmax_lse=True, **kw)
            elif form == "seqused":
                out, lse = flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, None, max(lens_q), max(lens_k),
                                                            block_table=table, seqused_k=used,
                                                            out=torch.full_like(q, float("nan")),
                                                            return_softmax_lse=True, **kw)
            else:
                out, lse, _ = flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, max(lens_q),
                                                               max(lens_k), block_table=table,
                                                               return_attn_probs=True, **kw)
        for i in range(len(lens_q)):
            qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
            assert_matches_reference(out[None, qs], lse[None, :, qs], q[None, qs], k[None, ks], v[None, ks], **kw)
    return params, run


def _paged(k_cache, v_cache, page_size):
    """The contiguous cache's rows on a shuffled page pool (spare pages of noise), and the table."""
    batch, capacity = k_cache.shape[:2]
    per_seq = -(-capacity // page_size)
    pages = batch * per_seq + 3
    order = torch.randperm(pages, device=DEV)[:batch * per_seq].view(batch, per_seq)
    k_pool = torch.randn(pages, page_size, *k_cache.shape[2:], device=DEV, dtype=k_cache.dtype)
    v_pool = torch.randn_like(k_pool)
    k_view = k_pool.new_zeros(batch, per_seq * page_size, *k_cache.shape[2:])
    k_view[:, :capacity] = k_cache
    v_view = torch.zeros_like(k_view)
    v_view[:, :capacity] = v_cache
    k_pool[order.flatten()] = k_view.view(batch * per_seq, page_size, *k_cache.shape[2:])
    v_pool[order.flatten()] = v_view.view(batch * per_seq, page_size, *k_cache.shape[2:])
    return k_pool, v_pool, order.to(torch.int32)


def _gather(pool, table, capacity):
    batch, per_seq = table.shape
    return pool[table.long().flatten()].view(batch, per_seq * pool.shape[1], *pool.shape[2:])[:, :capacity]


def kvcache_case(rng, long=False):
    """``long``: the long-cache plans of the serving shapes (32-128 sequence x KV-head pairs, head dim
    128, 16k-40k keys a sequence, contiguous or pages of 16): the warp-split and transposed plans."""
    if long:
        hk = rng.choice([2, 8])
        b = rng.choice([16, 32, 48, 64] if hk == 2 else [4, 8, 12, 16])
        h = hk * rng.choice([4, 6])
        sq = rng.choice([1, 1, 2, 3])
        d = 128
        dtype = rng.choice([torch.bfloat16, torch.float16])
        capacity = rng.randint(sq + _n(16384), sq + _n(40000))
        page = rng.choice([None, None, 16])
    else:
        b = rng.choice([1, 2, 3, 5, 8, 16])
        hk = rng.choice([1, 2, 8])
        h = hk * rng.choice([1, 4, 6])
        sq = rng.choice([1, 1, 1, 2, 4, 8, rng.randint(1, 48)])
        d = rng.choice([64, 128, 128, 128, 96, 256])
        dtype = rng.choice([torch.bfloat16, torch.float16])  # (drawn here: the seeds before kvcache-long)
        capacity = rng.choice([rng.randint(sq + 8, sq + 8 + _n(600)),
                               rng.randint(sq + 8 + _n(600), sq + 8 + _n(6000))])
        page = rng.choice([None, None, 1, 3, 8, 16, 16, 64, 256])
    new = rng.choice([0, 0, sq])
    kw = _mask_options(rng, causal_p=0.7 if sq > 1 else 0.3)
    splits = rng.choice([0, 0, 0, 1] if long else [0, 0, 0, 1, 3])
    leftpad = page is None and rng.random() < 0.2
    batch_idx = page is None and rng.random() < 0.2
    rotary = rng.random() < 0.2 and new > 0
    rotary_dim = rng.choice([d // 2, d]) if rotary else 0
    rotary_dim -= rotary_dim % 16
    rotary = rotary and rotary_dim > 0
    interleaved = rng.random() < 0.5
    params = dict(family="kvcache-long" if long else "kvcache", b=b, h=h, hk=hk, sq=sq, d=d, dtype=str(dtype),
                  capacity=capacity,
                  page=page, new=new, splits=splits, leftpad=leftpad, batch_idx=batch_idx,
                  rotary_dim=rotary_dim if rotary else 0, interleaved=interleaved, **kw)

    def run():
        rows = b + 2 if batch_idx else b
        q = torch.randn(b, sq, h, d, device=DEV, dtype=dtype)
        k_cache = torch.randn(rows, capacity, hk, d, device=DEV, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        lengths = torch.randint(0, capacity - new + 1, (b,), device=DEV, dtype=torch.int32)
        if rng.random() < 0.3:
            lengths[rng.randrange(b)] = capacity - new
        starts = torch.zeros(b, device=DEV, dtype=torch.int32)
        extra = {}
        if leftpad:
            starts = (torch.rand(b, device=DEV) * (lengths.float() + 1)).long().clamp(max=lengths).to(torch.int32)
            extra["cache_leftpad"] = starts
        cache_rows = torch.arange(b, device=DEV, dtype=torch.int32)
        if batch_idx:
            cache_rows = torch.randperm(rows, device=DEV)[:b].to(torch.int32)
            extra["cache_batch_idx"] = cache_rows
        if new:
            extra["k"] = torch.randn(b, new, hk, d, device=DEV, dtype=dtype)
            extra["v"] = torch.randn(b, new, hk, d, device=DEV, dtype=dtype)
        if rotary:
            angles = torch.rand(capacity + sq, rotary_dim // 2, device=DEV) * 6
            extra.update(rotary_cos=torch.cos(angles).to(dtype), rotary_sin=torch.sin(angles).to(dtype),
                         rotary_interleaved=interleaved)
        if page:
            k_in, v_in, table = _paged(k_cache, v_cache, page)
            extra["block_table"] = table
        else:
            k_in, v_in = k_cache, v_cache
        out, lse = flashtile.flash_attn_with_kvcache(q, k_in, v_in, cache_seqlens=lengths, num_splits=splits,
                                                     return_softmax_lse=True, **extra, **kw)
        if page:  # what the pages hold now, appends included
            k_cache = _gather(k_in, table, capacity)
            v_cache = _gather(v_in, table, capacity)
        for i in range(b):
            row, start, n = int(cache_rows[i]), int(starts[i]), int(lengths[i]) + new
            qi = q[i:i + 1]
            if rotary:
                pos = torch.arange(sq, device=DEV) + (n - new - start)
                q_pos = pos if kw.get("causal") or "window_size" in kw else torch.full_like(pos, n - new - start)
                qi = rotary_reference(qi, extra["rotary_cos"], extra["rotary_sin"], q_pos[None], interleaved)
            assert_matches_reference(out[i:i + 1], lse[i:i + 1], qi, k_cache[row:row + 1, start:n],
                                     v_cache[row:row + 1, start:n], **kw)
    return params, run


def _pool(x, order, page_size, fill):
    """Rows (B, S, ...) of ``x`` scattered over a pool of pages (``order`` (B, pages) the table),
    spare pages and the slots past S filled with ``fill``."""
    batch, capacity = x.shape[:2]
    per_seq = order.shape[1]
    pool = torch.full((int(order.max()) + 4, page_size, *x.shape[2:]), fill, device=DEV, dtype=x.dtype)
    view = torch.full((batch, per_seq * page_size, *x.shape[2:]), fill, device=DEV, dtype=x.dtype)
    view[:, :capacity] = x
    pool[order.long().flatten()] = view.view(batch * per_seq, page_size, *x.shape[2:])
    return pool


def e4m3_cache_call(q, k8, v8, kd, vd, page, describe=False, fill=float("nan"), **kw):
    """flash_attn_with_kvcache on an e4m3 cache (B, S, Hk, D) with per-key descales (B, S, Hk),
    contiguous or (``page``) as a shuffled pool of such pages, the descales through the same table
    (``fill``, NaN, in every slot past the cache: never read). Returns (out, the cache's dequantized K and V
    after the call (appends included) as (B, S, Hk, D) float32, and with ``describe`` the plan
    decode.describe_plan reports)."""
    from flashtile.kernels.decode import describe_plan
    capacity = k8.shape[1]
    if page:
        per_seq = -(-capacity // page)
        order = torch.randperm(k8.shape[0] * per_seq + 3, device=DEV)[:k8.shape[0] * per_seq]
        order = order.view(k8.shape[0], per_seq).to(torch.int32)
        k_in, v_in = (_pool(x.view(torch.uint8), order, page, 0).view(torch.float8_e4m3fn) for x in (k8, v8))
        kd_in, vd_in = (_pool(x, order, page, fill) for x in (kd, vd))
        kw["block_table"] = order
    else:
        k_in, v_in, kd_in, vd_in = k8, v8, kd, vd
    plan = describe_plan(q, k_in, v_in, block_table=kw.get("block_table"), causal=kw.get("causal", False),
                         in_graph=False) if describe else None
    out = flashtile.flash_attn_with_kvcache(q, k_in, v_in, k_descale=kd_in, v_descale=vd_in, **kw)
    if page:
        k8, v8 = (_gather(x.view(torch.uint8), order, capacity).view(torch.float8_e4m3fn) for x in (k_in, v_in))
        kd, vd = (_gather(x, order, capacity) for x in (kd_in, vd_in))
    else:
        k8, v8, kd, vd = k_in, v_in, kd_in, vd_in
    return out, k8.float() * kd[..., None], v8.float() * vd[..., None], plan


def kvcache_fp8_case(rng, long=False):
    """An e4m3 cache with per-key descales (fp8.quantize_per_key), contiguous or paged (descales
    through the same table, NaN in every slot past the cache), appends of bf16 keys quantized in place;
    the reference is float64 attention on the dequantized cache after the call, the budget 2x the same
    attention in the query's dtype (tests/test_fp8.py's rule). ``long``: batch 1-64 with 16k-40k keys
    a sequence at head dim 128 (the e4m3 plans of bench decode-fp8's points, wave splits among them)."""
    from flashtile import fp8
    if long:
        hk = rng.choice([2, 8])
        b = rng.choice([1, 16, 32, 64] if hk == 2 else [1, 4, 16])
        h = hk * rng.choice([4, 6])
        sq = rng.choice([1, 1, 2, 4])
        d = 128
        capacity = rng.randint(sq + _n(16384), sq + _n(40000))
        page = rng.choice([None, None, 16, 64])
    else:
        b = rng.choice([1, 2, 4, 16])
        hk = rng.choice([1, 2, 8])
        h = hk * rng.choice([1, 4, 6])
        sq = rng.choice([1, 1, 2, 4, rng.randint(1, 32)])
        d = rng.choice([64, 128, 128, 256])
        capacity = rng.choice([rng.randint(sq + 8, sq + 8 + _n(600)),
                               rng.randint(sq + 8 + _n(600), sq + 8 + _n(8000))])
        page = rng.choice([None, None, 1, 8, 16, 64, 256])
    new = rng.choice([0, 0, sq])
    causal = rng.random() < (0.7 if sq > 1 else 0.3)
    softcap = rng.choice([0.0, 0.0, 0.0, 20.0])
    splits = rng.choice([0, 0, 1, 3])
    params = dict(family="kvcache-fp8-long" if long else "kvcache-fp8", b=b, h=h, hk=hk, sq=sq, d=d,
                  capacity=capacity, page=page, new=new, causal=causal, softcap=softcap, splits=splits)

    def run():
        q = torch.randn(b, sq, h, d, device=DEV, dtype=torch.bfloat16)
        (k8, kd), (v8, vd) = (fp8.quantize_per_key(torch.randn(b, capacity, hk, d, device=DEV) * scale)
                              for scale in (3.0, 1.0))
        lengths = torch.randint(0, capacity - new + 1, (b,), device=DEV, dtype=torch.int32)
        extra = dict(cache_seqlens=lengths, causal=causal, softcap=softcap, num_splits=splits)
        if new:
            extra["k"] = torch.randn(b, new, hk, d, device=DEV, dtype=torch.bfloat16) * 3
            extra["v"] = torch.randn(b, new, hk, d, device=DEV, dtype=torch.bfloat16)
        out, k_deq, v_deq, _ = e4m3_cache_call(q, k8, v8, kd, vd, page, **extra)
        assert torch.isfinite(out).all(), "non-finite output"
        from flashtile.reference import attention as textbook
        for i in range(b):
            n = int(lengths[i]) + new
            args = (q[i:i + 1].double(), k_deq[i:i + 1, :n].double(), v_deq[i:i + 1, :n].double())
            ref, _ = textbook(*args, causal=causal, softcap=softcap)
            low, _ = textbook(*(t.to(q.dtype) for t in args), causal=causal, softcap=softcap)
            err = (out[i:i + 1].double() - ref).abs().max().item()
            budget = 2 * (low.double() - ref).abs().max().item() + 1e-6
            assert err <= budget, f"sequence {i}: max error {err:.3g} > 2x textbook bf16 error ({budget:.3g})"
    return params, run


def _e4m3_per_head(x, heads_k):
    """x (B, S, H, D) as e4m3 with one descale per (sequence, KV head), FlashAttention-3's convention,
    and its dequantized float64 copy."""
    from flashtile.fp8 import E4M3_MAX
    grouped = x.float().unflatten(2, (heads_k, -1))
    if x.shape[1]:
        descale = (grouped.abs().amax(dim=(1, 3, 4)).clamp_min(1e-6) / E4M3_MAX).float()
    else:  # an empty sequence (packed ones may be)
        descale = torch.ones(x.shape[0], heads_k, device=x.device)
    x8 = (grouped / descale[:, None, :, None, None]).flatten(2, 3).to(torch.float8_e4m3fn)
    back = (x8.double().unflatten(2, (heads_k, -1)) * descale[:, None, :, None, None].double()).flatten(2, 3)
    return x8, descale, back


def _portable(call):
    """call() with the Gluon forward off: the portable Triton e4m3 kernel on the same tensors."""
    from flashtile.kernels import forward
    saved = forward.GLUON_ENABLED
    forward.GLUON_ENABLED = False
    try:
        return call()
    finally:
        forward.GLUON_ENABLED = saved


def _e4m3_p_emulation(dq, dk, dv, sinks=None, **kw):
    """Float64 attention of the dequantized tensors with each row's probabilities relative to its
    largest (what the kernels hold, up to the running max) rounded to e4m3 before P V: the size of
    the error that rounding alone brings. ``sinks`` (H,): the rows then keep sigmoid(lse - sink)."""
    from flashtile.reference import attention, probabilities
    p = probabilities(dq.float(), dk.float(), **kw).double()
    u = p / p.amax(-1, keepdim=True).clamp_min(1e-300)
    u8 = u.to(torch.float8_e4m3fn).double()
    vt = dv.transpose(1, 2).repeat_interleave(dq.shape[2] // dv.shape[2], dim=1)
    out = (u8 @ vt / u.sum(-1, keepdim=True).clamp_min(1e-300)).transpose(1, 2)
    if sinks is None:
        return out
    _, lse = attention(dq, dk, dv, **kw)
    kept = torch.sigmoid(lse - sinks.double().view(1, -1, 1)).nan_to_num(0.0)
    return out * kept.transpose(1, 2).unsqueeze(-1)


def _check_e4m3(out, lse, portable_out, portable_lse, dq, dk, dv, ref_kw):
    """An e4m3 forward's output (1 or B, Sq, H, D) and LSE (B, H, Sq) against float64 attention of
    the dequantized tensors dq, dk, dv (``ref_kw``: its masks, and sinks), with prefill_fp8_case's
    budget."""
    from flashtile.reference import attention as textbook
    assert torch.isfinite(out).all(), "non-finite output"
    ref, ref_lse = textbook(dq, dk, dv, **ref_kw)
    low, _ = textbook(dq.bfloat16(), dk.bfloat16(), dv.bfloat16(), **ref_kw)
    seen = torch.isfinite(ref_lse)
    err = (out.double() - ref).abs().max().item()
    portable_err = (portable_out.double() - ref).abs().max().item()
    low_err = (low.double() - ref).abs().max().item()
    # the portable kernel's error, which sets the budget, against what e4m3 P alone explains
    # (a wrong descale, shared by both kernels, would otherwise raise the budget with the error)
    emulated_err = (_e4m3_p_emulation(dq, dk, dv, **ref_kw) - ref).abs().max().item()
    assert portable_err <= 4 * max(emulated_err, low_err) + 1e-6, \
        f"portable e4m3 error {portable_err:.3g} > 4x that of e4m3 P ({emulated_err:.3g})"
    budget = 2 * max(portable_err, low_err) + 1e-6
    assert err <= budget, f"max error {err:.3g} > budget {budget:.3g} (portable e4m3 {portable_err:.3g})"
    if seen.any():
        lse_err = (lse.double() - ref_lse)[seen].abs().max().item()
        portable_lse_err = (portable_lse.double() - ref_lse)[seen].abs().max().item()
        assert lse_err <= max(2 * portable_lse_err, 1e-3), \
            f"LSE error {lse_err:.3g} (portable e4m3 {portable_lse_err:.3g})"
    if not seen.all():  # rows that see no key: output 0
        assert (out.double().transpose(1, 2)[~seen] == 0).all(), "rows without keys not 0"


def prefill_fp8_case(rng):
    """The e4m3 forward: flash_attn_func on e4m3 q, k, v with (B, Hk) descales (masks and softcap as
    the prefill family draws them), or flashtile.fp8.quantize_qkv's block scales with or without the
    Hadamard rotation through fp8.attention. Reference: float64 attention of the dequantized tensors;
    budget gluon_check's: 2x the larger of the portable Triton e4m3 kernel's error on the same tensors
    (P rounds to e4m3 in both) and the textbook attention's in bf16; the LSE within 2x the portable
    kernel's LSE error (at least 1e-3); output finite, rows without keys 0. A third of the cases
    have attention sinks (s_aux), taken in the Gluon kernel's epilogue in half of those (``epilogue``:
    gluon_forward.SINKS_IN_EPILOGUE), else applied after it; the portable kernel takes them inside."""
    from flashtile import fp8
    from flashtile.kernels import gluon_forward
    b, hk = rng.randint(1, 3), rng.choice([1, 2, 4])
    h = hk * rng.choice([1, 2, 4])
    sq, sk = rng.randint(1, _n(2500)), rng.randint(1, _n(2500))
    if rng.random() < 0.4:
        sk = sq
    style = rng.choice(["descales", "descales", "blocks"])
    d = rng.choice([64, 128, 128, 256] if style == "blocks" else [64, 80, 128, 128, 256])
    hadamard = style == "blocks" and rng.random() < 0.6
    kw = _mask_options(rng) if style == "descales" else ({"causal": True} if rng.random() < 0.5 else {})
    outliers = rng.random() < 0.3
    with_sinks = rng.random() < 1 / 3
    epilogue = with_sinks and rng.random() < 0.5
    params = dict(family="prefill-fp8", style=style, b=b, h=h, hk=hk, sq=sq, sk=sk, d=d, hadamard=hadamard,
                  outliers=outliers, sinks=with_sinks, epilogue=epilogue, **kw)

    def run():
        q, k, v = (torch.randn(b, s, n, d, device=DEV, dtype=torch.bfloat16)
                   for s, n in ((sq, h), (sk, hk), (sk, hk)))
        if outliers:  # FlashAttention-3's study: N(0, 100) added to 0.1% of the entries
            for x in (q, k, v):
                x += torch.randn_like(x) * 10 * (torch.rand_like(x, dtype=torch.float32) < 1e-3)
        # (near the rows' LSE, so that each takes a share that shows in bf16)
        sinks = torch.randn(h, device=DEV) * 3 + math.log(sk) if with_sinks else None
        if style == "descales":
            (q8, qd, dq), (k8, kd, dk), (v8, vd, dv) = (_e4m3_per_head(x, hk) for x in (q, k, v))

            def call():
                out = flashtile.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                                return_attn_probs=True, s_aux=sinks, **kw)
                return out[0], out[1]
            ref_kw = dict(kw)
        else:
            z = fp8.quantize_qkv(q, k, v, block=fp8.kernel_blocks(d, q.device), hadamard=hadamard,
                                 seed=rng.randrange(1 << 30))
            dq, dk, dv = (fp8.dequantize(t, s_, blk).double() for t, s_, blk in
                          ((z.q, z.q_descale, z.block_q), (z.k, z.k_descale, z.block_k),
                           (z.v, z.v_descale, z.block_k)))

            def call():
                return fp8.attention(z, causal=bool(kw.get("causal")), return_lse=True, s_aux=sinks)
            ref_kw = {"causal": bool(kw.get("causal"))}
        if with_sinks:
            ref_kw["sinks"] = sinks
        saved, gluon_forward.SINKS_IN_EPILOGUE = gluon_forward.SINKS_IN_EPILOGUE, epilogue
        try:
            out, lse = call()
        finally:
            gluon_forward.SINKS_IN_EPILOGUE = saved
        portable_out, portable_lse = _portable(call)
        _check_e4m3(out, lse, portable_out, portable_lse, dq, dk, dv, ref_kw)
    return params, run


def assert_e4m3_lse(lse, ref_lse, low_lse, what=""):
    """The LSE (H, Sq) of e4m3 score dots against float64 (``ref_lse``, (1, H, Sq)): max error within
    2x that of textbook attention in bf16 on the same dequantized tensors (``low_lse``), the output's
    rule applied to the LSE, +inf exactly where the reference has no key. fp32 rounding, the 16-bit
    kernels' LSE rule, does not hold here: Hopper's e4m3 MMAs keep fewer bits of the running sum. On
    the H200 the LSE of 8 x 2048 causal d128 rows was 8.4e-4 (relative) off with e4m3 score dots, in
    the block-descale kernel and the per-sequence one alike, 1.8e-7 with fp16 ones
    (varlen-fp8-modes-h200-20261202.json), and a bound of 2^-11 of the rows' |q_d k_d| terms was
    exceeded by up to 1.45x with outliers (fuzz-gpu-h200-20261202-seed19/-seed20)."""
    seen = torch.isfinite(ref_lse[0])
    assert torch.equal(torch.isinf(lse) & (lse > 0), ~seen), f"{what}rows without keys must have LSE +inf"
    if seen.any():
        err = (lse.double() - ref_lse[0])[seen].abs().max().item()
        budget = 2 * (low_lse.double()[0] - ref_lse[0])[seen].abs().max().item() + 1e-6
        assert err <= budget, f"{what}LSE error {err:.3g} > 2x textbook bf16's ({budget:.3g})"


def _gluon_varlen_calls():
    """A counter of the calls flash_attn_varlen_func hands to the Gluon varlen forward (installed
    once: gluon_forward.gluon_varlen_forward wrapped)."""
    from flashtile.kernels import gluon_forward
    original = gluon_forward.gluon_varlen_forward
    if not hasattr(original, "calls"):
        def counted(*args, **kwargs):
            counted.calls += 1
            return original(*args, **kwargs)
        counted.calls = 0
        gluon_forward.gluon_varlen_forward = counted
    return gluon_forward.gluon_varlen_forward


def _gluon_backward_calls():
    """A counter of the backward calls that reach the Gluon backward: packed ones (gluon_dkdv with
    cu_seqlens) in ``calls``, the others in ``plain_calls`` (installed once, as _gluon_varlen_calls)."""
    from flashtile.kernels import gluon_backward
    original = gluon_backward.gluon_dkdv
    if not hasattr(original, "calls"):
        def counted(*args, **kwargs):
            packed = kwargs.get("cu_seqlens_q") is not None
            counted.calls += packed
            counted.plain_calls += not packed
            return original(*args, **kwargs)
        counted.calls = 0
        counted.plain_calls = 0
        gluon_backward.gluon_dkdv = counted
    return gluon_backward.gluon_dkdv


def varlen_fp8_case(rng):
    """The e4m3 forward on packed sequences: flash_attn_varlen_func with (B, Hk) descales, one per
    sequence and KV head, masks and softcap as the prefill family draws them, keys contiguous or on
    e4m3 page pools of any page size through block_table (the slots past the sequences NaN). The
    portable kernel's per-sequence path keeps P in 16 bits, so the test suite's rule applies
    sequence by sequence: 2x textbook bf16 attention on the dequantized tensors, the LSE by
    assert_e4m3_lse. Calls the Gluon varlen forward takes (sm_90, d128/d256, full or causal, keys
    contiguous or on pools gathered into the packed layouts) round P to e4m3 as flash_attn_func's e4m3 call does: prefill_fp8_case's rule then,
    against flash_attn_func's portable e4m3 kernel on the sequence alone."""
    from flashtile.reference import attention as textbook
    n = rng.randint(1, 5)
    hk = rng.choice([1, 2, 4])
    h = hk * rng.choice([1, 2, 4])
    d = rng.choice([64, 80, 128, 128, 256])
    lens_q = [rng.randint(0 if rng.random() < 0.1 else 1, _n(1500)) for _ in range(n)]
    lens_q[0] = max(lens_q[0], 1)
    lens_k = [rng.randint(1, _n(1500)) if rng.random() < 0.5 else max(lq, 1) for lq in lens_q]
    kw = _mask_options(rng)
    outliers = rng.random() < 0.3
    page = rng.choice([1, 3, 16, 64, 256]) if rng.random() < 0.5 else 0
    params = dict(family="varlen-fp8", h=h, hk=hk, d=d, lens_q=lens_q, lens_k=lens_k, outliers=outliers,
                  page=page, **kw)

    def run():
        seqs = []
        for lq, lk in zip(lens_q, lens_k):
            q, k, v = (torch.randn(1, s, m, d, device=DEV, dtype=torch.bfloat16)
                       for s, m in ((lq, h), (lk, hk), (lk, hk)))
            if outliers:
                for x in (q, k, v):
                    x += torch.randn_like(x) * 10 * (torch.rand_like(x, dtype=torch.float32) < 1e-3)
            seqs.append([_e4m3_per_head(x, hk) for x in (q, k, v)])
        packed = [torch.cat([seq[i][0][0] for seq in seqs]) for i in range(3)]
        descales = [torch.cat([seq[i][1] for seq in seqs]) for i in range(3)]
        cu_q = torch.tensor([0] + lens_q, device=DEV).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + lens_k, device=DEV).cumsum(0).to(torch.int32)
        k_in, v_in, paged = packed[1], packed[2], {}
        if page:
            k_in, v_in, paged["block_table"] = _varlen_pools(packed[1], packed[2], lens_k, page)
        gluon_calls = _gluon_varlen_calls()
        before = gluon_calls.calls
        out, lse, _ = flashtile.flash_attn_varlen_func(
            packed[0], k_in, v_in, cu_q, cu_k, max(lens_q), max(lens_k), q_descale=descales[0],
            k_descale=descales[1], v_descale=descales[2], return_attn_probs=True, **paged, **kw)
        params["gluon_varlen_calls"] = gluon_calls.calls - before
        assert torch.isfinite(out).all(), "non-finite output"
        from flashtile.kernels import forward
        for i, seq in enumerate(seqs):
            qs = slice(int(cu_q[i]), int(cu_q[i + 1]))
            if qs.stop == qs.start:
                continue
            if gluon_calls.calls > before:  # the Gluon varlen forward (e4m3 P)
                (q8, qd, dq), (k8, kd, dk), (v8, vd, dv) = seq
                portable, portable_lse, _ = _portable(lambda: flashtile.flash_attn_func(
                    q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, return_attn_probs=True, **kw))
                _check_e4m3(out[None, qs], lse[None, :, qs], portable, portable_lse, dq, dk, dv, kw)
                continue
            if not page and not forward.VARLEN_FP8_BY_SEQUENCE:
                # the block-descale kernel (FLASHTILE_VARLEN_FP8_BY_SEQUENCE=0) rounds P to e4m3:
                # prefill_fp8_case's rule, the kernel its own portable reference
                _check_e4m3(out[None, qs], lse[None, :, qs], out[None, qs], lse[None, :, qs],
                            seq[0][2], seq[1][2], seq[2][2], kw)
                continue
            dq, dk, dv = (x[2] for x in seq)
            ref, ref_lse = textbook(dq, dk, dv, **kw)
            low, low_lse = textbook(dq.bfloat16(), dk.bfloat16(), dv.bfloat16(), **kw)
            err = (out[None, qs].double() - ref).abs().max().item()
            budget = 2 * (low.double() - ref).abs().max().item() + 1e-6
            assert err <= budget, f"sequence {i}: max error {err:.3g} > 2x textbook bf16 ({budget:.3g})"
            assert (out[qs].transpose(0, 1)[~torch.isfinite(ref_lse[0])] == 0).all(), "rows without keys not 0"
            assert_e4m3_lse(lse[:, qs], ref_lse, low_lse, f"sequence {i}: ")
    return params, run


def sinks_case(rng):
    """Attention sinks (s_aux) on the routes gpt-oss's calls take: flash_attn_func (forward, or forward
    and backward with ds_aux checked as test_sinks checks it), packed decode steps on page pools
    through flash_attn_varlen_func with seqused_k, and flash_attn_with_kvcache (decode steps with
    splits, paged or not, and chunked prefill of 128+ queries). Outputs by the accuracy rule with half
    an ulp for the second rounding. The flash_attn_func routes, packed prefill through
    flash_attn_varlen_func (packed keys or page pools, chunks and decode steps mixed: vLLM's prefill)
    and the KV-cache call run with the Gluon forward's sinks epilogue (gluon_forward.SINKS_IN_EPILOGUE)
    in half the cases (``epilogue`` in the record), held to the rule without that half ulp where no
    route applies them after the kernel (the KV-cache call: its chunked prefill)."""
    route = rng.choice(["func", "func-backward", "varlen-pages", "varlen-prefill", "kvcache"])
    hk = rng.choice([1, 2, 8])
    h = hk * rng.choice([1, 4, 8])
    d = rng.choice([64, 64, 128, 80])
    dtype = rng.choice([torch.bfloat16, torch.float16])
    sinks = torch.randn(h, device=DEV) * 3
    kw = {}
    if rng.random() < 0.5:
        kw["causal"] = True
    if rng.random() < 0.3:  # gpt-oss's sliding layers: 128 keys
        kw["causal"], kw["window_size"] = True, (_n(127), 0)
    params = dict(family="sinks", route=route, h=h, hk=hk, d=d, dtype=str(dtype), **kw)

    def func_routes(epilogue):
        twice = not epilogue or "window_size" in kw
        b, sq = rng.randint(1, 2), rng.randint(1, _n(2000))
        sk = sq if rng.random() < 0.5 else rng.randint(1, _n(2000))
        params.update(b=b, sq=sq, sk=sk)
        q = torch.randn(b, sq, h, d, device=DEV, dtype=dtype)
        k = torch.randn(b, sk, hk, d, device=DEV, dtype=dtype)
        v = torch.randn(b, sk, hk, d, device=DEV, dtype=dtype)
        if route == "func":
            out, lse, _ = flashtile.flash_attn_func(q, k, v, s_aux=sinks, return_attn_probs=True, **kw)
            assert_matches_reference(out, lse, q, k, v, sinks=sinks, rounded_twice=twice, **kw)
            return
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        ss = sinks.clone().requires_grad_(True)
        out = flashtile.flash_attn_func(qq, kk, vv, s_aux=ss, **kw)
        dout = torch.randn_like(out)
        out.backward(dout)
        assert_matches_reference(out.detach(), None, q, k, v, sinks=sinks, rounded_twice=twice, **kw)
        assert_grads_match_reference((qq.grad, kk.grad, vv.grad), q, k, v, dout, sinks=sinks, **kw)
        from flashtile.reference import attention
        exact_s = sinks.double().clone().requires_grad_(True)
        low_s = sinks.clone().requires_grad_(True)
        for s_, t in ((exact_s, torch.float64), (low_s, dtype)):
            o, _ = attention(q.to(t), k.to(t), v.to(t), sinks=s_, **kw)
            (o.double() * dout.double()).sum().backward()
        # D's rounding: the backward reads the output as the forward stored it, the sinks applied
        ref, ref_lse = attention(q.double(), k.double(), v.double(), sinks=sinks, **kw)
        share = torch.exp(sinks.double().view(1, h, 1) - ref_lse)
        stored = out.detach().double()
        rounding = ((stored - ref) * dout.double()).sum(-1).transpose(1, 2)
        stored_err = (share * rounding).nan_to_num().sum((0, 2)).abs().max().item()
        err = (ss.grad.double() - exact_s.grad).abs().max().item()
        low_err = (low_s.grad.double() - exact_s.grad).abs().max().item()
        assert err <= max(3 * low_err, 2 * stored_err, 1e-6), f"ds_aux: {err:.3g} ({low_err:.3g}, {stored_err:.3g})"
        return

    def packed_call(lens_q, lens_k, page, rounded_twice):
        """flash_attn_varlen_func with the sinks on packed keys (page None) or on pools with seqused_k,
        each sequence against the reference."""
        n = len(lens_k)
        q, k, v, cu_q, cu_k = _packed_inputs(lens_q, lens_k, h, hk, d, dtype)
        params.update(lens_q=lens_q, lens_k=lens_k, page=page)
        if page is None:
            out, lse = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), s_aux=sinks,
                                                        return_softmax_lse=True, **kw)
        else:
            k_pool, v_pool, table = _varlen_pools(k, v, lens_k, page)
            seqused = torch.tensor(lens_k, device=DEV, dtype=torch.int32)
            out, lse = flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, None, max(lens_q), max(lens_k),
                                                        block_table=table, seqused_k=seqused, s_aux=sinks,
                                                        return_softmax_lse=True, **kw)
        for i in range(n):
            qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
            assert_matches_reference(out[qs].unsqueeze(0), lse[:, qs].unsqueeze(0), q[qs].unsqueeze(0),
                                     k[ks].unsqueeze(0), v[ks].unsqueeze(0), sinks=sinks,
                                     rounded_twice=rounded_twice, **kw)

    def varlen_prefill(epilogue):
        lens_k = [rng.randint(1, _n(2000)) for _ in range(rng.randint(1, 4))]
        lens_q = [lk if rng.random() < 0.5 else min(lk, rng.choice([1, rng.randint(1, _n(600))])) for lk in lens_k]
        packed_call(lens_q, lens_k, rng.choice([None, 16, 16, 256, 1]), not epilogue)

    def run():
        if route.startswith("func") or route == "varlen-prefill" or route == "kvcache":
            from flashtile.kernels import gluon_forward
            epilogue = rng.random() < 0.5
            params.update(epilogue=epilogue)
            saved, gluon_forward.SINKS_IN_EPILOGUE = gluon_forward.SINKS_IN_EPILOGUE, epilogue
            try:
                {"varlen-prefill": varlen_prefill, "kvcache": kvcache}.get(route, func_routes)(epilogue)
            finally:
                gluon_forward.SINKS_IN_EPILOGUE = saved
            return
        # decode steps on page pools (the decode takes the sinks; half an ulp as before)
        lens_k = [rng.randint(1, _n(5000)) for _ in range(rng.randint(1, 8))]
        packed_call([min(rng.randint(1, 4), lk) for lk in lens_k], lens_k, rng.choice([16, 16, 1, 32]), True)

    def kvcache(epilogue):
        """Decode steps, or (a quarter of the calls) chunked prefill of 128-600 queries, which the Gluon
        forward runs with seqused_k: the sinks in its epilogue where ``epilogue``, else after it."""
        long_cache = rng.random() < 0.4  # split plans of the Gluon kernel: the merge takes the sinks
        n = rng.randint(1, 2) if long_cache else rng.randint(1, 8)
        lens_k = [rng.randint(1, _n(40000 if long_cache else 5000)) for _ in range(n)]
        sq = rng.randint(128, max(128, _n(600))) if rng.random() < 0.25 else rng.randint(1, 4)
        capacity = max(lens_k) + sq
        k_cache = torch.randn(n, capacity, hk, d, device=DEV, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(n, sq, h, d, device=DEV, dtype=dtype)
        lengths = torch.tensor(lens_k, device=DEV, dtype=torch.int32)
        splits = rng.choice([0, 0, 1, 3])
        page = rng.choice([None, 16, 5])
        params.update(lens_k=lens_k, sq=sq, splits=splits, page=page)
        call = dict(cache_seqlens=lengths, num_splits=splits, s_aux=sinks, return_softmax_lse=True, **kw)
        k_in, v_in, table = (k_cache, v_cache, None) if page is None else _paged(k_cache, v_cache, page)
        out, lse = flashtile.flash_attn_with_kvcache(q, k_in, v_in, block_table=table, **call)
        from flashtile.kernels import decode
        left, right = flashtile.interface._check_window(kw.get("window_size", (-1, -1)), kw.get("causal", False))
        plan = decode.prepare_decode(q, k_in, v_in, softmax_scale=d ** -0.5, window_left=left, window_right=right,
                                     block_table=table, num_splits=splits, sinks=True)
        params.update(plan_splits=plan.splits, gluon=plan.gluon is not None, sinks_after=plan.sinks_after,
                      prefill=plan.prefill is not None)
        for i in range(n):
            m = lens_k[i]
            assert_matches_reference(out[i:i + 1], lse[i:i + 1], q[i:i + 1], k_cache[i:i + 1, :m],
                                     v_cache[i:i + 1, :m], sinks=sinks,
                                     rounded_twice=plan.prefill is None or plan.sinks_after, **kw)
    return params, run


FAMILIES = {"prefill": prefill_case, "varlen": varlen_case, "kvcache": kvcache_case, "mixed": mixed_case,
            "kvcache-long": lambda rng: kvcache_case(rng, long=True),
            "kvcache-fp8-long": lambda rng: kvcache_fp8_case(rng, long=True),
            "kvcache-fp8": kvcache_fp8_case, "prefill-fp8": prefill_fp8_case,
            "varlen-fp8": varlen_fp8_case, "sinks": sinks_case}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=240.0)
    ap.add_argument("--scale", type=float, default=1.0, help="length bounds times this")
    ap.add_argument("--device", default="cuda", help="cpu: through the Triton interpreter (smoke run)")
    ap.add_argument("--family", action="append", choices=sorted(FAMILIES),
                    help="families to draw from (default: all)")
    args = ap.parse_args(argv)
    global DEV, SCALE
    DEV, SCALE = args.device, args.scale
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    families = args.family or sorted(FAMILIES)
    t0 = time.time()
    cases, failures = [], []
    while time.time() - t0 < args.seconds:
        params, run = FAMILIES[rng.choice(families)](rng)
        start = time.time()
        try:
            run()
            if DEV == "cuda":
                torch.cuda.synchronize()
            state = "ok"
        except Exception as exc:  # record and go on: the point is to find every failing kind
            state = f"{type(exc).__name__}: {str(exc)[:300]}"
            failures.append(dict(params, error=state, trace=traceback.format_exc()[-1500:]))
            print("FAIL", params, state, flush=True)
        cases.append(dict(params, state=state, seconds=round(time.time() - start, 2)))
    stream = os.environ.get("FLASHTILE_DECODE_STREAM", "0")
    result = dict(seed=args.seed, families=families, stream_opt_in=stream, device=torch.cuda.get_device_name() if DEV == "cuda" else DEV,
                  cases=len(cases), failures=failures, all_cases=cases, seconds=round(time.time() - t0, 1))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"fuzz-gpu-{args.seed}{'-stream' if stream not in ('', '0') else ''}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    by_family = {}
    for c in cases:
        ok, n = by_family.get(c["family"], (0, 0))
        by_family[c["family"]] = (ok + (c["state"] == "ok"), n + 1)
    print(f"seed {args.seed} (stream opt-in {stream}): {len(cases)} cases in {result['seconds']} s, "
          f"{len(failures)} failed; " + ", ".join(f"{k} {ok}/{n} ok" for k, (ok, n) in sorted(by_family.items())))
    print(f"wrote {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
