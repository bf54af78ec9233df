"""The all-e4m3 decode (FlashAttention-3's call: e4m3 q with q_descale, e4m3 page pools) past 32
query rows a KV head, against float64 on the dequantized inputs: the varlen decode route, the same
call with the route off (prefill kernels), and flash_attn_with_kvcache on each sequence alone.

    PYTHONPATH=src python benchmarks/e4m3_rows_probe.py

Prints each sequence's output error over the budget (2x textbook bf16's) and its LSE error.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flashtile  # noqa: E402
from flashtile import interface  # noqa: E402
from flashtile.reference import attention as textbook  # noqa: E402
from varlen_decode import case_tensors  # noqa: E402

CASES = [  # (heads, heads_k, lens_q, lens_k)
    (32, 8, [64, 20, 0], [1500, 20, 9]), (32, 8, [64], [1500]), (32, 8, [20, 64], [20, 1500]),
    (32, 8, [33], [1500]), (32, 8, [48, 7], [900, 300]), (16, 2, [24, 9], [1500, 400]), (32, 8, [17, 3], [600, 40]),
]


def errors(out, lse, plain, cu_q, cu_k, b, kw):
    sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
    q, k, v = (t[s].unsqueeze(0) for t, s in zip(plain, (sq, sk, sk)))
    ref, ref_lse = textbook(q.double(), k.double(), v.double(), **kw)
    low, _ = textbook(*(t.to(torch.bfloat16) for t in (q, k, v)), **kw)
    budget = 2 * (low.double() - ref).abs().max().item() + 1e-6
    err = (out[sq].double() - ref[0]).abs().max().item()
    lse_err = (lse[:, sq].double() - ref_lse[0]).abs()
    worst_row = int(lse_err.max(0).values.argmax()) if lse_err.numel() else -1
    return f"out {err / budget:6.3f} of budget, LSE err {lse_err.max().item():.3g} (worst query {worst_row})"


def main() -> int:
    torch.manual_seed(0)
    kw = dict(causal=True)
    for heads, heads_k, lens_q, lens_k in CASES:
        cu_q, cu_k, q, k_pool, v_pool, table, descales, plain = case_tensors(lens_q, lens_k, heads, heads_k, 128,
                                                                            16, True)
        print(f"== {heads}/{heads_k} q{lens_q} k{lens_k}", flush=True)
        shipped = (interface.VARLEN_DECODE_MAX_QUERIES, interface.VARLEN_DECODE_WIDE_QUERIES)
        for name, limits in (("route", shipped), ("prefill kernels", (0, 0))):
            interface.VARLEN_DECODE_MAX_QUERIES, interface.VARLEN_DECODE_WIDE_QUERIES = limits
            try:
                out, lse, _ = flashtile.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, max(lens_q), max(lens_k),
                                                               block_table=table, return_attn_probs=True, **descales,
                                                               **kw)
            finally:
                interface.VARLEN_DECODE_MAX_QUERIES, interface.VARLEN_DECODE_WIDE_QUERIES = shipped
            for b, n in enumerate(lens_q):
                if n:
                    print(f"  {name:16s} seq {b} ({n} q): {errors(out, lse, plain, cu_q, cu_k, b, kw)}", flush=True)
        for b, n in enumerate(lens_q):  # each sequence alone through flash_attn_with_kvcache
            if not n:
                continue
            rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
            out, lse = flashtile.flash_attn_with_kvcache(
                q[rows].unsqueeze(0), k_pool, v_pool, cache_seqlens=torch.tensor([lens_k[b]], dtype=torch.int32,
                                                                                 device="cuda"),
                block_table=table[b:b + 1], q_descale=descales["q_descale"][b:b + 1],
                k_descale=descales["k_descale"][b:b + 1], v_descale=descales["v_descale"][b:b + 1],
                return_softmax_lse=True, **kw)
            one = torch.zeros_like(cu_q[:2])
            one[1] = n
            onek = torch.zeros_like(cu_k[:2])
            onek[1] = lens_k[b]
            keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
            plain_b = (plain[0][rows], plain[1][keys], plain[2][keys])
            print(f"  {'kvcache alone':16s} seq {b} ({n} q): {errors(out[0], lse[0], plain_b, one, onek, 0, kw)}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
