"""Sweep the e4m3 forward's tile configs on the GPU against flashtile bf16 and SDPA cudnn, in one run.

    PYTHONPATH=src python benchmarks/tune_fp8.py --out $OUT [--dims 128] [--seqlens 8192]

Inputs are quantized once per shape (block scales of 256 queries / 128 keys: a multiple of every
candidate tile, Hadamard rotation) outside the timed call. Each candidate's output is checked on
sampled rows against float64 attention of the dequantized inputs; the error is printed next to the
speed (an e4m3 P costs accuracy by design; a broken config shows up as a jump). Writes tune-fp8.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time

import torch

HIDDEN = 2048
TOKENS = 16384
SCALE_BLOCKS = (256, 128)

CANDIDATES = {
    64: [(128, 64, 4, 2), (128, 128, 4, 3), (128, 128, 8, 3), (128, 64, 4, 3), (256, 128, 8, 2)],
    # sweep a (tune-fp8-h200-20261129-a.json) also had (128, 64, 4, 2), (128, 128, 4, 2),
    # (128, 128, 8, 2), (128, 128, 8, 3), (256, 128, 8, 2); 64x128 with 3 stages won
    # sweep b (...-b.json) also had (64, 128, 4, 4), (64, 64, 4, 4), (128, 128, 8, 4), (128, 64, 4, 3)
    128: [(64, 128, 4, 3), (64, 128, 8, 3), (64, 128, 8, 2), (64, 128, 4, 2), (128, 128, 8, 3)],
    256: [(128, 64, 8, 2), (128, 128, 8, 2), (64, 128, 4, 2), (128, 64, 4, 2)],
}


def _shape(d: int, n: int):
    return TOKENS // n, n, HIDDEN // d, d  # batch, seqlen, heads, head_dim


def _quantized(d, n, seed=0):
    from flashtile.fp8 import quantize_qkv
    b, s, h, _ = _shape(d, n)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    return (q, k, v), quantize_qkv(q, k, v, block=SCALE_BLOCKS)


def _run_fp8(x, causal, cfg):
    from flashtile.kernels.forward import TileConfig, attention_forward
    return attention_forward(x.q, x.k, x.v, softmax_scale=x.q.shape[-1] ** -0.5, window_left=-1,
                             window_right=0 if causal else -1, diag_offset=0,
                             descales=(x.q_descale, x.k_descale, x.v_descale),
                             scale_blocks=(x.block_q, x.block_k), config=TileConfig(*cfg, use_tma=True))[0]


def _warm(job):
    d, cfg = job
    try:
        _, x = _quantized(d, 512)
        for causal in (False, True):
            _run_fp8(x, causal, cfg)
        torch.cuda.synchronize()
        return job, None
    except Exception as exc:
        return job, f"{type(exc).__name__}: {exc}"[:300]


def _error(out, x, causal, rows=64):
    """max |out - float64 attention of the dequantized inputs| on sampled rows of batch 0."""
    from flashtile.fp8 import dequantize
    from flashtile.reference import attention
    q = dequantize(x.q[:1], x.q_descale[:1], x.block_q).double()
    k = dequantize(x.k[:1], x.k_descale[:1], x.block_k).double()
    v = dequantize(x.v[:1], x.v_descale[:1], x.block_k).double()
    gen = torch.Generator(device="cuda").manual_seed(1)
    idx = torch.randperm(q.shape[1], device=q.device, generator=gen)[:rows]
    ref, _ = attention(q, k, v, causal=causal, query_rows=idx)
    return (out[:1, idx].double() - ref).abs().max().item()


def main():
    import triton
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashtile.kernels.forward import attention_forward

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dims", default="128")
    ap.add_argument("--seqlens", default="8192")
    ap.add_argument("--workers", type=int, default=12)
    args = ap.parse_args()
    dims = [int(x) for x in args.dims.split(",")]
    seqlens = [int(x) for x in args.seqlens.split(",")]

    jobs = [(d, cfg) for d in dims for cfg in CANDIDATES[d]]
    t0 = time.time()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        warm_errors = dict(pool.map(_warm, jobs))
    print(f"compiled {len(jobs)} candidates in {time.time() - t0:.0f} s", flush=True)

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    rows = []
    for d in dims:
        for n in seqlens:
            b, s, h, _ = _shape(d, n)
            (q, k, v), x = _quantized(d, n)
            qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
            for causal in (False, True):
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                point = {"d": d, "n": n, "batch": b, "heads": h, "causal": causal, "configs": []}
                ms = bench(lambda: attention_forward(q, k, v, softmax_scale=d ** -0.5, window_left=-1,
                                                     window_right=0 if causal else -1, diag_offset=0))
                point["flashtile-bf16"] = flops / ms / 1e9

                def cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                point["sdpa-cudnn"] = flops / bench(cudnn) / 1e9
                for cfg in CANDIDATES[d]:
                    rec = {"cfg": list(cfg)}
                    if warm_errors.get((d, cfg)):
                        rec["error"] = warm_errors[(d, cfg)]
                    else:
                        try:
                            rec["max_err"] = _error(_run_fp8(x, causal, cfg), x, causal)
                            rec["tflops"] = flops / bench(lambda: _run_fp8(x, causal, cfg)) / 1e9
                            rec["vs_bf16"] = rec["tflops"] / point["flashtile-bf16"]
                        except Exception as exc:
                            rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
                    point["configs"].append(rec)
                rows.append(point)
                print(f"d{d} n{n} {'causal' if causal else 'full'}: bf16 {point['flashtile-bf16']:.0f}, "
                      f"cudnn {point['sdpa-cudnn']:.0f} TFLOP/s", flush=True)
                for rec in point["configs"]:
                    if "tflops" in rec:
                        print(f"   {str(rec['cfg']):<20s} {rec['tflops']:7.1f} TFLOP/s  {rec['vs_bf16']:.2f}x bf16"
                              f"  err {rec['max_err']:.2e}", flush=True)
                    else:
                        print(f"   {str(rec['cfg']):<20s} {rec.get('error')}", flush=True)

    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "scale_blocks": SCALE_BLOCKS, "hadamard": True, "points": rows}
    path = os.path.join(args.out, "tune-fp8.json")
    with open(path, "w") as f:
        json.dump(info, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
