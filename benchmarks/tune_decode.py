"""Sweep split-KV decode configs on the GPU, cold cache, against SDPA cudnn and the read ceiling.

    PYTHONPATH=src python benchmarks/tune_decode.py --out $OUT
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/tune_decode.py --dry   # CPU smoke run

Same method as ``flashtile bench decode``: a CUDA graph over L layers with their own caches (>= 1 GiB
of K+V), replay timed with do_bench (median) / L, GB/s of K+V read. First every (block_n, warps,
stages) at the default split target, then the split target (waves per SM, shortest split) for the
best kernel configs. Each config's output is checked against the float64 reference on one layer.
Writes tune-decode.json under --out.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time

import torch

# (batch, heads, heads_k, context, page_size or 0)
POINTS = [(1, 32, 8, 1024, 0), (1, 32, 8, 4096, 0), (1, 32, 8, 32768, 0), (1, 32, 8, 131072, 0),
          (16, 32, 8, 4096, 0), (16, 32, 8, 32768, 0), (1, 12, 2, 32768, 0), (1, 32, 8, 32768, 16)]
# block_n, warps, stages, programmatic dependent launch
# block_n, warps, stages, programmatic dependent launch, page-number prefetch (paged points only)
KERNEL_CONFIGS = [(*c, pdl, True) for c in ((32, 4, 4), (64, 4, 3), (128, 4, 2)) for pdl in (False, True)]
PAGED_CONFIGS = [(*c, False, prefetch) for c in ((32, 4, 4), (64, 4, 3), (128, 4, 2), (128, 4, 3))
                 for prefetch in (False, True)]
SPLIT_TARGETS = [(2, 128), (2, 256), (1, 256)]


def _cfg(kernel, split=(2, 256)):
    from flashtile.kernels.decode import DecodeConfig
    block_n, warps, stages, pdl, prefetch = kernel
    return DecodeConfig(block_n, warps, stages, *split, pdl=pdl, page_prefetch=prefetch)


def _call(q, k, v, lengths, table, cfg, num_splits=0):
    from flashtile.kernels.decode import decode_attention
    return decode_attention(q, k, v, lengths, softmax_scale=q.shape[-1] ** -0.5, window_left=-1,
                            window_right=0, block_table=table, config=cfg, num_splits=num_splits)[0]


def _warm(job):
    kernel, paged = job
    try:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        q = torch.randn(2, 1, 32, 128, device=dev, dtype=torch.bfloat16)
        if paged:
            k = torch.randn(64, 16, 8, 128, device=dev, dtype=torch.bfloat16)
            table = torch.randperm(64, device=dev).view(2, 32).to(torch.int32)
        else:
            k = torch.randn(2, 512, 8, 128, device=dev, dtype=torch.bfloat16)
            table = None
        lengths = torch.tensor([300, 512], dtype=torch.int32, device=dev)
        _call(q, k, k, lengths, table, _cfg(kernel))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return job, None
    except Exception as exc:
        return job, f"{type(exc).__name__}: {exc}"[:300]


def _check(out, q, k, v, lengths, table, page_size):
    """Max error over 2x textbook bf16's, on batch row 0, against float64."""
    from flashtile.bench.decode import read_tokens
    from flashtile.reference import attention
    n = int(lengths[0])
    ks = read_tokens(k, table, 0, 0, n).unsqueeze(0)
    vs = read_tokens(v, table, 0, 0, n).unsqueeze(0)
    qs = q[:1]
    ref, _ = attention(qs.double(), ks.double(), vs.double(), causal=True)
    low, _ = attention(qs, ks, vs, causal=True)
    err = (out[:1].double() - ref).abs().max().item()
    return err / max(2 * (low.double() - ref).abs().max().item(), 1e-6)


def _default(page_size):
    from flashtile.kernels.decode import decode_config
    c = decode_config(bool(page_size), torch.device("cuda"))
    return (c.block_n, c.num_warps, c.num_stages, c.pdl, c.page_prefetch, c.waves, c.min_split_keys)


def main():
    from flashtile.bench.decode import (LayerCaches, Point, build_replay, gpu_timer, layers_for,
                                        ceiling_rate, measure_ceiling, point_bytes, shuffled_block_table)
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--top", type=int, default=2, help="kernel configs per point in the split sweep")
    ap.add_argument("--dry", action="store_true")
    ap.add_argument("--paged-only", action="store_true", help="only the paged points")
    ap.add_argument("--points", default=None,
                    help="points as batch,heads,heads_k,context,page_size;... instead of the built-in list")
    ap.add_argument("--split-counts", default=None,
                    help="comma-separated split counts: time the default kernel config with each (and the "
                         "heuristic's, as 0) instead of the config sweep")
    ap.add_argument("--configs", default=None,
                    help="with --split-counts: kernel configs as block_n,warps,stages,pdl;... to time with "
                         "each split count instead of the default config alone")
    args = ap.parse_args()
    chosen = None
    if args.configs:
        chosen = [tuple(int(x) for x in item.split(",")) for item in args.configs.split(";")]
        chosen = [(b, w, st, bool(pdl), True) for b, w, st, pdl in chosen]
    points = [p for p in POINTS if p[4] or not args.paged_only]
    if args.points:
        points = [tuple(int(x) for x in item.split(",")) for item in args.points.split(";")]
    split_counts = (list(dict.fromkeys([0] + [int(x) for x in args.split_counts.split(",")]))
                    if args.split_counts else None)
    if args.paged_only:
        points += [(16, 12, 2, 32768, 16), (1, 12, 2, 32768, 16), (16, 32, 8, 32768, 16)]
    kernel_configs = KERNEL_CONFIGS
    split_targets = SPLIT_TARGETS
    if args.dry:
        points = [(2, 8, 2, 256, 0), (2, 8, 2, 256, 16)]
        kernel_configs, split_targets = [(32, 4, 1, False, True)], [(2, 256)]
        PAGED_CONFIGS[:] = [(32, 4, 1, False, False), (32, 4, 1, False, True)]

    jobs = [(kc, False) for kc in kernel_configs] + [(kc, True) for kc in PAGED_CONFIGS]
    if split_counts:
        jobs = [(_default(0)[:5], False), (_default(16)[:5], True)]
        if chosen:
            jobs += [(kc, paged) for kc in chosen for paged in (False, True)
                     if kc != _default(16 if paged else 0)[:5]]
    t0 = time.time()
    if args.dry:
        errors = dict(_warm(j) for j in jobs)
    else:
        with mp.get_context("spawn").Pool(args.workers) as pool:
            errors = dict(pool.map(_warm, jobs))
    print(f"compiled {len(jobs)} configs in {time.time() - t0:.0f} s", flush=True)

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.dry:
        def timer(fn):
            fn()
            return 1.0
        ceiling = None
    else:
        timer = gpu_timer
        ceiling = ceiling_rate(measure_ceiling(dev))
        print(f"read ceiling {ceiling:.0f} GB/s", flush=True)

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rows = []
    for batch, heads, heads_k, context, page_size in points:
        point = Point("tune", batch, heads, heads_k, context)
        layers = 2 if args.dry else layers_for(point)
        nbytes = point_bytes(point)
        caches = LayerCaches.allocate(point, layers, dev)
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(batch, 1, heads, 128, generator=gen).to(dev, torch.bfloat16)
        lengths = torch.full((batch,), context, dtype=torch.int32, device=dev)
        table = (shuffled_block_table(batch, context // page_size, dev, gen) if page_size else None)

        def kv(layer):
            return caches.pools(layer, page_size) if page_size else caches.nhd(layer)

        rec = {"batch": batch, "heads": heads, "heads_k": heads_k, "context": context,
               "page_size": page_size, "layers": layers, "kv_bytes_per_layer": nbytes,
               "ceiling_gbps": ceiling, "results": []}

        def measure(kernel, split, num_splits=0):
            cfg = None if kernel == "plan" else _cfg(kernel, split)
            if kernel == "plan":  # what decode_attention picks for this shape by itself
                from flashtile.kernels import decode as dec
                c = dec.decode_config(bool(page_size), dev, batch * heads_k, capacity=context)
                kernel = (c.block_n, c.num_warps, c.num_stages, c.pdl, c.page_prefetch)
                split = (c.waves, c.min_split_keys)
            entry = {"block_n": kernel[0], "warps": kernel[1], "stages": kernel[2],
                     "pdl": kernel[3], "page_prefetch": kernel[4], "waves": split[0],
                     "min_split_keys": split[1], "num_splits": num_splits}
            entry["plan"] = cfg is None
            if errors.get((kernel, bool(page_size))):
                entry["error"] = errors[(kernel, bool(page_size))]
                return entry
            try:
                with torch.no_grad():
                    out = _call(q, *kv(0), lengths, table, cfg, num_splits)
                    entry["err_over_budget"] = _check(out, q, *kv(0), lengths, table, page_size)
                    replay = build_replay(
                        lambda layer: _call(q, *kv(layer), lengths, table, cfg, num_splits), layers, dev)
                    ms = timer(replay) / layers
                entry["us"] = ms * 1e3
                entry["gbps"] = nbytes / ms / 1e6
                del replay
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
            return entry

        if not args.dry and not page_size:
            q_t = q.transpose(1, 2).contiguous()
            try:
                def sdpa(layer):
                    k, v = caches.hnd(layer)
                    return F.scaled_dot_product_attention(q_t, k, v, enable_gqa=heads != heads_k)
                with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    sdpa(0)
                    replay = build_replay(sdpa, layers, dev)
                    ms = timer(replay) / layers
                rec["sdpa_cudnn_gbps"] = nbytes / ms / 1e6
                del replay
            except Exception as exc:
                rec["sdpa_cudnn_error"] = f"{type(exc).__name__}: {exc}"[:200]
        if split_counts:
            default = _default(page_size)
            kernels = [default[:5]] + ([kc for kc in chosen if kc != default[:5]] if chosen else [])
            rec["results"].append(measure("plan", None))
            for kernel in kernels:
                for count in split_counts:
                    rec["results"].append(measure(kernel, default[5:], count))
            ranked = []
        for kernel in ((PAGED_CONFIGS if page_size else kernel_configs) if not split_counts else ()):
            rec["results"].append(measure(kernel, split_targets[0]))
        if not split_counts:
            ranked = sorted((r for r in rec["results"] if "gbps" in r), key=lambda r: -r["gbps"])
        for best in ranked[:args.top]:
            kernel = (best["block_n"], best["warps"], best["stages"], best["pdl"], best["page_prefetch"])
            for split in split_targets:
                if split != split_targets[0]:
                    rec["results"].append(measure(kernel, split))
        rows.append(rec)
        caches = None  # frees this point's layers before the next allocation
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        top = sorted((r for r in rec["results"] if "gbps" in r), key=lambda r: -r["gbps"])[:3]
        if split_counts:
            top = [("plan" if r["plan"] else (r["block_n"], r["warps"], r["stages"], r["pdl"]),
                    r["num_splits"],
                    round(r.get("gbps", 0)), r.get("error")) for r in rec["results"]]
        print(json.dumps({k: v for k, v in rec.items() if k != "results"}), json.dumps(top), flush=True)

    import triton
    info = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "date": time.strftime("%Y-%m-%d")}
    with open(os.path.join(args.out, "tune-decode.json"), "w") as f:
        json.dump({"info": info, "points": rows}, f, indent=1)
    print("\nB  H/Hk  ctx     page | cudnn GB/s | best (block_n, warps, stages, pdl, prefetch, waves, min keys) GB/s")
    for r in rows:
        ok = sorted((x for x in r["results"] if "gbps" in x), key=lambda x: -x["gbps"])
        best = "  ".join(f"({x['block_n']},{x['warps']},{x['stages']},{'P' if x['pdl'] else '-'},"
                         f"s{x.get('num_splits', 0)},"
                         f"{'F' if x['page_prefetch'] else '-'},"
                         f"{x['waves']},{x['min_split_keys']})"
                         f"={x['gbps']:.0f}{'' if x['err_over_budget'] <= 1 else '!BAD'}" for x in ok[:3])
        default = [x for x in r["results"] if (x["block_n"], x["warps"], x["stages"], x["pdl"],
                                               x["page_prefetch"], x["waves"],
                                               x["min_split_keys"]) == _default(r["page_size"])]
        dflt = f"default={default[0].get('gbps', 0):.0f}" if default else ""
        print(f"{r['batch']:<3d}{r['heads']}/{r['heads_k']:<3d}{r['context']:<8d}{r['page_size']:<4d} | "
              f"{r.get('sdpa_cudnn_gbps') or 0:6.0f} | {dflt} {best}")


if __name__ == "__main__":
    main()
