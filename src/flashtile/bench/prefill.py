"""``flashtile bench prefill``: forward throughput against PyTorch SDPA's fused backends and textbook
attention.

Shapes: the FlashAttention-2 paper's sweep (batch x seqlen = 16k tokens, hidden 2048, head dims 64/128/256,
causal and not) plus the seed model's shape (Qwen2.5-1.5B: 12 query / 2 KV heads, d128, batch 1, causal,
up to 32k). Without a GPU the command only runs the correctness check, through Triton's interpreter.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import warnings
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from .. import reference
from . import check
from .common import (DTYPES, add_common_arguments, attention_flops, check_without_gpu,
                     choose_device, environment, format_number, format_seqlen, progress,
                     result_path, save_figure, speed_ratios, tflops, time_in_rounds, write_json)

TOKENS = 16384  # FA2 paper: batch x seqlen held at 16k tokens
HIDDEN = 2048  # FA2 paper: heads = hidden / head_dim
PAPER_HEAD_DIMS = (64, 128, 256)
PAPER_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
SEED_HEADS, SEED_HEADS_K, SEED_HEAD_DIM = 12, 2, 128  # Qwen2.5-1.5B
SEED_SEQLENS = (1024, 2048, 4096, 8192, 16384, 32768)
MEMORY_SEQLENS = (8192, 16384)
# Textbook attention materialises B*H*S*S scores; ~10 bytes each counts the bf16 scores, the fp32
# softmax and the masks alive at once. Above this it would OOM or take minutes.
TEXTBOOK_MAX_BYTES = 24e9
# At least ROUNDS rounds (a whole number of balanced orders: 6 for three providers) each time every
# racing provider once with do_bench (WARMUP_MS, REP_MS); a provider's time is the median of its
# rounds' medians. Textbook attention is timed once.
WARMUP_MS, REP_MS, ROUNDS = 10, 40, 5
UNRACED = ("textbook",)
TIMING_WHAT = (f"each provider but {', '.join(UNRACED)} timed in at least {ROUNDS} rounds, a whole "
               "number of balanced orders (each provider runs in every position and right after "
               "every other one equally often), after one untimed pass of the first; ms = median of "
               "the rounds' medians (ms_rounds); textbook timed once")

PROVIDERS = ("flashtile", "sdpa-flash", "sdpa-cudnn", "textbook")
# --dtype fp8: flashtile's e4m3 forward next to flashtile and the SDPA anchors in bf16
FP8_PROVIDERS = ("flashtile", "flashtile-fp8", "sdpa-flash", "sdpa-cudnn")
ANCHORS = ("sdpa-flash", "sdpa-cudnn", "textbook")
COLORS = {"flashtile": "tab:red", "sdpa-flash": "tab:blue", "sdpa-cudnn": "tab:green",
          "textbook": "tab:gray", "flashtile-fp8": "tab:purple"}


@dataclass(frozen=True)
class Point:
    family: str  # "fa2" (paper sweep) or "seed"
    batch: int
    heads: int
    heads_k: int
    seqlen: int
    head_dim: int
    causal: bool

    @property
    def flops(self) -> float:
        return attention_flops(self.batch, self.heads, self.seqlen, self.seqlen, self.head_dim,
                               self.causal)

    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        return (f"d{self.head_dim} {mask} B{self.batch} H{self.heads}/{self.heads_k} "
                f"S{format_seqlen(self.seqlen)}")


def paper_points(head_dims, seqlens, causals=(False, True)) -> list[Point]:
    heads = {d: HIDDEN // d for d in head_dims}
    return [Point("fa2", TOKENS // s, heads[d], heads[d], s, d, c)
            for d in head_dims for c in causals for s in seqlens]


def seed_points(seqlens) -> list[Point]:
    return [Point("seed", 1, SEED_HEADS, SEED_HEADS_K, s, SEED_HEAD_DIM, True) for s in seqlens]


def sweep_points(quick: bool) -> list[Point]:
    if quick:
        return paper_points((128,), (2048, 8192)) + seed_points((8192,))
    return paper_points(PAPER_HEAD_DIMS, PAPER_SEQLENS) + seed_points(SEED_SEQLENS)


# ----------------------------------------------------------------------------------------- providers

@dataclass
class Inputs:
    q: torch.Tensor  # (B, S, H, D), flash_attn's layout
    k: torch.Tensor
    v: torch.Tensor
    q_t: torch.Tensor  # (B, H, S, D) contiguous: SDPA's layout, copied so SDPA sees no strides
    k_t: torch.Tensor
    v_t: torch.Tensor


def make_inputs(point: Point, dtype: torch.dtype, device: torch.device) -> Inputs:
    def randn(heads: int) -> torch.Tensor:
        return torch.randn(point.batch, point.seqlen, heads, point.head_dim, dtype=dtype, device=device)

    q, k, v = randn(point.heads), randn(point.heads_k), randn(point.heads_k)
    return Inputs(q, k, v, *(t.transpose(1, 2).contiguous() for t in (q, k, v)))


def _flashtile_fn(point: Point, x: Inputs) -> Callable:
    import flashtile
    return lambda: flashtile.flash_attn_func(x.q, x.k, x.v, causal=point.causal)


def _sdpa_fn(point: Point, x: Inputs) -> Callable:
    gqa = point.heads != point.heads_k
    return lambda: F.scaled_dot_product_attention(x.q_t, x.k_t, x.v_t, is_causal=point.causal,
                                                  enable_gqa=gqa)


def _fp8_fn(point: Point, x: Inputs) -> Callable:
    """flashtile's FP8 forward on the point's inputs quantized once, outside the timed call (block
    scales of the kernel's tiles, Hadamard rotation of Q and K)."""
    from .. import fp8
    z = fp8.quantize_qkv(x.q, x.k, x.v, block=fp8.kernel_blocks(point.head_dim, x.q.device),
                         hadamard=True)
    return lambda: fp8.attention(z, causal=point.causal)


def _textbook_fn(point: Point, x: Inputs) -> Callable:
    return lambda: reference.attention(x.q, x.k, x.v, causal=point.causal, chunk_rows=point.seqlen)


# name -> (function builder, SDPA backend to pin or None)
_PROVIDER_SPECS = {
    "flashtile": (_flashtile_fn, None),
    "sdpa-flash": (_sdpa_fn, "FLASH_ATTENTION"),
    "sdpa-cudnn": (_sdpa_fn, "CUDNN_ATTENTION"),
    "textbook": (_textbook_fn, None),
    "flashtile-fp8": (_fp8_fn, None),
}


def textbook_bytes(point: Point) -> float:
    return 10.0 * point.batch * point.heads * point.seqlen * point.seqlen


def skip_reason(name: str, point: Point) -> str | None:
    if name == "textbook" and textbook_bytes(point) > TEXTBOOK_MAX_BYTES:
        return (f"skipped: score matrix ~{textbook_bytes(point) / 1e9:.0f} GB "
                f"> {TEXTBOOK_MAX_BYTES / 1e9:.0f} GB")
    return None


def backend_context(backend: str | None):
    """Pins SDPA to one backend, so a refused shape raises instead of silently using another one."""
    if backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(getattr(SDPBackend, backend))


def _first_line(text: str, limit: int = 300) -> str:
    text = str(text).strip()
    return text.splitlines()[0][:limit] if text else ""


def _error_text(exc: BaseException, caught: list) -> str:
    # SDPA gives the real reason a backend refused a shape as warnings; the exception only says
    # that no kernel was available.
    lines = [f"{type(exc).__name__}: {_first_line(exc)}"]
    for w in caught:
        text = _first_line(w.message)
        if text and text not in lines:
            lines.append(text)
    return " | ".join(lines)


def gpu_timer(fn: Callable) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def peak_extra_mb(fn: Callable) -> float:
    """Memory a call allocates on top of what exists before it (its output included), in MB."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del result
    return (peak - before) / 1e6


def prepare(name: str, point: Point, inputs: Inputs) -> tuple[Callable | None, str | None]:
    """The provider's call, run once (it compiles, and finds out whether the backend takes this
    shape): (the call, None), or (None, why it is unavailable). Never raises."""
    reason = skip_reason(name, point)
    if reason:
        return None, reason
    build, backend = _PROVIDER_SPECS[name]
    fn = build(point, inputs)
    caught: list = []
    try:
        with backend_context(backend):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fn()
    except Exception as exc:
        error = _error_text(exc, caught)
    else:
        return fn, None
    # Outside the except block, so the traceback no longer pins the failed call's tensors.
    del fn
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return None, error


def round_results(times: dict, flops: float) -> dict:
    """A provider's result from its rounds: the median ms (and each round's with several)."""
    ms = statistics.median(times)
    result = {"available": True, "ms": ms, "tflops": tflops(flops, ms)}
    if len(times) > 1:
        result["ms_rounds"] = list(times)
    return result


def measure_prepared(ready: dict, timer: Callable, flops: float, with_memory: bool,
                     rounds: int = 1) -> dict:
    """Time prepared calls (name -> (call, SDPA backend to pin or None)) in balanced rounds
    (``time_in_rounds``; textbook once) and give each the median of its rounds, plus its peak
    extra memory when asked; a call that raises is unavailable, never fatal."""
    def timed(fn, backend):
        with backend_context(backend):
            return timer(fn)

    times, errors = time_in_rounds(
        {name: (lambda fn=fn, backend=backend: timed(fn, backend))
         for name, (fn, backend) in ready.items()}, rounds, UNRACED)
    results: dict = {}
    for name, (fn, backend) in ready.items():
        if name in errors:
            results[name] = {"available": False, "error": _error_text(errors[name], [])}
            continue
        results[name] = round_results(times[name], flops)
        memory = None
        if with_memory:
            with backend_context(backend):
                memory = peak_extra_mb(fn)
        results[name]["peak_extra_mb"] = memory
    if errors and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return results


def measure_point(point: Point, inputs: Inputs, timer: Callable, with_memory: bool,
                  providers=PROVIDERS, rounds: int = 1) -> dict:
    """Time every provider at one point. With ``rounds`` > 1 the providers that race each other
    (all but textbook) are timed in balanced rounds (``time_in_rounds``) and each gets the median
    of its rounds: a single pass per provider in a fixed order let the GPU's clock state decide
    near ties (the first provider after textbook attention, a slow low-power call, ran 5-10%
    faster than in its later rounds). An exception makes a provider unavailable there, never
    fatal."""
    results: dict = {}
    ready: dict = {}
    for name in providers:
        fn, error = prepare(name, point, inputs)
        if fn is None:
            results[name] = {"available": False, "error": error}
        else:
            ready[name] = (fn, _PROVIDER_SPECS[name][1])
    results.update(measure_prepared(ready, timer, point.flops, with_memory, rounds))
    ready.clear()
    return {name: results[name] for name in providers}


def ratios(results: dict, anchors=ANCHORS) -> dict:
    """flashtile's speed relative to each anchor (> 1: flashtile is faster)."""
    return speed_ratios(results, "flashtile", anchors)


def output_mb(point: Point, dtype: torch.dtype) -> float:
    """Size of out + LSE, the least any implementation must allocate: the yardstick for peak memory."""
    out = point.batch * point.seqlen * point.heads * point.head_dim * torch.finfo(dtype).bits // 8
    lse = point.batch * point.heads * point.seqlen * 4
    return (out + lse) / 1e6


def measures_memory(point: Point, device: torch.device) -> bool:
    return device.type == "cuda" and point.seqlen in MEMORY_SEQLENS


def tile_config(head_dim: int, device: torch.device) -> dict:
    from ..kernels.forward import pick_config

    cfg = pick_config(head_dim, device)
    return asdict(cfg) if is_dataclass(cfg) else {"repr": repr(cfg)}


def forward_kernel(q, k, v, causal: bool) -> str:
    """The kernel flashtile.flash_attn_func runs on these inputs ("triton" or a Gluon variant)."""
    from ..kernels.forward import forward_kernel_name
    return forward_kernel_name(q, k, v, causal=causal)


def fp8_kernel(x: Inputs, point: Point) -> str:
    """The kernel the flashtile-fp8 provider's call runs on these inputs ("triton" or a Gluon variant)."""
    from .. import fp8
    from ..kernels.forward import fp8_forward_kernel_name
    e4m3 = torch.float8_e4m3fn
    q8, k8, v8 = (t.to(e4m3) for t in (x.q, x.k, x.v))
    return fp8_forward_kernel_name(q8, k8, v8, causal=point.causal,
                                   scale_blocks=fp8.kernel_blocks(point.head_dim, x.q.device))


def run_point(point: Point, dtype: torch.dtype, device: torch.device, timer: Callable, bar,
              providers=PROVIDERS, rounds: int = 1) -> dict:
    inputs = make_inputs(point, dtype, device)
    with_memory = measures_memory(point, device)
    bar.set_postfix_str(point.label(), refresh=False)
    results = measure_point(point, inputs, timer, with_memory, providers, rounds)
    bar.update(1)
    record = {**asdict(point), "flops": point.flops,
              "forward_kernel": forward_kernel(inputs.q, inputs.k, inputs.v, point.causal),
              "tile_config": tile_config(point.head_dim, device),
              "providers": results, "ratios": ratios(results),
              "out_lse_mb": output_mb(point, dtype) if with_memory else None}
    if "flashtile-fp8" in results:  # FP8 against bf16 flashtile and cuDNN
        record["ratios_fp8"] = speed_ratios(results, "flashtile-fp8", ("flashtile", "sdpa-cudnn"))
        record["fp8_kernel"] = fp8_kernel(inputs, point)
    return record


def run_sweep(points: list[Point], dtype: torch.dtype, device: torch.device,
              timer: Callable | None = None, providers=PROVIDERS, rounds: int = 1) -> list[dict]:
    timer = timer or gpu_timer
    bar = progress(len(points), "prefill")
    records = []
    try:
        with torch.no_grad():
            for point in points:
                record = run_point(point, dtype, device, timer, bar, providers, rounds)
                bar.write(_point_summary(record))
                records.append(record)
    finally:
        bar.close()
    return records


# ----------------------------------------------------------------------------------------- reporting

def _tflops_of(record: dict, name: str) -> float | None:
    result = record["providers"][name]
    return result.get("tflops") if result.get("available") else None


def _point_of(record: dict) -> Point:
    return Point(**{f: record[f] for f in Point.__dataclass_fields__})


def _point_summary(record: dict) -> str:
    point = _point_of(record)
    names = list(record["providers"])
    parts = [f"{name} {format_number(_tflops_of(record, name))}" for name in names]
    line = f"{point.label():<32} TFLOP/s: " + ", ".join(parts)
    if record["out_lse_mb"] is not None:
        mems = [f"{name} {format_number(record['providers'][name].get('peak_extra_mb'), '{:.1f}')}"
                for name in names]
        line += f"; peak extra MB: {', '.join(mems)} (out+lse {record['out_lse_mb']:.1f})"
    return line


def format_table(records: list[dict], title: str, providers=PROVIDERS) -> str:
    """The short table printed last: TFLOP/s per provider and flashtile's ratio to the SDPA anchors."""
    short = {"flashtile": "flashtile", "sdpa-flash": "flash", "sdpa-cudnn": "cudnn", "textbook": "textbook",
             "flashtile-fp8": "fp8"}
    widths = {"flashtile": 9, "sdpa-flash": 7, "sdpa-cudnn": 7, "textbook": 8, "flashtile-fp8": 7}
    fp8 = "flashtile-fp8" in providers
    columns = (f"{'d':>4} {'causal':>6} {'B':>3} {'H/Hk':>6} {'S':>5} | "
               + " ".join(f"{short[n]:>{widths[n]}}" for n in providers)
               + f" | {'vs flash':>8} {'vs cudnn':>8}"
               + (f" | {'fp8/bf16':>8} {'fp8/cudnn':>9}" if fp8 else "") + " | kernel")
    lines = [title, columns, "-" * len(columns)]
    for r in records:
        ratio = r["ratios"]
        lines.append(
            f"{r['head_dim']:>4} {'yes' if r['causal'] else 'no':>6} {r['batch']:>3} "
            f"{str(r['heads']) + '/' + str(r['heads_k']):>6} {format_seqlen(r['seqlen']):>5} | "
            + " ".join(f"{format_number(_tflops_of(r, n)):>{widths[n]}}" for n in providers)
            + f" | {format_number(ratio['sdpa-flash'], '{:.2f}x'):>8} "
            f"{format_number(ratio['sdpa-cudnn'], '{:.2f}x'):>8}"
            + (f" | {format_number(r['ratios_fp8']['flashtile'], '{:.2f}x'):>8} "
               f"{format_number(r['ratios_fp8']['sdpa-cudnn'], '{:.2f}x'):>9}" if fp8 else "")
            + f" | {r.get('forward_kernel', 'triton').split('-')[0]}"
            + (f", bwd {r['backward_kernel']}" if "backward_kernel" in r else "")
            + (f", fp8 {r.get('fp8_kernel', 'triton').split('-')[0]}" if fp8 else ""))
    return "\n".join(lines)


def _panels(records: list[dict]) -> list[tuple[str, list[dict]]]:
    panels = []
    for d in sorted({r["head_dim"] for r in records if r["family"] == "fa2"}):
        recs = [r for r in records if r["family"] == "fa2" and r["head_dim"] == d]
        tokens = format_seqlen(recs[0]["batch"] * recs[0]["seqlen"])
        panels.append((f"d{d}, H{recs[0]['heads']}, B x S = {tokens}", recs))
    seed = [r for r in records if r["family"] == "seed"]
    if seed:
        r = seed[0]
        panels.append((f"Qwen2.5-1.5B: H{r['heads']}/{r['heads_k']}, d{r['head_dim']}, B{r['batch']}",
                       seed))
    return panels


def draw_tflops_panels(axes, records: list[dict], providers, ylabel: str) -> int:
    """TFLOP/s against seqlen on ``axes``, one panel per head dim plus the seed shape (solid lines
    non-causal, dashed causal); returns how many panels were drawn."""
    from matplotlib.lines import Line2D

    panels = _panels(records)
    for ax, (panel_title, recs) in zip(axes, panels):
        for name in providers:
            for causal in (False, True):
                pts = [(r["seqlen"], _tflops_of(r, name)) for r in recs
                       if r["causal"] == causal and _tflops_of(r, name) is not None]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, color=COLORS[name], linestyle="--" if causal else "-", marker="o",
                            markersize=3)
        seqlens = sorted({r["seqlen"] for r in recs})
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqlens)
        ax.set_xticklabels([format_seqlen(s) for s in seqlens])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set(title=panel_title, xlabel="sequence length", ylabel=ylabel)
        ax.grid(alpha=0.3)
    if panels:
        handles = [Line2D([], [], color=COLORS[n], label=n) for n in providers]
        handles += [Line2D([], [], color="black", label="non-causal"),
                    Line2D([], [], color="black", linestyle="--", label="causal")]
        axes[len(panels) - 1].legend(handles=handles, fontsize=7, loc="best")
    return len(panels)


def write_plot(records: list[dict], path: Path, title: str, providers=PROVIDERS) -> str:
    """TFLOP/s against seqlen, one panel per head dim plus the seed shape; returns what happened."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: skipped the plot"
    count = len(_panels(records))
    if not count:
        return "no points to plot"
    fig, axes = plt.subplots(1, count, figsize=(4.6 * count, 4.2), squeeze=False)
    draw_tflops_panels(list(axes[0]), records, providers, "TFLOP/s")
    fig.suptitle(title)
    return save_figure(fig, path)


# ----------------------------------------------------------------------------------------- command

def add_arguments(parser) -> None:
    add_common_arguments(parser, "short sweep (d128 at 2k and 8k, causal and not, seed shape at 8k)",
                         "skip the correctness check", with_dtype=False)
    parser.add_argument("--dtype", choices=sorted(DTYPES) + ["fp8"], default="bf16",
                        help="input dtype (the check covers bf16 and fp16); fp8: flashtile's e4m3 "
                             "forward (block scales, Hadamard) next to flashtile and SDPA in bf16")


def run(args) -> int:
    device = choose_device()
    if device.type != "cuda":
        return _run_without_gpu(args, device)
    return _run_on_gpu(args, device)


def _run_without_gpu(args, device: torch.device) -> int:
    return check_without_gpu("prefill", "prefill", [lambda: check.run_check(device)], args)


def _run_on_gpu(args, device: torch.device) -> int:
    fp8 = args.dtype == "fp8"
    dtype = torch.bfloat16 if fp8 else DTYPES[args.dtype]
    providers = FP8_PROVIDERS if fp8 else PROVIDERS
    env = environment(device)
    print(f"flashtile bench prefill: {env['gpu']} ({env['sm_count']} SMs), {args.dtype}, "
          f"torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}")
    checks = None if args.no_check else check.run_check(device)
    records = run_sweep(sweep_points(args.quick), dtype, device, providers=providers, rounds=ROUNDS)

    payload = {"benchmark": "prefill", **env, "dtype": args.dtype, "quick": args.quick,
               "command": " ".join(sys.argv),
               "timing": {"function": "triton.testing.do_bench", "warmup_ms": WARMUP_MS,
                          "rep_ms": REP_MS, "return_mode": "median", "unit": "ms",
                          "rounds": ROUNDS, "what": TIMING_WHAT},
               "flops": "4*B*H*Sq*Sk*D, halved when causal (FlashAttention-2 convention)",
               "memory": "peak_extra_mb: max_memory_allocated after one call minus memory_allocated "
                         "before it (output included), MB = 1e6 bytes; out_lse_mb: size of out + LSE",
               "check": checks, "points": records}
    name = "prefill-fp8" if fp8 else "prefill"  # an FP8 run never overwrites the bf16 results
    json_path = result_path(args.out, name, env["gpu"], "json")
    write_json(json_path, payload)
    print(f"Wrote {json_path}")
    title = f"flashtile prefill forward, {args.dtype}, {env['gpu']}, {env['date'][:10]}"
    try:
        print(write_plot(records, result_path(args.out, name, env["gpu"], "png"), title, providers))
    except Exception as exc:  # the JSON is written; a plotting problem must not hide the table
        print(f"Plot failed: {type(exc).__name__}: {exc}")
    return _finish(records, checks, f"Prefill forward TFLOP/s, {args.dtype}, {env['gpu']} "
                                    f"(vs = flashtile / anchor)", providers)


def _finish(records: list[dict], checks: list[dict] | None, title: str, providers=PROVIDERS) -> int:
    """Warnings first, then the table as the last output; non-zero exit if anything was wrong."""
    failed_checks = [] if checks is None else [c for c in checks if not c["passed"]]
    broken = [r for r in records if not r["providers"]["flashtile"].get("available")]
    if failed_checks:
        print(f"WARNING: {len(failed_checks)} correctness case(s) FAILED: these timings are of a "
              "kernel that gives wrong answers.")
    for r in broken:
        error = r["providers"]["flashtile"]["error"]
        print(f"WARNING: flashtile failed at {_point_of(r).label()}: {error}")
    print()
    print(format_table(records, title, providers))
    return 1 if failed_checks or broken else 0
