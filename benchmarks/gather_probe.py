"""Times the e4m3 packed copies on an H200 (8 KV heads, d128, equal lengths; CUDA-graph replays,
do_bench medians; GB/s of the tensors read and written): the contiguous V^T pack
(packed_keys_transposed: its first pass, then _zero_after_last), its first pass alone with the
grid it ships with and with the grid widened to 304 keys past the longest sequence (every column
written the same), rows gathered from a page pool, and paged_keys_packed (K rows, V rows, V^T).
With HEAD_SOURCE (the forward.py of commit 342b131) also that commit's pack, and whether the
shipped one is bit for bit the same. Runs -a/-b of 2026-12-02 also timed a single pass from the
pool straight into V^T (since removed): ~105 us against ~24 us in two; -c timed the pack with its
grid widened and spans clamped at ~110 us against ~15 us.

    git show 342b131:src/flashtile/kernels/forward.py > /tmp/head_forward.py
    HEAD_SOURCE=/tmp/head_forward.py PYTHONPATH=src python benchmarks/gather_probe.py --out $OUT
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fuzz_gpu  # noqa: E402
from varlen_gluon import graph_time, offsets  # noqa: E402

from flashtile.kernels import forward  # noqa: E402


def head_forward():
    """forward.py of an earlier commit (HEAD_SOURCE) as a module, or None."""
    path = os.environ.get("HEAD_SOURCE")
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("flashtile.kernels.head_forward_probe", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    old = head_forward()
    rows = []
    for lens in ([4096] * 4, [2048] * 8):
        total, mx, batch = sum(lens), max(lens), len(lens)
        cu = offsets(lens)
        k = torch.randn(total, 8, 128, device="cuda").to(torch.float8_e4m3fn)
        v = torch.randn(total, 8, 128, device="cuda").to(torch.float8_e4m3fn)
        raw, width = v.view(torch.uint8), -(-total // 16) * 16 + 16 * (batch + 1)

        def first_pass(extra):
            out = torch.empty(8, 128, width, dtype=torch.uint8, device="cuda")
            forward._launch_copy_keys((-(-(mx + extra) // 128), 8, batch), raw, out, cu, None, raw.stride(),
                                      (0, 1, out.stride(0), out.stride(1)), total, batch, width, 128, packed=True)
            return out
        nbytes = 2 * k.numel()  # one tensor read and written
        calls = {("contiguous V^T pack", 1): lambda: forward.packed_keys_transposed(v, cu, mx),
                 ("its first pass, grid longest + 48", 1): lambda: first_pass(48),
                 ("its first pass, grid longest + 304", 1): lambda: first_pass(304)}
        if old is not None:
            calls[("342b131's pack", 1)] = lambda: old.packed_keys_transposed(v, cu, mx)
            same = torch.equal(forward.packed_keys_transposed(v, cu, mx).view(torch.uint8),
                               old.packed_keys_transposed(v, cu, mx).view(torch.uint8))
            print(f"{batch} x {mx}: the pack bit for bit 342b131's: {same}", flush=True)
        for page in (16, 256):
            kp, vp, table = fuzz_gpu._varlen_pools(k, v, lens, page)
            calls[(f"P{page} rows (one tensor)", 1)] = (
                lambda vp=vp, table=table: forward._paged_rows(vp, table, cu, mx))
            calls[(f"P{page} paged_keys_packed (K rows, V rows, V^T)", 3)] = (
                lambda kp=kp, vp=vp, table=table: forward.paged_keys_packed(kp, vp, table, cu, mx))
        for (label, tensors), fn in calls.items():
            ms = graph_time(fn)
            rows.append(dict(point=f"{batch} x {mx}", copy=label, us=ms * 1e3, gbs=tensors * nbytes / ms / 1e6))
            print(f"{batch} x {mx} {label:48} {ms * 1e3:8.1f} us {tensors * nbytes / ms / 1e6:8.0f} GB/s", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gather-probe.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
