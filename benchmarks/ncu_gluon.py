"""Nsight Compute over single launches of the Gluon forward (bf16 and e4m3, head dim 128), to see
which pipe bounds it: tensor cores, the transcendental/conversion unit (exp2, e4m3 packing) or
issue.

    PYTHONPATH=src python benchmarks/ncu_gluon.py --all      # every case under ncu
    PYTHONPATH=src python benchmarks/ncu_gluon.py CASE       # one case, no profiler

    PYTHONPATH=src python benchmarks/ncu_gluon.py --source CASE OUT_DIR   # stall samples per SASS line

CASE: bf16 (the shipped bf16 variant) or a substring of an e4m3 variant name (e.g. fp8-full-n128-s3);
B=2, S=8192, 16 heads, non-causal. Each runs the kernel three times (two warm-ups, then the profiled
launch). ``--source`` samples warp stalls per instruction (SourceCounters), writes the source page
as CSV to OUT_DIR and prints the instructions with the most samples and their main stall reasons.
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


def _source(case: str, out_dir: str) -> int:
    return source_profile(NCU, [sys.executable, __file__, case], out_dir)


def source_profile(ncu: list, command: list, out_dir: str) -> int:
    """Run ``command`` under ``ncu`` (its kernel filter and launch selection) sampling warp
    stalls per SASS instruction; write the source page as CSV under ``out_dir`` and print the
    stall reasons and the instructions with the most samples."""
    import csv
    import io
    import os
    report = os.path.join(out_dir, "ncu-source")
    status = subprocess.call(ncu + ["--clock-control", "none", "--section", "SourceCounters",
                                    "--section", "WarpStateStats", "-f", "-o", report, *command])
    details = subprocess.run(["ncu", "-i", report + ".ncu-rep", "--page", "details"],
                             capture_output=True, text=True)
    print(details.stdout[-6000:], details.stderr[-2000:], flush=True)
    page = subprocess.run(["ncu", "-i", report + ".ncu-rep", "--page", "source", "--csv",
                           "--print-source", "sass"], capture_output=True, text=True)
    with open(os.path.join(out_dir, "ncu-source.csv"), "w") as f:
        f.write(page.stdout)
    if page.returncode or not page.stdout.strip():
        print("source page failed:", page.stderr[-3000:])
        return 1
    lines = page.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    total_col = "Warp Stall Sampling (All Samples)"
    reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]

    def num(x):
        try:
            return float(str(x).replace(",", ""))
        except ValueError:
            return 0.0
    total = sum(num(r[total_col]) for r in rows) or 1.0
    by_reason = {c[6:]: sum(num(r[c]) for r in rows) / total for c in reasons}
    print(f"{len(rows)} instructions, {total:.0f} samples; by reason:",
          ", ".join(f"{k} {v:.1%}" for k, v in sorted(by_reason.items(), key=lambda kv: -kv[1])[:10]))
    base = int(rows[0]["Address"], 16)
    for r in sorted(rows, key=lambda r: -num(r[total_col]))[:40]:
        top = sorted(((num(r[c]), c[6:]) for c in reasons), reverse=True)[:3]
        print(f"{int(r['Address'], 16) - base:6x} {num(r[total_col]) / total:6.2%} "
              f"executed {num(r['Instructions Executed']):>9.0f}  {r['Source'].strip()[:56]:56s} "
              + " ".join(f"{c} {v / total:.1%}" for v, c in top if v))
    return status


def main() -> int:
    case = sys.argv[1]
    if case == "--source":
        return _source(sys.argv[2], sys.argv[3])
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
        blocks = (128, max(128, variant.block_n))
        z = fp8.quantize_qkv(q, k, v, block=blocks)
        descales = fp8_kernel_descales(z.q_descale, z.k_descale, z.v_descale)
        run = lambda: gluon_attention_forward(z.q, z.k, z.v, softmax_scale=128 ** -0.5, causal=False,
                                              variant=variant, descales=descales,
                                              scale_blocks=blocks)
    print(variant.name, flush=True)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
