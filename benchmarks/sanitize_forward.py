"""Small launches of every forward variant, for ``compute-sanitizer --tool memcheck`` on a GPU.

    compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/sanitize_forward.py

Shapes are ragged (lengths not multiples of any tile, Sq != Sk both ways, odd head dims) so every
masked edge and the pointer and tensor-descriptor paths are exercised; the output is also compared
with the float64 reference so a silent wrong answer fails too.
"""

from __future__ import annotations

import itertools
import sys

import torch

from flashtile.kernels.forward import TileConfig, attention_forward, pick_config
from flashtile.reference import attention


BF16, F16 = torch.bfloat16, torch.float16
# One launch per kernel variant that matters (each compiles once: the sanitizer makes compiling slow).
QUICK = [
    (128, BF16, dict(causal=True), (2, 33, 200), True),
    (128, BF16, dict(), (2, 200, 33), True),
    (64, F16, dict(window_size=(21, 13)), (1, 77, 77), True),
    (111, BF16, dict(causal=True), (2, 200, 33), False),
    (256, BF16, dict(causal=True, softcap=20.0), (2, 33, 200), True),
    (40, F16, dict(alibi=True), (2, 77, 130), True),
    (128, BF16, dict(causal=True, window_size=(37, 0)), (1, 150, 150), False),
    (80, BF16, dict(causal=True, window_size=(30, 0), softcap=10.0, alibi=True), (2, 90, 70), True),
]


def all_cases():
    features = [dict(), dict(causal=True), dict(causal=True, window_size=(37, 0)),
                dict(window_size=(21, 13)), dict(causal=True, softcap=20.0), dict(alibi=True)]
    shapes = [(1, 77, 77), (2, 33, 200), (2, 200, 33)]
    for head_dim, dtype, feat, shape, tma in itertools.product(
            (40, 64, 111, 128, 256), (BF16, F16), features, shapes, (True, False)):
        if dtype == F16 and shape != (1, 77, 77):
            continue  # fp16 differs from bf16 only in the element type; one shape is enough
        yield head_dim, dtype, feat, shape, tma


def main() -> int:
    dev = torch.device("cuda")
    failures = 0
    cases = 0
    for head_dim, dtype, feat, (batch, sq, sk), tma in (QUICK if "--quick" in sys.argv else all_cases()):
        cfg = pick_config(head_dim, dev)
        cfg = TileConfig(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, use_tma=tma and cfg.use_tma)
        heads, heads_k = 4, 2
        q = torch.randn(batch, sq, heads, head_dim, device=dev, dtype=dtype)
        k = torch.randn(batch, sk, heads_k, head_dim, device=dev, dtype=dtype)
        v = torch.randn(batch, sk, heads_k, head_dim, device=dev, dtype=dtype)
        slopes = torch.rand(batch, heads, device=dev) if feat.get("alibi") else None
        causal = feat.get("causal", False)
        left, right = feat.get("window_size", (-1, -1))
        out = torch.full_like(q, float("nan"))
        lse = torch.full((batch, heads, sq), float("nan"), device=dev)
        attention_forward(q, k, v, softmax_scale=head_dim ** -0.5, window_left=left,
                          window_right=0 if causal else right, diag_offset=sk - sq,
                          softcap=feat.get("softcap", 0.0), alibi_slopes=slopes, out=out, lse=lse,
                          config=cfg)
        kw = dict(causal=causal, window_size=(left, right), softcap=feat.get("softcap", 0.0),
                  alibi_slopes=slopes)
        ref, _ = attention(q.double(), k.double(), v.double(), **kw)
        low, _ = attention(q, k, v, **kw)
        err = (out.double() - ref).abs().max().item()
        budget = 2 * (low.double() - ref).abs().max().item()
        cases += 1
        if cases % 40 == 0:
            print(f"{cases} launches checked", flush=True)
        if not err <= budget:
            failures += 1
            print(f"FAIL d{head_dim} {dtype} {feat} {(batch, sq, sk)} tma={cfg.use_tma}: {err:.3g} > {budget:.3g}")
    torch.cuda.synchronize()
    print(f"sanitize_forward: {cases} launches, {failures} wrong results")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
