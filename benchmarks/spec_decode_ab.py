"""Speculative decode steps (Sq > 1 query positions against the cache, causal): the plans for 17-64
query rows a KV head, bf16 and e4m3 caches, against the settings before and the Triton kernel
(forced) with the rules before.

    PYTHONPATH=src python benchmarks/spec_decode_ab.py --out $OUT [--points 'B,H,Hk,ctx;...'] [--seqlen-q 8]

Each provider's output is first checked against float64 attention (the accuracy rule), then it
runs as a CUDA graph over L layers with their own caches (>= 1 GiB, as bench decode), timed in
``--rounds`` balanced rounds (bench.common.time_in_rounds), the median of the rounds' do_bench
medians; GB/s count the cache bytes (e4m3: and the float32 descales). Writes
spec-decode-ab-sq<Sq>.json under --out.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

from flashtile.bench import decode as bench
from flashtile.bench.decode_fp8 import FP8Caches, fp8_paged_step, fp8_point_bytes, fp8_step
from flashtile.kernels import decode as dec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paged_gap import forced, load_baseline, run_points  # noqa: E402

POINTS = "1,32,8,32768;4,32,8,8192;16,32,8,16384;16,12,2,16384;64,12,2,4096"
PAGE = 16
# the Triton kernel's rules before speculative steps were measured: 2-warp programs at any row
# count, tiles of the rows rounded up to a power of two
BEFORE = {"TWO_WARP_MAX_ROWS": 1 << 20, "WIDE_TILE_ROWS": 0}
BF16_CONFIGS: list = []  # --bf16-configs: Triton plans for the bf16 cache, as --e4m3-configs
BF16_PAGED_CONFIGS: list = []  # --bf16-paged-configs: the same for the bf16 page-16 pool
E4M3_CONFIGS: list = []  # --e4m3-configs: Triton plans (block_n, warps, stages[, waves[, pdl[, min
# split keys[, programs per SM[, the query as two e4m3 terms (DecodeConfig.fp8_split_q)]]]]]) to time
E4M3_PAGED_CONFIGS: list = []  # --e4m3-paged-configs: the same for the page-16 pool
BASELINE = None  # --baseline: an older kernels/decode.py, loaded (its decode_attention is timed too)
ONLY: list = []  # --only: the providers to time besides the dispatched ones (name substrings)


def kept(steps: dict) -> dict:
    """``steps`` without the providers --only leaves out (the dispatched ones always stay)."""
    return {name: step for name, step in steps.items()
            if not ONLY or name.endswith("dispatched") or any(part in name for part in ONLY)}


def triton_config(block_n: int, warps: int, stages: int, waves: int = 2, pdl: int = 1,
                  min_split_keys: int = 128, programs_per_sm: int = 1, fp8_split_q: int = 0):
    """decode.decode_config replaced by one plan (the split heuristic still sizes its splits)."""
    cfg = dec.DecodeConfig(block_n, warps, stages, waves=waves, min_split_keys=min_split_keys,
                           pdl=bool(pdl), programs_per_sm=programs_per_sm,
                           fp8_split_q=bool(fp8_split_q))
    return lambda *args, **kwargs: cfg


def config_name(config: tuple) -> str:
    return ("n{} w{} s{}".format(*config) + (f" waves {config[3]}" if len(config) > 3 else "")
            + (f" pdl {config[4]}" if len(config) > 4 else "")
            + (f" min {config[5]}" if len(config) > 5 else "")
            + (f" per SM {config[6]}" if len(config) > 6 else "")
            + (f" split q {config[7]}" if len(config) > 7 else ""))


def baseline_call(q, k_cache, v_cache, lengths, **kwargs):
    """A step through the --baseline module's decode_attention (flash_attn_with_kvcache's call of it)."""
    def call(layer):
        return BASELINE.decode_attention(q, k_cache(layer), v_cache(layer), lengths,
                                         softmax_scale=q.shape[-1] ** -0.5, window_left=-1, window_right=0,
                                         need_lse=False, **{k: v(layer) for k, v in kwargs.items()})[0]
    return bench.Step(call)


def add_configs(steps: dict, cache: str, call, paged_call, configs: list, paged_configs: list) -> None:
    """Providers for the Triton kernel forced to each of ``configs`` (contiguous ``call``) and
    ``paged_configs`` (``paged_call``)."""
    for prefix, fn, plans in ((f"{cache} Triton ", call, configs),
                              (f"{cache} P{PAGE} Triton ", paged_call, paged_configs)):
        for config in plans:
            steps[prefix + config_name(config)] = \
                bench.Step(forced(fn, False, decode_config=triton_config(*config)))


def report(results: dict, base: str) -> None:
    ref = results[base]
    for name, r in results.items():
        if not r.get("available"):
            print(f"  {name:34s} unavailable: {r.get('error')}", flush=True)
            continue
        r["vs_base"] = ref["ms_per_layer"] / r["ms_per_layer"] if ref.get("available") else None
        spread = (max(r["replay_ms_rounds"]) - min(r["replay_ms_rounds"])) / r["replay_ms"]
        print(f"  {name:34s} {r['us_per_layer']:8.1f} us {r['gbps']:6.0f} GB/s {r['pct_ceiling']:5.1f}%  "
              f"{r['vs_base'] or float('nan'):.3f}x {base}  spread {100 * spread:.1f}%", flush=True)


def in_page_order(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The sequences a paged step reads from ``cache`` (B, S, ...) viewed as a pool of
    S * B / P pages of P rows through ``table`` (B, S / P)."""
    batch, pages = table.shape
    pool = cache.reshape(-1, PAGE, *cache.shape[2:])
    return pool[table.long()].reshape(batch, pages * PAGE, *cache.shape[2:])


def check(steps: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list,
          table: torch.Tensor | None = None) -> dict:
    """Each provider's layer-0 output for the first and the last sequence against float64
    attention of ``k``, ``v`` (the layer's cache, dequantized for e4m3; for the paged provider in
    the order ``table`` gives its pages): error over the budget of textbook attention in bf16 (the
    accuracy rule's 2x); prints one line a provider."""
    from flashtile import reference
    worst = {}
    for name, step in steps.items():
        out = step.call(0)
        if f"P{PAGE}" in name:
            k_seq, v_seq = in_page_order(k, table), in_page_order(v, table)
        else:
            k_seq, v_seq = k, v
        ratio = 0.0
        for b in sorted({0, q.shape[0] - 1}):
            kb, vb = k_seq[b:b + 1, :lengths[b]], v_seq[b:b + 1, :lengths[b]]
            ref, _ = reference.attention(q[b:b + 1].double(), kb.double(), vb.double(), causal=True)
            low, _ = reference.attention(q[b:b + 1], kb.bfloat16(), vb.bfloat16(), causal=True)
            budget = 2 * (low.double() - ref).abs().max().item() + 1e-6
            err = (out[b:b + 1].double() - ref).abs().max().item()
            ratio = max(ratio, err / budget if torch.isfinite(out[b]).all() else math.inf)
        worst[name] = ratio
        print(f"  check {name:34s} {'ok' if ratio <= 1 else 'FAIL'} {ratio:.3f} of the budget", flush=True)
    return worst


def probe(point: bench.Point, device, ceiling: float, rounds: int, seqlen_q: int) -> dict:
    import flashtile
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(point.batch, seqlen_q, point.heads, point.head_dim, generator=gen).to(device, bench.DTYPE)
    lengths = torch.tensor(point.lengths(), dtype=torch.int32, device=device)
    shape = (point.batch, point.context, point.heads_k, point.head_dim)
    record = {"point": point.__dict__, "seqlen_q": seqlen_q, "rows": point.heads // point.heads_k * seqlen_q}

    # bf16 cache
    layers = bench.layers_for(point)
    caches = bench.LayerCaches.allocate(point, layers, device)

    def bf16_call(layer):
        return flashtile.flash_attn_with_kvcache(q, caches.k[layer].view(shape), caches.v[layer].view(shape),
                                                 cache_seqlens=lengths, causal=True)
    table = bench.shuffled_block_table(point.batch, point.context // PAGE, device)
    pool = (-1, PAGE, point.heads_k, point.head_dim)

    def bf16_paged_call(layer):
        return flashtile.flash_attn_with_kvcache(q, caches.k[layer].view(pool), caches.v[layer].view(pool),
                                                 cache_seqlens=lengths, block_table=table, causal=True)
    steps = {"bf16 dispatched": bench.Step(bf16_call),
             f"bf16 P{PAGE} dispatched": bench.Step(bf16_paged_call),
             f"bf16 P{PAGE} Triton": bench.Step(forced(bf16_paged_call, False)),
             "bf16 Triton": bench.Step(forced(bf16_call, False)),
             "bf16 Triton, tiles of 32 rows": bench.Step(forced(bf16_call, False, WIDE_TILE_ROWS=0)),
             "bf16 Triton, rules before": bench.Step(forced(bf16_call, False, **BEFORE))}
    add_configs(steps, "bf16", bf16_call, bf16_paged_call, BF16_CONFIGS, BF16_PAGED_CONFIGS)
    if BASELINE is not None:
        steps["bf16 baseline"] = baseline_call(q, lambda i: caches.k[i].view(shape), lambda i: caches.v[i].view(shape),
                                               lengths)
    steps = kept(steps)
    record["bf16_check"] = check(steps, q, caches.k[0].view(shape), caches.v[0].view(shape), point.lengths(),
                                 table)
    results = bench.measure_providers(list(steps), caches, q, lengths, {}, bench.gpu_timer,
                                      bench.point_bytes(point), ceiling, rounds=rounds, steps=steps)
    report(results, "bf16 dispatched")
    record["bf16"] = results
    caches = steps = None  # (the graphs are gone: measure_providers dropped them)
    torch.cuda.empty_cache()

    # e4m3 cache
    nbytes = fp8_point_bytes(point)
    layers = max(1, math.ceil(bench.MIN_TOTAL_BYTES / nbytes))
    caches8 = FP8Caches.allocate(point, layers, device)
    holder = bench.LayerCaches(point, layers, caches8.k, caches8.v)  # measure_providers reads .layers
    call = fp8_step(caches8, q, lengths).call
    paged_call = fp8_paged_step(caches8, q, lengths, PAGE, table).call
    steps = {"e4m3 dispatched": bench.Step(call),
             "e4m3 Gluon without the ring (before)": bench.Step(forced(call, True, E4M3_ROWS32_DS_RING=False)),
             "e4m3 Triton": bench.Step(forced(call, False)),
             "e4m3 Triton, rules before": bench.Step(forced(call, False, **BEFORE)),
             f"e4m3 P{PAGE} dispatched": bench.Step(paged_call)}
    add_configs(steps, "e4m3", call, paged_call, E4M3_CONFIGS, E4M3_PAGED_CONFIGS)
    if BASELINE is not None:
        steps["e4m3 baseline"] = baseline_call(q, lambda i: caches8.k[i], lambda i: caches8.v[i], lengths,
                                               k_descale=lambda i: caches8.k_descale[i],
                                               v_descale=lambda i: caches8.v_descale[i])
    steps = kept(steps)
    record["e4m3_check"] = check(steps, q, caches8.k[0].float() * caches8.k_descale[0][..., None],
                                 caches8.v[0].float() * caches8.v_descale[0][..., None], point.lengths(),
                                 table)
    results = bench.measure_providers(list(steps), holder, q, lengths, {}, bench.gpu_timer, nbytes, ceiling,
                                      rounds=rounds, steps=steps)
    report(results, "e4m3 dispatched")
    record["e4m3"] = results
    return record


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--points", default=POINTS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seqlen-q", type=int, default=8)
    parser.add_argument("--bf16-configs", default="",
                        help="Triton plans for the bf16 cache to time too (the fields of --e4m3-configs)")
    parser.add_argument("--bf16-paged-configs", default="",
                        help="the same for the bf16 page pool (the Triton kernel forced)")
    parser.add_argument("--e4m3-configs", default="",
                        help="Triton plans for the e4m3 cache to time too: "
                        "'block_n,warps,stages[,waves[,pdl 0/1[,min split keys[,programs per SM]]]];...'")
    parser.add_argument("--e4m3-paged-configs", default="",
                        help="the same for the e4m3 page pool (the Triton kernel forced)")
    parser.add_argument("--baseline", default="", help="an older kernels/decode.py to time too")
    parser.add_argument("--only", default="",
                        help="';'-separated name parts of the providers to time besides the dispatched ones")
    args = parser.parse_args()
    global E4M3_CONFIGS, E4M3_PAGED_CONFIGS, ONLY, BF16_CONFIGS, BF16_PAGED_CONFIGS, BASELINE
    if args.baseline:
        BASELINE = load_baseline(args.baseline)

    def configs(text):
        return [tuple(int(x) for x in c.split(",")) for c in text.split(";") if c]
    BF16_CONFIGS, BF16_PAGED_CONFIGS = configs(args.bf16_configs), configs(args.bf16_paged_configs)
    E4M3_PAGED_CONFIGS = [tuple(int(x) for x in c.split(",")) for c in args.e4m3_paged_configs.split(";") if c]
    ONLY = [part for part in args.only.split(";") if part]
    E4M3_CONFIGS = [tuple(int(x) for x in c.split(",")) for c in args.e4m3_configs.split(";") if c]
    run_points(args.points, lambda point, device, ceiling: probe(point, device, ceiling, args.rounds,
                                                                  args.seqlen_q),
               args.out, f"spec-decode-ab-sq{args.seqlen_q}.json", rounds=args.rounds)


if __name__ == "__main__":
    main()
