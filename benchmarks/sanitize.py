"""Small launches of the kernel variants, for ``compute-sanitizer --tool memcheck`` on a GPU.

    compute-sanitizer --tool memcheck --target-processes application-only --error-exitcode 1 \
        python benchmarks/sanitize.py --quick

Shapes are ragged (lengths not multiples of any tile, Sq != Sk both ways, odd head dims) so every
masked edge and the pointer and tensor-descriptor paths are exercised; the output is also compared
with the float64 reference so a silent wrong answer fails too.
"""

from __future__ import annotations

import itertools
import sys

import torch

from flashtile.kernels.forward import TileConfig, attention_forward, pick_config
from flashtile.reference import attention


BF16, F16 = torch.bfloat16, torch.float16
# One launch per kernel variant that matters (each compiles once: the sanitizer makes compiling slow).
QUICK = [
    (128, BF16, dict(causal=True), (2, 33, 200), True),
    (128, BF16, dict(), (2, 200, 33), True),
    (64, F16, dict(window_size=(21, 13)), (1, 77, 77), True),
    (111, BF16, dict(causal=True), (2, 200, 33), False),
    (256, BF16, dict(causal=True, softcap=20.0), (2, 33, 200), True),
    (40, F16, dict(alibi=True), (2, 77, 130), True),
    (128, BF16, dict(causal=True, window_size=(37, 0)), (1, 150, 150), False),
    (80, BF16, dict(causal=True, window_size=(30, 0), softcap=10.0, alibi=True), (2, 90, 70), True),
]


def all_cases():
    features = [dict(), dict(causal=True), dict(causal=True, window_size=(37, 0)),
                dict(window_size=(21, 13)), dict(causal=True, softcap=20.0), dict(alibi=True)]
    shapes = [(1, 77, 77), (2, 33, 200), (2, 200, 33)]
    for head_dim, dtype, feat, shape, tma in itertools.product(
            (40, 64, 111, 128, 256), (BF16, F16), features, shapes, (True, False)):
        if dtype == F16 and shape != (1, 77, 77):
            continue  # fp16 differs from bf16 only in the element type; one shape is enough
        yield head_dim, dtype, feat, shape, tma


def training_and_packed_cases(dev) -> int:
    """Backward (padded, varlen, dropout) and the paged varlen forward, checked against the reference
    through the public API; returns the number of wrong results."""
    import flashtile
    from flashtile.kernels.backward import attention_backward

    failures = 0
    for head_dim, dtype, kw in ((128, BF16, dict(causal=True)), (111, F16, dict(window_size=(30, 9))),
                                (256, BF16, dict(causal=True, softcap=20.0)), (64, F16, dict(alibi=True))):
        q = torch.randn(2, 77, 4, head_dim, device=dev, dtype=dtype)
        k = torch.randn(2, 130, 2, head_dim, device=dev, dtype=dtype)
        v, dout = torch.randn_like(k), torch.randn_like(q)
        slopes = torch.rand(2, 4, device=dev) if kw.pop("alibi", False) else None
        left, right = kw.get("window_size", (-1, -1))
        right = 0 if kw.get("causal") else right
        args = dict(softmax_scale=head_dim ** -0.5, window_left=left, window_right=right,
                    diag_offset=130 - 77, softcap=kw.get("softcap", 0.0), alibi_slopes=slopes)
        out, lse = attention_forward(q, k, v, **args)
        leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
        ref, _ = attention(*leaves, alibi_slopes=slopes, **kw)
        ref.backward(dout.double())
        for deterministic in (True, False):  # the dQ pass, and atomic dQ where the config has it
            grads = attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **args)
            for g, leaf in zip(grads, leaves):
                if not torch.isfinite(g).all() or (g.double() - leaf.grad).abs().max() > 0.1:
                    failures += 1
                    print(f"FAIL backward d{head_dim} {kw} deterministic={deterministic}")
    lengths = [70, 1, 130, 0]
    cu = torch.tensor([0, 70, 71, 201, 201], dtype=torch.int32, device=dev)
    q = torch.randn(201, 4, 64, device=dev, dtype=BF16, requires_grad=True)
    k = torch.randn(201, 2, 64, device=dev, dtype=BF16, requires_grad=True)
    v = torch.randn(201, 2, 64, device=dev, dtype=BF16, requires_grad=True)
    out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 130, 130, causal=True, dropout_p=0.2)
    out.backward(torch.randn_like(out))
    failures += sum(not torch.isfinite(t).all() for t in (out, q.grad, k.grad, v.grad))
    with torch.no_grad():
        expected = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 130, 130, causal=True)
        for page_size in (1, 8, 16, 48, 64):  # on sm_90 pages of 8, 16 and 64 take the Gluon kernel
            pages = [-(-n // page_size) for n in lengths]
            table = torch.zeros(4, max(pages), dtype=torch.int32, device=dev)
            pool_k = torch.randn(sum(pages) + 2, page_size, 2, 64, device=dev, dtype=BF16)
            pool_v = torch.randn_like(pool_k)
            next_page = 0
            for b, n in enumerate(lengths):
                for j in range(pages[b]):
                    rows = slice(int(cu[b]) + j * page_size, int(cu[b]) + min((j + 1) * page_size, n))
                    pool_k[next_page, :rows.stop - rows.start] = k[rows]
                    pool_v[next_page, :rows.stop - rows.start] = v[rows]
                    table[b, j] = next_page
                    next_page += 1
            paged = flashtile.flash_attn_varlen_func(q, pool_k, pool_v, cu, cu, 130, 130, causal=True,
                                                     block_table=table)
            if not torch.equal(paged, expected):
                failures += 1
                print(f"FAIL paged page_size {page_size}")
    return failures


def decode_cases(dev) -> int:
    """flash_attn_with_kvcache: split and unsplit, contiguous and paged (page sizes 1, 8, 16, 48, 64),
    appends with rotary, leftpad and batch_idx; each against the float64 reference."""
    import flashtile
    from flashtile.bench.decode import paginate

    failures = 0
    lengths = [1, 77, 300]
    batch, cap, heads, heads_k, d = 3, 300, 8, 2, 128
    q = torch.randn(batch, 1, heads, d, device=dev, dtype=BF16)
    k = torch.randn(batch, cap, heads_k, d, device=dev, dtype=BF16)
    v = torch.randn_like(k)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=dev)

    def reference(k_cache, v_cache, q_rows=q):
        rows = []
        for b, n in enumerate(lengths):
            ref, _ = attention(q_rows[b:b + 1].double(), k_cache[b:b + 1, :n].double(),
                               v_cache[b:b + 1, :n].double(), causal=True)
            rows.append(ref)
        return torch.cat(rows)

    expected = reference(k, v)

    def twice(call):
        # The first call of a signature launches through Triton's JIT, the second straight to the
        # compiled kernel (kernels/launch.py): both paths run under the sanitizer.
        call()
        return call()
    runs = {f"contiguous splits {s}": twice(lambda s=s: flashtile.flash_attn_with_kvcache(
        q, k, v, cache_seqlens=seqlens, causal=True, num_splits=s)) for s in (0, 1, 3)}
    for page_size in (1, 8, 16, 48, 64):  # on sm_90 pages of 8, 16 and 64 take the Gluon kernel
        pool_k, pool_v, table = paginate(k, v, page_size)
        runs[f"paged {page_size}"] = twice(lambda: flashtile.flash_attn_with_kvcache(
            q, pool_k, pool_v, cache_seqlens=seqlens, block_table=table, causal=True))
    # The H200 plans' key steps at this small size: unsplit 64-key steps (pairs near the SM
    # count), 32-key steps on pages (pairs over it).
    from flashtile.kernels.decode import DecodeConfig, decode_attention
    pool_k, pool_v, table = paginate(k, v, 16)
    for name, cfg, paged in (("unsplit 64-key steps", DecodeConfig(64, 4, 4, waves=1, pdl=True,
                                                                    max_splits=1), False),
                             ("paged 16, 32-key steps", DecodeConfig(32, 4, 4), True)):
        runs[name] = twice(lambda cfg=cfg, paged=paged: decode_attention(
            q, pool_k if paged else k, pool_v if paged else v, seqlens, softmax_scale=d ** -0.5,
            window_left=-1, window_right=0, block_table=table if paged else None, config=cfg)[0])
    # 132 (sequence, KV head) pairs, as many as the SMs: the Gluon paged plan with two CTAs per SM.
    many_q = q.repeat(22, 1, 1, 1)
    many_k, many_v = k.repeat(22, 1, 1, 1), v.repeat(22, 1, 1, 1)
    pool_k, pool_v, table = paginate(many_k, many_v, 16)
    many = twice(lambda: flashtile.flash_attn_with_kvcache(
        many_q, pool_k, pool_v, cache_seqlens=seqlens.repeat(22), block_table=table, causal=True))
    runs["paged 16, 132 pairs"] = many[:3]
    for name, out in runs.items():
        if not torch.isfinite(out).all() or (out.double() - expected).abs().max() > 0.05:
            failures += 1
            print(f"FAIL decode {name}")
    # A speculative step of 6 positions (24 query rows a KV head) through the Triton kernel: on
    # sm_90 a 64-row tile (decode.WIDE_TILE_ROWS), contiguous and paged.
    q6 = torch.randn(batch, 6, heads, d, device=dev, dtype=BF16)
    expected6 = reference(k, v, q6)
    pool_k, pool_v, table = paginate(k, v, 16)
    for name, paged in (("Sq 6, 24 rows", False), ("Sq 6, 24 rows, paged 16", True)):
        out = twice(lambda paged=paged: decode_attention(
            q6, pool_k if paged else k, pool_v if paged else v, seqlens, softmax_scale=d ** -0.5,
            window_left=-1, window_right=0, block_table=table if paged else None,
            config=DecodeConfig(32, 4, 4))[0])
        if not torch.isfinite(out).all() or (out.double() - expected6).abs().max() > 0.05:
            failures += 1
            print(f"FAIL decode {name}")
    # 40 positions (chunked prefill; 160 query rows a KV head: two blocks of rows, on sm_90 the
    # 8-warp plan of 128-row tiles), contiguous and paged 16, split by the heuristic and unsplit.
    q40 = torch.randn(batch, 40, heads, d, device=dev, dtype=BF16)
    seqlens40 = seqlens.clamp(min=40)
    expected40 = torch.cat([attention(q40[b:b + 1].double(), k[b:b + 1, :n].double(), v[b:b + 1, :n].double(),
                                      causal=True)[0] for b, n in enumerate(seqlens40.tolist())])
    pool_k, pool_v, table = paginate(k, v, 16)
    for name, paged, splits in (("Sq 40", False, 0), ("Sq 40, unsplit", False, 1), ("Sq 40, paged 16", True, 0)):
        out = twice(lambda paged=paged, splits=splits: flashtile.flash_attn_with_kvcache(
            q40, pool_k if paged else k, pool_v if paged else v, cache_seqlens=seqlens40,
            block_table=table if paged else None, causal=True, num_splits=splits))
        if not torch.isfinite(out).all() or (out.double() - expected40).abs().max() > 0.05:
            failures += 1
            print(f"FAIL decode {name}")
    # Append two new tokens with rotary at leftpad/batch_idx-mapped rows, then attend.
    k2, v2 = k.clone(), v.clone()
    new_k = torch.randn(batch, 2, heads_k, d, device=dev, dtype=BF16)
    new_v = torch.randn_like(new_k)
    cos, sin = torch.randn(512, 32, device=dev), torch.randn(512, 32, device=dev)
    before = torch.tensor([n - 2 if n >= 2 else 0 for n in lengths], dtype=torch.int32, device=dev)
    out = flashtile.flash_attn_with_kvcache(
        torch.randn(batch, 2, heads, d, device=dev, dtype=BF16), k2, v2, new_k, new_v,
        rotary_cos=cos, rotary_sin=sin, cache_seqlens=before, cache_batch_idx=torch.tensor(
            [2, 0, 1], dtype=torch.int32, device=dev), causal=True)
    failures += int(not torch.isfinite(out).all())
    leftpad = torch.tensor([0, 5, 100], dtype=torch.int32, device=dev)
    out = flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens.clamp(min=101),
                                            cache_leftpad=leftpad, causal=True)
    failures += int(not torch.isfinite(out).all())
    if failures:
        print(f"FAIL decode: {failures}")
    return failures


def fp8_cases(dev) -> int:
    """The FP8 forward (block scales with rotation, and flash_attn_func's per-head descales) on ragged
    shapes, against attention on the dequantized inputs (loose: P is e4m3 on the GPU)."""
    import flashtile
    from flashtile import fp8

    failures = 0
    for causal, (sq, sk) in ((True, (77, 200)), (False, (130, 33))):
        q = torch.randn(2, sq, 4, 128, device=dev, dtype=BF16)
        k = torch.randn(2, sk, 2, 128, device=dev, dtype=BF16)
        v = torch.randn(2, sk, 2, 128, device=dev, dtype=BF16)
        blocks = fp8.kernel_blocks(128, dev)
        z = fp8.quantize_qkv(q, k, v, block=blocks, hadamard=True)
        out = fp8.attention(z, causal=causal)
        deq = [fp8.dequantize(t, d, b).double() for t, d, b in
               ((z.q, z.q_descale, blocks[0]), (z.k, z.k_descale, blocks[1]),
                (z.v, z.v_descale, blocks[1]))]
        ref, _ = attention(*deq, causal=causal)
        ones = torch.ones(2, 2, device=dev)
        plain = flashtile.flash_attn_func(*(t.to(torch.float8_e4m3fn) for t in (q, k, v)),
                                          causal=causal, q_descale=ones, k_descale=ones, v_descale=ones)
        ref_plain, _ = attention(*(t.to(torch.float8_e4m3fn).double() for t in (q, k, v)), causal=causal)
        for got, expected in ((out, ref), (plain, ref_plain)):
            if not torch.isfinite(got).all() or (got.double() - expected).abs().max() > 0.1:
                failures += 1
                print(f"FAIL fp8 causal={causal} {(sq, sk)}")
    failures += fp8_varlen_and_cache_cases(dev)
    return failures


def _e4m3_pages(k8, v8, kd, vd, page_size: int):
    """An e4m3 cache (B, S, Hk, D) and its per-key descales as page pools in a shuffled order (one
    table for all four): (pool_k, pool_v, pool_kd, pool_vd, block_table)."""
    from flashtile.bench.decode import paginate
    g = torch.Generator().manual_seed(page_size)
    pool_k, pool_v, table = paginate(k8.view(torch.uint8), v8.view(torch.uint8), page_size, g)
    g = torch.Generator().manual_seed(page_size)  # the same table for the descales
    pool_kd, pool_vd, _ = paginate(kd[..., None], vd[..., None], page_size, g)
    e4m3 = torch.float8_e4m3fn
    return (pool_k.view(e4m3), pool_v.view(e4m3), pool_kd[..., 0].contiguous(),
            pool_vd[..., 0].contiguous(), table)


def _e4m3_read_back(pool_k, pool_v, pool_kd, pool_vd, table, slots: int):
    """The first ``slots`` keys of every sequence gathered back from the pools (after a call)."""
    page_size = pool_k.shape[1]
    rows = table.long().repeat_interleave(page_size, 1)[:, :slots]  # the page of each slot
    at = torch.arange(slots, device=pool_k.device) % page_size
    return pool_k[rows, at], pool_v[rows, at], pool_kd[rows, at], pool_vd[rows, at]


def _e4m3_cache_call(q, k8, v8, kd, vd, new_k, new_v, lengths, page_size, q_descale=None, fixed=None):
    """flash_attn_with_kvcache (causal, appending new_k/new_v) on copies of an e4m3 cache with per-key
    descales kd/vd, contiguous or as page pools (_e4m3_pages), or with ``fixed`` (B, Hk) descales
    instead; returns the output and the cache and descales as each sequence's rows afterwards."""
    import flashtile
    ck, cv, ckd, cvd = k8.clone(), v8.clone(), kd.clone(), vd.clone()
    kw = dict(cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=k8.device), causal=True,
              q_descale=q_descale)
    if page_size:
        pool_k, pool_v, pool_kd, pool_vd, table = _e4m3_pages(ck, cv, ckd, cvd, page_size)
        k_ds, v_ds = fixed or (pool_kd, pool_vd)
        got = flashtile.flash_attn_with_kvcache(q, pool_k, pool_v, new_k, new_v, block_table=table,
                                                k_descale=k_ds, v_descale=v_ds, **kw)
        return (got, *_e4m3_read_back(pool_k, pool_v, pool_kd, pool_vd, table, k8.shape[1]))
    k_ds, v_ds = fixed or (ckd, cvd)
    got = flashtile.flash_attn_with_kvcache(q, ck, cv, new_k, new_v, k_descale=k_ds, v_descale=v_ds, **kw)
    return got, ck, cv, ckd, cvd


def fp8_varlen_and_cache_cases(dev) -> int:
    """FP8 packed sequences (ragged lengths) and the e4m3 KV cache (contiguous and paged P16, with an
    append of two tokens) against attention on the dequantized tensors."""
    import flashtile

    failures = 0
    e4m3 = torch.float8_e4m3fn
    lens_q, lens_k = [5, 130, 1], [70, 130, 3]
    cu_q = torch.tensor([0] + lens_q, device=dev).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device=dev).cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(sum(n), h, 128, device=dev).to(e4m3)
               for n, h in ((lens_q, 4), (lens_k, 2), (lens_k, 2)))
    out = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    for b in range(3):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        ref, _ = attention(q[sq][None].double(), k[sk][None].double(), v[sk][None].double(), causal=True)
        if not torch.isfinite(out[sq]).all() or (out[sq].double() - ref[0]).abs().max() > 0.1:
            failures += 1
            print(f"FAIL fp8 varlen sequence {b}")
    k8 = torch.randn(3, 304, 2, 128, device=dev).to(e4m3)
    v8 = torch.randn(3, 304, 2, 128, device=dev).to(e4m3)
    kd = torch.rand(3, 304, 2, device=dev) + 0.5
    vd = torch.rand(3, 304, 2, device=dev) + 0.5
    # one query position appending two keys, and speculative steps of 6 (24 query rows a KV
    # head: on sm_90 the two-per-SM plan with V in shared tiles) and 12 (48 rows: the Triton
    # kernel, contiguous with one stage)
    # and 24 (96 rows: 128-row tiles on 8 warps)
    for sq, new, lengths in ((1, 2, [1, 77, 300]), (6, 6, [0, 77, 298]), (12, 12, [0, 77, 292]),
                             (24, 24, [0, 77, 280])):
        qd = torch.randn(3, sq, 8, 128, device=dev, dtype=BF16)
        new_k = torch.randn(3, new, 2, 128, device=dev, dtype=BF16)
        new_v = torch.randn(3, new, 2, 128, device=dev, dtype=BF16)
        # (on sm_90 the paged ones take the Gluon kernel: pages under, over and of a 64-key tile)
        for page_size in (None, 16, 8, 128, 64):
            ck, cv, ckd, cvd = k8.clone(), v8.clone(), kd.clone(), vd.clone()
            seqlens = torch.tensor(lengths, dtype=torch.int32, device=dev)
            if page_size:
                pool_k, pool_v, pool_kd, pool_vd, table = _e4m3_pages(ck, cv, ckd, cvd, page_size)
                got = flashtile.flash_attn_with_kvcache(qd, pool_k, pool_v, new_k,
                                                        new_v, cache_seqlens=seqlens, block_table=table,
                                                        causal=True, k_descale=pool_kd, v_descale=pool_vd)
                ck, cv, ckd, cvd = _e4m3_read_back(pool_k, pool_v, pool_kd, pool_vd, table, 304)
            else:
                got = flashtile.flash_attn_with_kvcache(qd, ck, cv, new_k, new_v, cache_seqlens=seqlens,
                                                        causal=True, k_descale=ckd, v_descale=cvd)
            for b, n in enumerate(lengths):
                kk = (ck[b, :n + new].double() * ckd[b, :n + new, :, None])[None]
                vv = (cv[b, :n + new].double() * cvd[b, :n + new, :, None])[None]
                ref, _ = attention(qd[b:b + 1].double(), kk, vv, causal=True)
                if not torch.isfinite(got[b]).all() or (got[b].double() - ref[0]).abs().max() > 0.05:
                    failures += 1
                    print(f"FAIL fp8 cache Sq {sq} page_size {page_size} row {b}")
    qd, lengths = qd[:, :1], [1, 77, 300]
    # 66 (sequence, KV head) pairs: on sm_90 the e4m3 plan with four CTAs per SM (64 registers)
    many = 22
    got = flashtile.flash_attn_with_kvcache(qd.repeat(many, 1, 1, 1), k8.repeat(many, 1, 1, 1),
                                            v8.repeat(many, 1, 1, 1),
                                            cache_seqlens=torch.tensor(lengths * many, dtype=torch.int32,
                                                                       device=dev),
                                            causal=True, k_descale=kd.repeat(many, 1, 1),
                                            v_descale=vd.repeat(many, 1, 1))
    for b, n in enumerate(lengths):
        kk = (k8[b, :n].double() * kd[b, :n, :, None])[None]
        vv = (v8[b, :n].double() * vd[b, :n, :, None])[None]
        ref, _ = attention(qd[b:b + 1].double(), kk, vv, causal=True)
        rows = got[b::len(lengths)]
        if not torch.isfinite(rows).all() or (rows.double() - ref).abs().max() > 0.05:
            failures += 1
            print(f"FAIL fp8 cache, {many * 2} pairs, row {b}")
    return failures


def fp8_query_cases(dev) -> int:
    """FlashAttention-3's all-FP8 decode: an e4m3 q with q_descale (B, Hk), contiguous (also given as
    a broadcast view, which the call copies) and paged P16 e4m3 caches with per-key descales, one,
    6 and 24 query positions (on sm_90: the Gluon kernel at 4 and 24 rows, the Triton kernel's
    128-row tiles at 96), appending bf16 tokens; fixed (B, Hk) descales with bf16 and e4m3 queries;
    then rotary with an e4m3 cache (bf16 q and new keys turned before the keys are quantized);
    against attention on the dequantized tensors."""
    import flashtile

    failures = 0
    e4m3 = torch.float8_e4m3fn
    k8 = torch.randn(3, 304, 2, 128, device=dev).to(e4m3)
    v8 = torch.randn(3, 304, 2, 128, device=dev).to(e4m3)
    kd = torch.rand(3, 304, 2, device=dev) + 0.5
    vd = torch.rand(3, 304, 2, device=dev) + 0.5
    for sq, lengths in ((1, [1, 77, 300]), (6, [0, 77, 298]), (24, [0, 77, 280])):
        q8 = (torch.randn(3, sq, 8, 128, device=dev) * 50).to(e4m3)
        for page_size, q_descale in ((None, torch.rand(3, 2, device=dev) / 50 + 0.01),
                                     (None, torch.full((1, 1), 0.02, device=dev).expand(3, 2)),
                                     (16, torch.rand(3, 2, device=dev) / 50 + 0.01)):
            new_k = torch.randn(3, sq, 2, 128, device=dev, dtype=BF16)
            new_v = torch.randn(3, sq, 2, 128, device=dev, dtype=BF16)
            got, ck, cv, ckd, cvd = _e4m3_cache_call(q8, k8, v8, kd, vd, new_k, new_v, lengths, page_size,
                                                     q_descale=q_descale)
            q_deq = q8.double() * q_descale.double().repeat_interleave(4, dim=1)[:, None, :, None]
            for b, n in enumerate(lengths):
                kk = (ck[b, :n + sq].double() * ckd[b, :n + sq, :, None])[None]
                vv = (cv[b, :n + sq].double() * cvd[b, :n + sq, :, None])[None]
                ref, _ = attention(q_deq[b:b + 1], kk, vv, causal=True)
                if got.dtype != BF16 or not torch.isfinite(got[b]).all() \
                        or (got[b].double() - ref[0]).abs().max() > 0.05:
                    failures += 1
                    print(f"FAIL e4m3 q Sq {sq} page_size {page_size} row {b}")
    # fixed (B, Hk) descales, bf16 and e4m3 q, 4 and 32 query rows a KV head, appending bf16 tokens
    # (quantized with the fixed descales)
    fkd, fvd = torch.rand(3, 2, device=dev) + 0.5, torch.rand(3, 2, device=dev) + 0.5
    for sq, lengths, page_size in ((1, [1, 77, 300], None), (8, [0, 77, 296], None), (1, [1, 77, 300], 16),
                                   (8, [0, 77, 296], 16), (16, [0, 77, 288], 16)):
        for fp8_q in (False, True):
            q = torch.randn(3, sq, 8, 128, device=dev, dtype=BF16)
            q_descale = torch.rand(3, 2, device=dev) / 50 + 0.01 if fp8_q else None
            q_call = (q.float() * 50).to(e4m3) if fp8_q else q
            new_k = torch.randn(3, sq, 2, 128, device=dev, dtype=BF16)
            new_v = torch.randn(3, sq, 2, 128, device=dev, dtype=BF16)
            # (with pages, (B, Hk) descales are one a sequence: decode's seq_descales)
            got, ck, cv, _, _ = _e4m3_cache_call(q_call, k8, v8, kd, vd, new_k, new_v, lengths, page_size,
                                                 q_descale=q_descale, fixed=(fkd, fvd))
            q_deq = q_call.double()
            if fp8_q:
                q_deq = q_deq * q_descale.double().repeat_interleave(4, dim=1)[:, None, :, None]
            for b, n in enumerate(lengths):
                kk = (ck[b, :n + sq].double() * fkd[b, None, :, None])[None]
                vv = (cv[b, :n + sq].double() * fvd[b, None, :, None])[None]
                ref, _ = attention(q_deq[b:b + 1], kk, vv, causal=True)
                if not torch.isfinite(got[b]).all() or (got[b].double() - ref[0]).abs().max() > 0.05:
                    failures += 1
                    print(f"FAIL fixed descales, e4m3 q {fp8_q}, Sq {sq} page_size {page_size} row {b}")
    # ... through cache_batch_idx (the sequences in rows 2, 0, 1 of a four-row cache; on sm_90 the
    # Gluon kernel's per-sequence descales at 4 and 32 rows)
    rows = torch.tensor([2, 0, 1], dtype=torch.int32, device=dev)
    for sq, lengths in ((1, [1, 77, 300]), (8, [0, 77, 296])):
        q = torch.randn(3, sq, 8, 128, device=dev, dtype=BF16)
        new_k = torch.randn(3, sq, 2, 128, device=dev, dtype=BF16)
        new_v = torch.randn(3, sq, 2, 128, device=dev, dtype=BF16)
        big_k = torch.zeros(4, 304, 2, 128, device=dev).to(e4m3)
        big_v = torch.zeros(4, 304, 2, 128, device=dev).to(e4m3)
        big_k[rows.long()], big_v[rows.long()] = k8, v8
        got = flashtile.flash_attn_with_kvcache(
            q, big_k, big_v, new_k, new_v, cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=dev),
            cache_batch_idx=rows, causal=True, k_descale=fkd, v_descale=fvd)
        for b, n in enumerate(lengths):
            kk = (big_k[rows[b].long(), :n + sq].double() * fkd[b, None, :, None])[None]
            vv = (big_v[rows[b].long(), :n + sq].double() * fvd[b, None, :, None])[None]
            ref, _ = attention(q[b:b + 1].double(), kk, vv, causal=True)
            if not torch.isfinite(got[b]).all() or (got[b].double() - ref[0]).abs().max() > 0.05:
                failures += 1
                print(f"FAIL fixed descales through cache_batch_idx, Sq {sq} row {b}")
    # rotary with an e4m3 cache: a bf16 q and new keys turned, then the keys quantized and appended
    angles = torch.rand(320, 32, device=dev) * 6
    cos, sin = torch.cos(angles).to(BF16), torch.sin(angles).to(BF16)
    for sq, lengths, page_size in ((1, [1, 77, 300], None), (6, [0, 77, 298], 16), (6, [0, 77, 298], None)):
        q = torch.randn(3, sq, 8, 128, device=dev, dtype=BF16)
        new_k = torch.randn(3, sq, 2, 128, device=dev, dtype=BF16)
        new_v = torch.randn(3, sq, 2, 128, device=dev, dtype=BF16)
        ck, cv, ckd, cvd = k8.clone(), v8.clone(), kd.clone(), vd.clone()
        seqlens = torch.tensor(lengths, dtype=torch.int32, device=dev)
        kw = dict(cache_seqlens=seqlens, causal=True, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False)
        if page_size:
            pool_k, pool_v, pool_kd, pool_vd, table = _e4m3_pages(ck, cv, ckd, cvd, page_size)
            got = flashtile.flash_attn_with_kvcache(q, pool_k, pool_v, new_k, new_v,
                                                    block_table=table, k_descale=pool_kd, v_descale=pool_vd,
                                                    **kw)
            ck, cv, ckd, cvd = _e4m3_read_back(pool_k, pool_v, pool_kd, pool_vd, table, 304)
        else:
            got = flashtile.flash_attn_with_kvcache(q, ck, cv, new_k, new_v, k_descale=ckd, v_descale=cvd, **kw)
        for b, n in enumerate(lengths):
            pos = torch.arange(n, n + sq, device=dev)
            turn = torch.complex(cos[pos].double(), sin[pos].double())[None, :, None]  # (1, sq, 1, 32)
            x = q[b:b + 1].double()
            z = torch.complex(x[..., :32], x[..., 32:64]) * turn
            q_rot = torch.cat([z.real, z.imag, x[..., 64:]], dim=-1)
            kk = (ck[b, :n + sq].double() * ckd[b, :n + sq, :, None])[None]
            vv = (cv[b, :n + sq].double() * cvd[b, :n + sq, :, None])[None]
            ref, _ = attention(q_rot, kk, vv, causal=True)
            kx = new_k[b:b + 1].double()
            zk = torch.complex(kx[..., :32], kx[..., 32:64]) * turn
            k_rot = torch.cat([zk.real, zk.imag, kx[..., 64:]], dim=-1)[0]
            if not torch.isfinite(got[b]).all() or (got[b].double() - ref[0]).abs().max() > 0.05 \
                    or (kk[0, n:] - k_rot).abs().max() > 0.1 * k_rot.abs().max():
                failures += 1
                print(f"FAIL rotary e4m3 cache Sq {sq} page_size {page_size} row {b}")
    return failures


def gluon_cases(dev) -> int:
    """Every shipped Gluon variant (sm_90) on ragged shapes, GQA and MQA, through attention_forward's
    dispatch and directly; output and LSE against float64."""
    from flashtile.kernels import gluon_forward
    if dev.type != "cuda" or torch.cuda.get_device_capability(dev) != (9, 0):
        print("gluon: not an sm_90 GPU, skipped")
        return 0
    failures = cases = 0
    only = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--only=")), "").split(",")
    variants = gluon_forward.variants_named(only)
    for variant in variants:
        dtype = {"bf16": BF16, "fp16": F16, "fp8": BF16}[variant.dtype]
        # The last has more work tiles (144 at d128) than an H200 has SMs: persistent CTAs take a
        # second one (and prefetch its Q).
        # Causal persistent variants run the last two again query-block-major (dispatch picks
        # (batch, head)-major at these lengths).
        shapes = [(2, 33, 200, 4, 2, None), (2, 200, 33, 4, 1, None), (1, 300, 300, 8, 8, None),
                  (1, 129, 1000, 4, 4, None), (2, 1100, 1100, 8, 2, None)]
        if variant.causal and variant.persistent:
            shapes += [(1, 129, 1000, 4, 4, 0), (2, 1100, 1100, 8, 2, 0)]
        for batch, sq, sk, heads, heads_k, head_group in shapes:
            q = torch.randn(batch, sq, heads, variant.head_dim, device=dev, dtype=dtype)
            k = torch.randn(batch, sk, heads_k, variant.head_dim, device=dev, dtype=dtype)
            v = torch.randn(batch, sk, heads_k, variant.head_dim, device=dev, dtype=dtype)
            out = torch.full_like(q, float("nan"))
            lse = torch.full((batch, heads, sq), float("nan"), device=dev)
            if variant.fp8:  # quantized inputs; reference on the dequantized ones, e4m3 P's error
                from flashtile import fp8
                from flashtile.kernels.forward import fp8_kernel_descales
                blocks = (128, 256)  # whole tiles of every e4m3 variant
                z = fp8.quantize_qkv(q, k, v, block=blocks, hadamard=True)
                gluon_forward.gluon_attention_forward(
                    z.q, z.k, z.v, softmax_scale=variant.head_dim ** -0.5, causal=variant.causal,
                    variant=variant, out=out, lse=lse,
                    descales=fp8_kernel_descales(z.q_descale, z.k_descale, z.v_descale),
                    scale_blocks=blocks, head_group=head_group)
                from flashtile.kernels.forward import attention_forward, pick_config
                portable, portable_lse = attention_forward(
                    z.q, z.k, z.v, softmax_scale=variant.head_dim ** -0.5, window_left=-1,
                    window_right=0 if variant.causal else -1, diag_offset=sk - sq,
                    descales=(z.q_descale, z.k_descale, z.v_descale), scale_blocks=blocks,
                    config=pick_config(variant.head_dim, dev, True))
                q, k, v = (fp8.dequantize(t, d, b) for t, d, b in
                           ((z.q, z.q_descale, blocks[0]), (z.k, z.k_descale, blocks[1]),
                            (z.v, z.v_descale, blocks[1])))
            else:
                gluon_forward.gluon_attention_forward(q, k, v, softmax_scale=variant.head_dim ** -0.5,
                                                      causal=variant.causal, variant=variant, out=out,
                                                      lse=lse, head_group=head_group)
            ref, ref_lse = attention(q.double(), k.double(), v.double(), causal=variant.causal)
            low, _ = attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=variant.causal)
            err = (out.double() - ref).abs().max().item()
            budget = 2 * (low.double() - ref).abs().max().item()
            if variant.fp8:  # P rounds to e4m3: 2x the portable e4m3 kernel's error on the same tensors
                budget = max(budget, 2 * (portable.double() - ref).abs().max().item())
            seen = torch.isfinite(ref_lse)
            lse_err = (lse.double() - ref_lse)[seen].abs().max().item() if seen.any() else 0.0
            lse_tol = 1e-3
            if variant.fp8 and seen.any():  # sm_90's fast e4m3 accumulation: 2x the portable kernel's
                lse_tol = max(lse_tol, 2 * (portable_lse.double() - ref_lse)[seen].abs().max().item())
            lse_ok = bool((lse[~seen] == float("inf")).all()) and lse_err <= lse_tol
            cases += 1
            if not (err <= budget and lse_ok):
                failures += 1
                print(f"FAIL {variant.name} {(batch, sq, sk, heads, heads_k)}: out {err:.3g} (budget "
                      f"{budget:.3g}), lse {lse_err:.3g} (budget {lse_tol:.3g})")
    print(f"gluon: {cases} launches of {len(variants)} variants; {failures} wrong results")
    return failures


def main() -> int:
    # CPU (with TRITON_INTERPRET=1) only to try the script itself; the sanitizer needs the GPU.
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if "--gluon-only" in sys.argv:  # the Hopper Gluon forward alone
        return 1 if gluon_cases(dev) else 0
    fp8_ok = dev.type != "cuda" or torch.cuda.get_device_capability(dev) >= (8, 9)
    if "--fp8-query-only" in sys.argv:  # the e4m3 query, fixed descales and rotary cases alone
        failures = fp8_query_cases(dev) if fp8_ok else 0
        print(f"sanitize: e4m3 query, fixed-descale and rotary cases; {failures} wrong results")
        return 1 if failures else 0
    if "--decode-only" in sys.argv:  # after a change to the decode kernels alone (e4m3 cache too)
        failures = decode_cases(dev) + (fp8_varlen_and_cache_cases(dev) + fp8_query_cases(dev)
                                        if fp8_ok else 0)
        print(f"sanitize: decode cases; {failures} wrong results")
        return 1 if failures else 0
    failures = training_and_packed_cases(dev) + decode_cases(dev) + (
        fp8_cases(dev) + fp8_query_cases(dev) if fp8_ok else 0)
    cases = 0
    for head_dim, dtype, feat, (batch, sq, sk), tma in (QUICK if "--quick" in sys.argv else all_cases()):
        cfg = pick_config(head_dim, dev)
        cfg = TileConfig(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, use_tma=tma and cfg.use_tma)
        heads, heads_k = 4, 2
        q = torch.randn(batch, sq, heads, head_dim, device=dev, dtype=dtype)
        k = torch.randn(batch, sk, heads_k, head_dim, device=dev, dtype=dtype)
        v = torch.randn(batch, sk, heads_k, head_dim, device=dev, dtype=dtype)
        slopes = torch.rand(batch, heads, device=dev) if feat.get("alibi") else None
        causal = feat.get("causal", False)
        left, right = feat.get("window_size", (-1, -1))
        out = torch.full_like(q, float("nan"))
        lse = torch.full((batch, heads, sq), float("nan"), device=dev)
        attention_forward(q, k, v, softmax_scale=head_dim ** -0.5, window_left=left,
                          window_right=0 if causal else right, diag_offset=sk - sq,
                          softcap=feat.get("softcap", 0.0), alibi_slopes=slopes, out=out, lse=lse,
                          config=cfg)
        kw = dict(causal=causal, window_size=(left, right), softcap=feat.get("softcap", 0.0),
                  alibi_slopes=slopes)
        ref, _ = attention(q.double(), k.double(), v.double(), **kw)
        low, _ = attention(q, k, v, **kw)
        err = (out.double() - ref).abs().max().item()
        budget = 2 * (low.double() - ref).abs().max().item()
        cases += 1
        if cases % 40 == 0:
            print(f"{cases} launches checked", flush=True)
        if not err <= budget:
            failures += 1
            print(f"FAIL d{head_dim} {dtype} {feat} {(batch, sq, sk)} tma={cfg.use_tma}: {err:.3g} > {budget:.3g}")
    if dev.type == "cuda":
        torch.cuda.synchronize()
    print(f"sanitize: {cases} forward launches plus backward, varlen, dropout, paged, decode and FP8 cases; "
          f"{failures} wrong results")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
