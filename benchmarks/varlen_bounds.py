"""flash_attn_varlen_func captured in a CUDA graph, then replayed with malformed offsets written into
cu_seqlens_q / cu_seqlens_k (capture skips the host's offset checks, as torch.compile does): no
kernel may read or write outside its tensors. Run under compute-sanitizer memcheck with PyTorch's
caching allocator off, so that every tensor is its own allocation and a stray access is reported:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
        python benchmarks/varlen_bounds.py

Cases: bf16 and e4m3 (the Hopper Gluon route on sm_90; the e4m3 one packs V^T first), contiguous
keys and e4m3 page pools. Each malformed replay also checks that the valid replay after it still
matches the eager call bit for bit (the graph is not poisoned). Prints one line per case;
arguments: names of MALFORMED entries to run (default: all).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fuzz_gpu  # noqa: E402

import flashtile  # noqa: E402

DEV = "cuda"
LENS_Q, LENS_K = [100, 300, 77], [200, 300, 500]
MALFORMED = {  # name: (cu_seqlens_q, cu_seqlens_k) written before a replay
    "q past the end": ([0, 100, 400, 10 ** 6], None),
    "q negative": ([-5000, 100, 400, 477], None),
    "q decreasing": ([0, 400, 100, 477], None),
    "k past the end": (None, [0, 200, 500, 10 ** 6]),
    "k negative": (None, [-7000, 200, 500, 1000]),
    "both huge": ([2 ** 30, 2 ** 30 + 1, 2 ** 30 + 2, 2 ** 30 + 3], [2 ** 30, 0, 2 ** 30, 5]),
}


def offsets(lens):
    return torch.tensor([0] + list(lens), device=DEV).cumsum(0).to(torch.int32)


def inputs(e4m3: bool, page: int, h=8, hk=2, d=128):
    q = torch.randn(sum(LENS_Q), h, d, device=DEV)
    k = torch.randn(sum(LENS_K), hk, d, device=DEV) * 3
    v = torch.randn(sum(LENS_K), hk, d, device=DEV)
    if not e4m3:
        return [t.to(torch.bfloat16) for t in (q, k, v)], {}
    b = len(LENS_Q)
    descales = [(t.abs().amax() / 448).expand(b, hk).contiguous() for t in (q, k, v)]
    q8, k8, v8 = [(t / s[0, 0]).to(torch.float8_e4m3fn) for t, s in zip((q, k, v), descales)]
    extra = dict(q_descale=descales[0], k_descale=descales[1], v_descale=descales[2])
    if page:
        k8, v8, extra["block_table"] = fuzz_gpu._varlen_pools(k8, v8, LENS_K, page)
    return [q8, k8, v8], extra


def capture(call):
    """(the CUDA graph of ``call``, its outputs), after a warm-up on a side stream that compiles
    and caches the launches off capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = call()
    return graph, outputs


def replay_malformed(graph, writes) -> None:
    """Replay ``graph`` once with each (tensor, malformed values) of ``writes`` written in, then
    once more with the tensors' values restored."""
    saved = [(t, t.clone()) for t, _ in writes]
    for t, bad in writes:
        t.copy_(torch.as_tensor(bad, dtype=t.dtype))
    graph.replay()
    torch.cuda.synchronize()
    for t, good in saved:
        t.copy_(good)
    graph.replay()
    torch.cuda.synchronize()


def run_case(e4m3: bool, page: int, causal: bool, names) -> bool:
    tensors, extra = inputs(e4m3, page)
    cu_q, cu_k = offsets(LENS_Q), offsets(LENS_K)

    def call():
        return flashtile.flash_attn_varlen_func(*tensors, cu_q, cu_k, max(LENS_Q), max(LENS_K),
                                                causal=causal, return_attn_probs=True, **extra)[:2]

    eager = call()
    torch.cuda.synchronize()
    graph, captured = capture(call)
    ok = True
    for name, (bad_q, bad_k) in MALFORMED.items():
        if names and name not in names:
            continue
        replay_malformed(graph, [(t, bad) for t, bad in ((cu_q, bad_q), (cu_k, bad_k)) if bad is not None])
        same = all(torch.equal(a, b) for a, b in zip(captured, eager))
        ok &= same
        print(f"{'ok  ' if same else 'FAIL'} {'e4m3' if e4m3 else 'bf16'} page={page} causal={causal} "
              f"{name}: replayed; the valid replay after it {'bit for bit' if same else 'NOT bit for bit'} "
              f"the eager call", flush=True)
    return ok


def main(argv=None) -> int:
    names = (sys.argv[1:] if argv is None else argv)  # malformed cases to run (default: all)
    failed = 0
    for e4m3, page in ((False, 0), (True, 0), (True, 16)):
        for causal in (False, True):
            failed += not run_case(e4m3, page, causal, names)
    print(f"{failed} of 6 cases failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
