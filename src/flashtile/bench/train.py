"""``flashtile bench train``: forward + backward throughput against PyTorch SDPA's fused backends.

One timed step is the forward and ``torch.autograd.grad(out, (q, k, v), dout)``, so nothing accumulates
between repetitions. Shapes are prefill's (the FlashAttention-2 paper's sweep and the seed model's
shape), plus packed variable-length sequences: flash_attn_varlen_func on the packed tokens against SDPA
on the zero-padded batch a user without varlen would run. Without a GPU the command only runs the
backward correctness check, through Triton's interpreter.
"""

from __future__ import annotations

import math
import random
import sys
import warnings
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from .. import reference
from . import check
from .common import (DTYPES, FWD_BWD_FACTOR, add_common_arguments, attention_train_flops,
                     check_without_gpu, choose_device, environment, format_number, progress,
                     result_path, save_figure, tflops, write_json)
from .prefill import (COLORS, PROVIDERS, ROUNDS, TIMING_WHAT, Point, _error_text, _panels,
                      backend_context, draw_tflops_panels, measure_prepared, ratios,
                      sweep_points, tile_config)
from .prefill import format_table as prefill_table
from .prefill import forward_kernel

# Timed as bench prefill times (its ROUNDS balanced rounds of do_bench, medians; textbook once).
WARMUP_MS, REP_MS = 10, 40
MEMORY_SEQLENS = (8192, 16384)
# Textbook attention keeps its float32 score matrix (and several more of its size) for the backward;
# it runs only where that matrix is small, so it cannot dominate the run's time or memory.
TEXTBOOK_MAX_SCORE_BYTES = 4e9


# Packed sequences: lengths from a fixed-seed lognormal (median 600 tokens, long tail), clipped, with a
# few explicit lengths; Python's own generator, so the lengths are the same on every machine.
VARLEN_COUNT = 64
VARLEN_REQUIRED = (1000, 3000, 96)
VARLEN_MIN, VARLEN_MAX = 64, 8192
VARLEN_SEED, VARLEN_MEDIAN, VARLEN_SIGMA = 0, 600, 1.0
VARLEN_HEADS, VARLEN_HEAD_DIM, VARLEN_CAUSAL = 16, 128, True
VARLEN_PROVIDERS = ("flashtile", "sdpa-flash", "sdpa-cudnn")


def train_flops(point: Point) -> float:
    """Forward + backward FLOPs of one point (FA2 counting: 3.5 x the forward)."""
    return attention_train_flops(point.batch, point.heads, point.seqlen, point.seqlen, point.head_dim,
                                 point.causal)


# ----------------------------------------------------------------------------------------- packed

def varlen_lengths(count: int = VARLEN_COUNT, seed: int = VARLEN_SEED,
                   required: tuple[int, ...] = VARLEN_REQUIRED, low: int = VARLEN_MIN,
                   high: int = VARLEN_MAX, median: float = VARLEN_MEDIAN,
                   sigma: float = VARLEN_SIGMA) -> list[int]:
    """``count`` sequence lengths: ``required`` plus lognormal draws clipped to [low, high], shuffled
    so that the long ones are not all in one place. Same arguments, same list."""
    if len(required) > count:
        raise ValueError(f"{len(required)} required lengths do not fit in {count} sequences")
    rng = random.Random(seed)
    drawn = [min(high, max(low, round(rng.lognormvariate(math.log(median), sigma))))
             for _ in range(count - len(required))]
    lengths = drawn + list(required)
    rng.shuffle(lengths)
    return lengths


def varlen_train_flops(lengths, heads: int, head_dim: int, causal: bool) -> float:
    """Useful forward + backward work of packed sequences: each sequence's own L^2 term."""
    return sum(attention_train_flops(1, heads, n, n, head_dim, causal) for n in lengths)


def cu_seqlens_of(lengths, device: torch.device) -> torch.Tensor:
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def pad_packed(x: torch.Tensor, lengths, max_len: int) -> torch.Tensor:
    """(total, H, D) packed tokens -> (B, H, max_len, D) contiguous, zero after each sequence's end."""
    device = x.device
    lens = torch.tensor(list(lengths), device=device)
    batch_of = torch.repeat_interleave(torch.arange(len(lengths), device=device), lens)
    starts = cu_seqlens_of(lengths, device)[:-1].long()
    position = torch.arange(x.shape[0], device=device) - starts[batch_of]
    padded = x.new_zeros(len(lengths), max_len, *x.shape[1:])
    padded[batch_of, position] = x
    return padded.transpose(1, 2).contiguous()


# ----------------------------------------------------------------------------------------- providers

@dataclass
class Inputs:
    q: torch.Tensor  # (B, S, H, D) leaves that require grad: flash_attn's layout
    k: torch.Tensor
    v: torch.Tensor
    q_t: torch.Tensor  # (B, H, S, D) contiguous leaves that require grad: SDPA's layout
    k_t: torch.Tensor
    v_t: torch.Tensor


def make_inputs(point: Point, dtype: torch.dtype, device: torch.device) -> Inputs:
    def randn(heads: int) -> torch.Tensor:
        return torch.randn(point.batch, point.seqlen, heads, point.head_dim, dtype=dtype, device=device)

    q, k, v = randn(point.heads), randn(point.heads_k), randn(point.heads_k)
    transposed = [t.transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v)]
    return Inputs(*(t.requires_grad_(True) for t in (q, k, v)), *transposed)


def provider(name: str, point: Point, x: Inputs) -> tuple[Callable, tuple, str | None]:
    """(forward, the leaves its gradients are taken for, SDPA backend to pin or None)."""
    if name == "flashtile":
        import flashtile
        return (lambda: flashtile.flash_attn_func(x.q, x.k, x.v, causal=point.causal),
                (x.q, x.k, x.v), None)
    if name in ("sdpa-flash", "sdpa-cudnn"):
        gqa = point.heads != point.heads_k
        backend = "FLASH_ATTENTION" if name == "sdpa-flash" else "CUDNN_ATTENTION"
        return (lambda: F.scaled_dot_product_attention(x.q_t, x.k_t, x.v_t, is_causal=point.causal,
                                                       enable_gqa=gqa),
                (x.q_t, x.k_t, x.v_t), backend)
    if name == "textbook":
        return (lambda: reference.attention(x.q, x.k, x.v, causal=point.causal,
                                            chunk_rows=point.seqlen)[0],
                (x.q, x.k, x.v), None)
    raise ValueError(f"unknown provider {name!r}")


def textbook_score_bytes(point: Point) -> float:
    return 4.0 * point.batch * point.heads * point.seqlen * point.seqlen


def skip_reason(name: str, point: Point) -> str | None:
    if name == "textbook" and textbook_score_bytes(point) > TEXTBOOK_MAX_SCORE_BYTES:
        return (f"skipped: float32 score matrix ~{textbook_score_bytes(point) / 1e9:.0f} GB "
                f"> {TEXTBOOK_MAX_SCORE_BYTES / 1e9:.0f} GB")
    return None


def gpu_timer(fn: Callable) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def prepare_step(forward: Callable, leaves, backend: str | None,
                 dout_mask: torch.Tensor | None = None) -> tuple[Callable | None, str | None]:
    """One training step, the forward plus ``torch.autograd.grad``, run once (it compiles both, and
    finds out whether the backend takes this shape): (the step, None), or (None, why it is
    unavailable). Never raises. dout is drawn like the provider's own output (same strides: cuDNN's
    backward wants them to match), zeroed where ``dout_mask`` is False."""
    caught: list = []
    try:
        with backend_context(backend):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = forward()
                dout = torch.randn_like(out)
                if dout_mask is not None:
                    dout.masked_fill_(~dout_mask, 0.0)
                del out

                def step():
                    return torch.autograd.grad(forward(), leaves, dout)

                step()
    except Exception as exc:
        error = _error_text(exc, caught)
    else:
        return step, None
    # Outside the except block, so the traceback no longer pins the failed call's tensors.
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return None, error


def measure_steps(specs: dict, timer: Callable, flops: float, with_memory: bool,
                  rounds: int = 1) -> dict:
    """Time the training step of each provider in ``specs`` (name -> (forward, leaves, SDPA backend
    or None, dout mask or None)), in balanced rounds as bench prefill times its forwards
    (``time_in_rounds``; textbook once); an exception makes a provider unavailable, never fatal."""
    results: dict = {}
    ready: dict = {}
    for name, (forward, leaves, backend, dout_mask) in specs.items():
        step, error = prepare_step(forward, leaves, backend, dout_mask)
        if step is None:
            results[name] = {"available": False, "error": error}
        else:
            ready[name] = (step, backend)
    results.update(measure_prepared(ready, timer, flops, with_memory, rounds))
    ready.clear()
    return {name: results[name] for name in specs}


def grads_mb(point: Point, dtype: torch.dtype) -> float:
    """out + LSE + dq + dk + dv: what any fused fwd+bwd must hold at its peak; the memory yardstick."""
    item = torch.finfo(dtype).bits // 8
    q_like = point.batch * point.seqlen * point.heads * point.head_dim * item
    kv_like = point.batch * point.seqlen * point.heads_k * point.head_dim * item
    lse = point.batch * point.heads * point.seqlen * 4
    return (2 * q_like + 2 * kv_like + lse) / 1e6


def backward_kernel(q, k, v, causal: bool) -> str:
    """What flash_attn_func's backward (deterministic=False, as timed here) runs on these inputs."""
    from ..kernels.backward import backward_kernel_name
    return backward_kernel_name(q, k, v, causal=causal)


def backward_config(head_dim: int, device: torch.device) -> dict:
    from ..kernels.backward import pick_backward_config

    cfg = pick_backward_config(head_dim, device)
    return asdict(cfg) if is_dataclass(cfg) else {"repr": repr(cfg)}


def run_point(point: Point, dtype: torch.dtype, device: torch.device, timer: Callable, bar,
              rounds: int = 1) -> dict:
    inputs = make_inputs(point, dtype, device)
    with_memory = device.type == "cuda" and point.seqlen in MEMORY_SEQLENS
    flops = train_flops(point)
    bar.set_postfix_str(point.label(), refresh=False)
    results, specs = {}, {}
    for name in PROVIDERS:
        reason = skip_reason(name, point)
        if reason:
            results[name] = {"available": False, "error": reason}
        else:
            forward, leaves, backend = provider(name, point, inputs)
            specs[name] = (forward, leaves, backend, None)
    results.update(measure_steps(specs, timer, flops, with_memory, rounds))
    results = {name: results[name] for name in PROVIDERS}
    del specs
    bar.update(1)
    return {**asdict(point), "flops": flops, "flops_forward": point.flops,
            "forward_kernel": forward_kernel(inputs.q, inputs.k, inputs.v, point.causal),
            "backward_kernel": backward_kernel(inputs.q, inputs.k, inputs.v, point.causal),
            "tile_config": tile_config(point.head_dim, device),
            "backward_config": backward_config(point.head_dim, device),
            "providers": results, "ratios": ratios(results),
            "out_lse_grads_mb": grads_mb(point, dtype) if with_memory else None}


def run_varlen(dtype: torch.dtype, device: torch.device, timer: Callable, bar,
               lengths: list[int] | None = None, rounds: int = 1) -> dict:
    """flash_attn_varlen_func on packed sequences against SDPA on the zero-padded batch.

    Causal SDPA is top-left aligned, so on right-padded sequences every real query row sees exactly its
    own sequence's keys: the padded batch gives the real tokens the right answer and only wastes work
    on the padding. dout is zero on padding rows, as a masked loss would make it.
    """
    import flashtile

    lengths = list(varlen_lengths() if lengths is None else lengths)
    heads, head_dim, causal = VARLEN_HEADS, VARLEN_HEAD_DIM, VARLEN_CAUSAL
    total, max_len, batch = sum(lengths), max(lengths), len(lengths)
    useful = varlen_train_flops(lengths, heads, head_dim, causal)
    padded_work = attention_train_flops(batch, heads, max_len, max_len, head_dim, causal)
    cu = cu_seqlens_of(lengths, device)

    q, k, v = (torch.randn(total, heads, head_dim, dtype=dtype, device=device).requires_grad_(True)
               for _ in range(3))
    with torch.no_grad():
        padded = [pad_packed(t, lengths, max_len).requires_grad_(True) for t in (q, k, v)]
    real = (torch.arange(max_len, device=device).view(1, -1)
            < torch.tensor(lengths, device=device).view(-1, 1)).view(batch, 1, max_len, 1)

    def packed_forward():
        return flashtile.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=causal)

    def padded_forward():
        return F.scaled_dot_product_attention(*padded, is_causal=causal)

    with_memory = device.type == "cuda"
    bar.set_postfix_str("varlen", refresh=False)
    backends = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION"}
    specs = {name: (packed_forward, (q, k, v), None, None) if name == "flashtile"
             else (padded_forward, tuple(padded), backends[name], real) for name in VARLEN_PROVIDERS}
    results = measure_steps(specs, timer, useful, with_memory, rounds)
    for name in VARLEN_PROVIDERS[1:]:
        if results[name].get("available"):
            results[name]["tflops_padded_work"] = tflops(padded_work, results[name]["ms"])
    bar.update(1)
    return {"lengths": lengths, "batch": batch, "total_tokens": total, "max_len": max_len,
            "padded_tokens": batch * max_len, "heads": heads, "heads_k": heads, "head_dim": head_dim,
            "causal": causal, "flops_useful": useful, "flops_padded": padded_work,
            "providers": results, "speedup": ratios(results, anchors=VARLEN_PROVIDERS[1:])}


def run_sweep(points: list[Point], dtype: torch.dtype, device: torch.device,
              timer: Callable | None = None, with_varlen: bool = True,
              rounds: int = 1) -> tuple[list[dict], dict | None]:
    timer = timer or gpu_timer
    bar = progress(len(points) + (1 if with_varlen else 0), "train")
    records, varlen = [], None
    try:
        for point in points:
            record = run_point(point, dtype, device, timer, bar, rounds)
            bar.write(_point_summary(record))
            records.append(record)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if with_varlen:
            varlen = run_varlen(dtype, device, timer, bar, rounds=rounds)
            bar.write(format_varlen(varlen))
    finally:
        bar.close()
    return records, varlen


# ----------------------------------------------------------------------------------------- reporting

def _tflops_of(record: dict, name: str) -> float | None:
    result = record["providers"].get(name, {})
    return result.get("tflops") if result.get("available") else None


def _point_of(record: dict) -> Point:
    return Point(**{f: record[f] for f in Point.__dataclass_fields__})


def _point_summary(record: dict) -> str:
    point = _point_of(record)
    parts = [f"{name} {format_number(_tflops_of(record, name))}" for name in PROVIDERS]
    line = f"{point.label():<32} fwd+bwd TFLOP/s: " + ", ".join(parts)
    if record["out_lse_grads_mb"] is not None:
        mems = [f"{name} {format_number(record['providers'][name].get('peak_extra_mb'), '{:.1f}')}"
                for name in PROVIDERS]
        line += (f"; peak extra MB: {', '.join(mems)} "
                 f"(out+lse+grads {record['out_lse_grads_mb']:.1f})")
    return line


def format_table(records: list[dict], title: str) -> str:
    """The short table printed last: fwd+bwd TFLOP/s and flashtile's ratio to the SDPA anchors."""
    return prefill_table(records, title, providers=("flashtile", "sdpa-flash", "sdpa-cudnn"))


def format_varlen(v: dict) -> str:
    lengths = v["lengths"]
    head = (f"varlen {v['batch']} seqs L{min(lengths)}..{v['max_len']} ({v['total_tokens']} tokens, "
            f"padded {v['batch']}x{v['max_len']}) H{v['heads']} d{v['head_dim']} "
            f"{'causal' if v['causal'] else 'full'}:")
    parts = []
    for name in VARLEN_PROVIDERS:
        r = v["providers"][name]
        label = name if name == "flashtile" else f"{name} padded"
        if not r.get("available"):
            parts.append(f"{label} unavailable")
            continue
        text = f"{label} {r['ms']:.2f} ms ({format_number(r['tflops'])} TFLOP/s useful"
        if r.get("peak_extra_mb") is not None:
            text += f", peak extra {r['peak_extra_mb']:.0f} MB"
        speed = v["speedup"].get(name)
        text += ")" if speed is None else f"; flashtile speedup {speed:.2f}x)"
        parts.append(text)
    return head + " " + "; ".join(parts)


def write_plot(records: list[dict], varlen: dict | None, path: Path, title: str) -> str:
    """TFLOP/s against seqlen, one panel per head dim plus the seed shape, and a varlen bar panel."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: skipped the plot"
    n_axes = len(_panels(records)) + (1 if varlen else 0)
    if not n_axes:
        return "no points to plot"
    fig, axes = plt.subplots(1, n_axes, figsize=(4.6 * n_axes, 4.2), squeeze=False)
    axes = list(axes[0])
    draw_tflops_panels(axes, records, PROVIDERS, "fwd+bwd TFLOP/s")
    if varlen:
        _varlen_bars(axes[-1], varlen)
    fig.suptitle(title)
    return save_figure(fig, path)


def _varlen_bars(ax, varlen: dict) -> None:
    names = [n for n in VARLEN_PROVIDERS if varlen["providers"][n].get("available")]
    ms = [varlen["providers"][n]["ms"] for n in names]
    labels = [n if n == "flashtile" else f"{n}\n(padded)" for n in names]
    bars = ax.bar(range(len(names)), ms, color=[COLORS[n] for n in names])
    for bar, name in zip(bars, names):
        speed = varlen["speedup"].get(name)
        note = f"{bar.get_height():.1f} ms" + ("" if speed is None else f"\nspeedup {speed:.2f}x")
        ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylim(top=max(ms, default=1.0) * 1.25)
    ax.set(title=f"varlen: {varlen['batch']} seqs, {varlen['total_tokens']} tokens, "
                 f"H{varlen['heads']} d{varlen['head_dim']}", ylabel="fwd+bwd ms (lower is better)")
    ax.grid(alpha=0.3, axis="y")


# ----------------------------------------------------------------------------------------- command

def add_arguments(parser) -> None:
    add_common_arguments(parser, "short sweep (d128 at 2k and 8k, causal and not, seed shape at 8k, varlen)",
                         "skip the backward correctness check")


def run(args) -> int:
    device = choose_device()
    if device.type != "cuda":
        return _run_without_gpu(args, device)
    return _run_on_gpu(args, device)


def _run_without_gpu(args, device: torch.device) -> int:
    return check_without_gpu("train", "train (forward + backward)",
                             [lambda: check.run_backward_check(device),
                              lambda: check.run_training_extras(device)], args)


def _run_on_gpu(args, device: torch.device) -> int:
    dtype = DTYPES[args.dtype]
    env = environment(device)
    print(f"flashtile bench train: {env['gpu']} ({env['sm_count']} SMs), {args.dtype}, "
          f"torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}")
    checks = None if args.no_check else check.run_backward_check(device)
    extras = None if args.no_check else check.run_training_extras(device)
    torch.cuda.empty_cache()
    records, varlen = run_sweep(sweep_points(args.quick), dtype, device, rounds=ROUNDS)

    payload = {"benchmark": "train", **env, "dtype": args.dtype, "quick": args.quick,
               "command": " ".join(sys.argv),
               "timing": {"function": "triton.testing.do_bench", "warmup_ms": WARMUP_MS,
                          "rep_ms": REP_MS, "return_mode": "median", "unit": "ms", "rounds": ROUNDS,
                          "what": TIMING_WHAT,
                          "step": "out = forward(); torch.autograd.grad(out, (q, k, v), dout)"},
               "flops": f"{FWD_BWD_FACTOR:g} x forward, forward = 4*B*H*Sq*Sk*D halved when causal "
                        "(FlashAttention-2 convention); varlen: sum over sequences of the same "
                        "(useful work, not the padded batch's)",
               "memory": "peak_extra_mb: max_memory_allocated during one step minus memory_allocated "
                         "before it (gradients included), MB = 1e6 bytes; out_lse_grads_mb: size of "
                         "out + LSE + dq + dk + dv",
               "check": checks, "extra_checks": extras, "points": records, "varlen": varlen}
    json_path = result_path(args.out, "train", env["gpu"], "json")
    write_json(json_path, payload)
    print(f"Wrote {json_path}")
    title = f"flashtile train (forward + backward), {args.dtype}, {env['gpu']}, {env['date'][:10]}"
    try:
        print(write_plot(records, varlen, result_path(args.out, "train", env["gpu"], "png"), title))
    except Exception as exc:  # the JSON is written; a plotting problem must not hide the table
        print(f"Plot failed: {type(exc).__name__}: {exc}")
    return _finish(records, varlen, None if args.no_check else checks + extras,
                   f"Train forward + backward TFLOP/s, {args.dtype}, {env['gpu']} "
                   f"(vs = flashtile / anchor)")


def _finish(records: list[dict], varlen: dict | None, checks: list[dict] | None, title: str) -> int:
    """Warnings first, then the table and the varlen line as the last output; non-zero exit if
    anything was wrong."""
    failed_checks = [] if checks is None else [c for c in checks if not c["passed"]]
    broken = [r for r in records if not r["providers"]["flashtile"].get("available")]
    varlen_broken = varlen is not None and not varlen["providers"]["flashtile"].get("available")
    if failed_checks:
        print(f"WARNING: {len(failed_checks)} backward correctness case(s) FAILED: these timings are "
              "of a kernel that gives wrong gradients.")
    for r in broken:
        error = r["providers"]["flashtile"]["error"]
        print(f"WARNING: flashtile failed at {_point_of(r).label()}: {error}")
    if varlen_broken:
        print(f"WARNING: flashtile failed on the varlen case: {varlen['providers']['flashtile']['error']}")
    print()
    print(format_table(records, title))
    if varlen is not None:
        print(format_varlen(varlen))
    return 1 if failed_checks or broken or varlen_broken else 0
