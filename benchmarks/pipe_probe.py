"""Which pipe runs the e4m3 conversion of P? Per-iteration time of inline-PTX loops on the GPU:
exponentials alone (MUFU.EX2), fp32 -> e4m3x2 conversions alone (F2FP.SATFINITE.E4M3), both, and
fp32 -> bf16x2 conversions for comparison. If the e4m3 conversions shared MUFU's pipe (16 results a
clock per SM), "both" would take about the sum of the two alone; on separate pipes, the larger.

    PYTHONPATH=src python benchmarks/pipe_probe.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

EX2 = ["ex2.approx.ftz.f32 $0, $4;", "ex2.approx.ftz.f32 $1, $5;",
       "ex2.approx.ftz.f32 $2, $6;", "ex2.approx.ftz.f32 $3, $7;"]
E4M3 = [".reg .b16 h0, h1;", "cvt.rn.satfinite.e4m3x2.f32 h0, $5, $4;",
        "cvt.rn.satfinite.e4m3x2.f32 h1, $7, $6;", "mov.b32 $0, {h0, h1};", "mov.b32 $1, {h1, h0};",
        "mov.b32 $2, {h0, h0};", "mov.b32 $3, {h1, h1};"]
BF16 = ["cvt.rn.bf16x2.f32 $0, $5, $4;", "cvt.rn.bf16x2.f32 $1, $7, $6;",
        "cvt.rn.bf16x2.f32 $2, $4, $5;", "cvt.rn.bf16x2.f32 $3, $6, $7;"]
# "both": the exponentials, then their e4m3 conversion, as the softmax does it
BOTH = [".reg .f32 e0, e1, e2, e3;", ".reg .b16 h0, h1;", "ex2.approx.ftz.f32 e0, $4;",
        "ex2.approx.ftz.f32 e1, $5;", "ex2.approx.ftz.f32 e2, $6;", "ex2.approx.ftz.f32 e3, $7;",
        "cvt.rn.satfinite.e4m3x2.f32 h0, e1, e0;", "cvt.rn.satfinite.e4m3x2.f32 h1, e3, e2;",
        "mov.b32 $0, {h0, h1};", "mov.b32 $1, {h1, h0};", "mov.b32 $2, e2;", "mov.b32 $3, e3;"]
F16 = [".reg .b32 t0, t1;", "cvt.rn.f16x2.f32 t0, $5, $4;", "cvt.rn.f16x2.f32 t1, $7, $6;",
       ".reg .b16 h0, h1;", "cvt.rn.satfinite.e4m3x2.f16x2 h0, t0;", "cvt.rn.satfinite.e4m3x2.f16x2 h1, t1;",
       "mov.b32 $0, {h0, h1};", "mov.b32 $1, {h1, h0};", "mov.b32 $2, t0;", "mov.b32 $3, t1;"]
NONE = ["mov.b32 $0, $4;", "mov.b32 $1, $5;", "mov.b32 $2, $6;", "mov.b32 $3, $7;"]
MODES = {"none": NONE, "ex2": EX2, "e4m3": E4M3, "ex2+e4m3": BOTH, "bf16": BF16, "f16->e4m3": F16}


@triton.jit
def _probe(X, Out, iters, ASM: tl.constexpr, REPEAT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs)
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(iters):
        y = x + i.to(tl.float32) * 1e-7
        for _ in tl.static_range(REPEAT):
            y = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r,r,r,r", [y.to(tl.int32, bitcast=True)],
                                          dtype=tl.int32, is_pure=True, pack=4).to(tl.float32,
                                                                                   bitcast=True)
            y = y * 0.5 - 1.0
        acc ^= y.to(tl.int32, bitcast=True)
    tl.store(Out + offs, acc)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--iters", type=int, default=4096)
    args = parser.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    block, warps, repeat = 1024, 8, 8
    programs = sms * 4
    x = torch.rand(programs * block, device=dev) * -4.0
    out = torch.empty(programs * block, dtype=torch.int32, device=dev)
    rows = []
    for name, lines in MODES.items():
        asm = "{\n" + "\n".join(lines) + "\n}"
        fn = lambda: _probe[(programs,)](x, out, args.iters, ASM=asm, REPEAT=repeat, BLOCK=block,  # noqa: E731
                                          num_warps=warps)
        fn()
        ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
        elems = programs * block * args.iters * repeat
        clock_ghz = torch.cuda.clock_rate(dev) / 1e3 if hasattr(torch.cuda, "clock_rate") else None
        per_sm_clk = elems / (ms * 1e-3) / sms / 1e9  # elements per ns per SM
        rows.append({"mode": name, "ms": ms, "elements_per_ns_per_sm": per_sm_clk, "sm_clock_ghz": clock_ghz})
        print(f"{name:10s} {ms:8.3f} ms  {per_sm_clk:7.2f} elements/ns/SM", flush=True)
    with open(os.path.join(args.out, "pipe-probe.json"), "w") as f:
        json.dump({"sms": sms, "block": block, "warps": warps, "programs": programs, "repeat": repeat,
                   "iters": args.iters, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
