"""Where the time of one training step (flash_attn_func forward + autograd backward) goes, on a GPU.

    PYTHONPATH=src python benchmarks/train_profile.py --out $OUT [--points 'B,S,H,Hk,D,causal;...']
        [--cprofile]

Per point and backward path (the fused Gluon kernel of deterministic=False at d128, and with it
turned off): the step's do_bench median as ``bench train`` times it, the host time to enqueue one
step (no synchronization, median of 30), and each kernel's device time in one step from
torch.profiler. A step whose median is well above its kernels' sum is bound by something else
(host, launch gaps). Writes $OUT/train-profile.json; prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import flashtile
from flashtile.kernels import backward as bwd

DEFAULT_POINTS = ("8,2048,16,16,128,1;8,2048,16,16,128,0;1,8192,12,2,128,1;1,16384,16,16,128,1;"
                  "32,512,16,16,128,1")


def parse_points(text: str):
    points = []
    for item in text.split(";"):
        b, s, h, hk, d, causal = (int(x) for x in item.split(","))
        points.append((b, s, h, hk, d, bool(causal)))
    return points


def step_fn(b, s, h, hk, d, causal):
    dev = torch.device("cuda")
    q = torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, s, hk, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, s, hk, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16)

    def step():
        out = flashtile.flash_attn_func(q, k, v, causal=causal)
        return torch.autograd.grad(out, (q, k, v), dout)
    return step


def profile_kernels(step) -> list[tuple[str, float]]:
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append((ev.name[:60], ev.device_time / 1e3))
    return kernels


def main() -> None:
    import triton.testing
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--points", default=DEFAULT_POINTS)
    ap.add_argument("--cprofile", action="store_true",
                    help="only a cProfile of 50 steps at the first point (host time by function)")
    args = ap.parse_args()
    if args.cprofile:
        import cProfile
        import pstats
        step = step_fn(*parse_points(args.points)[0])
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            step()
        prof.disable()
        torch.cuda.synchronize()
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(45)
        return
    rows = []
    for point in parse_points(args.points):
        b, s, h, hk, d, causal = point
        flops = 3.5 * 4 * b * h * s * s * d / (2 if causal else 1)
        for fused in (True, False):
            bwd.GLUON_FUSED_DQ = fused
            step = step_fn(*point)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
            host = []
            for _ in range(30):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                step()
                host.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
            kernels = profile_kernels(step)
            row = {"point": point, "fused_dq": fused, "step_ms": ms, "tflops": flops / ms / 1e9,
                   "host_ms": statistics.median(host), "kernel_ms": sum(t for _, t in kernels),
                   "kernels": kernels}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
            for name, t in kernels:
                print(f"    {t * 1e3:8.1f} us  {name}")
    bwd.GLUON_FUSED_DQ = True
    with open(os.path.join(args.out, "train-profile.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print("\npoint (B,S,H,Hk,D,causal) | fused_dq | step ms | TFLOP/s | host ms | kernels ms")
    for r in rows:
        print(f"{str(r['point']):32} | {str(r['fused_dq']):5} | {r['step_ms']:7.3f} | {r['tflops']:6.0f} | "
              f"{r['host_ms']:7.3f} | {r['kernel_ms']:7.3f}")


if __name__ == "__main__":
    main()
