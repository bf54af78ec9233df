"""Check and time the Gluon Hopper forward (flashtile.kernels.gluon_forward) on an H200, in one run.

    PYTHONPATH=src python benchmarks/gluon_check.py --out $OUT

Two phases, each in its own process with a time limit, so that a kernel that hangs (an mbarrier
protocol error waits forever) costs one phase and is reported instead of stalling the run:

1. check: every shipped variant against the float64 textbook reference (flashtile.reference) on
   sampled query rows, with the project's rule: max error <= 2x the error of the same textbook
   attention in the input dtype; LSE to fp32 rounding, +inf (and output 0) on rows that see no key.
   Outputs are filled with NaN before each call, and the whole output and LSE must come back free of
   NaN (every row written). Cases: bf16/fp16, d64/d128/d256, causal or not, Sq = Sk = 4096, Sq != Sk
   (bottom-right causal, including rows that see no key), odd lengths, GQA 32/8 and MQA, B = 2,
   a q sliced out of a packed qkv tensor.
2. bench: triton.testing.do_bench medians of the Gluon variants that came through the check, the
   portable flashtile kernel and SDPA's cuDNN and FlashAttention-2 backends, at 16k tokens as
   (B, S) = (8, 2k), (4, 4k), (2, 8k), (1, 16k), 16 heads, d128, d256 and d64, causal and not.
   TFLOP/s = 4 * S^2 * D * H * B (halved for causal) / time.

e4m3 variants (``-fp8-``): the inputs are quantized with flashtile.fp8.quantize_qkv (128 x 256
blocks, Hadamard rotation); the reference is float64 attention of the dequantized tensors, and the
budget is 2x the larger of the portable Triton e4m3 kernel's error on the same tensors (P rounds to
e4m3 in both) and the textbook attention's in bf16; LSE as above. Their bench rows (d128) time
the e4m3 variants, the portable e4m3 kernel, the bf16 default (flashtile's bf16 path) and SDPA.

``--only A,B`` restricts both phases to the variants whose name contains A or B (``A$``: ends in A); ``--check-limit``
raises the check phase's time limit (a phase that runs out marks its running variant as hung).

Writes $OUT/gluon-check.json and prints a compact table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback

# Seconds per phase; a check that times out is resumed once (without the variant that hung) for
# what is left of its limit plus RESUME_LIMIT. The whole run must stay under 4 minutes.
PHASE_LIMITS = {"check": 150, "bench": 120}
RESUME_LIMIT = 35
SHAPES = [(8, 2048), (4, 4096), (2, 8192), (1, 16384)]
HEADS = 16


# ------------------------------------------------------------------------------------------------
# Shared helpers (run inside the phase processes)
# ------------------------------------------------------------------------------------------------

def _save(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def _variants():
    from flashtile.kernels.gluon_forward import variants_named
    return variants_named(os.environ.get("GLUON_CHECK_ONLY", "").split(","))


def _sample_rows(seqlen_q, device, count=160):
    """Random rows plus the edges: first/last rows and both sides of every 64-row boundary near the
    start and the end (consumer warpgroup and CTA block edges)."""
    import torch
    edges = {0, 1, seqlen_q - 1, seqlen_q - 2}
    for b in (63, 64, 127, 128, 191, 192):
        edges.update({b, seqlen_q - 1 - b})
    edges = sorted(r for r in edges if 0 <= r < seqlen_q)
    rand = torch.randperm(seqlen_q, device=device)[:count]
    return torch.unique(torch.cat([rand, torch.tensor(edges, device=device, dtype=rand.dtype)]))


def _score_terms(q, k, rows, scale):
    """(B, H, rows): max over keys of scale * sum_d |q_d| |k_d| (the fp32 rounding scale of a score)."""
    import torch
    group = q.shape[2] // k.shape[2]
    kk = k.abs().double().repeat_interleave(group, dim=2)
    return torch.einsum("bqhd,bkhd->bhqk", q[:, rows].abs().double(), kk).amax(-1) * scale


def _check_case(q, k, v, causal, variant, order=None):
    """Run the kernel into NaN-filled buffers and compare sampled rows with the float64 reference."""
    import torch

    from flashtile.kernels.gluon_forward import gluon_attention_forward, shapes_supported
    from flashtile.reference import attention

    # Every variant is checked at its own head dim, whether or not ``supported`` dispatches it.
    if not shapes_supported(q, k, v, head_dims=(variant.head_dim,)):
        raise RuntimeError("shapes_supported() returned False for this case")
    scale = q.shape[-1] ** -0.5
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), dtype=torch.float32,
                     device=q.device)
    gluon_attention_forward(q, k, v, softmax_scale=scale, causal=causal, variant=variant, out=out, lse=lse,
                            **(order or {}))
    torch.cuda.synchronize()
    rows = _sample_rows(q.shape[1], q.device)
    ref, ref_lse = attention(q.double(), k.double(), v.double(), causal=causal, query_rows=rows)
    low, _ = attention(q, k, v, causal=causal, query_rows=rows)
    return _judge({}, out, lse, rows, ref, ref_lse, 2 * (low.double() - ref).abs().max().item(),
                  _score_terms(q, k, rows, scale))


def _judge(rec, out, lse, rows, ref, ref_lse, budget, terms, lse_floor=0.0):
    """Fill ``rec`` from the kernel's NaN-prefilled out/LSE against the float64 reference on
    ``rows``: output within ``budget``, LSE within fp32 rounding of its terms (or ``lse_floor``),
    +inf LSE and 0 output exactly on the rows that see no key, nothing left NaN."""
    import torch
    rec.update(nan_out=bool(torch.isnan(out).any()), nan_lse=bool(torch.isnan(lse).any()))
    got, got_lse = out[:, rows].double(), lse[:, :, rows].double()
    rec["err"] = (got - ref).abs().max().item()
    rec["budget"] = budget
    empty = torch.isinf(ref_lse)
    rec["empty_rows"] = int(empty.sum().item())
    rec["empty_ok"] = bool(torch.equal(torch.isinf(got_lse) & (got_lse > 0), empty)
                           and (got.transpose(1, 2)[empty] == 0).all().item())
    if (~empty).any():
        lse_err = (got_lse - ref_lse)[~empty].abs()
        tol = 1e-5 * torch.maximum(ref_lse[~empty].abs(), terms[~empty]).clamp(min=1.0) + 1e-5
        rec["lse_err"] = lse_err.max().item()
        rec["lse_ok"] = bool((lse_err <= torch.clamp(tol, min=lse_floor)).all().item())
    else:
        rec["lse_err"], rec["lse_ok"] = 0.0, True
    rec["ok"] = (not rec["nan_out"] and not rec["nan_lse"] and rec["err"] <= rec["budget"]
                 and rec["lse_ok"] and rec["empty_ok"])
    return rec


def _check_case_fp8(q, k, v, causal, variant, order=None):
    """e4m3 variant on quantized q, k, v (bf16 inputs here): NaN-filled out/LSE, sampled rows
    against float64 attention of the dequantized tensors."""
    import torch

    from flashtile import fp8
    from flashtile.kernels.forward import attention_forward, fp8_kernel_descales
    from flashtile.kernels.gluon_forward import fp8_shapes_supported, gluon_attention_forward
    from flashtile.reference import attention

    z = fp8.quantize_qkv(q, k, v, block=(128, 256), hadamard=True, seed=3)
    blocks = (z.block_q, z.block_k)
    if not fp8_shapes_supported(z.q, z.k, z.v, blocks, causal, variant):
        raise RuntimeError("fp8_shapes_supported() returned False for this case")
    scale = q.shape[-1] ** -0.5
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), dtype=torch.float32,
                     device=q.device)
    gluon_attention_forward(z.q, z.k, z.v, softmax_scale=scale, causal=causal, variant=variant, out=out,
                            lse=lse, descales=fp8_kernel_descales(z.q_descale, z.k_descale, z.v_descale),
                            scale_blocks=blocks, **(order or {}))
    torch.cuda.synchronize()
    rows = _sample_rows(q.shape[1], q.device)
    dq, dk, dv = (fp8.dequantize(t, d, b) for t, d, b in ((z.q, z.q_descale, z.block_q),
                                                          (z.k, z.k_descale, z.block_k),
                                                          (z.v, z.v_descale, z.block_k)))
    ref, ref_lse = attention(dq.double(), dk.double(), dv.double(), causal=causal, query_rows=rows)
    low, _ = attention(dq.bfloat16(), dk.bfloat16(), dv.bfloat16(), causal=causal, query_rows=rows)
    # The portable e4m3 kernel on the same tensors (an explicit tile config keeps it off Gluon).
    from flashtile.kernels.forward import pick_config
    triton_out, triton_lse = attention_forward(z.q, z.k, z.v, softmax_scale=scale, window_left=-1,
                                               window_right=0 if causal else -1,
                                               diag_offset=k.shape[1] - q.shape[1],
                                               descales=(z.q_descale, z.k_descale, z.v_descale),
                                               scale_blocks=blocks,
                                               config=pick_config(q.shape[-1], q.device, True))
    seen = ~torch.isinf(ref_lse)
    rec = {"triton_err": (triton_out[:, rows].double() - ref).abs().max().item(),
           "triton_lse_err": ((triton_lse[:, :, rows].double() - ref_lse)[seen].abs().max().item()
                              if seen.any() else 0.0)}
    # P is e4m3 in both kernels; sm_90's e4m3 wgmma accumulates in reduced precision (Triton's
    # default there), so the LSE gets 2x the portable kernel's error too.
    budget = 2 * max(rec["triton_err"], (low.double() - ref).abs().max().item())
    return _judge(rec, out, lse, rows, ref, ref_lse, budget, _score_terms(dq, dk, rows, scale),
                  lse_floor=2 * rec["triton_lse_err"])


def _inputs(batch, seqlen_q, seqlen_k, heads, heads_k, d, dtype, packed=False):
    """packed: q, k, v as slices of one tensor; "rising": keys scaled by 1 + 3 * position / Sk,
    so that each row's running max keeps growing over the key tiles (by ~17 in log2 units at
    d128: the lazy rescale's reference has to move several times)."""
    import torch
    if packed == "rising":
        q, k, v = _inputs(batch, seqlen_q, seqlen_k, heads, heads_k, d, dtype)
        ramp = 1 + 3 * torch.arange(seqlen_k, device="cuda", dtype=torch.float32) / seqlen_k
        return q, (k.float() * ramp[None, :, None, None]).to(dtype), v
    if packed:  # q, k, v sliced out of one (B, S, 3, H, D) tensor: row stride 3 * H * D
        qkv = torch.randn(batch, seqlen_q, 3, heads, d, device="cuda", dtype=dtype)
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    q = torch.randn(batch, seqlen_q, heads, d, device="cuda", dtype=dtype)
    k = torch.randn(batch, seqlen_k, heads_k, d, device="cuda", dtype=dtype)
    v = torch.randn(batch, seqlen_k, heads_k, d, device="cuda", dtype=dtype)
    return q, k, v


def _check_cases(variant):
    """(label, batch, Sq, Sk, H, Hk, packed, order) for one variant: the ones dispatch runs get the
    full list, the alternates a representative subset. Causal persistent variants also run three
    cases in work-tile orders dispatch would not pick for them (order: gluon_attention_forward's
    head_group keyword; None: dispatch's pick)."""
    from flashtile.kernels.gluon_forward import DISPATCHED
    full = variant in DISPATCHED
    cases = [("Sq=Sk=4096", 2, 4096, 4096, 16, 16, False, None),
             ("Sq=1000,Sk=3000", 2, 1000, 3000, 8, 8, False, None),
             ("Sq=3000,Sk=1000", 1, 3000, 1000, 8, 8, False, None),
             ("odd 1531", 2, 1531, 1531, 8, 8, False, None),
             ("GQA 32/8", 2, 2048, 2048, 32, 8, False, None)]
    if full:
        cases += [("MQA 16/1", 2, 1024, 1024, 16, 1, False, None),
                  ("tiny 1x1", 1, 1, 1, 4, 4, False, None),
                  ("17x200", 3, 17, 200, 4, 2, False, None),
                  ("packed qkv 777", 2, 777, 777, 8, 8, True, None)]
    if variant.lazy_rescale:
        cases += [("rising scores", 2, 2048, 2048, 8, 8, "rising", None),
                  ("rising Sq<Sk", 1, 700, 3000, 8, 4, "rising", None)]
    if variant.causal and variant.persistent:
        cases += [("4096 heads-outer", 2, 4096, 4096, 16, 16, False, {"head_group": 1}),
                  ("GQA blocks-outer", 2, 2048, 2048, 32, 8, False, {"head_group": 0}),
                  ("GQA groups of 5", 2, 2048, 2048, 32, 8, False, {"head_group": 5})]
    return cases


def phase_check(out_dir, resume=False):
    """Check every variant; ``resume`` keeps the results of an earlier (timed-out) run, marks the
    variant that was running then as hung and goes on with the variants not checked yet."""
    import torch
    path = os.path.join(out_dir, "gluon-check-check.json")
    results = _load(path, {"cases": [], "variants": {}}) if resume else {"cases": [], "variants": {}}
    for name, status in results["variants"].items():
        if status.get("state") == "running":
            status["state"] = "hung"
    torch.manual_seed(0)
    phase_t0 = time.time()
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
    for variant in _variants():
        if variant.name in results["variants"]:
            continue
        status = {"state": "running", "failures": 0}
        results["variants"][variant.name] = status
        t0 = time.time()
        for label, b, sq, sk, h, hk, packed, order in _check_cases(variant):
            # Seconds into this phase process: says whether a case left running had time to hang.
            rec = {"variant": variant.name, "case": label, "state": "running",
                   "started_s": round(time.time() - phase_t0, 1)}
            results["cases"].append(rec)
            _save(path, results)  # a hang leaves this case marked "running"
            try:
                q, k, v = _inputs(b, sq, sk, h, hk, variant.head_dim, dtypes[variant.dtype], packed)
                check = _check_case_fp8 if variant.fp8 else _check_case
                rec.update(check(q, k, v, variant.causal, variant, order))
                rec["state"] = "done"
            except Exception as exc:
                rec.update(state="error", ok=False, error=f"{type(exc).__name__}: {exc}"[:400])
                traceback.print_exc()
            status["failures"] += 0 if rec.get("ok") else 1
            tag = "ok " if rec.get("ok") else "BAD"
            detail = (rec.get("error") or f"err {rec['err']:.3g} (budget {rec['budget']:.3g}), lse err "
                      f"{rec['lse_err']:.2g}, empty rows {rec['empty_rows']}"
                      f"{'' if rec['empty_ok'] else ' WRONG'}"
                      f"{' NaN-out' if rec['nan_out'] else ''}{' NaN-lse' if rec['nan_lse'] else ''}")
            print(f"[check] {tag} {variant.name:58s} {label:16s} {detail}", flush=True)
        status["state"] = "done"
        status["seconds"] = round(time.time() - t0, 1)
        _save(path, results)


def _flops(b, s, h, d, causal):
    return 4 * b * h * s * s * d / (2 if causal else 1)


def _bench_point(d, causal, batch, seqlen, variants, fp8_variants=()):
    """TFLOP/s of the Gluon variants and the baselines at one shape (bf16), and of the e4m3
    variants, the public e4m3 call (fp8.attention) and the portable e4m3 kernel on the same
    inputs quantized once (kernel_blocks scales, Hadamard rotation)."""
    import torch
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashtile.kernels.forward import attention_forward
    from flashtile.kernels.gluon_forward import gluon_attention_forward

    point = {"d": d, "causal": causal, "batch": batch, "seqlen": seqlen, "heads": HEADS,
             "tflops": {}, "errors": {}}
    fl = _flops(batch, seqlen, HEADS, d, causal)
    q, k, v = _inputs(batch, seqlen, seqlen, HEADS, HEADS, d, torch.bfloat16)
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    scale = d ** -0.5
    runs = {}
    for var in variants:
        runs[var.name] = (lambda var=var: gluon_attention_forward(
            q, k, v, softmax_scale=scale, causal=causal, variant=var))
    runs["flashtile-triton"] = lambda: attention_forward(
        q, k, v, softmax_scale=scale, window_left=-1, window_right=0 if causal else -1, diag_offset=0)
    if fp8_variants:
        from flashtile import fp8
        from flashtile.kernels.forward import pick_config
        z, blocks, descales = fp8_inputs(q, k, v, fp8_variants)
        for var in fp8_variants:
            runs[var.name] = (lambda var=var: gluon_attention_forward(
                z.q, z.k, z.v, softmax_scale=scale, causal=causal, variant=var, descales=descales,
                scale_blocks=blocks))
        runs["fp8.attention"] = lambda: fp8.attention(z, causal=causal)
        from flashtile.kernels.forward import fp8_forward_kernel_name
        point["fp8_attention_kernel"] = fp8_forward_kernel_name(z.q, z.k, z.v, causal=causal,
                                                                scale_blocks=blocks)
        cfg = pick_config(d, q.device, True)
        runs["fp8-triton"] = lambda: attention_forward(
            z.q, z.k, z.v, softmax_scale=scale, window_left=-1, window_right=0 if causal else -1,
            diag_offset=0, descales=(z.q_descale, z.k_descale, z.v_descale), scale_blocks=blocks,
            config=cfg)
    for name, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        runs[name] = sdpa
    for name, fn in runs.items():
        try:
            ms = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
            point["tflops"][name] = fl / ms / 1e9
        except Exception as exc:
            point["errors"][name] = f"{type(exc).__name__}: {exc}"[:300]
            print(f"[bench] {name} failed: {point['errors'][name]}", flush=True)
    return point


def fp8_inputs(q, k, v, variants=()):
    """q, k, v quantized as the benches run e4m3 (the kernel's scale blocks, made whole tiles of
    ``variants`` too; Hadamard rotation): (the quantized tensors, their scale blocks, the descales
    as the Gluon kernel reads them)."""
    from flashtile import fp8
    from flashtile.kernels.forward import fp8_kernel_descales
    block_q, block_k = fp8.kernel_blocks(q.shape[-1], q.device)
    block_k = math.lcm(block_k, *(var.block_n for var in variants))
    z = fp8.quantize_qkv(q, k, v, block=(math.lcm(block_q, 64), block_k), hadamard=True)
    return z, (z.block_q, z.block_k), fp8_kernel_descales(z.q_descale, z.k_descale, z.v_descale)


def phase_bench(out_dir, checked):
    """Time the variants whose check ran to the end (accurate or not: the table marks which)."""
    import torch

    path = os.path.join(out_dir, "gluon-check-bench.json")
    points = []
    t_start = time.time()
    budget = PHASE_LIMITS["bench"] - 10
    torch.manual_seed(0)
    for d in (128, 256, 64):
        for causal in (False, True):
            variants = [v for v in _variants() if v.head_dim == d and v.causal == causal
                        and v.dtype == "bf16" and checked.get(v.name) == "done"]
            fp8_variants = [v for v in _variants() if v.head_dim == d and v.causal == causal
                            and v.fp8 and checked.get(v.name) == "done"]
            if fp8_variants:  # flashtile's bf16 path for the fp8 / bf16 ratio
                from flashtile.kernels.gluon_forward import default_variant
                variants = variants or [default_variant(d, "bf16", causal)]
            if not variants and not fp8_variants:
                continue
            for b, s in SHAPES:
                if time.time() - t_start > budget:
                    print(f"[bench] time budget spent, skipping d{d} causal={causal} B={b} S={s}",
                          flush=True)
                    continue
                point = _bench_point(d, causal, b, s, variants, fp8_variants)
                points.append(point)
                _save(path, {"points": points})
                print(f"[bench] d{d} causal={causal!s:5} B={b} S={s:5d} "
                      + "  ".join(f"{n}={t:.0f}" for n, t in point["tflops"].items())
                      + (f"  (fp8.attention ran {point['fp8_attention_kernel']})"
                         if "fp8_attention_kernel" in point else ""), flush=True)
                torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------

def _run_phase(name, out_dir, limit, extra=()):
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", name, "--out", out_dir, *extra]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, timeout=limit)
        state = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        state = f"TIMEOUT after {limit:.0f} s (a kernel hung or the phase ran long)"
    print(f"[{name}] phase {state} in {time.time() - t0:.0f} s", flush=True)
    return state


def _load(path, default):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def _env_info():
    info = {"date": time.strftime("%Y-%m-%d %H:%M")}
    try:
        import torch
        import triton
        info.update(torch=torch.__version__, triton=triton.__version__)
    except Exception:  # the driver process does not need either to work
        pass
    return info


def _table(check, bench):
    lines = ["", "Gluon forward check (sampled rows vs float64; budget = 2x textbook error in dtype):"]
    for name, status in check.get("variants", {}).items():
        cases = [c for c in check.get("cases", []) if c["variant"] == name]
        bad = [c["case"] for c in cases if not c.get("ok")]
        hung = [f"{c['case']} (started {c.get('started_s', '?')} s into its phase)" for c in cases
                if c.get("state") == "running"]
        if hung or status.get("state") in ("hung", "running"):
            verdict = "HUNG (or out of time) in " + (", ".join(hung) or "?")
        else:
            verdict = "ok" if not bad else "BAD: " + ", ".join(bad)
        lines.append(f"  {name:58s} {len(cases):2d} cases  {verdict}")
    passed = {name for name in check.get("variants", {})
              if all(c.get("ok") for c in check.get("cases", []) if c["variant"] == name)}
    points = bench.get("points", [])
    if points:
        names = []
        for p in points:
            for n in p["tflops"]:
                if n not in names:
                    names.append(n)
        # The best is taken over accurate ones only (and unchecked ones: the bf16 default next to an
        # --only fp8 run, checked in runs of its own).
        checked_names = set(check.get("variants", {}))
        gluon_names = [n for n in names if n in passed
                       or (n.startswith("gluon") and n not in checked_names)]
        short = {n: n.replace("gluon-", "").replace("-bf16", "")
                 + ("" if n in gluon_names or not n.startswith("gluon") else " (FAILED CHECK)")
                 for n in names}
        lines += ["", "TFLOP/s, bf16, 16 heads, 16k tokens (best checked gluon variant / cuDNN last):"]
        for d in (128, 256, 64):
            for causal in (False, True):
                sel = [p for p in points if p["d"] == d and p["causal"] == causal]
                if not sel:
                    continue
                cols = [n for n in names if any(n in p["tflops"] for p in sel)]
                lines.append(f"  d{d} {'causal' if causal else 'full'}: "
                             + " | ".join(f"[{i}] {short[n]}" for i, n in enumerate(cols)))
                for p in sel:
                    t = p["tflops"]
                    best = max((t[n] for n in gluon_names if n in t), default=float("nan"))
                    cudnn = t.get("sdpa-cudnn", float("nan"))
                    ratio = best / cudnn if cudnn and not math.isnan(cudnn) else float("nan")
                    vals = " ".join(f"[{i}]{t[n]:5.0f}" if n in t else f"[{i}]    -"
                                    for i, n in enumerate(cols))
                    fp8_best = max((t[n] for n in gluon_names if n in t and "-fp8-" in n),
                                   default=float("nan"))
                    bf16_best = max((t[n] for n in gluon_names if n in t and "-fp8-" not in n),
                                    default=float("nan"))
                    extra = (f", best fp8 / best bf16 gluon = {fp8_best / bf16_best:.2f}"
                             if not math.isnan(fp8_best) else "")
                    ratio = bf16_best / cudnn if cudnn and not math.isnan(cudnn) else float("nan")
                    lines.append(f"    B={p['batch']} S={p['seqlen']:5d}: {vals}   best bf16 gluon / cudnn "
                                 f"= {ratio:.2f}{extra}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", default="",
                    help="substrings (comma-separated) of the variant names to check and time")
    ap.add_argument("--check-limit", type=float, default=PHASE_LIMITS["check"],
                    help="seconds for the check phase (the whole list takes longer than the default)")
    ap.add_argument("--phase", choices=["check", "bench"], help=argparse.SUPPRESS)
    ap.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.only:  # the phase processes inherit it
        os.environ["GLUON_CHECK_ONLY"] = args.only
    if args.phase == "check":
        phase_check(args.out, resume=args.resume)
        return
    if args.phase == "bench":
        check = _load(os.path.join(args.out, "gluon-check-check.json"), {})
        checked = {name: status.get("state") for name, status in check.get("variants", {}).items()}
        phase_bench(args.out, checked)
        return

    t0 = time.time()
    states = {"check": _run_phase("check", args.out, args.check_limit)}
    if states["check"].startswith("TIMEOUT"):
        check_path = os.path.join(args.out, "gluon-check-check.json")
        if any(s.get("state") == "running" for s in _load(check_path, {}).get("variants", {}).values()):
            states["check-resumed"] = _run_phase("check", args.out, RESUME_LIMIT, ["--resume"])
    states["bench"] = _run_phase("bench", args.out, PHASE_LIMITS["bench"])
    check = _load(os.path.join(args.out, "gluon-check-check.json"), {})
    bench = _load(os.path.join(args.out, "gluon-check-bench.json"), {})
    result = {"info": _env_info(), "phases": states, "check": check, "bench": bench,
              "seconds": round(time.time() - t0, 1)}
    _save(os.path.join(args.out, "gluon-check.json"), result)
    print(_table(check, bench))
    print(f"\nphases: {states}; {result['seconds']} s; wrote {os.path.join(args.out, 'gluon-check.json')}")


if __name__ == "__main__":
    main()
