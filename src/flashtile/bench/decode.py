"""``flashtile bench decode`` and ``flashtile bench paged``: one-token decode against a KV cache, as
memory bandwidth.

Decode reads the whole cache once per token and does almost no arithmetic, so it is measured in GB/s
of K+V read, against a read ceiling measured in the same run (the fastest of a streaming read
kernel's configs over 8 GiB, ``stream_read``; ``torch.sum``, the ceiling before, is printed beside it).
The method:

* every provider runs as a CUDA graph of layer calls over L "layers", each with its own K/V cache, at
  least 1 GiB of K+V in all, so no read hits L2; the graph holds more calls than L where a replay
  would read less than ``GRAPH_BYTES`` (16 GB), up to ``GRAPH_CALLS`` = 32 (a 32-layer model's decode
  step), cycling through the layers (a cache is read again only after >= 1 GiB of other reads: still
  cold), so that a replay's fixed cost outside its kernels (~12 us) weighs at most ~0.3% rather than
  falling on L = 1-2 layers of 0.5-1.1 GB; the graph replay is timed with ``triton.testing.do_bench``
  (median) and divided by its calls, the providers of a point in balanced rounds (``ROUNDS``), each
  taking the median of its rounds;
* bytes = the K+V bytes the step must read: sum over the batch of cache_seqlens[b] * Hk * D * 2 tensors
  * element size; every sequence holds exactly ``context`` tokens and every cache is exactly that long,
  so each provider reads the same bytes;
* the layers' caches are one allocation per point that every provider views in its own layout:
  flash_attn's (B, S, Hk, D) for flashtile, SDPA's (B, Hk, S, D) for PyTorch (both contiguous, no copy
  in the timed call), and page pools (num_pages, page_size, Hk, D) behind a shuffled block table for
  the paged runs.

``decode`` compares flashtile (flash_attn_with_kvcache, cache_seqlens on the device) with SDPA's flash
and cuDNN backends; ``paged`` compares flashtile through a block table (page size 16 everywhere, page
sizes 1 and 256 at one context) with flashtile on the contiguous cache. Before timing, a correctness
check compares decode with a float64 reference (contiguous and paged caches, several splits), and a
graph-replay check captures one decode step, grows cache_seqlens in place and replays it. Without a GPU
only the correctness check runs, through Triton's interpreter.
"""

from __future__ import annotations

import functools
import math
import random
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from .. import reference
from . import check
from .common import (DEFAULT_OUT, check_without_gpu, choose_device, environment, format_number,
                     format_seqlen, gbps, progress, result_path, save_figure, speed_ratios,
                     time_in_rounds, write_json)
from .prefill import _error_text, backend_context

DTYPE = torch.bfloat16
DTYPE_NAME = "bf16"
HEAD_DIM = 128
# (name, query heads, KV heads)
MODELS = (("Llama-3-8B", 32, 8), ("Qwen2.5-1.5B", 12, 2))
BATCHES = (1, 16, 64)
CONTEXTS = (1024, 4096, 16384, 32768, 65536, 131072)
QUICK_BATCHES = (1, 16)
QUICK_CONTEXTS = (4096, 32768)
QUICK_MODELS = MODELS[:1]

MIN_TOTAL_BYTES = 1 << 30  # K+V over all layers: far beyond L2, so every read comes from DRAM
MAX_TOTAL_BYTES = 60e9  # skip a point whose caches (all layers) would hold more than this
FREE_MEMORY_FRACTION = 0.9  # ... or more than this share of the GPU memory free at that point
# Read for the ceiling: 8 GiB (1.9 ms) rather than 2, so that one launch's ramp and tail weigh
# ~0.3%: over 2 GiB the fastest read (4,505 GB/s) stayed 1.2% under decode steps of 8.6 GB a layer
# (4,563, paged-nvidia-h200-20261201 before this change)
CEILING_BYTES = 8 << 30

PAGE_SIZE = 16
PAGE_SWEEP_SIZES = (1, 256)
PAGE_SWEEP_CONTEXT = 32768  # in both the full and the quick context lists

# Every provider of a point timed in at least ROUNDS rounds, a whole number of balanced orders (12
# for three providers, 16 for four), each a do_bench of its graph replay (WARMUP_MS, REP_MS); its time
# is the median of its rounds' medians. One pass per provider in a fixed order (before 2026-11-30) let
# the order decide differences of a few percent. Six rounds (until 2026-12-01) were too few on long
# caches: the H200 reaches its 700 W power cap there and the rounds that fall into a capped stretch
# run 4-19% slower, three of six for flashtile at B16 32/8 128k in decode-nvidia-h200-20261201-c
# (0.96x cuDNN as the median; 1.002x in decode-long-ab-h200-20261201.log's ten rounds, 0.995x in
# twelve in decode-nvidia-h200-20261201-e).
WARMUP_MS, REP_MS, ROUNDS = 10, 40, 10
# A captured graph's layer calls cycle through the L layers' caches (a cache is read again only after
# >= 1 GiB of other reads, so every read stays cold) until the replay reads GRAPH_BYTES, at most
# GRAPH_CALLS calls (a 32-layer model's decode step) unless L is more. A graph replay costs ~12 us
# beyond its calls (decode-timeline-h200-20261203: a graph of a point's L calls against one of 32
# calls over the same caches, 11.6 and 12.0 us more a replay at 0.55 and 1.1 GB a layer), which
# graphs of L = 1-2 layers of 0.5-1.1 GB had charged to one or two layers (until 2026-12-03: 4-5% of
# such a layer).
GRAPH_CALLS, GRAPH_BYTES = 32, 16e9
TIMING_WHAT = (f"replay of one CUDA graph of layer calls cycling through L layers' K/V caches (>= "
               f"{MIN_TOTAL_BYTES / 2**30:g} GiB of K+V in all unless --layers), max(L, min("
               f"{GRAPH_CALLS}, {GRAPH_BYTES / 1e9:g} GB / bytes a layer)) calls (graph_calls), divided "
               f"by its calls; every "
               f"provider of a point timed in at least {ROUNDS} rounds, a whole number of balanced "
               "orders (each provider in every position and right after every other one equally "
               "often), after one untimed pass of the first; replay_ms = median of the rounds' "
               "medians (replay_ms_rounds)")

DECODE_PROVIDERS = ("flashtile", "sdpa-flash", "sdpa-cudnn")
DECODE_ANCHORS = ("sdpa-flash", "sdpa-cudnn")
CONTIGUOUS = "flashtile"
COLORS = {"flashtile": "tab:red", "sdpa-flash": "tab:blue", "sdpa-cudnn": "tab:green",
          "flashtile-paged16": "tab:purple", "flashtile-paged1": "tab:orange",
          "flashtile-paged256": "tab:brown"}


def paged_name(page_size: int) -> str:
    return f"flashtile-paged{page_size}"


def page_size_of(name: str) -> int | None:
    """None for the contiguous cache and the SDPA providers, else the page size in the name."""
    prefix = "flashtile-paged"
    return int(name[len(prefix):]) if name.startswith(prefix) else None


# ----------------------------------------------------------------------------------------- points

@dataclass(frozen=True)
class Point:
    model: str
    batch: int
    heads: int
    heads_k: int
    context: int
    head_dim: int = HEAD_DIM

    def label(self) -> str:
        return f"B{self.batch} H{self.heads}/{self.heads_k} ctx{format_seqlen(self.context)}"

    def lengths(self) -> list[int]:
        """cache_seqlens of the point: every sequence holds exactly ``context`` tokens."""
        return [self.context] * self.batch


def kv_bytes_read(cache_seqlens, heads_k: int, head_dim: int, element_size: int) -> int:
    """Bytes of K and V a decode step must read: sum_b cache_seqlens[b] * Hk * D * 2 * element size.

    ``cache_seqlens``: an int (one sequence), a sequence of ints or a tensor of lengths.
    """
    if isinstance(cache_seqlens, torch.Tensor):
        lengths = cache_seqlens.reshape(-1).tolist()
    elif isinstance(cache_seqlens, int):
        lengths = [cache_seqlens]
    else:
        lengths = list(cache_seqlens)
    if any(int(n) < 0 for n in lengths):
        raise ValueError(f"cache_seqlens must be >= 0, got {lengths}")
    return sum(int(n) for n in lengths) * heads_k * head_dim * 2 * element_size


def element_size(dtype: torch.dtype = DTYPE) -> int:
    return torch.finfo(dtype).bits // 8


def point_bytes(point: Point, dtype: torch.dtype = DTYPE) -> int:
    """K+V bytes one layer reads, which is also its cache's size (caches are exactly ``context``)."""
    return kv_bytes_read(point.lengths(), point.heads_k, point.head_dim, element_size(dtype))


def layers_for(point: Point, override: int | None = None, min_total: int = MIN_TOTAL_BYTES,
               dtype: torch.dtype = DTYPE) -> int:
    """``override``, else the fewest layers whose caches hold at least ``min_total`` bytes together."""
    if override is not None:
        if override < 1:
            raise ValueError(f"layers must be >= 1, got {override}")
        return override
    return max(1, math.ceil(min_total / point_bytes(point, dtype)))


def skip_reason(point: Point, layers: int, max_total: float = MAX_TOTAL_BYTES,
                dtype: torch.dtype = DTYPE) -> str | None:
    total = layers * point_bytes(point, dtype)
    if total > max_total:
        return (f"skipped: {layers} layer(s) x {point_bytes(point, dtype) / 1e9:.1f} GB of K+V = "
                f"{total / 1e9:.1f} GB > {max_total / 1e9:.0f} GB")
    return None


def decode_points(quick: bool) -> list[Point]:
    """The sweep, ordered by model, then batch, then context (the table's and the plot's order)."""
    models = QUICK_MODELS if quick else MODELS
    batches = QUICK_BATCHES if quick else BATCHES
    contexts = QUICK_CONTEXTS if quick else CONTEXTS
    return [Point(name, b, h, hk, s) for name, h, hk in models for b in batches for s in contexts]


@dataclass(frozen=True)
class Planned:
    point: Point
    layers: int
    skip: str | None


def plan(points: list[Point], layers: int | None = None, max_total: float = MAX_TOTAL_BYTES,
         min_total: int = MIN_TOTAL_BYTES) -> list[Planned]:
    out = []
    for p in points:
        n = layers_for(p, layers, min_total)
        out.append(Planned(p, n, skip_reason(p, n, max_total)))
    return out


def providers_for(point: Point, command: str) -> tuple[str, ...]:
    if command == "decode":
        return DECODE_PROVIDERS
    names = [CONTIGUOUS, paged_name(PAGE_SIZE)]
    if point.context == PAGE_SWEEP_CONTEXT:
        names += [paged_name(p) for p in PAGE_SWEEP_SIZES]
    # The pools are views of the contiguous bytes: a page size must divide the context.
    names = [n for n in names if point.context % (page_size_of(n) or 1) == 0]
    return tuple(names)


# ----------------------------------------------------------------------------------------- caches

@dataclass
class LayerCaches:
    """K and V of ``layers`` layers of one point: two flat allocations, each layer's slice viewed in
    the layout a provider reads. Contents are random; only the bytes matter for timing."""
    point: Point
    layers: int
    k: torch.Tensor  # (layers, B * S * Hk * D)
    v: torch.Tensor

    @classmethod
    def allocate(cls, point: Point, layers: int, device: torch.device,
                 dtype: torch.dtype = DTYPE) -> "LayerCaches":
        n = point.batch * point.context * point.heads_k * point.head_dim
        k = torch.empty(layers, n, dtype=dtype, device=device).normal_()
        v = torch.empty(layers, n, dtype=dtype, device=device).normal_()
        return cls(point, layers, k, v)

    def nhd(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """flash_attn's (B, S, Hk, D)."""
        p = self.point
        shape = (p.batch, p.context, p.heads_k, p.head_dim)
        return self.k[layer].view(shape), self.v[layer].view(shape)

    def hnd(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """SDPA's (B, Hk, S, D)."""
        p = self.point
        shape = (p.batch, p.heads_k, p.context, p.head_dim)
        return self.k[layer].view(shape), self.v[layer].view(shape)

    def pools(self, layer: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Page pools (B * S / page_size, page_size, Hk, D)."""
        p = self.point
        if p.context % page_size:
            raise ValueError(f"context {p.context} is not a multiple of page size {page_size}")
        shape = (p.batch * p.context // page_size, page_size, p.heads_k, p.head_dim)
        return self.k[layer].view(shape), self.v[layer].view(shape)


def shuffled_block_table(batch: int, pages_per_seq: int, device: torch.device,
                         generator: torch.Generator | None = None) -> torch.Tensor:
    """int32 (batch, pages_per_seq): every page of the pool once, in a random order, as pages end up
    after a serving engine has run for a while (the same table serves every layer, as in vLLM)."""
    order = torch.randperm(batch * pages_per_seq, generator=generator)
    return order.view(batch, pages_per_seq).to(device=device, dtype=torch.int32)


# ----------------------------------------------------------------------------------------- providers

@dataclass
class Step:
    """One layer's decode call and what the JSON records about it."""
    call: Callable[[int], object]  # layer -> output
    backend: str | None = None  # SDPA backend to pin
    info: dict = field(default_factory=dict)


def make_step(name: str, caches: LayerCaches, q: torch.Tensor, lengths: torch.Tensor,
              block_tables: dict) -> Step:
    """q (B, 1, H, D); lengths int32 (B,) on the device; block_tables: page size -> table."""
    import flashtile
    from ..kernels.decode import describe_plan

    point = caches.point
    if name == CONTIGUOUS:
        def call(layer):
            k, v = caches.nhd(layer)
            return flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True)

        return Step(call, info={"layout": "(B, S, Hk, D) contiguous, S = context",
                                **describe_plan(q, *caches.nhd(0))})
    page_size = page_size_of(name)
    if page_size is not None:
        table = block_tables[page_size]

        def call(layer):
            k, v = caches.pools(layer, page_size)
            return flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, block_table=table,
                                                     causal=True)

        return Step(call, info={"layout": f"pages ({point.batch * point.context // page_size}, "
                                          f"{page_size}, Hk, D), shuffled block table",
                                "page_size": page_size,
                                **describe_plan(q, *caches.pools(0, page_size), table)})
    if name in ("sdpa-flash", "sdpa-cudnn"):
        q_t = q.transpose(1, 2).contiguous()  # (B, H, 1, D), made once outside the timed call
        gqa = point.heads != point.heads_k

        # One query at the end of the sequence sees every key: causal is a no-op. SDPA's is_causal is
        # top-left aligned (query 0 would see key 0 only), so it must stay off here.
        def call(layer):
            k, v = caches.hnd(layer)
            return F.scaled_dot_product_attention(q_t, k, v, enable_gqa=gqa)

        backend = "FLASH_ATTENTION" if name == "sdpa-flash" else "CUDNN_ATTENTION"
        return Step(call, backend, {"layout": "(B, Hk, S, D) contiguous, S = context",
                                    "call": "scaled_dot_product_attention(q (B, H, 1, D), k, v, "
                                            f"enable_gqa={gqa})"})
    raise ValueError(f"unknown provider {name!r}")


def graph_calls(layers: int, layer_bytes: float, device: torch.device) -> int:
    """Layer calls in a point's graph (GRAPH_CALLS, GRAPH_BYTES); the Python loop off the GPU runs
    each layer once."""
    if device.type != "cuda":
        return layers
    return max(layers, min(GRAPH_CALLS, math.ceil(GRAPH_BYTES / layer_bytes)))


def build_replay(call: Callable[[int], object], layers: int, device: torch.device,
                 calls: int | None = None) -> Callable:
    """One callable running every layer: a CUDA graph's replay on a GPU, a Python loop elsewhere.
    ``calls``: layer calls in the graph, cycling through the layers (default: each layer once).

    The first layer has already run eagerly (compiles, cuDNN plans), so only a short side-stream
    warm-up precedes the capture, as torch.cuda.graphs recommends.
    """
    if device.type != "cuda":
        return lambda: [call(layer) for layer in range(layers)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call(0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls or layers):
            call(i % layers)
    torch.cuda.synchronize()
    return graph.replay


def gpu_timer(fn: Callable) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def prepare_replay(name: str, caches: LayerCaches, q: torch.Tensor, lengths: torch.Tensor,
                   block_tables: dict, step: Step | None = None,
                   calls: int | None = None) -> tuple[Callable | None, Step | None, str | None]:
    """One provider's step (``step`` if given, else the named provider's) run once eagerly and
    captured over ``calls`` layer calls cycling through the layers (default: each once): (replay,
    step, None), or (None, step or None, error text) when it cannot run here."""
    caught: list = []
    try:
        step = step or make_step(name, caches, q, lengths, block_tables)
        with backend_context(step.backend):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step.call(0)  # compiles, and finds out whether the backend takes this shape
            try:
                return build_replay(step.call, caches.layers, q.device, calls), step, None
            except Exception as exc:
                raise RuntimeError(f"CUDA graph capture failed: {type(exc).__name__}: "
                                   f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                                   ) from exc
    except Exception as exc:
        return None, step, _error_text(exc, caught)


def measure_providers(names, caches: LayerCaches, q: torch.Tensor, lengths: torch.Tensor,
                      block_tables: dict, timer: Callable, nbytes: int, ceiling_gbps: float | None,
                      rounds: int = 1, steps: dict | None = None, graph_bytes: float | None = None) -> dict:
    """Time each named provider's replay over every layer (``caches.layers``; ``steps[name]`` if
    given, else the named provider's step). With ``rounds`` > 1 the replays that ran are timed in
    balanced rounds (``time_in_rounds``: each provider in every position and right after every other
    one equally often) and each gets the median of its rounds (``replay_ms_rounds``). A provider that
    cannot run is unavailable there with the reason, never fatal. Each graph holds graph_calls
    layer calls, counted from ``graph_bytes`` a layer (default ``nbytes``)."""
    steps = steps or {}
    device = q.device
    calls = graph_calls(caches.layers, graph_bytes or nbytes, device)
    replays, prepared, results = {}, {}, {}
    for name in names:
        replay, step, error = prepare_replay(name, caches, q, lengths, block_tables, steps.get(name),
                                             calls)
        if error is not None:
            results[name] = {"available": False, "error": error}
        else:
            replays[name], prepared[name] = replay, step
    times, errors = time_in_rounds({name: (lambda r=replay: timer(r)) for name, replay in replays.items()},
                                   rounds)
    # The graphs go before the next point allocates its caches.
    replays.clear()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    for name in names:
        if name in results:
            continue
        if name in errors:
            results[name] = {"available": False, "error": _error_text(errors[name], [])}
            continue
        total_ms = statistics.median(times[name])
        ms = total_ms / calls
        rate = gbps(nbytes, ms)
        pct = None if ceiling_gbps is None or rate is None else 100.0 * rate / ceiling_gbps
        results[name] = {"available": True, "ms_per_layer": ms, "us_per_layer": ms * 1e3,
                         "replay_ms": total_ms, "graph_calls": calls, "gbps": rate, "pct_ceiling": pct,
                         **prepared[name].info}
        if len(times[name]) > 1:
            results[name]["replay_ms_rounds"] = list(times[name])
    return {name: results[name] for name in names}


def measure(name: str, caches: LayerCaches, q: torch.Tensor, lengths: torch.Tensor,
            block_tables: dict, timer: Callable, nbytes: int, ceiling_gbps: float | None,
            step: Step | None = None) -> dict:
    """One provider timed once (``measure_providers`` with one name)."""
    return measure_providers([name], caches, q, lengths, block_tables, timer, nbytes, ceiling_gbps,
                             steps={name: step} if step is not None else None)[name]


def run_point(planned: Planned, command: str, device: torch.device, timer: Callable,
              ceiling_gbps: float | None, bar, seed: int = 0) -> dict:
    point, layers = planned.point, planned.layers
    names = providers_for(point, command)
    nbytes = point_bytes(point)
    record = {**asdict(point), "layers": layers, "kv_bytes_per_layer": nbytes,
              "kv_bytes_all_layers": nbytes * layers, "cache_seqlens": point.context}
    reason = planned.skip or _memory_skip(nbytes * layers, device)
    if reason:
        record.update(skipped=reason, providers={n: {"available": False, "error": reason} for n in names})
        bar.update(len(names))
    else:
        gen = torch.Generator().manual_seed(seed)
        caches = LayerCaches.allocate(point, layers, device)
        q = torch.randn(point.batch, 1, point.heads, point.head_dim, generator=gen).to(device, DTYPE)
        lengths = torch.tensor(point.lengths(), dtype=torch.int32, device=device)
        tables = {page_size_of(n): shuffled_block_table(point.batch, point.context // page_size_of(n),
                                                        device, gen)
                  for n in names if page_size_of(n) is not None}
        bar.set_postfix_str(f"{point.label()} L{layers}", refresh=False)
        results = measure_providers(names, caches, q, lengths, tables, timer, nbytes, ceiling_gbps,
                                    rounds=ROUNDS)
        bar.update(len(names))
        del caches, q, lengths, tables
        if device.type == "cuda":
            torch.cuda.empty_cache()
        record.update(skipped=None, providers=results)
    if command == "decode":
        record["ratios"] = speed_ratios(record["providers"], "flashtile", DECODE_ANCHORS, "ms_per_layer")
    else:
        record["ratios"] = {n: speed_ratios(record["providers"], n, [CONTIGUOUS], "ms_per_layer")[CONTIGUOUS]
                            for n in names if n != CONTIGUOUS}
    return record


def _memory_skip(nbytes: int, device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    if nbytes > FREE_MEMORY_FRACTION * free:
        return f"skipped: caches need {nbytes / 1e9:.1f} GB, {free / 1e9:.1f} GB free"
    return None


def run_sweep(planned: list[Planned], command: str, device: torch.device, timer: Callable | None = None,
              ceiling_gbps: float | None = None) -> list[dict]:
    timer = timer or gpu_timer
    total = sum(len(providers_for(p.point, command)) for p in planned)
    bar = progress(total, command)
    records = []
    try:
        with torch.no_grad():
            for i, item in enumerate(planned):
                record = run_point(item, command, device, timer, ceiling_gbps, bar, seed=i)
                bar.write(point_summary(record, command))
                records.append(record)
    finally:
        bar.close()
    return records


# ----------------------------------------------------------------------------------------- ceiling

def ceiling_bytes(device: torch.device) -> int:
    """CEILING_BYTES, or a quarter of the free GPU memory where that is less (the measurement holds
    two buffers of this size): whole MiB, so every stream_read block size divides it."""
    if device.type != "cuda":
        return CEILING_BYTES
    free, _ = torch.cuda.mem_get_info(device)
    return max(1 << 20, min(CEILING_BYTES, free // 4) >> 20 << 20)


def measure_ceiling(device: torch.device, timer: Callable | None = None,
                    nbytes: int | None = None) -> dict:
    """DRAM read rate over ``nbytes`` (``ceiling_bytes`` if None): a streaming read kernel
    (``stream_read``: the best of its configs, the ceiling), and for comparison ``torch.sum`` over
    bf16 (the ceiling before 2026-12-01, which decode kernels beat by up to 10%) and a copy."""
    from . import stream_read
    timer = timer or gpu_timer
    nbytes = nbytes or ceiling_bytes(device)
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    sum_ms = timer(functools.partial(torch.sum, x))
    read = stream_read.measure(x.view(torch.int32), timer)
    y = torch.empty_like(x)
    copy_ms = timer(functools.partial(y.copy_, x))
    del x, y
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"bytes": nbytes, "read_gbps": read["gbps"], "read_best": read["best"],
            "read_configs": read["configs"], "sum_ms": sum_ms, "sum_gbps": gbps(nbytes, sum_ms),
            "copy_ms": copy_ms, "copy_read_gbps": gbps(nbytes, copy_ms),
            "copy_read_write_gbps": gbps(2 * nbytes, copy_ms)}


def ceiling_line(measured: dict) -> str:
    best = measured["read_best"]
    return (f"Read ceiling: streaming read of {measured['bytes'] / 2**30:g} GiB "
            f"{measured['read_gbps']:.0f} GB/s ({best['block_words']}-word blocks, {best['warps']} warps, "
            f"{best['per_sm'] or 'no'} programs per SM), torch.sum {measured['sum_gbps']:.0f} GB/s, "
            f"copy {measured['copy_read_write_gbps']:.0f} GB/s read + write")


def ceiling_rate(measured: dict) -> float | None:
    """The ceiling of one measurement: the faster of the streaming read and torch.sum."""
    rates = [measured.get(k) for k in ("read_gbps", "sum_gbps") if measured.get(k)]
    return max(rates) if rates else None


def ceiling_summary(before: dict, after: dict | None) -> dict:
    """The ceiling is the best read rate of the run (measured before and after the sweep)."""
    rates = [ceiling_rate(m) for m in (before, after) if m and ceiling_rate(m)]
    return {"gbps": max(rates) if rates else None,
            "method": f"a streaming read kernel (flashtile.bench.stream_read, the best of "
                      f"{len(before.get('read_configs', ()))} configs) and torch.sum over "
                      f"{before['bytes'] / 2**30:g} GiB, bytes read / median time of "
                      "triton.testing.do_bench, the best of the measurements before and after "
                      "the sweep",
            "sum_gbps": max([m["sum_gbps"] for m in (before, after) if m and m.get("sum_gbps")],
                            default=None),
            "before": before, "after": after}


# ----------------------------------------------------------------------------------------- checks

@dataclass(frozen=True)
class DecodeCase:
    batch: int
    heads: int
    heads_k: int
    lengths: tuple[int, ...]
    capacity: int
    page_size: int | None = None  # None: contiguous cache
    num_splits: int = 0  # 0: the heuristic
    head_dim: int = HEAD_DIM
    dtype: torch.dtype = DTYPE

    def label(self) -> str:
        cache = "contiguous" if self.page_size is None else f"paged P{self.page_size}"
        splits = "auto" if self.num_splits == 0 else str(self.num_splits)
        lens = ",".join(str(n) for n in self.lengths)
        return (f"{DTYPE_NAME if self.dtype == DTYPE else self.dtype} B{self.batch} "
                f"H{self.heads}/{self.heads_k} d{self.head_dim} L({lens}) {cache} splits {splits}")

    def as_dict(self) -> dict:
        return {"batch": self.batch, "heads": self.heads, "heads_k": self.heads_k,
                "lengths": list(self.lengths), "capacity": self.capacity, "page_size": self.page_size,
                "num_splits": self.num_splits, "head_dim": self.head_dim, "dtype": str(self.dtype)}


def check_cases(on_gpu: bool) -> list[DecodeCase]:
    """Decode against the float64 reference: contiguous and paged caches (page sizes 1, 3, 16, 256),
    the heuristic's splits and forced ones, both benchmark head layouts. Lengths are ragged against
    the tiles and the pages, with a one-token sequence."""
    if on_gpu:
        lengths, cap = (1, 1000, 7777, 16384), 16384
        H, Hk = 32, 8
    else:
        lengths, cap = (1, 77, 300), 300
        H, Hk = 8, 2
    C = DecodeCase
    b = len(lengths)
    return [
        C(b, H, Hk, lengths, cap),
        C(b, H, Hk, lengths, cap, num_splits=1),
        C(b, 12, 2, lengths, cap, num_splits=3),
        C(b, H, Hk, lengths, cap, page_size=1),
        C(b, 12, 2, lengths, cap, page_size=3, num_splits=2),
        C(b, H, Hk, lengths, cap, page_size=16),
        C(b, H, Hk, lengths, cap, page_size=16, num_splits=5),
        C(b, H, Hk, lengths, cap, page_size=256),
        C(b, 12, 2, lengths, cap, page_size=256, num_splits=1),
    ]


def paginate(k: torch.Tensor, v: torch.Tensor, page_size: int,
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contiguous caches (B, S, Hk, D) -> page pools (B * ceil(S / P), P, Hk, D) with the pages in a
    random order, and the int32 block table (B, ceil(S / P)) that finds them."""
    batch, capacity, heads_k, head_dim = k.shape
    per_seq = -(-capacity // page_size)
    table = shuffled_block_table(batch, per_seq, k.device, generator)
    pad = per_seq * page_size - capacity

    def pool_of(x: torch.Tensor) -> torch.Tensor:
        padded = torch.cat([x, x.new_zeros(batch, pad, heads_k, head_dim)], dim=1)
        pool = torch.empty(batch * per_seq, page_size, heads_k, head_dim, dtype=x.dtype, device=x.device)
        pool[table.reshape(-1).long()] = padded.reshape(batch * per_seq, page_size, heads_k, head_dim)
        return pool

    return pool_of(k), pool_of(v), table


def read_tokens(cache: torch.Tensor, block_table: torch.Tensor | None, b: int, start: int,
                stop: int) -> torch.Tensor:
    """Tokens [start, stop) of sequence b, (n, Hk, D), from a contiguous cache or a page pool."""
    if block_table is None:
        return cache[b, start:stop]
    pos = torch.arange(start, stop, device=cache.device)
    page_size = cache.shape[1]
    pages = block_table[b].long()[pos // page_size]
    return cache[pages, pos % page_size]


def write_tokens(cache: torch.Tensor, block_table: torch.Tensor | None, b: int, start: int,
                 values: torch.Tensor) -> None:
    """Write values (n, Hk, D) at tokens [start, start + n) of sequence b."""
    stop = start + values.shape[0]
    if block_table is None:
        cache[b, start:stop] = values
        return
    pos = torch.arange(start, stop, device=cache.device)
    page_size = cache.shape[1]
    pages = block_table[b].long()[pos // page_size]
    cache[pages, pos % page_size] = values


def reference_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table,
                     lengths) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(exact out float64, exact LSE, textbook out in q's dtype), each sequence against its first
    lengths[b] keys (one query at the end of the sequence sees them all)."""
    exact, exact_lse, low = [], [], []
    for b, n in enumerate(lengths):
        k = read_tokens(k_cache, block_table, b, 0, n)[None]
        v = read_tokens(v_cache, block_table, b, 0, n)[None]
        out, lse = reference.attention(q[b:b + 1].double(), k.double(), v.double(), causal=True)
        exact.append(out)
        exact_lse.append(lse)
        low.append(reference.attention(q[b:b + 1], k, v, causal=True)[0])
    return torch.cat(exact), torch.cat(exact_lse), torch.cat(low)


def _judge(out: torch.Tensor, lse: torch.Tensor, exact: torch.Tensor, exact_lse: torch.Tensor,
           low: torch.Tensor) -> dict:
    """The prefill check's rule: out within 2x textbook-in-dtype's error of float64, LSE to 1e-3."""
    finite = bool(torch.isfinite(out).all())
    out_err = check._max_abs_error(out, exact)
    budget = check.OUT_BUDGET_FACTOR * check._max_abs_error(low, exact)
    lse_err = check.lse_error(lse, exact_lse)
    return {"finite": finite, "out_err": out_err, "budget": budget, "lse_err": lse_err,
            "passed": finite and out_err <= budget and lse_err <= check.LSE_RTOL}


def run_case(case: DecodeCase, device: torch.device, seed: int) -> dict:
    import flashtile

    start = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, case.dtype)

    q = randn(case.batch, 1, case.heads, case.head_dim)
    k = randn(case.batch, case.capacity, case.heads_k, case.head_dim)
    v = randn(case.batch, case.capacity, case.heads_k, case.head_dim)
    table = None
    if case.page_size is not None:
        k, v, table = paginate(k, v, case.page_size, gen)
    lengths = torch.tensor(case.lengths, dtype=torch.int32, device=device)

    def call():
        return flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, block_table=table,
                                                 causal=True, num_splits=case.num_splits,
                                                 return_softmax_lse=True)
    out, lse = call()
    same = True
    if device.type == "cuda":
        # The first call of a signature goes through Triton's JIT, later ones straight to the
        # compiled kernel (kernels/launch.py): the judged output is a later call's, bit for bit the first's.
        first_out, first_lse = out, lse
        out, lse = call()
        same = torch.equal(out, first_out) and torch.equal(lse, first_lse)
    exact, exact_lse, low = reference_decode(q, k, v, table, case.lengths)
    judged = _judge(out, lse, exact, exact_lse, low)
    judged["passed"] = judged["passed"] and same
    return {**case.as_dict(), "label": case.label(), **judged, "repeat_identical": same,
            "seconds": round(time.perf_counter() - start, 3), "error": None}


def format_result(r: dict) -> str:
    status = "PASS" if r["passed"] else "FAIL"
    if r.get("error"):
        return f"{status}  {r['label']:<62}  error: {r['error']}"
    within = "<=" if r["out_err"] <= r["budget"] else "> "
    nonfinite = "" if r["finite"] else "  NaN/inf in output!"
    extra = ""
    if "identical_to_eager" in r:
        extra = f"  replay == eager: {'yes' if r['identical_to_eager'] else 'NO'}"
    return (f"{status}  {r['label']:<62}  out err {r['out_err']:.2e} {within} {r['budget']:.2e}  "
            f"lse err {r['lse_err']:.1e}{extra}{nonfinite}")


def _guarded(label: str, fn: Callable[[], dict], extra: dict) -> dict:
    error = None
    try:
        result = fn()
    except Exception as exc:  # a crash is a failed case, not a crashed check
        error = f"{type(exc).__name__}: {str(exc).strip()[:500]}"
    if error is not None:  # outside the except block: the traceback no longer pins tensors
        result = {**extra, "label": label, "passed": False, "error": error}
    return result


def run_check(device: torch.device, cases: list[DecodeCase] | None = None,
              log: Callable[[str], None] = print) -> list[dict]:
    """Decode against the float64 reference, one line per case; records for the result JSON."""
    cases = check_cases(device.type == "cuda") if cases is None else cases
    log(f"Decode check: {len(cases)} cases on {device.type}; rule: max|out - fp64| <= "
        f"{check.OUT_BUDGET_FACTOR:g} x max|textbook(bf16) - fp64|, LSE within {check.LSE_RTOL:g} "
        "relative")
    base_seed = random.SystemRandom().randrange(2**31)  # fresh inputs every run; recorded to replay
    results = []
    for i, case in enumerate(cases):
        result = _guarded(case.label(), lambda: run_case(case, device, base_seed + i), case.as_dict())
        result["seed"] = base_seed + i
        log(format_result(result))
        results.append(result)
    log(f"Decode check: {sum(r['passed'] for r in results)}/{len(results)} passed")
    return results


# Before replay i, the host writes GROWTH[i] tokens straight into the caches and advances
# cache_seqlens in place; every replay then appends one token (with_kvcache's k/v) and the graph
# itself advances cache_seqlens by one.
GROWTH = (0, 0, 3, 0, 5)


def replay_check(device: torch.device, page_size: int | None, seed: int,
                 growth: tuple[int, ...] = GROWTH) -> dict:
    """Capture one decode step (append one token, attend, cache_seqlens += 1) as a CUDA graph, then
    grow the caches and replay it: each replay must match an eager call on the same state bitwise
    and the float64 reference within the check's budget. Without CUDA the same steps run eagerly."""
    import flashtile

    on_gpu = device.type == "cuda"
    batch, heads, heads_k = (4, 32, 8) if on_gpu else (2, 8, 2)
    start_lengths = [1, 100, 2047, 3000] if on_gpu else [1, 40]
    capacity = 4096 if on_gpu else 64
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, DTYPE)

    k_cache = randn(batch, capacity, heads_k, HEAD_DIM)
    v_cache = randn(batch, capacity, heads_k, HEAD_DIM)
    table = None
    if page_size is not None:
        k_cache, v_cache, table = paginate(k_cache, v_cache, page_size, gen)
    q = randn(batch, 1, heads, HEAD_DIM)
    k_new, v_new = randn(batch, 1, heads_k, HEAD_DIM), randn(batch, 1, heads_k, HEAD_DIM)
    lengths = torch.tensor(start_lengths, dtype=torch.int32, device=device)
    static: dict = {}

    def attend():
        static["out"], static["lse"] = flashtile.flash_attn_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, block_table=table, causal=True,
            return_softmax_lse=True)

    def step():
        attend()
        lengths.add_(1)

    if on_gpu:
        # Warm-up without the increment: its append lands where replay 0 appends again.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            attend()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        run = graph.replay
    else:
        run = step

    expected = list(start_lengths)
    worst = {"out_err": 0.0, "budget": math.inf, "lse_err": 0.0, "finite": True, "passed": True}
    identical = appended_ok = lengths_ok = True
    steps = []
    for grow in growth:
        if grow:
            for b in range(batch):
                write_tokens(k_cache, table, b, expected[b], randn(grow, heads_k, HEAD_DIM))
                write_tokens(v_cache, table, b, expected[b], randn(grow, heads_k, HEAD_DIM))
                expected[b] += grow
            lengths.add_(grow)
        q.copy_(randn(*q.shape))
        k_new.copy_(randn(*k_new.shape))
        v_new.copy_(randn(*v_new.shape))
        run()
        if on_gpu:
            torch.cuda.synchronize()
        for b in range(batch):
            appended_ok &= torch.equal(read_tokens(k_cache, table, b, expected[b], expected[b] + 1),
                                       k_new[b]) and \
                torch.equal(read_tokens(v_cache, table, b, expected[b], expected[b] + 1), v_new[b])
            expected[b] += 1
        lengths_ok &= lengths.tolist() == expected
        out, lse = static["out"].clone(), static["lse"].clone()
        eager_out, eager_lse = flashtile.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lengths, block_table=table, causal=True,
            return_softmax_lse=True)
        same = torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
        identical &= same
        judged = _judge(out, lse, *reference_decode(q, k_cache, v_cache, table, expected))
        steps.append({"lengths": list(expected), **judged, "identical_to_eager": same})
        if judged["out_err"] - judged["budget"] >= worst["out_err"] - worst["budget"]:
            worst.update(out_err=judged["out_err"], budget=judged["budget"])
        worst["lse_err"] = max(worst["lse_err"], judged["lse_err"])
        worst["finite"] &= judged["finite"]
        worst["passed"] &= judged["passed"]
    cache = "contiguous" if page_size is None else f"paged P{page_size}"
    mode = "CUDA graph replay" if on_gpu else "eager loop (graphs need CUDA)"
    label = (f"{mode}: {DTYPE_NAME} B{batch} H{heads}/{heads_k} {cache}, {len(growth)} steps "
             f"+{sum(growth)} grown")
    passed = worst["passed"] and identical and appended_ok and lengths_ok
    return {"label": label, "page_size": page_size, "graph": on_gpu, "start_lengths": start_lengths,
            "growth": list(growth), **worst, "passed": passed, "identical_to_eager": identical,
            "appended_tokens_ok": appended_ok, "cache_seqlens_ok": lengths_ok, "steps": steps,
            "error": None}


def run_replay_check(device: torch.device, log: Callable[[str], None] = print) -> list[dict]:
    base_seed = random.SystemRandom().randrange(2**31)
    results = []
    log("Graph-replay check: capture append + decode + cache_seqlens += 1, grow the caches in place, "
        "replay; each replay against an eager call (bitwise) and float64")
    for i, page_size in enumerate((None, PAGE_SIZE)):
        label = f"replay {'contiguous' if page_size is None else f'paged P{page_size}'}"
        result = _guarded(label, lambda: replay_check(device, page_size, base_seed + i),
                          {"page_size": page_size})
        result["seed"] = base_seed + i
        if result.get("error") is None and not (result["appended_tokens_ok"] and result["cache_seqlens_ok"]):
            log(f"  appended tokens in place: {result['appended_tokens_ok']}, "
                f"cache_seqlens advanced by the graph: {result['cache_seqlens_ok']}")
        log(format_result(result))
        results.append(result)
    return results


def anchor_check(device: torch.device, log: Callable[[str], None] = print) -> list[dict]:
    """That the SDPA calls the benchmark times compute the same decode (is_causal off, GQA on), against
    the float64 reference at one small point. Informational: it does not fail the run."""
    point = Point("check", 2, 32, 8, 2048)
    gen = torch.Generator().manual_seed(0)
    caches = LayerCaches(point, 1, *(torch.randn(1, point.batch * point.context * point.heads_k *
                                                 point.head_dim, generator=gen).to(device, DTYPE)
                                     for _ in range(2)))
    q = torch.randn(point.batch, 1, point.heads, point.head_dim, generator=gen).to(device, DTYPE)
    k, v = (t.transpose(1, 2) for t in caches.hnd(0))  # the bytes SDPA reads, as (B, S, Hk, D)
    exact, _, low = reference_decode(q, k, v, None, point.lengths())
    budget = check.OUT_BUDGET_FACTOR * check._max_abs_error(low, exact)
    results = []
    for name in DECODE_ANCHORS:
        caught: list = []
        error = err = None
        try:
            step = make_step(name, caches, q, torch.tensor(point.lengths(), dtype=torch.int32,
                                                           device=device), {})
            with backend_context(step.backend), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = step.call(0).transpose(1, 2)  # (B, 1, H, D)
            err = check._max_abs_error(out, exact)
        except Exception as exc:
            error = _error_text(exc, caught)
        ok = None if error else err <= budget
        results.append({"provider": name, "matches": ok, "out_err": err, "budget": budget,
                        "error": error})
        status = "unavailable" if error else ("OK" if ok else "MISMATCH")
        detail = error if error else f"out err {err:.2e} vs budget {budget:.2e}"
        log(f"{status:<11} {name} on {point.label()}: {detail}")
    return results


def all_passed(results) -> bool:
    return all(r["passed"] for r in results)


# ----------------------------------------------------------------------------------------- reporting

def _gbps_of(record: dict, name: str) -> float | None:
    r = record["providers"].get(name, {})
    return r.get("gbps") if r.get("available") else None


def _pct_of(record: dict, name: str) -> float | None:
    r = record["providers"].get(name, {})
    return r.get("pct_ceiling") if r.get("available") else None


def _point_of(record: dict) -> Point:
    return Point(**{f: record[f] for f in Point.__dataclass_fields__})


def point_summary(record: dict, command: str) -> str:
    point = _point_of(record)
    head = f"{point.model:<13} {point.label():<22} L{record['layers']:<5}"
    if record.get("skipped"):
        return f"{head} {record['skipped']}"
    parts = []
    for name, r in record["providers"].items():
        if r.get("available"):
            parts.append(f"{name} {r['gbps']:.0f} GB/s ({r['us_per_layer']:.1f} us)")
        else:
            parts.append(f"{name} unavailable ({r['error'][:120]})")
    return f"{head} " + ", ".join(parts)


def format_decode_table(records: list[dict], title: str) -> str:
    columns = (f"{'B':>3} {'H/Hk':>6} {'ctx':>5} | {'flashtile':>9} {'%ceil':>6} {'splits':>6} | "
               f"{'flash':>7} {'cudnn':>7} | {'vs flash':>8} {'vs cudnn':>8}")
    lines = [title, columns, "-" * len(columns)]
    for r in records:
        ratio = r["ratios"]
        mine = r["providers"]["flashtile"]
        lines.append(
            f"{r['batch']:>3} {str(r['heads']) + '/' + str(r['heads_k']):>6} "
            f"{format_seqlen(r['context']):>5} | "
            f"{format_number(_gbps_of(r, 'flashtile'), '{:.0f}'):>9} "
            f"{format_number(_pct_of(r, 'flashtile'), '{:.0f}%'):>6} "
            f"{format_number(mine.get('num_splits'), '{:d}'):>6} | "
            f"{format_number(_gbps_of(r, 'sdpa-flash'), '{:.0f}'):>7} "
            f"{format_number(_gbps_of(r, 'sdpa-cudnn'), '{:.0f}'):>7} | "
            f"{format_number(ratio['sdpa-flash'], '{:.2f}x'):>8} "
            f"{format_number(ratio['sdpa-cudnn'], '{:.2f}x'):>8}")
    return "\n".join(lines)


def format_paged_table(records: list[dict], title: str) -> str:
    p16, sweep = paged_name(PAGE_SIZE), [paged_name(p) for p in PAGE_SWEEP_SIZES]
    columns = (f"{'B':>3} {'H/Hk':>6} {'ctx':>5} | {'contig':>7} {'%ceil':>6} | {'P16':>7} {'%ceil':>6} "
               f"{'vs contig':>9} | " + " ".join(f"{'P' + str(p):>7} {'vs contig':>9}"
                                                  for p in PAGE_SWEEP_SIZES))
    lines = [title, columns, "-" * len(columns)]
    for r in records:
        ratio = r["ratios"]
        row = (f"{r['batch']:>3} {str(r['heads']) + '/' + str(r['heads_k']):>6} "
               f"{format_seqlen(r['context']):>5} | "
               f"{format_number(_gbps_of(r, CONTIGUOUS), '{:.0f}'):>7} "
               f"{format_number(_pct_of(r, CONTIGUOUS), '{:.0f}%'):>6} | "
               f"{format_number(_gbps_of(r, p16), '{:.0f}'):>7} "
               f"{format_number(_pct_of(r, p16), '{:.0f}%'):>6} "
               f"{format_number(ratio.get(p16), '{:.2f}x'):>9} | ")
        row += " ".join(f"{format_number(_gbps_of(r, n), '{:.0f}'):>7} "
                        f"{format_number(ratio.get(n), '{:.2f}x'):>9}" for n in sweep)
        lines.append(row)
    return "\n".join(lines)


def write_plot(records: list[dict], command: str, ceiling_gbps: float | None, path: Path,
               title: str) -> str:
    """GB/s against context, one panel per (batch, heads) config, the ceiling as a horizontal line."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        return "matplotlib is not installed: skipped the plot"
    configs = []
    for r in records:
        key = (r["model"], r["heads"], r["heads_k"], r["batch"])
        if key not in configs:
            configs.append(key)
    if not configs:
        return "no points to plot"
    cols = min(3, len(configs))
    rows = -(-len(configs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.9 * rows), squeeze=False)
    names = DECODE_PROVIDERS if command == "decode" else \
        (CONTIGUOUS, paged_name(PAGE_SIZE), *(paged_name(p) for p in PAGE_SWEEP_SIZES))
    for ax, (model, heads, heads_k, batch) in zip(axes.flat, configs):
        recs = [r for r in records if (r["model"], r["heads"], r["heads_k"], r["batch"]) ==
                (model, heads, heads_k, batch)]
        for name in names:
            pts = [(r["context"], _gbps_of(r, name)) for r in recs if _gbps_of(r, name) is not None]
            if not pts:
                continue
            xs, ys = zip(*pts)
            if len(pts) > 1:
                ax.plot(xs, ys, color=COLORS[name], marker="o", markersize=3)
            else:
                ax.scatter(xs, ys, color=COLORS[name], marker="D", s=22, zorder=3)
        if ceiling_gbps:
            ax.axhline(ceiling_gbps, color="black", linestyle="--", linewidth=1)
        contexts = sorted({r["context"] for r in recs})
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts)
        ax.set_xticklabels([format_seqlen(s) for s in contexts])
        ax.minorticks_off()
        highest = max([ceiling_gbps or 0.0] + [_gbps_of(r, n) or 0.0 for r in recs for n in names])
        ax.set_ylim(bottom=0, top=highest * 1.15 or None)
        ax.set(title=f"{model}: H{heads}/{heads_k}, B{batch}", xlabel="context (tokens)",
               ylabel="K+V read, GB/s")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(configs):]:
        ax.axis("off")
    sweep = {paged_name(p) for p in PAGE_SWEEP_SIZES}
    handles = [Line2D([], [], color=COLORS[n], marker="D" if n in sweep else "o",
                      markersize=4 if n in sweep else 3, linestyle="none" if n in sweep else "-",
                      label=n) for n in names]
    if ceiling_gbps:
        handles.append(Line2D([], [], color="black", linestyle="--",
                              label=f"read ceiling {ceiling_gbps:.0f} GB/s"))
    axes.flat[0].legend(handles=handles, fontsize=7, loc="lower right")
    fig.suptitle(title)
    return save_figure(fig, path)


# ----------------------------------------------------------------------------------------- command

def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="short sweep (batch 1 and 16 at 4k and 32k, Llama-3-8B's 32/8 heads)")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the correctness and graph-replay checks")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"directory for the JSON and PNG results (default: {DEFAULT_OUT})")
    parser.add_argument("--layers", type=int, default=None, metavar="L",
                        help="layers (caches) per CUDA graph at every point (default: the fewest "
                             f"that hold {MIN_TOTAL_BYTES / 2**30:g} GiB of K+V)")


def run(args) -> int:
    return run_command(args, "decode")


def run_paged(args) -> int:
    return run_command(args, "paged")


def run_command(args, command: str) -> int:
    if args.layers is not None and args.layers < 1:
        print(f"--layers must be >= 1, got {args.layers}")
        return 2
    device = choose_device()
    if device.type != "cuda":
        return _run_without_gpu(args, device, command)
    return _run_on_gpu(args, device, command)


def _what(command: str) -> str:
    return ("decode (one-token attention against a KV cache)" if command == "decode" else
            "paged decode (through a block table, against the contiguous cache)")


def _run_without_gpu(args, device: torch.device, command: str) -> int:
    return check_without_gpu(command, _what(command),
                             [lambda: run_check(device), lambda: run_replay_check(device)], args)


def _run_on_gpu(args, device: torch.device, command: str) -> int:
    env = environment(device)
    print(f"flashtile bench {command}: {env['gpu']} ({env['sm_count']} SMs), {DTYPE_NAME}, "
          f"torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}")
    checks = replays = anchors = None
    if not args.no_check:
        checks = run_check(device)
        replays = run_replay_check(device)
        if command == "decode":
            anchors = anchor_check(device)
        torch.cuda.empty_cache()

    before = measure_ceiling(device)
    print(ceiling_line(before))
    planned = plan(decode_points(args.quick), args.layers)
    records = run_sweep(planned, command, device, ceiling_gbps=ceiling_rate(before))
    after = measure_ceiling(device)
    ceiling = ceiling_summary(before, after)
    _rescale(records, ceiling["gbps"])
    print(f"After the sweep: {ceiling_line(after)}; using {ceiling['gbps']:.0f} GB/s")

    splits = {}
    from ..kernels.decode import planned_splits
    for r in records:
        splits[_point_of(r).label()] = planned_splits(r["batch"], r["heads_k"], r["context"], device)
    payload = {"benchmark": command, **env, "dtype": DTYPE_NAME, "quick": args.quick,
               "layers_override": args.layers, "command": " ".join(sys.argv),
               "timing": {"function": "triton.testing.do_bench", "warmup_ms": WARMUP_MS,
                          "rep_ms": REP_MS, "return_mode": "median", "unit": "ms",
                          "rounds": ROUNDS, "what": TIMING_WHAT},
               "bytes": "K+V read per layer = sum_b cache_seqlens[b] * Hk * D * 2 * element size; "
                        "GB = 1e9 bytes",
               "decode": "q (B, 1, H, D), d128, bf16, causal, cache_seqlens = context for every "
                         "sequence, caches exactly context long (S_max = context)",
               "paged": f"page pools over the same bytes, block table a random permutation of the "
                        f"pages; page size {PAGE_SIZE} at every point, {PAGE_SWEEP_SIZES} at "
                        f"context {PAGE_SWEEP_CONTEXT}",
               "ratios": ("flashtile speed / anchor speed (> 1: flashtile faster)" if command == "decode"
                          else "paged speed / contiguous speed (> 1: paged faster)"),
               "ceiling": ceiling, "check": checks, "replay_check": replays, "anchor_check": anchors,
               "split_heuristic": splits, "points": records}
    json_path = result_path(args.out, command, env["gpu"], "json")
    write_json(json_path, payload)
    print(f"Wrote {json_path}")
    title = f"flashtile {command}, {DTYPE_NAME} d128, {env['gpu']}, {env['date'][:10]}"
    try:
        print(write_plot(records, command, ceiling["gbps"], result_path(args.out, command, env["gpu"],
                                                                        "png"), title))
    except Exception as exc:  # the JSON is written; a plotting problem must not hide the table
        print(f"Plot failed: {type(exc).__name__}: {exc}")
    return _finish(records, command, checks, replays, anchors, ceiling["gbps"], env["gpu"])


def _rescale(records: list[dict], ceiling_gbps: float | None) -> None:
    """% of ceiling against the run's final ceiling (the best of before and after)."""
    for r in records:
        for result in r["providers"].values():
            if result.get("available") and ceiling_gbps:
                result["pct_ceiling"] = 100.0 * result["gbps"] / ceiling_gbps


def _finish(records, command, checks, replays, anchors, ceiling_gbps, gpu) -> int:
    """Warnings first, then the table as the last output; non-zero exit if anything was wrong."""
    failed = [c for c in (checks or []) + (replays or []) if not c["passed"]]
    broken = [(r, n) for r in records if not r.get("skipped") for n in r["providers"]
              if n.startswith("flashtile") and not r["providers"][n].get("available")]
    if failed:
        print(f"WARNING: {len(failed)} correctness case(s) FAILED: these timings are of a kernel that "
              "gives wrong answers.")
    for a in anchors or []:
        if a["matches"] is False:
            print(f"WARNING: {a['provider']} does not compute the same decode (out err "
                  f"{a['out_err']:.2e} > {a['budget']:.2e}): its column is not comparable.")
    for r, n in broken:
        print(f"WARNING: {n} failed at {_point_of(r).label()}: {r['providers'][n]['error']}")
    for r in records:
        if r.get("skipped"):
            print(f"Note: {_point_of(r).label()} {r['skipped']}")
    print()
    ceiling = format_number(ceiling_gbps, "{:.0f}")
    if command == "decode":
        print(format_decode_table(records, f"Decode K+V read GB/s, {DTYPE_NAME} d128, {gpu}, read "
                                           f"ceiling {ceiling} GB/s (vs = flashtile / anchor speed)"))
    else:
        print(format_paged_table(records, f"Paged decode K+V read GB/s, {DTYPE_NAME} d128, {gpu}, read "
                                          f"ceiling {ceiling} GB/s (vs contig = paged / contiguous "
                                          "speed)"))
    return 1 if failed or broken else 0
