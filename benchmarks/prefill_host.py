"""Host time of a short prefill call on the GPU machine: where `bench prefill`'s small shapes (the
Qwen2.5-1.5B rows, 12/2 heads, 1k-4k tokens) go when the GPU finishes before the next call is
enqueued.

    PYTHONPATH=src python benchmarks/prefill_host.py [--out DIR]

For each shape: host microseconds per call (enqueueing 200 calls without waiting, least of 5
rounds), GPU microseconds per call (20 calls in a CUDA graph) and do_bench's median, for
flash_attn_func, the kernel entry point under it (attention_forward) and SDPA cuDNN; then a cProfile
of flash_attn_func at the smallest shape.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_host import gpu_us, host_us  # noqa: E402

import flashtile  # noqa: E402
from flashtile.kernels.forward import attention_forward  # noqa: E402

SHAPES = [(1, 1024, 12, 2, True), (1, 2048, 12, 2, True), (1, 4096, 12, 2, True),
          (32, 512, 16, 16, True)]


def main() -> int:
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for b, s, h, hk, causal in SHAPES:
        q = torch.randn(b, s, h, 128, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, s, hk, 128, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        kt, vt = (x.repeat_interleave(h // hk, dim=1) for x in (kt, vt))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        calls = {"flash_attn_func": lambda: flashtile.flash_attn_func(q, k, v, causal=causal),
                 "attention_forward": lambda: attention_forward(
                     q, k, v, softmax_scale=128 ** -0.5, window_left=-1,
                     window_right=0 if causal else -1, diag_offset=0),
                 "sdpa-cudnn": cudnn}
        for name, fn in calls.items():
            with torch.no_grad():
                rec = {"batch": b, "seqlen": s, "heads": h, "heads_k": hk, "causal": causal,
                       "call": name, "host_us": round(host_us(fn), 1), "gpu_us": round(gpu_us(fn), 1),
                       "do_bench_us": round(1e3 * triton.testing.do_bench(fn, return_mode="median"), 1)}
            rows.append(rec)
            print(f"B{b:<3d} S{s:<5d} {h}/{hk} {name:18s} host {rec['host_us']:7.1f} us  gpu "
                  f"{rec['gpu_us']:7.1f} us  do_bench {rec['do_bench_us']:7.1f} us", flush=True)
    if args.out:
        with open(os.path.join(args.out, "prefill-host.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows,
                       "method": "host: 200 enqueued calls, least of 5 rounds; gpu: 20 calls in a "
                                 "CUDA graph; do_bench: triton.testing.do_bench median"}, f, indent=1)

    # Pieces of one attention_forward call at the first shape, host us each (least of 5 rounds).
    from flashtile.kernels import gluon_forward as gf
    from flashtile.kernels import launch as launch_mod
    b, s, h, hk, causal = SHAPES[0]
    q = torch.randn(b, s, h, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(b, s, hk, 128, device=dev, dtype=torch.bfloat16)
    out, lse = gf.gluon_attention_forward(q, k, k, softmax_scale=0.088, causal=causal)
    captured = {}
    real_launch = gf.launch

    def capture(*a, **kw):
        captured["args"], captured["kw"] = a, kw
        return real_launch(*a, **kw)
    gf.launch = capture
    gf.gluon_attention_forward(q, k, k, softmax_scale=0.088, causal=causal, out=out, lse=lse)
    gf.launch = real_launch
    jit, grid, tensors, scalars, options, descriptors = captured["args"]
    launch_mod.launch(jit, grid, tensors, scalars, options, descriptors)
    key = (jit, id(options), torch.cuda.current_device(), grid, scalars,
           *[d.base.dtype for d in descriptors],
           *[(t.dtype, t.data_ptr() % 16 == 0) for t in tensors])
    kernel, tail = launch_mod._KERNELS[key][:2]
    ptrs = [t.data_ptr() for t in tensors]
    stream = torch.cuda.current_stream().cuda_stream
    g = grid + (1,) * (3 - len(grid))
    pieces = {
        "gluon_forward.supported": lambda: gf.supported(q, k, k, causal=causal, softmax_scale=0.088),
        "torch.empty out + lse": lambda: (torch.empty_like(q), torch.empty(b, h, s, device=dev)),
        "gluon_attention_forward (out, lse given)": lambda: gf.gluon_attention_forward(
            q, k, k, softmax_scale=0.088, causal=causal, out=out, lse=lse),
        "launch.launch (prepared arguments)": lambda: launch_mod.launch(
            jit, grid, tensors, scalars, options, descriptors),
        "kernel.run (Triton's launcher: encodes the descriptors)": lambda: kernel.run(
            g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, None, None, None,
            *descriptors, *ptrs, *scalars, *tail),
    }
    parts = {}
    for name, fn in pieces.items():
        if fn is not None:
            parts[name] = round(host_us(fn), 1)
            print(f"  {name:60s} {parts[name]:7.1f} us", flush=True)
    if args.out:
        with open(os.path.join(args.out, "prefill-host.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows, "pieces": parts,
                       "method": "host: 200 enqueued calls, least of 5 rounds; gpu: 20 calls in a "
                                 "CUDA graph; do_bench: triton.testing.do_bench median"}, f, indent=1)

    import cProfile
    import pstats
    q = torch.randn(b, s, h, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(b, s, hk, 128, device=dev, dtype=torch.bfloat16)
    profile = cProfile.Profile()
    with torch.no_grad():
        for _ in range(20):
            flashtile.flash_attn_func(q, k, k, causal=causal)
        profile.enable()
        for _ in range(500):
            flashtile.flash_attn_func(q, k, k, causal=causal)
        profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
