"""The FP8 calls under torch.compile on the GPU: flash_attn_func / flash_attn_varlen_func on e4m3
inputs (FlashAttention-3's descales), flashtile.fp8.quantize_qkv + fp8.attention and
flash_attn_with_kvcache on e4m3 caches (and flash_attn_combine, the other op new to torch.compile),
each compiled with fullgraph=True against the same call eager, bit for bit (output and LSE; the
caches and descales an append writes), at shapes that take the Gluon e4m3 kernels (d128, d256),
the portable one (d64) and the decode kernels. Then one function under mode="reduce-overhead"
(CUDA graphs through Inductor) replayed on new inputs, and do_bench of the compiled and eager calls.

    PYTHONPATH=src python benchmarks/fp8_compile.py [--out DIR]

Writes fp8-compile.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton.testing

import flashtile
from flashtile import fp8

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fuzz_gpu  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
fuzz_gpu.DEV = DEV  # its page pools on this device (the CPU for --smoke)
E4M3 = torch.float8_e4m3fn


def same(a, b) -> bool:
    a, b = (x if isinstance(x, (tuple, list)) else (x,) for x in (a, b))
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape
        and torch.equal(x.view(torch.uint8) if x.dtype == E4M3 else x, y.view(torch.uint8) if y.dtype == E4M3 else y)
        for x, y in zip(a, b))


def fa3_case(b, s, h, hk, d, causal):
    q, k, v = (torch.randn(b, s, n, d, device=DEV).to(E4M3) for n in (h, hk, hk))
    ds = [torch.rand(b, hk, device=DEV) + 0.5 for _ in range(3)]

    def fn(q, k, v, qd, kd, vd):
        return flashtile.flash_attn_func(q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                                         return_attn_probs=True)[:2]
    return fn, (q, k, v, *ds)


def quantized_case(b, s, h, hk, d, causal):
    q = torch.randn(b, s, h, d, device=DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(b, s, hk, d, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    blocks = fp8.kernel_blocks(d, DEV)

    def fn(q, k, v):
        z = fp8.quantize_qkv(q, k, v, block=blocks, hadamard=True, seed=11)
        return fp8.attention(z, causal=causal, return_lse=True)
    return fn, (q, k, v)


def varlen_case(lens, h, hk, d, page_size):
    cu = torch.tensor([0] + lens, device=DEV).cumsum(0).to(torch.int32)
    total = sum(lens)
    q = torch.randn(total, h, d, device=DEV).to(E4M3)
    k, v = (torch.randn(total, hk, d, device=DEV) for _ in range(2))
    table = None
    if page_size:  # shuffled pages, NaN in every unused slot
        k, v, table = fuzz_gpu._varlen_pools(k, v, lens, page_size, nan_fill=True)
    k, v = k.to(E4M3), v.to(E4M3)
    ds = [torch.rand(len(lens), hk, device=DEV) + 0.5 for _ in range(3)]
    top = max(lens)

    def fn(q, k, v, qd, kd, vd):
        return flashtile.flash_attn_varlen_func(q, k, v, cu, cu, top, top, causal=True, block_table=table,
                                                q_descale=qd, k_descale=kd, v_descale=vd,
                                                return_attn_probs=True)[:2]
    return fn, (q, k, v, *ds)


def kvcache_case(b, slots, h, hk, d, length):
    caches = [torch.randn(b, slots, hk, d, device=DEV).to(E4M3) for _ in range(2)]
    descales = [torch.rand(b, slots, hk, device=DEV) + 0.5 for _ in range(2)]
    q = torch.randn(b, 1, h, d, device=DEV, dtype=torch.bfloat16)
    new = [torch.randn(b, 1, hk, d, device=DEV, dtype=torch.bfloat16) for _ in range(2)]
    lengths = torch.full((b,), length, dtype=torch.int32, device=DEV)

    def fn(q, kc, vc, kd, vd):
        out = flashtile.flash_attn_with_kvcache(q, kc, vc, k=new[0], v=new[1], cache_seqlens=lengths,
                                                k_descale=kd, v_descale=vd, causal=True)
        return out, kc, vc, kd, vd
    return fn, (q, *caches, *descales)


def combine_case(splits, b, s, h, d):
    parts = torch.randn(splits, b, s, h, d, device=DEV, dtype=torch.bfloat16)
    lse = torch.randn(splits, b, h, s, device=DEV) * 3
    lse[0, 0] = float("-inf")

    def fn(parts, lse):
        return flashtile.flash_attn_combine(parts, lse, out_dtype=torch.bfloat16)
    return fn, (parts, lse)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU run through the interpreter)")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.smoke:
        return run({"fa3": fa3_case(1, 70, 4, 2, 64, True), "quantized": quantized_case(1, 70, 4, 2, 64, True),
                    "varlen paged": varlen_case([20, 1, 33], 4, 2, 32, 8),
                    "kvcache": kvcache_case(2, 64, 4, 2, 32, 30), "combine": combine_case(3, 2, 5, 4, 32)},
                   "", timing=False)
    cases = {
        "flash_attn_func e4m3 d128 causal B2 4k 16/16": fa3_case(2, 4096, 16, 16, 128, True),
        "flash_attn_func e4m3 d128 full B1 3000 12/2": fa3_case(1, 3000, 12, 2, 128, False),
        "flash_attn_func e4m3 d256 causal B1 2k 8/8": fa3_case(1, 2048, 8, 8, 256, True),
        "flash_attn_func e4m3 d64 causal B2 1k 8/2": fa3_case(2, 1024, 8, 2, 64, True),
        "quantize_qkv + fp8.attention d128 causal B1 4k 12/2": quantized_case(1, 4096, 12, 2, 128, True),
        "quantize_qkv + fp8.attention d128 full B2 1000 16/16": quantized_case(2, 1000, 16, 16, 128, False),
        "flash_attn_varlen_func e4m3 d128 packed": varlen_case([700, 1, 2048, 33], 16, 4, 128, 0),
        "flash_attn_varlen_func e4m3 d128 pages of 16": varlen_case([700, 1, 2048, 33], 16, 4, 128, 16),
        "flash_attn_with_kvcache e4m3 cache + append B4 32/8 8k": kvcache_case(4, 8192, 32, 8, 128, 5000),
        "flash_attn_combine (bf16, not FP8) 4 splits B2 Sq 16 32 heads": combine_case(4, 2, 16, 32, 128),
    }
    return run(cases, args.out)


def run(cases: dict, out_dir: str, timing: bool = True) -> int:
    rows, ok = [], True
    for name, (fn, inputs) in cases.items():
        torch._dynamo.reset()
        eager_in = [x.clone() for x in inputs]
        compiled_in = [x.clone() for x in inputs]
        eager = fn(*eager_in)
        compiled = torch.compile(fn, fullgraph=True)(*compiled_in)
        if DEV.type == "cuda":
            torch.cuda.synchronize()
        good = same(eager, compiled) and same(eager_in, compiled_in)
        ok &= good
        rows.append({"case": name, "bitwise_same": good})
        print(f"{'PASS' if good else 'FAIL'} {name}", flush=True)
    timings = {}
    if timing:
        ok &= graphs_and_timings(rows, timings)
    if out_dir:
        with open(os.path.join(out_dir, "fp8-compile.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
                       "do_bench_us": timings, "all_same": ok}, f, indent=1)
    print("PASS" if ok else "FAIL", "fp8 calls compiled against eager")
    return 0 if ok else 1


def graphs_and_timings(rows: list, timings: dict) -> bool:
    """mode="reduce-overhead" (CUDA graphs through Inductor): captured once, replayed on new inputs;
    then do_bench of the eager, compiled and graphed calls."""
    torch._dynamo.reset()
    fn, inputs = fa3_case(2, 4096, 16, 16, 128, True)
    graphed = torch.compile(fn, fullgraph=True, mode="reduce-overhead")
    good = True
    for step in range(4):
        fresh = [torch.randn(x.shape, device=DEV).to(E4M3) if x.dtype == E4M3 else torch.rand_like(x) + 0.5
                 for x in inputs]
        got = [t.clone() for t in graphed(*fresh)]
        good &= same(fn(*fresh), got)
    rows.append({"case": "reduce-overhead (CUDA graphs) FA3 d128 causal B2 4k, 4 steps on new inputs",
                 "bitwise_same": good})
    print(f"{'PASS' if good else 'FAIL'} reduce-overhead replays on new inputs", flush=True)
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    for name, callable_ in (("eager", lambda: fn(*inputs)), ("compiled", lambda: compiled(*inputs)),
                            ("reduce-overhead", lambda: graphed(*inputs))):
        callable_()
        timings[name] = round(1e3 * triton.testing.do_bench(callable_, return_mode="median"), 1)
    print("do_bench us (FA3 d128 causal B2 4k 16/16):", timings, flush=True)
    return good


if __name__ == "__main__":
    raise SystemExit(main())
