"""Where the packed e4m3 call's time over flash_attn_func's e4m3 call goes: the V^T pack.

    PYTHONPATH=src python benchmarks/pack_probe.py --out $OUT

Same run, CUDA-graph replays (do_bench medians), 32/8 heads, equal lengths: the packed e4m3 call
(flash_attn_varlen_func) and flash_attn_func's e4m3 call on the same batch, both calls in bf16 on
the same values for scale, and alone the V copies
each makes: the pack of 2026-12-02 (a zero fill, then 64-key programs: kept below to time it),
the shipped one (no fill, 128-key programs that also zero the gaps), flash_attn_func's
keys_contiguous copy (the same Triton pass) and the torch copy it replaced. Every pack's output
is compared with the shipped one's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

import flashtile
from flashtile.kernels import forward

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fuzz_gpu  # noqa: E402
from varlen_gluon import graph_time  # noqa: E402

DEV = "cuda"


@triton.jit
def _pack_before(X, Out, CuSeqlens, stride_xt, stride_xh, stride_oh, stride_od,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr):
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    start = tl.load(CuSeqlens + seq)
    length = tl.load(CuSeqlens + seq + 1) - start
    column = (start + 15) // 16 * 16 + 16 * seq
    keys = chunk * BLOCK_K + tl.arange(0, BLOCK_K)
    dims = tl.arange(0, BLOCK_D)
    mask = (keys < length)[:, None] & (dims < HEAD_DIM)[None, :]
    x = tl.load(X + (start + keys).to(tl.int64)[:, None] * stride_xt + head * stride_xh + dims[None, :],
                mask=mask)
    tl.store(Out + head.to(tl.int64) * stride_oh + dims[:, None] * stride_od + (column + keys)[None, :],
             tl.trans(x), mask=tl.trans(mask))


def pack_before(x, cu, longest):
    """The pack as of 17972c6: torch.zeros, then one 64-key program per chunk of a sequence."""
    total, heads, d = x.shape
    batch = cu.shape[0] - 1
    width = -(-total // 16) * 16 + 16 * (batch + 1)
    out = torch.zeros(heads, d, width, dtype=x.dtype, device=x.device)
    raw, raw_out = x.view(torch.uint8), out.view(torch.uint8)
    _pack_before[(-(-longest // 64), heads, batch)](raw, raw_out, cu, raw.stride(0), raw.stride(1),
                                                   raw_out.stride(0), raw_out.stride(1), HEAD_DIM=d,
                                                   BLOCK_D=triton.next_power_of_2(d), BLOCK_K=64)
    return out.permute(2, 0, 1).unsqueeze(0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    heads, heads_k = 32, 8
    rows = []
    for d, causal, b, n in ((128, True, 4, 4096), (128, True, 8, 2048), (128, False, 4, 4096),
                            (256, True, 8, 2048)):
        lens = [n] * b
        cu = torch.tensor([0] + lens, device=DEV).cumsum(0).to(torch.int32)
        xs = [torch.randn(1, b * n, h, d, device=DEV) for h in (heads, heads_k, heads_k)]
        qkv = [fuzz_gpu._e4m3_per_head(x, heads_k) for x in xs]
        p8 = [t[0][0] for t in qkv]
        ds = [t[1].expand(b, heads_k).contiguous() for t in qkv]
        p8b = [t.view(b, n, -1, d) for t in p8]
        kw = dict(causal=causal, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])
        same = (torch.equal(pack_before(p8[2], cu, n).view(torch.uint8),
                            forward.packed_keys_transposed(p8[2], cu, n).view(torch.uint8))
                and torch.equal(forward.keys_contiguous(p8b[2]).view(torch.uint8), p8b[2].view(torch.uint8)))
        bf = [x[0].bfloat16() for x in xs]
        bfb = [t.view(b, n, -1, d) for t in bf]
        calls = {"bf16 varlen call": lambda: flashtile.flash_attn_varlen_func(*bf, cu, cu, n, n, causal=causal),
                 "bf16 flash_attn_func": lambda: flashtile.flash_attn_func(*bfb, causal=causal),
                 "e4m3 varlen call": lambda: flashtile.flash_attn_varlen_func(*p8, cu, cu, n, n, **kw),
                 "e4m3 flash_attn_func": lambda: flashtile.flash_attn_func(*p8b, **kw),
                 "pack (shipped)": lambda: forward.packed_keys_transposed(p8[2], cu, n),
                 "pack before (zero fill + 64-key programs)": lambda: pack_before(p8[2], cu, n),
                 "keys_contiguous (flash_attn_func's copy)": lambda: forward.keys_contiguous(p8b[2]),
                 "torch copy (keys_contiguous before)": lambda: forward.empty_keys_contiguous(
                     p8b[2].shape, p8b[2].dtype, p8b[2].device).copy_(p8b[2])}
        times = {label: graph_time(fn) * 1000 for label, fn in calls.items()}
        nbytes = 2 * p8[2].numel()
        for label, us in times.items():
            rows.append(dict(head_dim=d, causal=causal, batch=b, seqlen=n, provider=label, us=us,
                             copy_gb_s=nbytes / us / 1e3 if "pack" in label or "keys" in label else None,
                             same_as_shipped=same))
        print(f"d{d} {'causal' if causal else 'full'} {b} x {n}: pack and copy outputs equal: {same}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "pack-probe.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), heads=heads, heads_k=heads_k, rows=rows), f, indent=1)
    print(f"{'point':24} {'provider':44} {'us':>9} {'GB/s':>7}")
    for r in rows:
        gbs = f"{r['copy_gb_s']:.0f}" if r["copy_gb_s"] else "-"
        print(f"d{r['head_dim']} {'causal' if r['causal'] else 'full':6} {r['batch']} x {r['seqlen']:<8} "
              f"{r['provider']:44} {r['us']:9.1f} {gbs:>7}")
    return 0 if all(r["same_as_shipped"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
