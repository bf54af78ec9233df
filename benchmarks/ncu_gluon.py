"""Nsight Compute over single launches of the Gluon forward (bf16 and e4m3, head dim 128), to see
which pipe bounds it: tensor cores, the transcendental/conversion unit (exp2, e4m3 packing) or
issue.

    PYTHONPATH=src python benchmarks/ncu_gluon.py --all      # every case under ncu
    PYTHONPATH=src python benchmarks/ncu_gluon.py CASE       # one case, no profiler

CASE: bf16 (the shipped bf16 variant) or a substring of an e4m3 variant name (e.g. fp8-full-n128-s3);
B=2, S=8192, 16 heads, non-causal. Each runs the kernel three times (two warm-ups, then the profiled
launch).
"""

from __future__ import annotations

import subprocess
import sys

import torch

SECTIONS = ["--section", "SpeedOfLight", "--section", "ComputeWorkloadAnalysis", "--section",
            "WarpStateStats", "--section", "InstructionStats", "--section", "LaunchStats"]
NCU = ["ncu", "--target-processes", "all", "-k", "regex:_attn_fwd_gluon", "--launch-skip", "2",
       "--launch-count", "1"]
# Per-pipe utilization; in its own ncu run so that a metric this ncu lacks costs only that run.
PIPES = ["--metrics", ",".join([
    "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active",
    "smsp__issue_active.avg.pct_of_peak_sustained_active"])]
CASES = ("bf16", "fp8-full-n128-s3-ws-pingpong", "fp8-full-n128-s3-ws")


def main() -> int:
    case = sys.argv[1]
    if case == "--all":
        status = 0
        for name in CASES:
            print(f"== {name}", flush=True)
            status |= subprocess.call(NCU + SECTIONS + [sys.executable, __file__, name])
            print(f"== {name} pipes", flush=True)
            subprocess.call(NCU + PIPES + [sys.executable, __file__, name])
        return status
    from flashtile import fp8
    from flashtile.kernels.forward import fp8_kernel_descales
    from flashtile.kernels.gluon_forward import GLUON_VARIANTS, default_variant, gluon_attention_forward

    q, k, v = (torch.randn(2, 8192, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if case == "bf16":
        variant = default_variant(128, "bf16", False)
        run = lambda: gluon_attention_forward(q, k, v, softmax_scale=128 ** -0.5, causal=False,
                                              variant=variant)
    else:
        variant = next(x for x in GLUON_VARIANTS if x.fp8 and not x.causal and case in x.name
                       and x.name.endswith(case.split("-")[-1]))
        z = fp8.quantize_qkv(q, k, v, block=(128, 128))
        descales = fp8_kernel_descales(z.q_descale, z.k_descale, z.v_descale)
        run = lambda: gluon_attention_forward(z.q, z.k, z.v, softmax_scale=128 ** -0.5, causal=False,
                                              variant=variant, descales=descales,
                                              scale_blocks=(128, 128))
    print(variant.name, flush=True)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
