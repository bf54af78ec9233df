"""What attention sinks (s_aux) cost on top of the same call without them, gpt-oss's shapes (64 query
heads, 8 KV heads, head dim 64; 120b's, 20b has 64/8 too).

    PYTHONPATH=src python benchmarks/sinks_cost.py --out $OUT [--rounds N] [--smoke] [--check-only]
        [--kinds decode,prefill,varlen,train,prefill-e4m3,chunked,window]

Medians of triton.testing.do_bench in rounds that rotate the order of the calls: with s_aux,
without, and without but returning the LSE (what the sinks need of the kernels), for: decode steps
through flash_attn_with_kvcache (batch 1/16/64, 8k and 32k keys, contiguous and pages of 16), a
prefill through flash_attn_func (4k causal, batch 1), packed prefill through flash_attn_varlen_func
(4 sequences of 1k, causal; packed keys, and on shuffled pools of 16-key pages with seqused_k as
vLLM calls it), a training step (forward and backward, 4k causal), and an e4m3 prefill through
flash_attn_func with FlashAttention-3's (B, Hk) descales (4k causal at head dim 128, the e4m3 Gluon
kernel's; its check compares the epilogue's output with the pass's: one rounding apart), and
flash_attn_with_kvcache's chunked prefill (512 queries on an 8k cache, contiguous and on 16-key
pages: the Gluon forward with seqused_k), and a causal prefill with a 1024-key window (32/8 heads, head
dim 128: the Gluon kernel's general route, gluon_attention_forward); plus, for
decode, host microseconds per eager call and the GPU time of one call replayed from a CUDA graph
(how serving engines run decode: eager decode calls this small are host-bound). The prefill, packed,
chunked and training points time the call with s_aux twice: the Gluon kernel's result with the sinks
applied after it ("with") and with gluon_forward.SINKS_IN_EPILOGUE ("epilogue", the sinks inside
the kernel), and check both against float64 (the last 256 query rows of each sequence; the
allowance of a second rounding only for "with"). ``--smoke``: tiny shapes through the interpreter on
the CPU (no timings worth reading); ``--check-only``: the points' float64 checks alone (for
compute-sanitizer).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import flashtile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def points(smoke: bool):
    if smoke:
        return [("decode", 2, 64, 0), ("decode", 2, 64, 16), ("prefill", 1, 32, 0), ("varlen", 2, 24, 0),
                ("varlen", 2, 32, 16), ("train", 1, 32, 0), ("prefill-e4m3", 1, 32, 0), ("chunked", 1, 48, 16),
                ("window", 1, 40, 0)]
    decode = [("decode", b, n, page) for b in (1, 16, 64) for n in (8192, 32768) for page in (0, 16)
              if b * n <= 64 * 8192 or b == 16]
    return decode + [("prefill", 1, 4096, 0), ("varlen", 4, 1024, 0), ("varlen", 4, 1024, 16), ("train", 1, 4096, 0),
                     ("prefill-e4m3", 1, 4096, 0), ("chunked", 1, 8192, 0), ("chunked", 1, 8192, 16),
                     ("window", 1, 8192, 0)]


def modes(kind: str) -> tuple:
    return ("with", "without", "lse") if kind == "decode" else ("with", "epilogue", "without", "lse")


def epilogue_sinks(mode: str) -> None:
    """The Gluon forward's setting for a call of this mode: the sinks in its epilogue for "epilogue"."""
    from flashtile.kernels import gluon_forward
    gluon_forward.SINKS_IN_EPILOGUE = mode == "epilogue"


def check_rows(out, lse, q, k, v, sinks, cu=None, rows=256, rounded_twice=False, window=(-1, -1)) -> float:
    """The last ``rows`` query rows of each sequence (bottom-right causal, with ``window`` if given: the
    reference on those rows alone is the same attention) against float64; the worst error as a share of
    the budget."""
    from helpers import assert_matches_reference
    worst = 0.0
    spans = ([(0, q.shape[1], 0, k.shape[1], b) for b in range(q.shape[0])] if cu is None else
             [(int(cu[b]), int(cu[b + 1]), int(cu[b]), int(cu[b + 1]), None) for b in range(cu.shape[0] - 1)])
    for q0, q1, k0, k1, b in spans:
        first = max(q0, q1 - rows)
        if b is None:
            got, got_lse = out[first:q1].unsqueeze(0), lse[:, first:q1].unsqueeze(0)
            qs, ks, vs = q[first:q1].unsqueeze(0), k[k0:k1].unsqueeze(0), v[k0:k1].unsqueeze(0)
        else:
            got, got_lse = out[b:b + 1, first:q1], lse[b:b + 1, :, first:q1]
            qs, ks, vs = q[b:b + 1, first:q1], k[b:b + 1], v[b:b + 1]
        err, budget = assert_matches_reference(got, got_lse, qs, ks, vs, causal=True, sinks=sinks,
                                               rounded_twice=rounded_twice, window_size=window)
        worst = max(worst, err / budget if budget else 0.0)
    return worst


def e4m3_call(batch, keys, device, heads, heads_k, d, sinks):
    """make_call's e4m3 prefill: call(mode) and its check (the epilogue's output and LSE against the
    pass's, which the GPU fuzzer holds to float64: the same kernel, so one rounding apart)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from fuzz_gpu import _e4m3_per_head  # (FlashAttention-3's descales: one per batch row and KV head)
    tensors, descales, _ = zip(*(_e4m3_per_head(torch.randn(batch, keys, n, d, device=device), heads_k)
                                 for n in (heads, heads_k, heads_k)))
    scales = dict(zip(("q_descale", "k_descale", "v_descale"), descales))

    def call(mode, lse=False):
        epilogue_sinks(mode)
        return flashtile.flash_attn_func(*tensors, causal=True, s_aux=sinks if mode in ("with", "epilogue") else None,
                                         return_attn_probs=lse or mode == "lse", **scales)

    def check():
        (after, after_lse, _), (inside, inside_lse, _) = (call(mode, lse=True) for mode in ("with", "epilogue"))
        epilogue_sinks("with")
        scale = torch.maximum(inside.float().abs(), after.float().abs()).clamp_min(torch.finfo(torch.bfloat16).tiny)
        ulps = ((inside.float() - after.float()).abs() / (torch.finfo(torch.bfloat16).eps * scale)).max().item()
        lse_err = (inside_lse - after_lse).abs().max().item()
        assert torch.isfinite(inside).all() and ulps <= 2 and lse_err <= 1e-5 * after_lse.abs().max().item() + 1e-5, \
            f"epilogue against the pass: {ulps:.3g} ulps, LSE {lse_err:.3g}"
        return dict(epilogue_ulps_from_pass=ulps, epilogue_lse_from_pass=lse_err)
    call.check = check
    return call


def make_call(kind, batch, keys, page, device, heads=64, heads_k=8, d=64):
    dtype = torch.bfloat16
    sinks = torch.randn(heads, device=device) * 2
    if kind == "prefill-e4m3":  # (head dim 128: the e4m3 Gluon kernel's)
        return e4m3_call(batch, keys, device, heads, heads_k, 128, sinks)
    if kind == "decode":
        q = torch.randn(batch, 1, heads, d, device=device, dtype=dtype)
        k = torch.randn(batch, keys, heads_k, d, device=device, dtype=dtype)
        v = torch.randn_like(k)
        lengths = torch.full((batch,), keys, device=device, dtype=torch.int32)
        extra = {}
        if page:
            pages = keys // page
            table = torch.randperm(batch * pages, device=device).view(batch, pages).to(torch.int32)
            pool_k = torch.empty(batch * pages, page, heads_k, d, device=device, dtype=dtype)
            pool_v = torch.empty_like(pool_k)
            pool_k[table.long().flatten()] = k.view(batch * pages, page, heads_k, d)
            pool_v[table.long().flatten()] = v.view(batch * pages, page, heads_k, d)

        def call(mode):
            return flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True,
                                                     s_aux=sinks if mode == "with" else None,
                                                     return_softmax_lse=mode == "lse", **extra)

        def check():
            """The call with sinks against float64 (the accuracy rule; half an ulp more only where the
            plan applies the sinks after the kernels) on its first and last sequence; the plan."""
            from flashtile.kernels import decode
            from helpers import assert_matches_reference
            plan = decode.prepare_decode(q, k, v, softmax_scale=d ** -0.5, window_left=-1, window_right=0,
                                         block_table=extra.get("block_table"), sinks=True)
            out, lse = flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True, s_aux=sinks,
                                                         return_softmax_lse=True, **extra)
            budgets = []
            for b in sorted({0, batch - 1}):
                kb, vb = (keys_of[b:b + 1] for keys_of in (keys_k, keys_v))
                err, budget = assert_matches_reference(out[b:b + 1], lse[b:b + 1], q[b:b + 1], kb, vb, causal=True,
                                                       sinks=sinks, rounded_twice=plan.sinks_after)
                budgets.append(err / budget if budget else 0.0)
            return dict(splits=plan.splits, gluon=plan.gluon is not None, sinks_after=plan.sinks_after,
                        worst_of_budget=max(budgets))
        keys_k, keys_v = k, v
        if page:
            k, v, extra = pool_k, pool_v, dict(block_table=table)
        call.check = check
        return call
    window = (-1, -1)
    if kind == "window":  # a sliding window at head dim 128 (windows at d64 run the portable kernel)
        heads, heads_k, d, window = 32, 8, 128, (keys // 8, 0)
        sinks = sinks[:heads].contiguous()
    q = torch.randn(batch, keys, heads, d, device=device, dtype=dtype)
    k = torch.randn(batch, keys, heads_k, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    taking = ("with", "epilogue")
    if kind in ("prefill", "window"):
        def call(mode):
            epilogue_sinks(mode)
            return flashtile.flash_attn_func(q, k, v, causal=True, s_aux=sinks if mode in taking else None,
                                             return_attn_probs=mode == "lse", window_size=window)
    elif kind == "chunked":  # the cache's last 512 positions as one chunk, contiguous or on ``page``-key pages
        q = q[:, -min(512, keys):].contiguous()
        lengths = torch.full((batch,), keys, device=device, dtype=torch.int32)
        k_in, v_in, cache = k, v, {}
        if page:
            pages = keys // page
            table = torch.randperm(batch * pages, device=device).view(batch, pages).to(torch.int32)
            k_in, v_in = (torch.empty(batch * pages, page, heads_k, d, device=device, dtype=dtype) for _ in range(2))
            k_in[table.long().flatten()] = k.reshape(batch * pages, page, heads_k, d)
            v_in[table.long().flatten()] = v.reshape(batch * pages, page, heads_k, d)
            cache = dict(block_table=table)

        def chunk(s_aux, lse=False):
            return flashtile.flash_attn_with_kvcache(q, k_in, v_in, cache_seqlens=lengths, causal=True, s_aux=s_aux,
                                                     return_softmax_lse=lse, **cache)

        def call(mode):
            epilogue_sinks(mode)
            return chunk(sinks if mode in taking else None, lse=mode == "lse")
    elif kind == "varlen":  # batch sequences of ``keys`` tokens each, packed; on pools of ``page`` keys
        pools = {}
        if page:  # vLLM's prefill: the keys on shuffled page pools, their counts as seqused_k
            pages = keys // page
            table = torch.randperm(batch * pages, device=device).view(batch, pages).to(torch.int32)
            pool_k, pool_v = (torch.empty(batch * pages, page, heads_k, d, device=device, dtype=dtype)
                              for _ in range(2))
            pool_k[table.long().flatten()] = k.reshape(batch * pages, page, heads_k, d)
            pool_v[table.long().flatten()] = v.reshape(batch * pages, page, heads_k, d)
            pools = dict(block_table=table, seqused_k=torch.full((batch,), keys, device=device, dtype=torch.int32))
        q, k, v = (t.flatten(0, 1) for t in (q, k, v))
        cu = torch.arange(0, (batch + 1) * keys, keys, device=device, dtype=torch.int32)
        k_in, v_in, cu_k = (pool_k, pool_v, None) if page else (k, v, cu)

        def varlen(s_aux, **kw):
            return flashtile.flash_attn_varlen_func(q, k_in, v_in, cu, cu_k, keys, keys, causal=True, s_aux=s_aux,
                                                    **pools, **kw)

        def call(mode):
            epilogue_sinks(mode)
            return varlen(sinks if mode in taking else None, return_attn_probs=mode == "lse")
    else:
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        ss = sinks.clone().requires_grad_(True)
        dout = torch.randn_like(q)

        def call(mode):
            epilogue_sinks(mode)
            out = flashtile.flash_attn_func(qq, kk, vv, causal=True, s_aux=ss if mode in taking else None,
                                            return_attn_probs=mode == "lse")
            (out[0] if mode == "lse" else out).backward(dout)

    def check():
        """The forward with sinks, after the kernel and in its epilogue, against float64."""
        result = {}
        for mode in taking:
            epilogue_sinks(mode)
            with torch.no_grad():
                if kind == "varlen":
                    out, lse, _ = varlen(sinks, return_attn_probs=True)
                elif kind == "chunked":
                    out, lse = chunk(sinks, lse=True)
                else:
                    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, s_aux=sinks,
                                                            return_attn_probs=True, window_size=window)
            result[f"{mode}_worst_of_budget"] = check_rows(out, lse, q, k, v, sinks, cu if kind == "varlen" else None,
                                                           rounded_twice=mode == "with", window=window)
        epilogue_sinks("with")
        return result
    call.check = check
    return call



def graph_ms(call, mode, bench) -> float:
    """One call captured in a CUDA graph (varlen_bounds.capture), its replay timed."""
    sys.path.insert(0, os.path.dirname(__file__))
    from varlen_bounds import capture
    graph, _ = capture(lambda: call(mode))
    return bench(graph.replay)


def median(values):
    values = sorted(values)
    return values[len(values) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--check-only", action="store_true",
                    help="the points' checks, no timing (compute-sanitizer)")
    ap.add_argument("--kinds", default="decode,prefill,varlen,train,prefill-e4m3,chunked,window",
                    help="which points (comma-separated)")
    args = ap.parse_args(argv)
    kinds = set(args.kinds.split(","))
    from flashtile.kernels import gluon_forward
    switch = gluon_forward.SINKS_IN_EPILOGUE  # (the calls set it per mode; restored at the end)
    device = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:
        def bench(fn):
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
    else:
        from triton.testing import do_bench
        bench = do_bench
    rows = []
    for kind, batch, keys, page in points(args.smoke):
        if kind not in kinds:
            continue
        call = make_call(kind, batch, keys, page, device)
        checked = call.check()  # (AssertionError: the run stops)
        if args.check_only:
            print(f"check {kind} B{batch} {keys} page {page}: {checked}", flush=True)
            continue
        kind_modes = modes(kind)
        times = {mode: [] for mode in kind_modes}
        for r in range(args.rounds):
            for i in range(len(kind_modes)):
                mode = kind_modes[(r + i) % len(kind_modes)]
                times[mode].append(bench(lambda: call(mode)))
        epilogue_sinks("with")
        row = dict(kind=kind, batch=batch, keys=keys, page=page, **{f"ms_{m}": median(times[m]) for m in kind_modes})
        row["ratio"] = row["ms_with"] / row["ms_without"]
        if "epilogue" in kind_modes:
            row["epilogue_ratio"] = row["ms_epilogue"] / row["ms_without"]
        if checked:
            row["check"] = checked
        if kind == "decode" and device.type == "cuda":
            for mode in kind_modes:
                row[f"graph_ms_{mode}"] = median([graph_ms(call, mode, bench) for _ in range(3)])
            row["graph_ratio"] = row["graph_ms_with"] / row["graph_ms_without"]
        if kind == "decode":  # host time of eager calls: enqueue 50, least of 3
            host = {}
            for with_sinks in (False, True):
                best = float("inf")
                for _ in range(3):
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    for _ in range(5 if args.smoke else 50):
                        call("with" if with_sinks else "without")
                    best = min(best, (time.perf_counter() - start) / (5 if args.smoke else 50) * 1e6)
                host[with_sinks] = best
            row.update(host_us_with=host[True], host_us_without=host[False])
        rows.append(row)
        print(json.dumps(row), flush=True)
    gluon_forward.SINKS_IN_EPILOGUE = switch
    os.makedirs(args.out, exist_ok=True)
    name = "sinks-cost-smoke.json" if args.smoke else "sinks-cost.json"
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(dict(device=device_name, rounds=args.rounds, rows=rows), f, indent=1)
    print(f"{'kind':8} {'B':>3} {'keys':>6} {'page':>4} {'with ms':>9} {'without':>9} {'lse only':>9} {'ratio':>6}"
          f" {'graph with':>10} {'without':>9} {'lse only':>9} {'ratio':>6}")
    for r in rows:
        c = r.get("check")
        if c and "splits" in c:
            print(f"check {r['kind']} B{r['batch']} {r['keys']} page {r['page']}: splits {c['splits']}, "
                  f"{'Gluon' if c['gluon'] else 'Triton'}, sinks {'after' if c['sinks_after'] else 'inside'}, "
                  f"error {c['worst_of_budget']:.2f} of the budget")
        elif c and "epilogue_ulps_from_pass" in c:
            print(f"check {r['kind']} B{r['batch']} {r['keys']} page {r['page']}: the epilogue's output "
                  f"{c['epilogue_ulps_from_pass']:.2f} ulps, LSE {c['epilogue_lse_from_pass']:.2g} from the pass's")
        elif c:
            print(f"check {r['kind']} B{r['batch']} {r['keys']} page {r['page']}: error after the kernel "
                  f"{c['with_worst_of_budget']:.2f}, "
                  f"in the epilogue {c['epilogue_worst_of_budget']:.2f} of the budget")
    for r in rows:
        graph = (f" {r['graph_ms_with']:10.4f} {r['graph_ms_without']:9.4f} {r['graph_ms_lse']:9.4f} "
                 f"{r['graph_ratio']:6.3f}" if "graph_ratio" in r else "")
        epilogue = (f" epilogue {r['ms_epilogue']:9.4f} ({r['epilogue_ratio']:.3f}x)" if "epilogue_ratio" in r else "")
        print(f"{r['kind']:8} {r['batch']:>3} {r['keys']:>6} {r['page']:>4} {r['ms_with']:9.4f} "
              f"{r['ms_without']:9.4f} {r['ms_lse']:9.4f} {r['ratio']:6.3f}{graph}{epilogue}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
