"""Nsight Compute over single decode-kernel launches, to see where a decode kernel stalls.

    PYTHONPATH=src python benchmarks/ncu_decode.py --all      # every case under ncu
    PYTHONPATH=src python benchmarks/ncu_decode.py CASE       # one case, no profiler
    PYTHONPATH=src python benchmarks/ncu_decode.py --source CASE OUT_DIR  # stall samples per SASS line

CASE: contiguous (B1 32/8, 32k, bf16), paged16 (the same through a shuffled 16-token page table) or
fp8 (B16 32/8, 32k, e4m3 cache with per-key descales), fp8-12-2 (B16 12/2, 16k, e4m3), b16-128k
(B16 32/8, 128k, bf16: the unsplit 128-pair plan, its key tiles split among the warps on sm_90) and
b16-128k-2d (the same with decode.WARP_SPLIT off: the 2-D loop). Each runs the decode three times (two
warm-ups, then the profiled launch). ``--pair A B``: cases A and B under ncu with the SM clock free
(``--clock-control none``, the clocks the benches run at; ncu otherwise locks them to base).
"""

from __future__ import annotations

import os
import sys

import torch

import flashtile
from flashtile.bench.decode import shuffled_block_table


NCU = ["ncu", "--target-processes", "all", "-k", "regex:_attn_decode", "--launch-skip", "2",
       "--launch-count", "1", "--section", "SpeedOfLight", "--section", "WarpStateStats",
       "--section", "MemoryWorkloadAnalysis", "--section", "Occupancy", "--section", "LaunchStats"]


def main() -> int:
    case = sys.argv[1]
    if case == "--source":  # the Gluon decode kernel (the e4m3 cases take it on sm_90)
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from ncu_gluon import source_profile
        ncu = [*NCU[:4], "regex:_attn_decode_gluon", *NCU[5:9]]
        return source_profile(ncu, [sys.executable, __file__, sys.argv[2]], sys.argv[3])
    if case == "--pair":
        import subprocess
        status = 0
        for name in sys.argv[2:4]:
            print(f"== {name}", flush=True)
            status |= subprocess.call([*NCU, "--section", "SchedulerStats", "--section", "SourceCounters",
                                      "--clock-control", "none", sys.executable, __file__, name])
        return status
    if case == "--all":
        import subprocess
        status = 0
        for name in ("contiguous", "paged16", "fp8"):
            print(f"== {name}", flush=True)
            status |= subprocess.call(NCU + [sys.executable, __file__, name])
        return status
    dev = torch.device("cuda")
    if case == "b16-128k-2d":
        from flashtile.kernels import decode
        decode.WARP_SPLIT = False
    batch, ctx = {"fp8": (16, 32768), "fp8-12-2": (16, 16384), "b16-128k": (16, 131072),
                  "b16-128k-2d": (16, 131072)}.get(case, (1, 32768))
    heads, heads_k = (12, 2) if case == "fp8-12-2" else (32, 8)
    q = torch.randn(batch, 1, heads, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(batch, ctx, heads_k, 128, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lengths = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    kw = {}
    if case == "paged16":
        k, v = k.view(-1, 16, 8, 128), v.view(-1, 16, 8, 128)
        kw["block_table"] = shuffled_block_table(batch, ctx // 16, dev)
    elif case.startswith("fp8"):
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        kw["k_descale"] = torch.rand(batch, ctx, heads_k, device=dev) + 0.5
        kw["v_descale"] = torch.rand(batch, ctx, heads_k, device=dev) + 0.5
    for _ in range(3):
        flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True, **kw)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
