"""flash_attn_with_kvcache captured in a CUDA graph, then replayed with malformed values written into
its index tensors (capture skips the host's value checks, as torch.compile does): cache_batch_idx
rows outside the cache, block_table entries outside the pool. No kernel may read or write outside
its tensors. Run under compute-sanitizer memcheck:

    compute-sanitizer --tool memcheck python benchmarks/kvcache_bounds.py

Cases (decode steps, 32/8 heads, d128, per-key descales on e4m3 caches): bf16 and e4m3 caches read
through cache_batch_idx; bf16 and e4m3 page pools of 16 keys (on sm_90 the Gluon TMA decode, which
loads short splits' e4m3 descales through the table). The entries are written ~2^30 past their
tensor and negative, so that a stray access leaves the caching allocator's segments and memcheck
sees it. Each malformed replay is followed by a valid one, which must match a valid replay before
them bit for bit (and that one the eager call within 2e-2: eager calls may split differently).
Prints one line per replay.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fuzz_gpu as fz  # noqa: E402
from varlen_bounds import capture, replay_malformed  # noqa: E402

import flashtile  # noqa: E402
from flashtile import fp8  # noqa: E402

DEV = "cuda"
LAUNCHED = []  # the Gluon decode variants the calls launched


def _record_gluon_launches():
    from flashtile.kernels import gluon_decode
    launch = gluon_decode.gluon_decode

    def recorded(*args, **kwargs):
        LAUNCHED.append(kwargs["variant"].name)
        return launch(*args, **kwargs)
    gluon_decode.gluon_decode = recorded
B, H, HK, D, CAPACITY, PAGE = 4, 32, 8, 128, 2048, 16


def _case(e4m3: bool, paged: bool):
    """(positional tensors, keyword arguments, the index tensor to corrupt)."""
    q = torch.randn(B, 1, H, D, device=DEV, dtype=torch.bfloat16)
    lengths = torch.randint(CAPACITY // 2, CAPACITY + 1, (B,), device=DEV, dtype=torch.int32)
    k = torch.randn(B + 2, CAPACITY, HK, D, device=DEV) * 3
    v = torch.randn(B + 2, CAPACITY, HK, D, device=DEV)
    kw = dict(cache_seqlens=lengths)
    if e4m3:
        (k8, kd), (v8, vd) = fp8.quantize_per_key(k), fp8.quantize_per_key(v)
    else:
        k8, v8 = k.to(torch.bfloat16), v.to(torch.bfloat16)
    if paged:
        k8, v8 = k8[:B], v8[:B]
        per_seq = CAPACITY // PAGE
        order = torch.randperm(B * per_seq + 3, device=DEV)[:B * per_seq].view(B, per_seq).to(torch.int32)
        if e4m3:
            k8, v8 = (fz._pool(x.view(torch.uint8), order, PAGE, 0).view(torch.float8_e4m3fn) for x in (k8, v8))
            kw.update(k_descale=fz._pool(kd[:B], order, PAGE, 1.0), v_descale=fz._pool(vd[:B], order, PAGE, 1.0))
        else:
            k8, v8 = (fz._pool(x, order, PAGE, 0) for x in (k8, v8))
        kw["block_table"] = order
        index = order
    else:
        if e4m3:
            kw.update(k_descale=kd, v_descale=vd)
        index = torch.randperm(B + 2, device=DEV)[:B].to(torch.int32)
        kw["cache_batch_idx"] = index
    return (q, k8, v8), kw, index


def run_case(e4m3: bool, paged: bool) -> bool:
    tensors, kw, index = _case(e4m3, paged)

    def call():
        return flashtile.flash_attn_with_kvcache(*tensors, return_softmax_lse=True, **kw)

    eager = call()
    torch.cuda.synchronize()
    graph, captured = capture(call)
    graph.replay()
    torch.cuda.synchronize()
    # (eager calls may take another split plan than captured ones: compared with a valid replay)
    valid = [t.clone() for t in captured]
    ok = all(torch.allclose(a.float(), b.float(), atol=2e-2, rtol=0) for a, b in zip(valid, eager))
    label = f"{'e4m3' if e4m3 else 'bf16'} {'pages of 16' if paged else 'cache_batch_idx'}"
    print(f"{'ok  ' if ok else 'FAIL'} {label}: a valid replay within 2e-2 of the eager call; captured: "
          f"{LAUNCHED[-1] if LAUNCHED else 'the Triton kernel'}", flush=True)
    LAUNCHED.clear()
    for name, value in (("past the end", 2 ** 30), ("negative", -(2 ** 30)), ("minus one", -1)):
        bad = index.clone()
        bad.view(-1)[::3] = value  # every third entry
        replay_malformed(graph, [(index, bad)])
        same = all(torch.equal(a, b) for a, b in zip(captured, valid))
        ok &= same
        print(f"{'ok  ' if same else 'FAIL'} {label} {name}: replayed; the valid replay after it "
              f"{'bit for bit' if same else 'NOT bit for bit'} the one before", flush=True)
    return ok


def main() -> int:
    _record_gluon_launches()
    failed = sum(not run_case(e4m3, paged) for e4m3 in (False, True) for paged in (False, True))
    print(f"{failed} of 4 cases failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
