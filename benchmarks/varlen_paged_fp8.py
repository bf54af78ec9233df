"""flash_attn_varlen_func on e4m3 q, k, v (one descale per sequence and KV head), contiguous or on
e4m3 page pools through block_table: checks and timings.

    PYTHONPATH=src python benchmarks/varlen_paged_fp8.py --check            # small cases (sanitizer)
    PYTHONPATH=src python benchmarks/varlen_paged_fp8.py --bench --out $OUT
    PYTHONPATH=src python benchmarks/varlen_paged_fp8.py --ab --out $OUT    # FP8 modes x tiles

--check: ragged packed sequences, contiguous or on shuffled pools of 1, 3, 16, 64 and 256-key pages
(unused slots NaN), head dims 64/128/256, causal, window + softcap; each sequence against float64
attention of the dequantized tensors (output and LSE within 2x textbook bf16's errors, as
fuzz_gpu.assert_e4m3_lse), every call made twice (JIT launch, then the direct launcher).
--bench: CUDA-graph replays (do_bench median), 32/8 heads, d128, causal, at equal lengths (where
SDPA's flash and cuDNN backends and textbook attention in bf16 run the same problem without padding)
and at ragged ones: e4m3 and bf16 on pools of 16 and 256-key pages and contiguous; TFLOP/s as
FlashAttention-2 counts them, e4m3 against bf16 on the same layout, everything against SDPA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import flashtile
from flashtile.fp8 import E4M3_MAX
from flashtile.reference import attention as textbook

import fuzz_gpu  # noqa: E402  (benchmarks/, next to this script: its page pools)


DEV = "cuda"


def quantize(x, cu, heads_k):
    """Packed (total, H, D) float -> e4m3 with one descale per (sequence, KV head)."""
    grouped = x.float().unflatten(1, (heads_k, -1))
    ds = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ds.append(grouped[a:b].abs().amax(dim=(0, 2, 3)) if b > a else torch.ones(heads_k, device=x.device))
    d = (torch.stack(ds).clamp_min(1e-6) / E4M3_MAX).float()
    rows = torch.repeat_interleave(torch.arange(len(cu) - 1, device=x.device), cu[1:] - cu[:-1])
    x8 = (grouped / d[rows][:, :, None, None]).flatten(1, 2).to(torch.float8_e4m3fn)
    back = (x8.double().unflatten(1, (heads_k, -1)) * d[rows][:, :, None, None].double()).flatten(1, 2)
    return x8, d, back


def check() -> int:
    failures = 0
    cases = [(64, 1, dict(causal=True)), (128, 3, dict(causal=True)), (128, 16, dict(window_size=(40, 7), softcap=20.0)),
             (256, 64, dict(causal=True)), (128, 256, dict()), (256, 16, dict(causal=True, softcap=30.0)),
             (64, 0, dict()), (128, 0, dict(causal=True)), (256, 0, dict(window_size=(40, 7), softcap=20.0))]
    for d, page, kw in cases:
        lens_q, lens_k = [37, 1, 0, 200, 65], [300, 17, 9, 200, 1]
        heads, heads_k = 8, 2
        cu_q = torch.tensor([0] + lens_q, device=DEV).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + lens_k, device=DEV).cumsum(0).to(torch.int32)
        q8, qd, dq = quantize(torch.randn(sum(lens_q), heads, d, device=DEV) * 2, cu_q, heads_k)
        k8, kd, dk = quantize(torch.randn(sum(lens_k), heads_k, d, device=DEV) * 3, cu_k, heads_k)
        v8, vd, dv = quantize(torch.randn(sum(lens_k), heads_k, d, device=DEV), cu_k, heads_k)
        paged = {}
        kp, vp = k8, v8  # page 0: the packed tensors themselves
        if page:
            kp, vp, paged["block_table"] = fuzz_gpu._varlen_pools(k8, v8, lens_k, page)
        worst, worst_lse, ok = 0.0, 0.0, True
        for attempt in range(2):
            out, lse, _ = flashtile.flash_attn_varlen_func(
                q8, kp, vp, cu_q, cu_k, max(lens_q), max(lens_k), q_descale=qd, k_descale=kd,
                v_descale=vd, return_attn_probs=True, **paged, **kw)
            ok &= bool(torch.isfinite(out).all())
            for i in range(len(lens_q)):
                qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
                if qs.stop == qs.start:
                    continue
                ref, ref_lse = textbook(dq[None, qs], dk[None, ks], dv[None, ks], **kw)
                low, low_lse = textbook(dq[None, qs].bfloat16(), dk[None, ks].bfloat16(),
                                        dv[None, ks].bfloat16(), **kw)
                err = (out[None, qs].double() - ref).abs().max().item()
                budget = 2 * (low.double() - ref).abs().max().item() + 1e-6
                seen = torch.isfinite(ref_lse[0])
                lse_over = 0.0
                if seen.any():
                    lse_over = ((lse[:, qs].double() - ref_lse[0])[seen].abs().max().item()
                                / (2 * (low_lse.double()[0] - ref_lse[0])[seen].abs().max().item() + 1e-6))
                ok &= err <= budget and lse_over <= 1 and bool(torch.isinf(lse[:, qs][~seen]).all())
                worst, worst_lse = max(worst, err / budget), max(worst_lse, lse_over)
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} d{d} page {page} {kw}: output {worst:.2f} of the budget, "
              f"LSE {worst_lse:.2f} of its budget")
    return failures


def graph_time(fn) -> float:
    import triton
    fn()  # checks (cached by tensor version) and compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=50, rep=300)


def bench(out_dir: str) -> None:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rows = []
    heads, heads_k, d = 32, 8, 128
    for name, lens in (("equal 4 x 4096", [4096] * 4), ("equal 8 x 2048", [2048] * 8),
                       ("ragged 16 in [64, 8192]", torch.randint(64, 8193, (16,), generator=torch.Generator()
                                                                  .manual_seed(0)).tolist())):
        cu = torch.tensor([0] + lens, device=DEV).cumsum(0).to(torch.int32)
        total, mx = sum(lens), max(lens)
        flops = sum(4 * n * n * d * heads / 2 for n in lens)  # causal
        q = torch.randn(total, heads, d, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(total, heads_k, d, device=DEV, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q8, qd, _ = quantize(q, cu, heads_k)
        k8, kd, _ = quantize(k, cu, heads_k)
        v8, vd, _ = quantize(v, cu, heads_k)
        calls = {
            "bf16 contiguous": lambda: flashtile.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=True),
            "e4m3 contiguous": lambda: flashtile.flash_attn_varlen_func(
                q8, k8, v8, cu, cu, mx, mx, causal=True, q_descale=qd, k_descale=kd, v_descale=vd),
        }
        for page in (16, 256):
            kp, vp, table = fuzz_gpu._varlen_pools(k, v, lens, page)
            kp8, vp8, table8 = fuzz_gpu._varlen_pools(k8, v8, lens, page)
            calls[f"bf16 pages of {page}"] = (lambda kp=kp, vp=vp, table=table: flashtile.flash_attn_varlen_func(
                q, kp, vp, cu, cu, mx, mx, causal=True, block_table=table))
            calls[f"e4m3 pages of {page}"] = (lambda kp8=kp8, vp8=vp8, table8=table8: flashtile.flash_attn_varlen_func(
                q8, kp8, vp8, cu, cu, mx, mx, causal=True, block_table=table8, q_descale=qd, k_descale=kd,
                v_descale=vd))
        if len(set(lens)) == 1:
            b = len(lens)
            qb, kb, vb = (x.view(b, mx, -1, d).transpose(1, 2) for x in (q, k, v))
            for backend, label in ((SDPBackend.FLASH_ATTENTION, "sdpa-flash"), (SDPBackend.CUDNN_ATTENTION, "sdpa-cudnn")):
                def sdpa(backend=backend):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
                calls[label] = sdpa
            calls["textbook bf16"] = lambda: textbook(q.view(b, mx, heads, d), k.view(b, mx, heads_k, d),
                                                      v.view(b, mx, heads_k, d), causal=True,
                                                      chunk_rows=mx)
        times = {}
        for label, fn in calls.items():
            try:
                times[label] = graph_time(fn)
            except Exception as exc:  # an anchor that cannot run here is reported, not fatal
                print(f"{name} {label}: {type(exc).__name__}: {exc}")
        for label, ms in times.items():
            rows.append(dict(point=name, provider=label, ms=ms, tflops=flops / ms / 1e9,
                             vs_bf16=times.get(label.replace("e4m3", "bf16"), float("nan")) / ms
                             if "e4m3" in label else None,
                             vs_sdpa_flash=times["sdpa-flash"] / ms if "sdpa-flash" in times else None,
                             vs_sdpa_cudnn=times["sdpa-cudnn"] / ms if "sdpa-cudnn" in times else None))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "varlen-paged-fp8.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), heads=heads, heads_k=heads_k, head_dim=d,
                       causal=True, rows=rows), f, indent=1)
    print(f"{'point':26} {'provider':18} {'ms':>8} {'TFLOP/s':>8} {'e4m3/bf16':>9} {'x flash':>8} {'x cudnn':>8}")
    for r in rows:
        def fmt(x):
            return f"{x:.3f}" if x is not None else "-"
        print(f"{r['point']:26} {r['provider']:18} {r['ms']:8.3f} {r['tflops']:8.1f} "
              f"{fmt(r['vs_bf16']):>9} {fmt(r['vs_sdpa_flash']):>8} {fmt(r['vs_sdpa_cudnn']):>8}")


def ab(out_dir: str, modes, configs, lens=(2048,) * 8) -> None:
    """Each FP8 mode and tile config of the per-sequence e4m3 path on pages of 16 and on the contiguous
    packed tensors (VARLEN_FP8_BY_SEQUENCE), 8 x 2048 causal 32/8 d128: time, and the first
    sequence's output and LSE against float64 (output budget 2x textbook bf16)."""
    from flashtile.kernels import forward
    from flashtile.kernels.forward import TileConfig
    by_sequence = forward.VARLEN_FP8_BY_SEQUENCE
    heads, heads_k, d, lens = 32, 8, 128, list(lens)
    cu = torch.tensor([0] + lens, device=DEV).cumsum(0).to(torch.int32)
    mx, flops = max(lens), sum(4 * n * n * d * heads / 2 for n in lens)
    x = [torch.randn(sum(lens), h, d, device=DEV) * s_ for h, s_ in ((heads, 2.0), (heads_k, 3.0), (heads_k, 1.0))]
    (q8, qd, dq), (k8, kd, dk), (v8, vd, dv) = (quantize(t, cu, heads_k) for t in x)
    kp8, vp8, table8 = fuzz_gpu._varlen_pools(k8, v8, lens, 16)
    q16, k16, v16 = (t.bfloat16() for t in x)
    kp, vp, table = fuzz_gpu._varlen_pools(k16, v16, lens, 16)
    n0 = lens[0]
    ref, ref_lse = textbook(dq[None, :n0], dk[None, :n0], dv[None, :n0], causal=True)
    low, _ = textbook(dq[None, :n0].bfloat16(), dk[None, :n0].bfloat16(), dv[None, :n0].bfloat16(), causal=True)
    budget = 2 * (low.double() - ref).abs().max().item()
    rows = []

    def record(label, fn):
        out, lse, _ = fn()
        err = lse_err = float("nan")  # 16-bit rows run other inputs: time only
        if label.startswith("e4m3"):
            err = (out[None, :n0].double() - ref).abs().max().item() / budget
            lse_err = ((lse[:, :n0].double() - ref_lse[0]).abs() / ref_lse[0].abs().clamp(min=1)).max().item()
        ms = graph_time(fn) if DEV == "cuda" else float("nan")
        rows.append(dict(label=label, ms=ms, tflops=flops / ms / 1e9, err_of_budget=err, lse_rel_err=lse_err))
        print(f"{label:44} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s  error {err:.2f} of budget, "
              f"LSE {lse_err:.2e}", flush=True)

    kw = dict(causal=True, return_attn_probs=True)
    record("bf16 contiguous", lambda: flashtile.flash_attn_varlen_func(q16, k16, v16, cu, cu, mx, mx, **kw))
    record("bf16 pages of 16", lambda: flashtile.flash_attn_varlen_func(q16, kp, vp, cu, cu, mx, mx,
                                                                        block_table=table, **kw))
    ds = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    try:
        forward.VARLEN_FP8_BY_SEQUENCE = False
        record("e4m3 contiguous, block-descale kernel", lambda: flashtile.flash_attn_varlen_func(
            q8, k8, v8, cu, cu, mx, mx, **ds, **kw))
        for mode in modes:
            for cfg in configs:
                forward.SEQUENCE_FP8_MODE, forward.SEQUENCE_FP8_CONFIG = mode, TileConfig(*cfg)
                for layout in ("pages of 16", "contiguous"):
                    forward.VARLEN_FP8_BY_SEQUENCE = layout == "contiguous"
                    label = f"e4m3 {layout}, mode {mode}, tiles {cfg}"
                    try:
                        if layout == "contiguous":
                            record(label, lambda: flashtile.flash_attn_varlen_func(q8, k8, v8, cu, cu, mx, mx, **ds, **kw))
                        else:
                            record(label, lambda: flashtile.flash_attn_varlen_func(
                                q8, kp8, vp8, cu, cu, mx, mx, block_table=table8, **ds, **kw))
                    except Exception as exc:
                        print(f"{label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    finally:
        forward.SEQUENCE_FP8_MODE = forward.SEQUENCE_FP8_CONFIG = None
        forward.VARLEN_FP8_BY_SEQUENCE = by_sequence
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "varlen-fp8-modes.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name() if DEV == "cuda" else DEV, lens=lens, heads=heads, heads_k=heads_k,
                       head_dim=d, rows=rows), f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--ab", action="store_true", help="FP8 modes x tiles of the per-sequence path")
    ap.add_argument("--modes", default="4,3,2,5")
    ap.add_argument("--ab-lens", default="2048," * 7 + "2048")
    ap.add_argument("--configs", default="128,64,4,2;128,64,8,2;64,64,4,3;128,128,8,2")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda", help="cpu: --check through the Triton interpreter")
    args = ap.parse_args(argv)
    global DEV
    DEV = fuzz_gpu.DEV = args.device
    failures = check() if args.check else 0
    if args.ab:
        ab(args.out, [int(m) for m in args.modes.split(",")],
           [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")],
           [int(n) for n in args.ab_lens.split(",")])
    if args.bench:
        bench(args.out)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
