"""Check flash_attn_with_kvcache calls with more than 64 query rows a KV head (the sm_90 "wide rows"
plans, decode._wide_rows_config) on page pools against the float64 reference, one line per case.

    PYTHONPATH=src python benchmarks/wide_rows_check.py [CASES_JSON] [--config JSON]

The default cases are the fuzz_gpu.py failure of 2026-12-01 (an e4m3 cache with per-key descales,
B4 32/8 heads, Sq 20 = 80 rows a KV head, head dim 256, pages of 1 key, 20 keys appended, causal) and
its neighbours: head dim 192 and 128, pages of 16/64/256, the contiguous cache, longer caches, 16-bit
caches (``"e4m3": false``). ``--fp8-mode`` forces the kernel's FP8 constexpr. ``--config`` replaces fields of the wide-rows plan (e.g. '{"block_n": 32}',
the step that gave wrong e4m3 outputs at head dims over 128 on pages). e4m3: the rule of
tests/test_fp8.py (2x the error of the same attention in bf16, on the dequantized cache after the
call); 16-bit: tests/helpers.assert_matches_reference. Exit status 1 if any case fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import fuzz_gpu as fz  # noqa: E402
from helpers import assert_matches_reference  # noqa: E402

import flashtile  # noqa: E402
from flashtile import fp8  # noqa: E402
from flashtile.kernels import decode  # noqa: E402
from flashtile.reference import attention as textbook  # noqa: E402

CASES = [{}, {"d": 192}, {"d": 128}, {"page": 16}, {"page": 64}, {"page": 256}, {"page": None},
         {"b": 1, "capacity": 2000}, {"b": 2, "sq": 40}, {"e4m3": False}, {"e4m3": False, "page": 16},
         {"e4m3": False, "d": 192, "page": 16}]


def _e4m3_case(q, b, hk, d, capacity, page, new, causal, fill=float("nan"), uniform=False):
    dev = q.device
    (k8, kd), (v8, vd) = (fp8.quantize_per_key(torch.randn(b, capacity, hk, d, device=dev) * s)
                          for s in (3.0, 1.0))
    if uniform:  # one descale for every key (the e4m3 values as quantized per key)
        kd, vd = torch.full_like(kd, 3.0 / 64), torch.full_like(vd, 1.0 / 64)
    lengths = torch.randint(0, capacity - new + 1, (b,), device=dev, dtype=torch.int32)
    extra = dict(cache_seqlens=lengths.clone(), causal=causal)
    if new:
        extra["k"] = torch.randn(b, new, hk, d, device=dev, dtype=q.dtype) * 3
        extra["v"] = torch.randn(b, new, hk, d, device=dev, dtype=q.dtype)
    out, k_deq, v_deq, plan = fz.e4m3_cache_call(q, k8, v8, kd, vd, page, describe=True, fill=fill, **extra)
    if not torch.isfinite(out).all():
        return float("inf"), plan
    worst = 0.0
    for i in range(b):
        n = int(lengths[i]) + new
        args = (q[i:i + 1].double(), k_deq[i:i + 1, :n].double(), v_deq[i:i + 1, :n].double())
        ref, _ = textbook(*args, causal=causal)
        low, _ = textbook(*(t.to(q.dtype) for t in args), causal=causal)
        budget = 2 * (low.double() - ref).abs().max().item() + 1e-6
        worst = max(worst, (out[i:i + 1].double() - ref).abs().max().item() / budget)
    return worst, plan


def _16bit_case(q, b, hk, d, capacity, page, new, causal):
    dev = q.device
    k_cache = torch.randn(b, capacity, hk, d, device=dev, dtype=q.dtype)
    v_cache = torch.randn_like(k_cache)
    lengths = torch.randint(0, capacity - new + 1, (b,), device=dev, dtype=torch.int32)
    extra = dict(cache_seqlens=lengths.clone(), causal=causal)
    if new:
        extra["k"] = torch.randn(b, new, hk, d, device=dev, dtype=q.dtype)
        extra["v"] = torch.randn(b, new, hk, d, device=dev, dtype=q.dtype)
    k_in, v_in = k_cache, v_cache
    if page:
        k_in, v_in, table = fz._paged(k_cache, v_cache, page)
        extra["block_table"] = table
    plan = decode.describe_plan(q, k_in, v_in, block_table=extra.get("block_table"), causal=causal,
                                in_graph=False)
    out = flashtile.flash_attn_with_kvcache(q, k_in, v_in, **extra)
    if page:
        k_cache, v_cache = fz._gather(k_in, table, capacity), fz._gather(v_in, table, capacity)
    worst = 0.0
    for i in range(b):
        n = int(lengths[i]) + new
        try:
            err, budget = assert_matches_reference(out[i:i + 1], None, q[i:i + 1], k_cache[i:i + 1, :n],
                                                   v_cache[i:i + 1, :n], causal=causal)
        except AssertionError:
            return float("inf"), plan
        worst = max(worst, err / max(budget, 1e-12))
    return worst, plan


def run_case(b=4, h=32, hk=8, sq=20, d=256, capacity=480, page=1, new=20, causal=True, seed=0, e4m3=True,
             **e4m3_options):
    """(worst error / budget over the sequences, the plan describe_plan reports); ``e4m3_options``:
    ``fill``, the descales in the page pool's unused slots (NaN), ``uniform``, one descale for all keys."""
    torch.manual_seed(seed)
    q = torch.randn(b, sq, h, d, device=fz.DEV, dtype=torch.bfloat16)
    if e4m3:
        return _e4m3_case(q, b, hk, d, capacity, page, new, causal, **e4m3_options)
    return _16bit_case(q, b, hk, d, capacity, page, new, causal)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="?", default=None, help="JSON list of keyword overrides of run_case")
    ap.add_argument("--config", default="{}", help="JSON fields replacing the wide-rows plan's")
    ap.add_argument("--all-plans", action="store_true",
                    help="apply --config to every decode plan (decode.decode_config), not only the wide-rows one")
    ap.add_argument("--fp8-mode", type=int, default=None,
                    help="the decode kernel's FP8 constexpr for e4m3 caches (decode._fp8_cache_mode), e.g. 2:"
                         " Triton's own conversions instead of the PTX widening and e4m3 dots")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    fz.DEV = args.device
    override = json.loads(args.config)
    if override and args.all_plans:
        shipped = decode.decode_config
        decode.decode_config = lambda *a, **kw: dataclasses.replace(shipped(*a, **kw), **override)
    elif override:
        wide = decode._wide_rows_config
        decode._wide_rows_config = lambda paged, head_dim, fp8_cache=False: dataclasses.replace(
            wide(paged, head_dim, fp8_cache), **override)
    if args.fp8_mode is not None:
        decode._fp8_cache_mode = lambda device, split_q=False: args.fp8_mode
    failed = 0
    for case in (json.loads(args.cases) if args.cases else CASES):
        try:
            worst, plan = run_case(**case)
            state = "ok  " if worst <= 1 else "FAIL"
        except Exception as exc:  # report and go on
            worst, plan, state = float("nan"), {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}, "ERR "
        failed += state != "ok  "
        print(f"{state} {worst:8.3f} of the budget  {case}  {plan}", flush=True)
    print(f"{failed} of {len(json.loads(args.cases) if args.cases else CASES)} failed"
          + (f" (plan fields {override})" if override else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
