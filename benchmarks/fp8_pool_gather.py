"""e4m3 page pools through flash_attn_varlen_func: the gathered Gluon route (K rows, V rows and V^T
copied out of the pools first) against the portable kernel reading the pages in place, by query rows
a sequence, on an H200.

    PYTHONPATH=src python benchmarks/fp8_pool_gather.py [--out DIR] [--rounds N]

Per point (32/8 heads, d128, causal, equal lengths, shuffled pages whose unused slots hold NaN,
one descale per sequence and KV head): the shipped call (which gathers wherever the copies fit in
forward.FP8_GATHER_BYTES) and the same call with the gather refused (FP8_GATHER_BYTES = 0), both
finite and within 5% of each other's largest output (they round P differently: e4m3 in the Gluon
kernel, 16-bit in the portable one; each is held to the accuracy rule by varlen_paged_fp8.py
--check), then CUDA-graph replays in balanced rounds (do_bench medians). Writes
fp8-pool-gather.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import flashtile
from flashtile.kernels import forward

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fuzz_gpu  # noqa: E402
from varlen_gather import graph_rounds  # noqa: E402
from varlen_paged_fp8 import quantize  # noqa: E402

DEV = "cuda"
# (sequences, query rows a sequence, keys a sequence, page size)
POINTS = [(64, 1, 4096, 16), (64, 4, 4096, 16), (16, 16, 8192, 16), (16, 64, 8192, 16),
          (8, 128, 8192, 16), (4, 256, 8192, 16), (2, 512, 8192, 16), (1, 1024, 16384, 16),
          (16, 1, 8192, 1), (4, 256, 8192, 1)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    torch.manual_seed(0)
    h, hk, d = 32, 8, 128
    shipped = forward.FP8_GATHER_BYTES
    rows, ok = [], True
    for batch, sq, sk, page in POINTS:
        lens_q, lens_k = [sq] * batch, [sk] * batch
        cu_q = torch.tensor([0] + lens_q, device=DEV).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + lens_k, device=DEV).cumsum(0).to(torch.int32)
        q8, qd, _ = quantize(torch.randn(sum(lens_q), h, d, device=DEV), cu_q, hk)
        k8, kd, _ = quantize(torch.randn(sum(lens_k), hk, d, device=DEV), cu_k, hk)
        v8, vd, _ = quantize(torch.randn(sum(lens_k), hk, d, device=DEV), cu_k, hk)
        k_pool, v_pool, table = fuzz_gpu._varlen_pools(k8, v8, lens_k, page)

        def call(bound):
            def run():
                forward.FP8_GATHER_BYTES = bound
                try:
                    return flashtile.flash_attn_varlen_func(q8, k_pool, v_pool, cu_q, cu_k, sq, sk, causal=True,
                                                            block_table=table, q_descale=qd, k_descale=kd,
                                                            v_descale=vd)
                finally:
                    forward.FP8_GATHER_BYTES = shipped
            return run

        timed = {"shipped": call(shipped), "portable": call(0)}
        outs = {key: fn().float() for key, fn in timed.items()}
        scale = outs["portable"].abs().max().item()
        diff = (outs["shipped"] - outs["portable"]).abs().max().item()
        agree = all(bool(torch.isfinite(o).all()) for o in outs.values()) and diff <= 0.05 * max(scale, 1e-6)
        ok &= agree
        med = graph_rounds(timed, args.rounds)
        gathers = forward._gather_fits(k_pool, table, sk)
        rec = {"sequences": batch, "query_rows": sq, "keys": sk, "page": page, "rows_a_sequence": sq * h // hk,
               "us": med, "portable_over_shipped": round(med["portable"] / med["shipped"], 3),
               "shipped_gathers": gathers, "max_abs_diff": diff, "out_abs_max": scale, "agree": agree}
        rows.append(rec)
        print(f"B{batch:<3d} Sq{sq:<5d} Sk{sk:<6d} P{page:<3d} rows {sq * h // hk:5d}  shipped "
              f"({'gathered' if gathers else 'portable'}) {med['shipped']:8.1f} us  portable {med['portable']:8.1f} us"
              f"  portable/shipped {rec['portable_over_shipped']:.3f}  {'agree' if agree else 'DISAGREE'}",
              flush=True)
        del outs
        torch.cuda.empty_cache()
    if args.out:
        with open(os.path.join(args.out, "fp8-pool-gather.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "heads": [h, hk], "head_dim": d, "rows": rows,
                       "fp8_gather_bytes": shipped, "all_agree": ok}, f, indent=1)
    print("PASS" if ok else "FAIL", "both routes finite and within 5% of each other")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
