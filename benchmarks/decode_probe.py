"""Where a batch-1 decode step's time goes on the GPU: the split kernel alone, the merge, kernel
boundaries, and plain read kernels with the same grid (what streaming the same bytes costs without
attention math).

    PYTHONPATH=src python benchmarks/decode_probe.py --out $OUT

Each variant runs as a CUDA graph over L layers with their own caches (>= 1 GiB, as ``bench decode``)
and is timed with do_bench (median) / L. Writes decode-probe.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashtile.bench.decode import LayerCaches, Point, build_replay, ceiling_rate, layers_for, measure_ceiling, \
    shuffled_block_table
from flashtile.kernels import decode as dec
from flashtile.kernels.launch import launch


@triton.jit
def _read_tiles(K, V, Out, seqlen, stride_kb, stride_ks, stride_kh, BLOCK_N: tl.constexpr,
                HEAD_DIM: tl.constexpr, PDL: tl.constexpr):
    split = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    chunk = tl.cdiv(tl.cdiv(seqlen, BLOCK_N), tl.num_programs(0)) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seqlen)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    base = b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    acc = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        at = base + (start + offs_n)[:, None].to(tl.int64) * stride_ks + offs_d[None, :]
        acc += tl.load(K + at).to(tl.float32) + tl.load(V + at).to(tl.float32)
    pid = (b * tl.num_programs(2) + h) * tl.num_programs(0) + split
    tl.store(Out + pid, tl.sum(acc))


@triton.jit
def _touch(X, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    tl.store(X + tl.program_id(0), tl.program_id(0))


def _setup(point, device):
    """Layers (>= 1 GiB of K+V), their caches, K+V bytes of one layer, a query, full lengths."""
    layers = layers_for(point)
    caches = LayerCaches.allocate(point, layers, device)
    nbytes = 2 * point.batch * point.context * point.heads_k * point.head_dim * 2
    q = torch.randn(point.batch, 1, point.heads, point.head_dim, device=device, dtype=torch.bfloat16)
    lengths = torch.full((point.batch,), point.context, dtype=torch.int32, device=device)
    return layers, caches, nbytes, q, lengths


def time_layers(call, layers, device):
    call(0)
    replay = build_replay(call, layers, device)
    ms = triton.testing.do_bench(replay, warmup=25, rep=150, return_mode="median")
    del replay
    return ms * 1e3 / layers


def _fp8_error_ratio(out, q, k8, v8, k_descale, v_descale):
    """Sequence 0's error against float64 attention of its dequantized cache, over the budget (2x
    the error of the same attention in bf16)."""
    from flashtile.reference import attention
    k = (k8[:1].double() * k_descale[:1, ..., None].double())
    v = (v8[:1].double() * v_descale[:1, ..., None].double())
    ref, _ = attention(q[:1].double(), k, v, causal=True)
    low, _ = attention(q[:1], k.to(torch.bfloat16), v.to(torch.bfloat16), causal=True)
    err = (out[:1].double() - ref).abs().max().item()
    return err / max(2 * (low.double() - ref).abs().max().item(), 1e-9)


def probe_fp8(point, _, device, ceiling):
    """An e4m3 cache with per-key descales (bf16 query): tile configs against the bf16 cache, GB/s
    counting the bytes each reads."""
    layers = layers_for(point)
    caches = LayerCaches.allocate(point, layers, device)
    fp8_k = caches.k.to(torch.float8_e4m3fn)
    fp8_v = caches.v.to(torch.float8_e4m3fn)
    shape = (point.batch, point.context, point.heads_k, point.head_dim)
    k_descale = torch.rand(layers, *shape[:3], device=device) + 0.5
    v_descale = torch.rand(layers, *shape[:3], device=device) + 0.5
    q = torch.randn(point.batch, 1, point.heads, point.head_dim, device=device, dtype=torch.bfloat16)
    lengths = torch.full((point.batch,), point.context, dtype=torch.int32, device=device)
    scale = point.head_dim ** -0.5
    rows = []
    bf16_bytes = 2 * point.batch * point.context * point.heads_k * point.head_dim * 2
    splits = dec.split_heuristic(point.batch, point.heads_k, point.context, device,
                                 dec.decode_config(False, device, point.batch * point.heads_k))
    # (name, config, e4m3 cache, split count multiplier, FP8 constexpr or None for the default)
    configs = FP8_CONFIGS or [("e4m3", n, w, st, m) for n, w, st, m in (
        (64, 4, 4, 1), (64, 8, 4, 1), (128, 4, 3, 1), (128, 8, 3, 1), (128, 4, 2, 1), (64, 4, 3, 1),
        (32, 4, 4, 1), (128, 4, 3, 2), (64, 4, 4, 2))]
    variants = [("bf16 default", None, False, 1, None), ("e4m3 default", None, True, 1, None)] + (
        [] if FP8_CONFIGS else [("e4m3 default, Triton's cvt (FP8=2)", None, True, 1, 2)]) + [
        (f"{kind} n{n} w{w} s{st}" + (f" x{m} splits" if m > 1 else " heuristic" if m == 0 else "")
         + (f" {per_sm}/SM" if per_sm else "") + (f" min{min_keys}" if min_keys else ""),
         dec.DecodeConfig(n, w, st, pdl=True, **(dict(waves=1, programs_per_sm=per_sm) if per_sm else {}),
                          **(dict(min_split_keys=min_keys) if min_keys else {})),
         kind.startswith("e4m3"), m, int(kind.split("@")[1]) if "@" in kind else None)
        for kind, n, w, st, m, per_sm, min_keys in ((*c, 0, 0)[:7] for c in configs)]
    original_mode = dec._fp8_cache_mode
    for name, cfg, fp8, mult, mode in variants:
        def call(layer, cfg=cfg, fp8=fp8, mult=mult):
            if fp8:
                k, v = fp8_k[layer].view(shape), fp8_v[layer].view(shape)
                extra = dict(k_descale=k_descale[layer], v_descale=v_descale[layer])
            else:
                k, v = caches.nhd(layer)
                extra = {}
            return dec.decode_attention(q, k, v, lengths, softmax_scale=scale, window_left=-1,
                                        window_right=0, config=cfg,
                                        num_splits=splits * mult if cfg else 0,
                                        need_lse=False, **extra)[0]
        dec._PLANS.clear()
        if mode is not None:
            dec._fp8_cache_mode = lambda device, head_dim=128, mode=mode: mode
        try:
            us = time_layers(call, layers, device)
            ratio = _fp8_error_ratio(call(0), q, fp8_k[0].view(shape), fp8_v[0].view(shape), k_descale[0],
                                     v_descale[0]) if fp8 else None
        except Exception as exc:
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        finally:
            dec._fp8_cache_mode = original_mode
            dec._PLANS.clear()
        nbytes = bf16_bytes // 2 if fp8 else bf16_bytes
        gbps = nbytes / us / 1e3
        rows.append({"variant": name, "us_per_layer": us, "gbps": gbps, "pct": 100 * gbps / ceiling,
                     "err_over_budget": ratio})
        check = "" if ratio is None else f"  err/budget {ratio:.2f}" + (" FAIL" if not ratio <= 1 else "")
        print(f"  {name:28s} {us:8.1f} us {gbps:6.0f} GB/s {100 * gbps / ceiling:5.1f}%{check}", flush=True)
    return {"point": point.__dict__, "layers": layers, "rows": rows}


def _alternate_merges(point, device, ceiling, variants):
    """Time the default decode of ``point`` with each (name, merge kernel, merge option overrides)
    in turn, the list twice over, restoring the shipped merge after."""
    layers, caches, nbytes, q, lengths = _setup(point, device)
    original_kernel, original_options = dec._combine, dec._combine_options
    rows = []
    try:
        for name, kernel, override in variants * 2:
            dec._combine = kernel
            dec._combine_options = (lambda *a, o=override: dict(original_options(*a), **o))
            dec._PLANS.clear()

            def call(layer):
                k, v = caches.nhd(layer)
                return dec.decode_attention(q, k, v, lengths, softmax_scale=0.088, window_left=-1,
                                            window_right=0, need_lse=False)[0]
            us = time_layers(call, layers, device)
            gbps = nbytes / us / 1e3
            rows.append({"variant": name, "us_per_layer": us, "gbps": gbps})
            print(f"  {name:32s} {us:7.2f} us {gbps:5.0f} GB/s {100 * gbps / ceiling:5.1f}%", flush=True)
    finally:
        dec._combine, dec._combine_options = original_kernel, original_options
        dec._PLANS.clear()
    return {"point": point.__dict__, "layers": layers, "rows": rows}


def probe_trigger(point, _, device, ceiling):
    """The merge kernel letting the next kernel launch at its start or at its end (the default)."""
    return _alternate_merges(point, device, ceiling, [
        (f"merge triggers dependents={t}", dec._combine, {"LAUNCH_DEPENDENTS": t}) for t in (True, False)])


def probe_combine(point, _, device, ceiling):
    """The merge kernel as shipped, with each of --warps forced, and (with --baseline FILE, a module
    defining ``_combine``, e.g. the kernel cut out of an older decode.py) that version with 4 warps."""
    variants = [("shipped", dec._combine, {})] + [
        (f"shipped, {w} warps", dec._combine, {"num_warps": w}) for w in WARPS]
    if BASELINE is not None:
        variants.append(("baseline, 4 warps", BASELINE._combine, {"num_warps": 4}))
    return _alternate_merges(point, device, ceiling, variants)


BASELINE = None
WARPS = (4,)  # combine mode: warp counts to force on the shipped kernel
# fp8 mode: (cache, block_n, warps, stages, split multiplier[, programs per SM[, min split keys]])
FP8_CONFIGS = None


def probe_paged(point, page_sizes, device, ceiling):
    """Paged against contiguous with the same tile configs: shuffled block tables (as ``bench paged``)
    and identity tables (pages in memory order), to tell the gather's own cost from the cost of
    scattered pages."""
    layers, caches, nbytes, q, lengths = _setup(point, device)
    scale = point.head_dim ** -0.5
    rows = []
    base = dec.decode_config(False, device, point.batch * point.heads_k)
    splits = dec.split_heuristic(point.batch, point.heads_k, point.context, device, base)
    layouts = [("contiguous", 0, None)]
    for page in page_sizes:
        pages = point.context // page
        layouts.append((f"P{page} shuffled", page, shuffled_block_table(point.batch, pages, device)))
        layouts.append((f"P{page} in order", page, torch.arange(point.batch * pages, device=device,
                                                                dtype=torch.int32).view(point.batch, pages)))
    for name, page, table in layouts:
        for block_n, stages, prefetch in ((32, 4, 1), (64, 3, 1), (64, 3, 0), (128, 2, 1)):
            if not page and prefetch == 0:
                continue
            cfg = dec.DecodeConfig(block_n, 4, stages, pdl=False, page_prefetch=bool(prefetch))

            def call(layer, page=page, table=table, cfg=cfg):
                k, v = caches.pools(layer, page) if page else caches.nhd(layer)
                return dec.decode_attention(q, k, v, lengths, softmax_scale=scale, window_left=-1,
                                            window_right=0, block_table=table, config=cfg,
                                            num_splits=splits, need_lse=False)[0]
            us = time_layers(call, layers, device)
            gbps = nbytes / us / 1e3
            label = f"{name} n{block_n} s{stages} prefetch{prefetch}"
            rows.append({"variant": label, "splits": splits, "us_per_layer": us, "gbps": gbps,
                         "pct": 100 * gbps / ceiling})
            print(f"  {label:40s} splits {splits:3d} {us:8.1f} us {gbps:6.0f} GB/s {100 * gbps / ceiling:5.1f}%",
                  flush=True)
    return {"point": point.__dict__, "layers": layers, "bytes_per_layer": nbytes, "rows": rows}


def probe_point(point, page, device, ceiling):
    layers, caches, nbytes, q, lengths = _setup(point, device)
    table = shuffled_block_table(point.batch, point.context // page, device) if page else None
    scale = point.head_dim ** -0.5
    rows = []

    def record(name, us, **info):
        gbps = nbytes / us / 1e3
        rows.append({"variant": name, "us_per_layer": us, "gbps": gbps, "pct": 100 * gbps / ceiling, **info})
        print(f"  {name:48s} {us:8.1f} us {gbps:6.0f} GB/s {100 * gbps / ceiling:5.1f}%", flush=True)

    def kv(layer):
        return caches.pools(layer, page) if page else caches.nhd(layer)

    def full(cfg=None, splits=0):
        def call(layer):
            k, v = kv(layer)
            return dec.decode_attention(q, k, v, lengths, softmax_scale=scale, window_left=-1,
                                        window_right=0, block_table=table, config=cfg,
                                        num_splits=splits, need_lse=False)[0]
        return call

    record("default", time_layers(full(), layers, device))
    k0, v0 = kv(0)
    p = dec.prepare_decode(q, k0, v0, softmax_scale=scale, window_left=-1, window_right=0,
                           block_table=table, need_lse=False)
    default_splits = p.splits
    rows[-1]["splits"] = default_splits

    def split_only(layer):
        k, v = kv(layer)
        outp = torch.empty(p.splits, *p.out_shape, dtype=torch.float32, device=device)
        lsep = torch.empty(p.splits, *p.lse_shape, dtype=torch.float32, device=device)
        out = torch.empty(p.out_shape, dtype=p.dtype, device=device)
        lse = torch.empty(p.lse_shape, dtype=torch.float32, device=device)
        launch(dec._attn_decode, p.grid, (q, k, v, outp, lsep, out, lse, lengths, None, None, table,
                                          None, None, None, None, None), p.scalars, p.kernel_options)
        return out

    if p.splits > 1:
        record("split kernel only (no merge)", time_layers(split_only, layers, device), splits=p.splits)

    configs = [(32, 4, 4, True), (32, 4, 4, False), (64, 4, 3, True), (64, 4, 4, True), (64, 8, 4, True),
               (128, 8, 3, True), (16, 4, 6, True)]
    split_counts = sorted({default_splits, max(1, default_splits // 2), 2 * default_splits})
    for block_n, warps, stages, pdl in configs:
        for splits in split_counts:
            cfg = dec.DecodeConfig(block_n, warps, stages, pdl=pdl and not page)
            try:
                us = time_layers(full(cfg, splits), layers, device)
            except Exception as exc:  # a config that does not fit
                print(f"  cfg {block_n},{warps},{stages} splits {splits}: {type(exc).__name__}")
                continue
            record(f"cfg n{block_n} w{warps} s{stages} pdl{int(pdl)} splits{splits}", us,
                   block_n=block_n, warps=warps, stages=stages, pdl=pdl, splits=splits)

    if not page:
        sink = torch.empty(1 << 16, dtype=torch.float32, device=device)
        for block_n, stages in ((32, 4), (64, 3), (64, 4)):
            for splits in split_counts:
                grid = (splits, point.batch, point.heads_k)

                def read(layer, grid=grid, block_n=block_n, stages=stages):
                    k, v = caches.nhd(layer)
                    _read_tiles[grid](k, v, sink, point.context, k.stride(0), k.stride(1), k.stride(2),
                                      BLOCK_N=block_n, HEAD_DIM=point.head_dim, PDL=True,
                                      num_warps=4, num_stages=stages, launch_pdl=True)
                record(f"read tiles n{block_n} s{stages} grid {grid}", time_layers(read, layers, device))
        for programs in (132, 264, 528):
            def flat(layer, programs=programs):
                k, v = caches.k[layer].view(1, -1, 1, 128), caches.v[layer].view(1, -1, 1, 128)
                _read_tiles[(programs, 1, 1)](k, v, sink, k.shape[1], 0, 128, 0, BLOCK_N=32, HEAD_DIM=128,
                                              PDL=True, num_warps=4, num_stages=4, launch_pdl=True)
            record(f"read flat chunks, {programs} programs", time_layers(flat, layers, device))
        for pdl in (False, True):
            def touch2(layer, pdl=pdl):
                for _ in range(2):
                    _touch[(264,)](sink, PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}))
            us = time_layers(touch2, layers, device)
            rows.append({"variant": f"two empty kernels pdl{int(pdl)}", "us_per_layer": us})
            print(f"  two empty kernels pdl{int(pdl)}: {us:.2f} us per layer", flush=True)
    return {"point": point.__dict__ if hasattr(point, "__dict__") else str(point), "page": page,
            "layers": layers, "bytes_per_layer": nbytes, "rows": rows}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--mode", choices=("where", "paged", "fp8", "trigger", "combine"), default="where")
    parser.add_argument("--baseline", default=None,
                        help="combine mode: a file defining another _combine kernel to time against")
    parser.add_argument("--warps", default=None, help="combine mode: warp counts to force, e.g. 1,2,4")
    parser.add_argument("--fp8-configs", default=None,
                        help="fp8 mode: cache:block_n,warps,stages,split multiplier[,programs per SM[,min split keys]];"
                             "... (cache e4m3, e4m3@2 or e4m3@3 for that FP8 constexpr, or bf16; multiplier 0: the split "
                             "heuristic with this config, one wave of the programs per SM if given) instead "
                             "of the built-in list")
    parser.add_argument("--points", default=None,
                        help="batch,heads,heads_k,context;... instead of the mode's points (contiguous)")
    args = parser.parse_args()
    if args.baseline:
        import importlib.util
        global BASELINE
        spec = importlib.util.spec_from_file_location("baseline_combine", args.baseline)
        BASELINE = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(BASELINE)
    if args.warps:
        global WARPS
        WARPS = tuple(int(w) for w in args.warps.split(","))
    if args.fp8_configs:
        global FP8_CONFIGS
        FP8_CONFIGS = [(item.split(":")[0], *(int(x) for x in item.split(":")[1].split(",")))
                       for item in args.fp8_configs.split(";")]
        for kind, *_ in FP8_CONFIGS:  # the kernel knows FP8 modes 2 and 3; others would run as 2
            if kind not in ("bf16", "e4m3", "e4m3@2", "e4m3@3"):
                parser.error(f"--fp8-configs: unknown cache {kind!r} (bf16, e4m3, e4m3@2, e4m3@3)")
    device = torch.device("cuda")
    ceiling = ceiling_rate(measure_ceiling(device))
    print(f"read ceiling {ceiling:.0f} GB/s", flush=True)
    results = []
    if args.mode == "where":
        points = [(1, 32, 8, 32768, 0), (1, 32, 8, 4096, 0), (1, 32, 8, 131072, 0),
                  (16, 32, 8, 32768, 0), (1, 32, 8, 32768, 16), (1, 12, 2, 32768, 0),
                  (1, 12, 2, 32768, 16)]
    elif args.mode == "paged":
        points = [(1, 32, 8, 32768, (16, 256, 1)), (16, 32, 8, 16384, (16,)), (1, 12, 2, 32768, (16,))]
    elif args.mode == "fp8":
        points = [(16, 32, 8, 32768, 0), (1, 32, 8, 32768, 0), (16, 32, 8, 4096, 0), (64, 12, 2, 16384, 0)]
    else:
        points = [(16, 12, 2, 1024, 0), (16, 12, 2, 4096, 0), (16, 12, 2, 32768, 0), (1, 32, 8, 4096, 0)]
        if args.mode == "combine":
            points += [(1, 32, 8, 32768, 0), (1, 12, 2, 32768, 0)]
    if args.points:
        points = [(*(int(x) for x in item.split(",")), 0) for item in args.points.split(";")]
    probe = {"where": probe_point, "paged": probe_paged, "fp8": probe_fp8, "trigger": probe_trigger,
             "combine": probe_combine}[args.mode]
    for (batch, heads, heads_k, context, page) in points:
        point = Point("probe", batch, heads, heads_k, context)
        print(f"B{batch} {heads}/{heads_k} ctx{context} page{page}", flush=True)
        results.append(probe(point, page, device, ceiling))
        torch.cuda.empty_cache()
        with open(os.path.join(args.out, f"decode-probe-{args.mode}.json"), "w") as f:
            json.dump({"ceiling_gbps": ceiling, "points": results}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
