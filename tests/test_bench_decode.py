"""``flashtile bench decode`` / ``bench paged``: the CPU path end to end, the byte counting, the point
list and its skip logic, the cache views, the check's rule and the timing plumbing with a stand-in
timer (the CUDA graphs themselves need a GPU)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flashtile.bench import decode, stream_read
from flashtile.bench.common import gbps, write_json

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
GB = 1e9


def _run_cli(*args, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "flashtile", "bench", *args, "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_cpu_path_runs_the_check_and_says_timings_need_a_gpu(tmp_path):
    done = _run_cli("decode", "--quick", tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    lines = out.splitlines()
    passes = [line for line in lines if line.startswith("PASS")]
    assert len(passes) == len(decode.check_cases(on_gpu=False)) + 2  # + contiguous and paged replay
    assert not any(line.startswith("FAIL") for line in lines)
    for page_size in (1, 3, 16, 256):
        assert any(f"paged P{page_size} " in line for line in passes)
    assert any("contiguous" in line for line in passes)
    assert "need a GPU" in out
    assert not any(tmp_path.iterdir())  # nothing written without timings


def test_paged_command_is_registered_and_skips_timing_on_cpu(tmp_path):
    done = _run_cli("paged", "--quick", "--no-check", "--layers", "2", tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "need a GPU" in done.stdout and "paged" in done.stdout
    assert not any(tmp_path.iterdir())
    bad = _run_cli("decode", "--layers", "0", tmp_path=tmp_path)
    assert bad.returncode == 2 and "--layers" in bad.stdout


# ----------------------------------------------------------------------------------------- bytes

def test_bytes_read_count_k_and_v_of_every_cached_token():
    # Llama-3-8B, one sequence of 4k: 4096 tokens x 8 heads x 128 x (K and V) x 2 bytes.
    assert decode.kv_bytes_read([4096], 8, 128, 2) == 4096 * 8 * 128 * 2 * 2 == 16 * 2**20
    assert decode.kv_bytes_read(4096, 8, 128, 2) == 16 * 2**20
    # Ragged lengths: the sum of what each sequence holds, not batch x the longest.
    assert decode.kv_bytes_read([1, 1000, 3], 2, 128, 2) == 1004 * 2 * 128 * 4
    assert decode.kv_bytes_read(torch.tensor([1, 1000, 3], dtype=torch.int32), 2, 128, 2) == \
        1004 * 2 * 128 * 4
    assert decode.kv_bytes_read([], 8, 128, 2) == 0
    assert decode.kv_bytes_read([5], 8, 128, 4) == 2 * decode.kv_bytes_read([5], 8, 128, 2)
    with pytest.raises(ValueError):
        decode.kv_bytes_read([3, -1], 8, 128, 2)
    # A point: every sequence holds the context, caches are exactly that long.
    point = decode.Point("Qwen2.5-1.5B", 16, 12, 2, 32768)
    assert decode.point_bytes(point) == 16 * 32768 * 2 * 128 * 2 * 2
    assert gbps(decode.point_bytes(point), 1.0) == pytest.approx(decode.point_bytes(point) / 1e6)
    assert gbps(1e9, None) is None and gbps(1e9, 0.0) is None


def test_cache_views_read_exactly_the_counted_bytes():
    point = decode.Point("t", 2, 8, 2, 32, head_dim=16)
    caches = decode.LayerCaches.allocate(point, 3, CPU)
    nbytes = decode.point_bytes(point)
    for layer in range(3):
        views = [*caches.nhd(layer), *caches.hnd(layer), *caches.pools(layer, 16), *caches.pools(layer, 1)]
        for view in views:
            assert view.is_contiguous()
            assert view.numel() * view.element_size() == nbytes // 2  # K or V: half the bytes
        # The views are the layer's own bytes, not copies and not another layer's.
        k_nhd, _ = caches.nhd(layer)
        k_hnd, _ = caches.hnd(layer)
        assert k_nhd.data_ptr() == k_hnd.data_ptr() == caches.k[layer].data_ptr()
    assert caches.k[1].data_ptr() - caches.k[0].data_ptr() == nbytes // 2
    with pytest.raises(ValueError):
        caches.pools(0, 3)  # 32 tokens are not whole pages of 3


# ----------------------------------------------------------------------------------------- points

def test_point_list_covers_the_sweep():
    points = decode.decode_points(quick=False)
    assert len(points) == 2 * 3 * 6
    assert {(p.heads, p.heads_k) for p in points} == {(32, 8), (12, 2)}
    assert {p.batch for p in points} == {1, 16, 64}
    assert sorted({p.context for p in points}) == [1024 << i for i in (0, 2, 4, 5, 6, 7)]
    assert all(p.head_dim == 128 for p in points)
    assert len(set(points)) == len(points)
    quick = decode.decode_points(quick=True)
    assert {(p.batch, p.context) for p in quick} == {(1, 4096), (1, 32768), (16, 4096), (16, 32768)}
    assert {(p.heads, p.heads_k) for p in quick} == {(32, 8)}
    assert decode.PAGE_SWEEP_CONTEXT in {p.context for p in quick}


def test_layers_give_at_least_a_gib_of_cold_cache():
    for item in decode.plan(decode.decode_points(quick=False)):
        total = item.layers * decode.point_bytes(item.point)
        assert total >= decode.MIN_TOTAL_BYTES
        # The fewest such layers: one fewer would fit in less (or there is only one).
        assert item.layers == 1 or (item.layers - 1) * decode.point_bytes(item.point) < decode.MIN_TOTAL_BYTES
    tiny = decode.Point("Qwen2.5-1.5B", 1, 12, 2, 1024)  # 1 MiB a layer
    assert decode.layers_for(tiny) == 1024
    assert decode.layers_for(tiny, override=7) == 7
    with pytest.raises(ValueError):
        decode.layers_for(tiny, override=0)


def test_graphs_hold_a_model_of_layer_calls():
    # On a GPU a point's graph cycles through its L caches until a replay reads GRAPH_BYTES, at most
    # GRAPH_CALLS calls unless L is more, so a replay's fixed cost weighs as over a model's layers;
    # off it, each layer once.
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert (decode.GRAPH_CALLS, decode.GRAPH_BYTES) == (32, 16e9)
    for item in decode.plan(decode.decode_points(quick=False)):
        nbytes = decode.point_bytes(item.point)
        calls = decode.graph_calls(item.layers, nbytes, gpu)
        assert calls >= item.layers and (calls == item.layers or calls <= decode.GRAPH_CALLS)
        # enough calls that a replay reads GRAPH_BYTES, or GRAPH_CALLS of them, or L
        assert calls * nbytes >= decode.GRAPH_BYTES or calls == max(item.layers, decode.GRAPH_CALLS)
        # no more than needed: one call fewer would read less, unless L calls are the floor
        assert calls == item.layers or (calls - 1) * nbytes < decode.GRAPH_BYTES
        # a cache is read again only after >= 1 GiB of reads (itself, or the other layers')
        assert item.layers * nbytes >= decode.MIN_TOTAL_BYTES
        assert decode.graph_calls(item.layers, nbytes, cpu) == item.layers
    assert decode.graph_calls(2, 553e6, gpu) == 29  # the e4m3 B16 32/8 16k layers: 16 GB a replay
    assert decode.graph_calls(16, 69e6, gpu) == 32
    assert decode.graph_calls(1, 17.7e9, gpu) == 1
    assert decode.graph_calls(1024, 1e6, gpu) == 1024


def test_skip_logic_bounds_the_total_cache():
    # The default sweep fits: its largest point is one 34 GB layer (Llama-3-8B, B64, 128k).
    planned = decode.plan(decode.decode_points(quick=False))
    assert not [p for p in planned if p.skip]
    biggest = max(planned, key=lambda p: p.layers * decode.point_bytes(p.point))
    assert (biggest.point.batch, biggest.point.heads_k, biggest.point.context) == (64, 8, 131072)
    assert biggest.layers == 1 and decode.point_bytes(biggest.point) == pytest.approx(34.36 * GB, rel=1e-3)
    # Forcing layers pushes the big points over ~60 GB, and only those are skipped.
    forced = decode.plan(decode.decode_points(quick=False), layers=2)
    skipped = [p for p in forced if p.skip]
    assert [(p.point.batch, p.point.heads_k, p.point.context) for p in skipped] == [(64, 8, 131072)]
    assert "34.4 GB" in skipped[0].skip and "68.7 GB > 60 GB" in skipped[0].skip
    for p in forced:
        assert (p.skip is None) == (2 * decode.point_bytes(p.point) <= decode.MAX_TOTAL_BYTES)
    assert decode.skip_reason(biggest.point, 1, max_total=10 * GB) is not None


def test_providers_per_command():
    at_sweep = decode.Point("Llama-3-8B", 1, 32, 8, decode.PAGE_SWEEP_CONTEXT)
    elsewhere = decode.Point("Llama-3-8B", 1, 32, 8, 4096)
    assert decode.providers_for(elsewhere, "decode") == ("flashtile", "sdpa-flash", "sdpa-cudnn")
    assert decode.providers_for(elsewhere, "paged") == ("flashtile", "flashtile-paged16")
    assert decode.providers_for(at_sweep, "paged") == ("flashtile", "flashtile-paged16", "flashtile-paged1",
                                                       "flashtile-paged256")
    assert decode.page_size_of("flashtile-paged256") == 256 and decode.page_size_of("flashtile") is None


# ----------------------------------------------------------------------------------------- pages

@pytest.mark.parametrize("page_size", [1, 3, 16, 256])
def test_paginate_round_trips_through_the_block_table(page_size):
    k = torch.randn(3, 40, 2, 8)
    v = torch.randn(3, 40, 2, 8)
    k_pool, v_pool, table = decode.paginate(k, v, page_size, torch.Generator().manual_seed(1))
    per_seq = -(-40 // page_size)
    assert table.dtype == torch.int32 and table.shape == (3, per_seq)
    assert sorted(table.reshape(-1).tolist()) == list(range(3 * per_seq))  # every page once
    for b in range(3):
        assert torch.equal(decode.read_tokens(k_pool, table, b, 0, 40), k[b])
        assert torch.equal(decode.read_tokens(v_pool, table, b, 5, 37), v[b, 5:37])
    new = torch.randn(4, 2, 8)
    decode.write_tokens(k_pool, table, 1, 30, new)
    assert torch.equal(decode.read_tokens(k_pool, table, 1, 30, 34), new)
    assert torch.equal(decode.read_tokens(k_pool, table, 1, 0, 30), k[1, :30])
    decode.write_tokens(k, None, 1, 30, new)
    assert torch.equal(decode.read_tokens(k, None, 1, 30, 34), new)


def test_shuffled_block_table_uses_every_page_once():
    table = decode.shuffled_block_table(4, 64, CPU, torch.Generator().manual_seed(0))
    assert table.dtype == torch.int32 and table.shape == (4, 64)
    flat = table.reshape(-1).tolist()
    assert sorted(flat) == list(range(256)) and flat != list(range(256))


# ----------------------------------------------------------------------------------------- check rule

def test_check_rule_accepts_exact_and_rejects_wrong():
    q = torch.randn(2, 1, 4, 16, dtype=torch.bfloat16)
    k = torch.randn(2, 30, 2, 16, dtype=torch.bfloat16)
    v = torch.randn(2, 30, 2, 16, dtype=torch.bfloat16)
    exact, exact_lse, low = decode.reference_decode(q, k, v, None, [30, 7])
    assert exact.shape == (2, 1, 4, 16) and exact_lse.shape == (2, 4, 1)
    assert decode._judge(exact.to(q.dtype), exact_lse.float(), exact, exact_lse, low)["passed"]
    assert not decode._judge((exact + 0.05).to(q.dtype), exact_lse.float(), exact, exact_lse, low)["passed"]
    assert not decode._judge(exact.to(q.dtype), exact_lse.float() + 0.1, exact, exact_lse, low)["passed"]
    nan = exact.clone()
    nan[0, 0, 0, 0] = math.nan
    assert not decode._judge(nan.to(q.dtype), exact_lse.float(), exact, exact_lse, low)["passed"]
    # Sequence 1 sees only its first 7 keys.
    only7, _, _ = decode.reference_decode(q[1:], k[1:, :7], v[1:, :7], None, [7])
    assert torch.equal(exact[1:], only7)


def test_check_cases_cover_pages_splits_and_heads():
    for on_gpu in (False, True):
        cases = decode.check_cases(on_gpu)
        assert {c.page_size for c in cases} == {None, 1, 3, 16, 256}
        assert {0, 1} <= {c.num_splits for c in cases} and any(c.num_splits > 1 for c in cases)
        assert {(c.heads, c.heads_k) for c in cases} >= {(12, 2)}
        assert all(1 in c.lengths and max(c.lengths) == c.capacity for c in cases)


# ----------------------------------------------------------------------------------------- plumbing

def _fake_timer(calls):
    def timer(fn):
        fn()
        calls.append(fn)
        return 3.0  # ms for the whole replay
    return timer


@pytest.mark.parametrize("command", ["decode", "paged"])
def test_sweep_records_tables_plot_and_json(command, tmp_path, monkeypatch):
    monkeypatch.setattr(decode, "PAGE_SWEEP_CONTEXT", 256)
    point = decode.Point("tiny", 2, 8, 2, 256, head_dim=32)
    calls = []
    records = decode.run_sweep(decode.plan([point], layers=2), command, CPU, timer=_fake_timer(calls),
                               ceiling_gbps=0.01)
    (record,) = records
    names = decode.providers_for(point, command)
    assert list(record["providers"]) == list(names)
    assert record["layers"] == 2 and record["kv_bytes_per_layer"] == decode.point_bytes(point)
    mine = record["providers"]["flashtile"]
    assert mine["available"], mine
    assert mine["ms_per_layer"] == pytest.approx(1.5)  # the replay's 3 ms over 2 layers
    assert mine["gbps"] == pytest.approx(decode.point_bytes(point) / 1.5e-3 / 1e9)
    assert mine["pct_ceiling"] == pytest.approx(100 * mine["gbps"] / 0.01)
    assert mine["num_splits"] >= 1
    if command == "decode":
        # cuDNN has no CPU kernel: unavailable with a reason, not a crash.
        assert not record["providers"]["sdpa-cudnn"]["available"]
        assert record["providers"]["sdpa-cudnn"]["error"]
        assert record["ratios"]["sdpa-cudnn"] is None
        table = decode.format_decode_table(records, "T")
    else:
        assert all(record["providers"][n]["available"] for n in names), record["providers"]
        assert record["ratios"]["flashtile-paged16"] == pytest.approx(1.0)  # same fake time
        table = decode.format_paged_table(records, "T")
    # Every provider that ran was timed in at least ROUNDS balanced rounds, after one untimed pass.
    timed = [r for r in record["providers"].values() if r["available"]]
    raced = len(timed) > 1
    assert all(len(r.get("replay_ms_rounds", [r["replay_ms"]])) >= (decode.ROUNDS if raced else 1)
               for r in timed)
    assert len(calls) == sum(len(r.get("replay_ms_rounds", [0])) for r in timed) + raced
    assert "B" in table.splitlines()[1] and table.splitlines()[-1].split()[0] == "2"
    png = tmp_path / f"{command}.png"
    message = decode.write_plot(records, command, 0.01, png, "t")
    assert message.startswith("Wrote") or "not installed" in message
    write_json(tmp_path / "r.json", {"points": records})
    assert json.loads((tmp_path / "r.json").read_text())["points"][0]["context"] == 256


def test_speed_ratios_are_anchor_time_over_flashtile_time():
    results = {"flashtile": {"available": True, "ms_per_layer": 2.0},
               "sdpa-flash": {"available": True, "ms_per_layer": 3.0},
               "sdpa-cudnn": {"available": False, "error": "no"}}
    assert decode.speed_ratios(results, "flashtile", decode.DECODE_ANCHORS, "ms_per_layer") == \
        {"sdpa-flash": 1.5, "sdpa-cudnn": None}


def test_ceiling_counts_bytes_read(monkeypatch):
    # every config through the interpreter would take minutes: two of them
    monkeypatch.setattr(stream_read, "CONFIGS", ((4096, 4, 1), (16384, 8, 2)))
    calls = []
    m = decode.measure_ceiling(CPU, timer=_fake_timer(calls), nbytes=1 << 20)
    assert m["sum_gbps"] == pytest.approx((1 << 20) / 3e-3 / 1e9)
    assert m["read_gbps"] == pytest.approx((1 << 20) / 3e-3 / 1e9)
    assert len(m["read_configs"]) == len(stream_read.CONFIGS)
    assert m["copy_read_write_gbps"] == pytest.approx(2 * m["copy_read_gbps"])
    faster = {**m, "read_gbps": 2 * m["read_gbps"]}
    summary = decode.ceiling_summary(m, faster)
    assert summary["gbps"] == 2 * m["read_gbps"] and summary["sum_gbps"] == m["sum_gbps"]
    assert decode.ceiling_rate({**m, "sum_gbps": 3 * m["read_gbps"]}) == 3 * m["read_gbps"]


@pytest.mark.parametrize("block,per_sm", [(4096, 1), (4096, 0), (16384, 2)])
def test_stream_read_reads_every_word(block, per_sm):
    words = torch.randint(-2**31, 2**31 - 1, (block * 11,), dtype=torch.int32)  # 11 blocks
    out = torch.full((64,), 7, dtype=torch.int32)
    got = stream_read.stream_read(words, block, 4, per_sm, out=out)
    grid = stream_read.grid_size(11, per_sm, 4)
    blocks = words.view(11, block).numpy()
    for p in range(grid):
        expected = np.bitwise_xor.reduce(blocks[p::grid].reshape(-1))
        assert int(got[p]) == int(expected)
    with pytest.raises(ValueError, match="words"):
        stream_read.stream_read(words[1:], block, 4, per_sm)


def test_ceiling_bytes_fit_small_gpus(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (141 << 30, 141 << 30))
    assert decode.ceiling_bytes(cuda) == decode.CEILING_BYTES
    free = (10 << 30) + 12345  # a quarter, in whole MiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 24 << 30))
    assert decode.ceiling_bytes(cuda) == (free // 4) >> 20 << 20
    assert decode.ceiling_bytes(cuda) % (4 * max(b for b, _, _ in stream_read.CONFIGS)) == 0


def test_stream_read_verify_catches_a_skipped_word(monkeypatch):
    words = torch.randint(-2**31, 2**31 - 1, (16384 * 3,), dtype=torch.int32)
    monkeypatch.setattr(stream_read, "CONFIGS", ((4096, 4, 1), (16384, 4, 0)))
    stream_read.verify(words)  # passes
    real = stream_read.stream_read

    def skips_the_last_block(w, block, warps, per_sm, out=None):
        return real(w[:-block], block, warps, per_sm, out)
    monkeypatch.setattr(stream_read, "stream_read", skips_the_last_block)
    with pytest.raises(RuntimeError, match="stream_read"):
        stream_read.verify(words)
