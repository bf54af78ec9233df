"""Direct launches by specialization class (kernels/launch.py) on a GPU: calls whose lengths and
strides change every time (a KV cache that grows each step, prefills of varying length) must give
bitwise the output of Triton's JIT path, and launch directly after the first call of each class.

    PYTHONPATH=src python benchmarks/launch_check.py --out $OUT

Writes $OUT/launch-check.json; prints one line per workload.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from flashtile.kernels import launch
from flashtile.kernels.decode import decode_attention
from flashtile.kernels.forward import attention_forward


def _decode_calls(n_calls: int):
    """A cache that grows by one slot per step (new tensors, new strides), as transformers' does."""
    torch.manual_seed(0)
    b, h, hk, d = 2, 12, 2, 128
    calls = []
    for step in range(n_calls):
        cap = 3000 + step
        q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, cap, hk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, cap, hk, d, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((b,), cap, device="cuda", dtype=torch.int32)
        calls.append(lambda q=q, k=k, v=v, lens=lens: decode_attention(
            q, k, v, lens, softmax_scale=d ** -0.5, window_left=-1, window_right=0, num_splits=4)[0])
    return calls


def _prefill_calls(n_calls: int):
    torch.manual_seed(1)
    calls = []
    for step in range(n_calls):
        n = 1000 + 7 * step
        q, k, v = (torch.randn(1, n, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        calls.append(lambda q=q, k=k, v=v: attention_forward(
            q, k, v, softmax_scale=128 ** -0.5, window_left=-1, window_right=0, diag_offset=0)[0])
    return calls


def _run(name, calls):
    launch.ENABLED = False
    ref = [fn().clone() for fn in calls]
    torch.cuda.synchronize()
    launch.ENABLED = True
    launch._KERNELS.clear()
    launch._BY_CLASS.clear()
    got = [fn().clone() for fn in calls]
    torch.cuda.synchronize()
    jit_calls = len(launch._BY_CLASS)  # each class entry came from one JIT launch (of any kernel)
    equal = sum(bool(torch.equal(a, b)) for a, b in zip(ref, got))
    # host time per call over the same changing calls, each path warm
    times = {}
    for enabled in (False, True):
        launch.ENABLED = enabled
        for fn in calls:
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for fn in calls:
            fn()
        times["direct" if enabled else "jit"] = (time.perf_counter() - t0) / len(calls) * 1e6
        torch.cuda.synchronize()
    rec = {"workload": name, "calls": len(calls), "bitwise_equal": equal, "jit_launches_direct_mode": jit_calls,
           "host_us_per_call": times}
    print(f"{name}: {equal}/{len(calls)} bitwise equal to the JIT path; {jit_calls} JIT launches for "
          f"{len(calls)} calls with direct launches on (decode: 2 kernels a call); host us/call "
          f"(incl. Python) jit {times['jit']:.0f} direct {times['direct']:.0f}", flush=True)
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    records = [_run("decode, cache growing by one slot per call", _decode_calls(32)),
               _run("prefill (Gluon forward), 32 lengths 1000-1217", _prefill_calls(32))]
    with open(os.path.join(args.out, "launch-check.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M"),
                   "records": records}, f, indent=1)
    ok = all(r["bitwise_equal"] == r["calls"] for r in records)
    print("launch check:", "ok" if ok else "MISMATCH")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
