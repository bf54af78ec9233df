"""``flashtile bench decode-fp8``: one-token decode against an e4m3 KV cache (one float32 descale per
key and KV head), next to the same decode against the bf16 cache, as GB/s of what each reads.

The bytes counted for the FP8 cache are its e4m3 K and V plus their descales (4 bytes per key and KV
head, each): sum_b cache_seqlens[b] * Hk * (2 * D + 8). Both caches are timed like ``bench decode``:
a CUDA graph of layer calls cycling through L layers, each with its own cache, at least 1 GiB of
cache in all, so every read comes from DRAM (the calls: ``decode.graph_calls``, counted from the e4m3
layers' bytes), the two in balanced rounds (each the median of its rounds); the read ceiling is
``bench decode``'s (a streaming read kernel), measured in the same run. With ``--page-size P`` (16 unless 0) the same e4m3 caches
are also read as page pools of P keys through a shuffled block table, timed in the same rounds. A correctness check of
the FP8 cache against float64 attention of the dequantized cache comes first.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from .common import (add_common_arguments, check_without_gpu, choose_device, environment, format_number,
                     format_seqlen, gbps, result_path, write_json)
from .decode import (CONTIGUOUS, MAX_TOTAL_BYTES, MIN_TOTAL_BYTES, ROUNDS, LayerCaches, Point, Step,
                     _memory_skip, ceiling_line, ceiling_rate, ceiling_summary, decode_points, gpu_timer,
                     layers_for, measure, measure_ceiling, measure_providers, paginate,
                     point_bytes, shuffled_block_table)

FP8 = torch.float8_e4m3fn
FP8_PROVIDER = "flashtile-fp8"
FP8_PAGED_PROVIDER = "flashtile-fp8-paged"  # the same e4m3 caches read as page pools
PAGE_SIZE = 16


def fp8_point_bytes(point: Point) -> int:
    """e4m3 K+V plus their float32 descales, read by one layer."""
    return sum(point.lengths()) * point.heads_k * (2 * point.head_dim + 8)


@dataclass
class FP8Caches:
    """e4m3 K/V (layers, B, S, Hk, D) and descales (layers, B, S, Hk); random, only bytes matter."""
    layers: int
    k: torch.Tensor
    v: torch.Tensor
    k_descale: torch.Tensor
    v_descale: torch.Tensor

    @classmethod
    def allocate(cls, point: Point, layers: int, device: torch.device) -> "FP8Caches":
        shape = (layers, point.batch, point.context, point.heads_k, point.head_dim)
        k = torch.empty(shape, dtype=FP8, device=device)
        v = torch.empty(shape, dtype=FP8, device=device)
        for layer in range(layers):  # one layer at a time: no full-size bf16 temporary
            k[layer] = torch.randn(shape[1:], device=device, dtype=torch.bfloat16).to(FP8)
            v[layer] = torch.randn(shape[1:], device=device, dtype=torch.bfloat16).to(FP8)
        scales = torch.rand(shape[:4], device=device) * 0.01 + 0.005
        return cls(layers, k, v, scales, scales.clone())


def fp8_step(caches: FP8Caches, q: torch.Tensor, lengths: torch.Tensor) -> Step:
    import flashtile

    def call(layer):
        return flashtile.flash_attn_with_kvcache(q, caches.k[layer], caches.v[layer], cache_seqlens=lengths,
                                                 causal=True, k_descale=caches.k_descale[layer],
                                                 v_descale=caches.v_descale[layer])
    return Step(call, info={"layout": "(B, S, Hk, D) e4m3 contiguous, descales (B, S, Hk) float32 for "
                                      "K and for V"})


def fp8_paged_step(caches: FP8Caches, q: torch.Tensor, lengths: torch.Tensor, page_size: int,
                   block_table: torch.Tensor) -> Step:
    """The same layer caches as page pools (B * S / P, P, Hk, D) read through ``block_table`` (every
    page once, in a shuffled order), descales as (B * S / P, P, Hk): the same bytes as contiguous."""
    import flashtile
    heads_k, head_dim = caches.k.shape[3:]
    pool = (-1, page_size, heads_k, head_dim)

    def call(layer):
        return flashtile.flash_attn_with_kvcache(
            q, caches.k[layer].view(pool), caches.v[layer].view(pool), cache_seqlens=lengths,
            block_table=block_table, causal=True, k_descale=caches.k_descale[layer].view(pool[:3]),
            v_descale=caches.v_descale[layer].view(pool[:3]))
    return Step(call, info={"layout": f"e4m3 page pools of {page_size} keys, descales alike, pages "
                                      "in a shuffled order"})


# ----------------------------------------------------------------------------------------- check

def check_cases(on_gpu: bool) -> list[dict]:
    if on_gpu:
        return [dict(batch=4, heads=32, heads_k=8, head_dim=128, lengths=(1, 1000, 7777, 16384),
                     page_size=None, num_splits=0),
                dict(batch=4, heads=32, heads_k=8, head_dim=128, lengths=(1, 1000, 7777, 16384),
                     page_size=None, num_splits=1),
                dict(batch=4, heads=12, heads_k=2, head_dim=128, lengths=(1, 1000, 7777, 16384),
                     page_size=16, num_splits=0),
                dict(batch=2, heads=8, heads_k=1, head_dim=64, lengths=(300, 4099), page_size=None,
                     num_splits=3),
                # FlashAttention-3's all-FP8 call: an e4m3 q with q_descale (B, Hk)
                dict(batch=4, heads=32, heads_k=8, head_dim=128, lengths=(1, 1000, 7777, 16384),
                     page_size=None, num_splits=0, fp8_query=True, fixed_descales=True),
                dict(batch=4, heads=32, heads_k=8, head_dim=128, lengths=(1, 1000, 7777, 16384),
                     page_size=None, num_splits=0, fp8_query=True),
                dict(batch=4, heads=12, heads_k=2, head_dim=128, lengths=(1, 1000, 7777, 16384),
                     page_size=16, num_splits=0, fp8_query=True),
                # fixed (B, Hk) descales with a bf16 query, one and 8 positions (32 query rows a
                # KV head)
                dict(batch=4, heads=12, heads_k=2, head_dim=128, lengths=(1, 1000, 7777, 16384),
                     page_size=None, num_splits=0, fixed_descales=True),
                dict(batch=2, heads=32, heads_k=8, head_dim=128, lengths=(3000, 16384), page_size=None,
                     num_splits=0, fixed_descales=True, seqlen_q=8),
                # ... with pages of 16 (one descale a sequence, read once by a program), e4m3 q too
                dict(batch=4, heads=32, heads_k=8, head_dim=128, lengths=(1, 1000, 7777, 16384),
                     page_size=16, num_splits=0, fixed_descales=True),
                dict(batch=4, heads=12, heads_k=2, head_dim=128, lengths=(1, 1000, 7777, 16384),
                     page_size=16, num_splits=0, fixed_descales=True, fp8_query=True),
                dict(batch=2, heads=32, heads_k=8, head_dim=128, lengths=(3000, 16384), page_size=16,
                     num_splits=0, fixed_descales=True, seqlen_q=16)]
    return [dict(batch=2, heads=4, heads_k=2, head_dim=32, lengths=(1, 70), page_size=None, num_splits=0),
            dict(batch=2, heads=4, heads_k=1, head_dim=32, lengths=(33, 70), page_size=16, num_splits=2),
            dict(batch=2, heads=4, heads_k=2, head_dim=32, lengths=(5, 70), page_size=None, num_splits=0,
                 fp8_query=True, fixed_descales=True),
            dict(batch=2, heads=4, heads_k=2, head_dim=32, lengths=(5, 70), page_size=16, num_splits=0,
                 fixed_descales=True)]


def _fp8_query(q: torch.Tensor, heads_k: int):
    """q (B, Sq, H, D) as e4m3 with FlashAttention-3's q_descale (B, Hk): one scale per sequence and
    KV head over its query heads; also the dequantized q the reference reads."""
    b, sq, h, d = q.shape
    grouped = q.float().view(b, sq, heads_k, h // heads_k, d)
    qd = grouped.abs().amax(dim=(1, 3, 4)) / torch.finfo(FP8).max
    q8 = (grouped / qd[:, None, :, None, None]).to(FP8).view(b, sq, h, d)
    deq = (q8.float().view(b, sq, heads_k, h // heads_k, d) * qd[:, None, :, None, None]).view(b, sq, h, d)
    return q8, qd, deq


def run_check(device: torch.device, log=print) -> list[dict]:
    """FP8 cache decode against float64 attention of the dequantized cache, per sequence; the budget
    is 2x the error of the same attention computed in bf16."""
    import flashtile
    from ..fp8 import quantize_per_key
    from ..reference import attention

    results = []
    gen = torch.Generator().manual_seed(0)
    for case in check_cases(device.type == "cuda"):
        b, h, hk, d, lengths = case["batch"], case["heads"], case["heads_k"], case["head_dim"], case["lengths"]
        cap = max(lengths)
        if case["page_size"]:
            cap = -(-cap // case["page_size"]) * case["page_size"]
        q = torch.randn(b, case.get("seqlen_q", 1), h, d, generator=gen).to(device, torch.bfloat16)
        k = (torch.randn(b, cap, hk, d, generator=gen) * 2).to(device)
        v = torch.randn(b, cap, hk, d, generator=gen).to(device)
        if case.get("fixed_descales"):  # FlashAttention-3's (B, Hk)
            fixed = [x.abs().amax(dim=(1, 3)) / torch.finfo(FP8).max for x in (k, v)]
            (k8, v8), (kd, vd) = [(x / s[:, None, :, None]).to(FP8) for x, s in zip((k, v), fixed)], \
                [s[:, None, :].expand(b, cap, hk) for s in fixed]
        else:
            (k8, kd), (v8, vd) = quantize_per_key(k), quantize_per_key(v)
        seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
        kw = dict(cache_seqlens=seqlens, causal=True, num_splits=case["num_splits"])
        q_call = q
        if case.get("fp8_query"):
            q_call, kw["q_descale"], q = _fp8_query(q, hk)
        if case["page_size"]:
            ps = case["page_size"]
            pool_k, pool_v, table = paginate(k8.view(torch.uint8), v8.view(torch.uint8), ps, gen)
            if case.get("fixed_descales"):  # FlashAttention-3's (B, Hk) with pages: per sequence
                pool_kd, pool_vd = kd[:, 0], vd[:, 0]
            else:
                pool_kd = torch.full(pool_k.shape[:3], float("nan"), device=device)
                pool_vd = torch.full(pool_k.shape[:3], float("nan"), device=device)
                pages = table.long()
                pool_kd[pages.reshape(-1)] = kd.reshape(b * (cap // ps), ps, hk)
                pool_vd[pages.reshape(-1)] = vd.reshape(b * (cap // ps), ps, hk)
            out = flashtile.flash_attn_with_kvcache(q_call, pool_k.view(FP8), pool_v.view(FP8),
                                                    block_table=table, k_descale=pool_kd,
                                                    v_descale=pool_vd, **kw)
        elif case.get("fixed_descales"):
            out = flashtile.flash_attn_with_kvcache(q_call, k8, v8, k_descale=kd[:, 0], v_descale=vd[:, 0],
                                                    **kw)
        else:
            out = flashtile.flash_attn_with_kvcache(q_call, k8, v8, k_descale=kd, v_descale=vd, **kw)
        k_deq, v_deq = k8.float() * kd[..., None], v8.float() * vd[..., None]
        err = budget = 0.0
        for i, n in enumerate(lengths):
            args = (q[i:i + 1].double(), k_deq[i:i + 1, :n].double(), v_deq[i:i + 1, :n].double())
            ref, _ = attention(*args, causal=True)
            low, _ = attention(*(t.to(torch.bfloat16) for t in args), causal=True)
            err = max(err, (out[i:i + 1].double() - ref).abs().max().item())
            budget = max(budget, 2 * (low.double() - ref).abs().max().item())
        cache = "contiguous" if not case["page_size"] else f"paged P{case['page_size']}"
        if case.get("fixed_descales"):
            cache += ", fixed descales"
        label = (f"e4m3 {'q and ' if case.get('fp8_query') else ''}cache B{b}"
                 f"{' Sq' + str(case['seqlen_q']) if case.get('seqlen_q') else ''} H{h}/{hk} d{d} "
                 f"L({','.join(map(str, lengths))}) {cache} splits {case['num_splits'] or 'auto'}")
        passed = bool(torch.isfinite(out).all()) and out.dtype == torch.bfloat16 and err <= budget
        results.append({"label": label, "passed": passed, "out_err": err, "budget": budget,
                        "case": {**case, "lengths": list(lengths)}})
        log(f"{'PASS' if passed else 'FAIL'}  {label:<60s} out err {err:.2e} <= {budget:.2e}")
    return results


# ----------------------------------------------------------------------------------------- sweep

def fp8_layers(point: Point, override: int | None) -> int:
    return override or max(1, math.ceil(MIN_TOTAL_BYTES / fp8_point_bytes(point)))


def run_point(point: Point, device: torch.device, ceiling: float | None, layers_override: int | None,
              seed: int, page_size: int = PAGE_SIZE) -> dict:
    """Both caches timed in balanced rounds (as ``bench decode`` times its providers) over the same
    number of layers, enough for >= 1 GiB of the e4m3 cache (so more for the bf16 one); where both
    do not fit at once, each alone over its own layer count, one pass each. ``page_size`` > 0: the
    e4m3 caches also read as page pools of that many keys (FP8_PAGED_PROVIDER), timed with them."""
    nb16, nb8 = point_bytes(point), fp8_point_bytes(point)
    layers = max(layers_for(point, layers_override), fp8_layers(point, layers_override))
    fp8_total = 2 * layers * nb8  # ... and the fp8 allocation's per-layer bf16 temporary, at most
    together = (layers * max(nb16, nb8) <= MAX_TOTAL_BYTES
                and _memory_skip(layers * nb16 + fp8_total, device) is None)
    layers_bf16 = layers if together else layers_for(point, layers_override)
    layers_fp8 = layers if together else fp8_layers(point, layers_override)
    record = {"model": point.model, "batch": point.batch, "heads": point.heads, "heads_k": point.heads_k,
              "context": point.context, "head_dim": point.head_dim, "layers_bf16": layers_bf16,
              "layers_fp8": layers_fp8, "bytes_per_layer_bf16": nb16, "bytes_per_layer_fp8": nb8,
              "timing": "balanced rounds of both" if together else "one pass each, alone",
              "providers": {}}
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(point.batch, 1, point.heads, point.head_dim, generator=gen).to(device, torch.bfloat16)
    lengths = torch.tensor(point.lengths(), dtype=torch.int32, device=device)
    paged = page_size > 0 and point.context % page_size == 0
    record["page_size"] = page_size if paged else None
    table = shuffled_block_table(point.batch, point.context // page_size, device, gen) if paged else None

    def fp8_steps(caches8):
        steps = {FP8_PROVIDER: fp8_step(caches8, q, lengths)}
        if paged:
            steps[FP8_PAGED_PROVIDER] = fp8_paged_step(caches8, q, lengths, page_size, table)
        return steps
    if together:
        caches = LayerCaches.allocate(point, layers, device)
        caches8 = FP8Caches.allocate(point, layers, device)
        steps = fp8_steps(caches8)
        record["providers"] = measure_providers(
            [CONTIGUOUS, *steps], caches, q, lengths, {}, gpu_timer, nb16, ceiling,
            rounds=ROUNDS, steps=steps, graph_bytes=nb8)  # (calls by the smaller layers: the e4m3 ones)
        for name in steps:
            _count_bytes(record["providers"][name], nb8, ceiling)
        del caches, caches8
        torch.cuda.empty_cache()
    else:
        for name, layers, nbytes in ((CONTIGUOUS, layers_bf16, nb16), (FP8_PROVIDER, layers_fp8, nb8)):
            total = layers * nbytes * (2 if name == FP8_PROVIDER else 1)  # ... and the fp8 allocation's
            reason = ("too large" if layers * nbytes > MAX_TOTAL_BYTES else None) or _memory_skip(total, device)
            if reason:
                record["providers"][name] = {"available": False, "error": reason}
                if name == FP8_PROVIDER and paged:
                    record["providers"][FP8_PAGED_PROVIDER] = {"available": False, "error": reason}
                continue
            if name == CONTIGUOUS:
                caches = LayerCaches.allocate(point, layers, device)
                record["providers"][name] = measure(name, caches, q, lengths, {}, gpu_timer, nbytes, ceiling)
            else:
                caches8 = FP8Caches.allocate(point, layers, device)
                holder = LayerCaches(point, layers, caches8.k, caches8.v)  # measure reads .layers only
                for fp8_name, step in fp8_steps(caches8).items():
                    record["providers"][fp8_name] = measure(fp8_name, holder, q, lengths, {}, gpu_timer,
                                                            nbytes, ceiling, step=step)
                del caches8, holder
            caches = None
            torch.cuda.empty_cache()
    bf16, fp8 = record["providers"][CONTIGUOUS], record["providers"][FP8_PROVIDER]
    record["fp8_speedup_per_token"] = (bf16["ms_per_layer"] / fp8["ms_per_layer"]
                                       if bf16.get("available") and fp8.get("available") else None)
    fp8_paged = record["providers"].get(FP8_PAGED_PROVIDER, {})
    record["fp8_paged_vs_contiguous"] = (fp8["ms_per_layer"] / fp8_paged["ms_per_layer"]
                                         if fp8.get("available") and fp8_paged.get("available") else None)
    return record


def _count_bytes(result: dict, nbytes: int, ceiling: float | None) -> None:
    """GB/s (and % of the ceiling) of a provider timed next to another that reads other bytes."""
    if result.get("available"):
        result["gbps"] = gbps(nbytes, result["ms_per_layer"])
        result["pct_ceiling"] = None if ceiling is None else 100.0 * result["gbps"] / ceiling


def format_table(records: list[dict], title: str) -> str:
    page = next((r["page_size"] for r in records if r.get("page_size")), None)
    columns = (f"{'B':>3} {'H/Hk':>6} {'ctx':>5} | {'bf16 GB/s':>9} {'%ceil':>6} | {'fp8 GB/s':>9} "
               f"{'%ceil':>6} | {'fp8 speedup':>11}")
    if page:
        columns += f" | {f'fp8 P{page} GB/s':>13} {'%ceil':>6} {'vs contig':>9}"
    lines = [title, columns, "-" * len(columns)]
    for r in records:
        p16, p8 = r["providers"][CONTIGUOUS], r["providers"][FP8_PROVIDER]
        line = (f"{r['batch']:>3} {str(r['heads']) + '/' + str(r['heads_k']):>6} "
                f"{format_seqlen(r['context']):>5} | {format_number(p16.get('gbps'), '{:.0f}'):>9} "
                f"{format_number(p16.get('pct_ceiling'), '{:.0f}%'):>6} | "
                f"{format_number(p8.get('gbps'), '{:.0f}'):>9} "
                f"{format_number(p8.get('pct_ceiling'), '{:.0f}%'):>6} | "
                f"{format_number(r['fp8_speedup_per_token'], '{:.2f}x'):>11}")
        if page:
            pp = r["providers"].get(FP8_PAGED_PROVIDER, {})
            line += (f" | {format_number(pp.get('gbps'), '{:.0f}'):>13} "
                     f"{format_number(pp.get('pct_ceiling'), '{:.0f}%'):>6} "
                     f"{format_number(r.get('fp8_paged_vs_contiguous'), '{:.3f}x'):>9}")
        lines.append(line)
    return "\n".join(lines)


def add_arguments(parser) -> None:
    add_common_arguments(parser, "a few points only", "skip the FP8 cache correctness check",
                         with_dtype=False)
    parser.add_argument("--layers", type=int, default=None, metavar="L",
                        help="layers per CUDA graph (default: enough for >= 1 GiB of cache)")
    parser.add_argument("--page-size", type=int, default=PAGE_SIZE, metavar="P",
                        help="also time the e4m3 caches read as page pools of P keys (0: not); "
                             f"default {PAGE_SIZE}")


def run(args) -> int:
    device = choose_device()
    if device.type != "cuda":
        return check_without_gpu("decode-fp8", "FP8-cache decode", [lambda: run_check(device)], args)
    env = environment(device)
    print(f"flashtile bench decode-fp8: {env['gpu']}, q bf16, e4m3 K/V cache with per-key descales, "
          f"torch {env['torch']}, triton {env['triton']}")
    checks = None if args.no_check else run_check(device)
    before = measure_ceiling(device)
    print(ceiling_line(before))
    records = []
    for i, point in enumerate(decode_points(args.quick)):
        records.append(run_point(point, device, ceiling_rate(before), args.layers, seed=i,
                                 page_size=args.page_size))
        r = records[-1]
        print(f"{point.model:<13} {point.label():<22} " + ", ".join(
            f"{n} {p['gbps']:.0f} GB/s ({p['us_per_layer']:.1f} us)" if p.get("available")
            else f"{n} unavailable ({p['error'][:100]})" for n, p in r["providers"].items()), flush=True)
    after = measure_ceiling(device)
    ceiling = ceiling_summary(before, after)
    for r in records:
        for p in r["providers"].values():
            if p.get("available") and ceiling["gbps"]:
                p["pct_ceiling"] = 100.0 * p["gbps"] / ceiling["gbps"]
    payload = {"benchmark": "decode-fp8", **env, "quick": args.quick, "command": " ".join(sys.argv),
               "bytes": "bf16: sum_b L_b * Hk * D * 2 * 2; fp8: sum_b L_b * Hk * (2 * D + 2 * 4) "
                        "(e4m3 K and V plus a float32 descale per key and KV head for each)",
               "gbps_unit": "1e9 bytes/s", "ceiling": ceiling, "check": checks, "points": records}
    path = result_path(args.out, "decode-fp8", env["gpu"], "json")
    write_json(path, payload)
    print(f"Wrote {path}")
    print()
    print(format_table(records, f"flashtile decode, bf16 vs e4m3 cache, d128, {env['gpu']} "
                                f"(ceiling {ceiling['gbps']:.0f} GB/s)"))
    failed = [c for c in checks or [] if not c["passed"]]
    if failed:
        print(f"WARNING: {len(failed)} FP8 cache check(s) FAILED")
    return 1 if failed else 0
