"""The benchmark CLI: its CPU path end to end, the FLOP convention, and the check's accuracy rule."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashtile import reference
from flashtile.bench import check
from flashtile.bench.common import attention_flops
from flashtile.bench.prefill import Point, sweep_points

ROOT = Path(__file__).resolve().parents[1]


def test_flops_follow_flashattention2():
    # FA2 paper, d128 at 16k tokens and hidden 2048: 4 * B * H * S^2 * D.
    assert attention_flops(1, 16, 16384, 16384, 128, causal=False) == 4 * 16 * 16384**2 * 128
    assert attention_flops(1, 16, 16384, 16384, 128, causal=True) == 2 * 16 * 16384**2 * 128
    assert attention_flops(2, 12, 1000, 3000, 64, causal=False) == 4 * 2 * 12 * 1000 * 3000 * 64
    assert Point("seed", 1, 12, 2, 8192, 128, True).flops == 2 * 12 * 8192**2 * 128


def test_sweep_keeps_sixteen_k_tokens():
    points = sweep_points(quick=False)
    paper = [p for p in points if p.family == "fa2"]
    assert len(paper) == 3 * 6 * 2
    assert all(p.batch * p.seqlen == 16384 and p.heads * p.head_dim == 2048 for p in paper)
    assert sorted(p.seqlen for p in points if p.family == "seed") == [1024 << i for i in range(6)]
    assert 0 < len(sweep_points(quick=True)) < len(points)


def _exact_attn(q, k, v, return_attn_probs=True, **kwargs):
    out, lse = reference.attention(q.double(), k.double(), v.double(), **kwargs)
    return out.to(q.dtype), lse.float(), None


def test_check_rule_accepts_exact_and_rejects_wrong():
    cpu = torch.device("cpu")
    case = check.Case(torch.float16, 1, 2, 2, 48, 40, 64, causal=True)  # Sq > Sk: rows with no key
    assert check.run_case(case, cpu, attn=_exact_attn)["passed"]

    def off_by_a_bit(q, k, v, **kw):
        out, lse, _ = _exact_attn(q, k, v, **kw)
        return out + 1e-2, lse, None

    def finite_lse_for_empty_rows(q, k, v, **kw):
        out, lse, _ = _exact_attn(q, k, v, **kw)
        return out, torch.nan_to_num(lse, posinf=0.0), None

    assert not check.run_case(case, cpu, attn=off_by_a_bit)["passed"]
    assert not check.run_case(case, cpu, attn=finite_lse_for_empty_rows)["passed"]


def test_lse_error_treats_empty_rows_exactly():
    exact = torch.tensor([1.0, math.inf, 50.0], dtype=torch.float64)
    assert check.lse_error(exact.float(), exact) == 0.0
    assert check.lse_error(torch.tensor([1.0, 3.0, 50.0]), exact) == math.inf
    assert check.lse_error(torch.tensor([1.0, math.inf, 50.01]), exact) == pytest.approx(2e-4, rel=1e-2)


def test_cli_without_gpu_runs_the_check_and_skips_timings(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "flashtile", "bench", "prefill", "--quick", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    verdicts = [line.split()[0] for line in done.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(verdicts) == len(check.check_cases(on_gpu=False)), log
    assert set(verdicts) == {"PASS"}, log
    assert "timings need a gpu" in done.stdout.lower(), log


def test_plots_render(tmp_path):
    """Both sweeps' plots draw from records shaped like a GPU run's (matplotlib is in the bench set)."""
    pytest.importorskip("matplotlib")
    from dataclasses import asdict

    from flashtile.bench import prefill, train

    records = []
    for i, point in enumerate(prefill.sweep_points(quick=True)):
        providers = {name: {"available": True, "tflops": 100.0 + 10 * i + j, "ms": 1.0}
                     for j, name in enumerate(prefill.PROVIDERS)}
        records.append({**asdict(point), "providers": providers, "ratios": {}, "out_lse_mb": None})
    assert prefill.write_plot(records, tmp_path / "prefill.png", "t").startswith("Wrote")
    assert train.write_plot(records, None, tmp_path / "train.png", "t").startswith("Wrote")
    assert (tmp_path / "prefill.png").stat().st_size > 1000 and (tmp_path / "train.png").stat().st_size > 1000


def test_prefill_fp8_mode_times_the_fp8_kernel_next_to_bf16(tmp_path):
    """`bench prefill --dtype fp8`: the e4m3 forward runs as its own provider on the point's inputs
    quantized once; the table adds its speed relative to bf16 flashtile and cuDNN."""
    from flashtile.bench import prefill

    point = prefill.Point("fa2", 1, 2, 2, 96, 64, True)
    timings = {"flashtile": 2.0, "flashtile-fp8": 1.0}
    calls = []

    def timer(fn):  # a stand-in: which provider runs is told by the order of calls
        calls.append(fn)
        fn()
        return [2.0, 1.0, 3.0, 3.0][len(calls) - 1]

    records = prefill.run_sweep([point], torch.bfloat16, torch.device("cpu"), timer=timer,
                                providers=prefill.FP8_PROVIDERS)
    results = records[0]["providers"]
    assert results["flashtile"]["available"] and results["flashtile-fp8"]["available"]
    assert results["flashtile-fp8"]["ms"] == timings["flashtile-fp8"]
    assert records[0]["ratios_fp8"]["flashtile"] == 2.0
    table = prefill.format_table(records, "t", prefill.FP8_PROVIDERS)
    assert "fp8/bf16" in table and "2.00x" in table.splitlines()[-1]
    pytest.importorskip("matplotlib")
    assert prefill.write_plot(records, tmp_path / "p.png", "t", prefill.FP8_PROVIDERS).startswith("Wrote")


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_balanced_orders_put_everyone_everywhere_and_after_everyone(n):
    from collections import Counter

    from flashtile.bench.common import balanced_orders

    orders = balanced_orders(n)
    assert len(orders) == (n if n % 2 == 0 else 2 * n)
    assert all(sorted(row) == list(range(n)) for row in orders)
    positions = Counter((pos, x) for row in orders for pos, x in enumerate(row))
    assert len(set(positions.values())) == 1 and len(positions) == n * n
    follows = Counter((a, b) for row in orders for a, b in zip(row, row[1:]))
    assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1


def test_prefill_rounds_balance_the_racing_providers_and_take_their_median(monkeypatch):
    """With rounds, the racing providers are timed in balanced orders (after one untimed call of
    the first), textbook once, and each gets the median of its rounds."""
    from flashtile.bench import prefill
    from flashtile.bench.common import balanced_orders

    point = prefill.Point("fa2", 1, 2, 2, 64, 64, False)
    names = ("flashtile", "sdpa-flash", "sdpa-cudnn", "textbook")
    built = {}

    def spec(name):
        def build(p, x):
            fn = lambda: None  # noqa: E731: a stand-in call that every backend takes
            built[fn] = name
            return fn
        return build, None

    monkeypatch.setattr(prefill, "_PROVIDER_SPECS", {n: spec(n) for n in names})
    order = []
    samples = {"flashtile": [9.0, 5.0, 1.0, 2.0, 2.0, 3.0, 4.0], "sdpa-flash": [3.0, 9.0, 4.0, 4.0, 1.0, 8.0],
               "sdpa-cudnn": [7.0, 6.0, 8.0, 7.0, 7.0, 7.0], "textbook": [50.0]}

    def timer(fn):
        name = built[fn]
        order.append(name)
        return samples[name][sum(1 for n in order if n == name) - 1]

    results = prefill.measure_point(point, None, timer, False, names, rounds=5)
    raced = names[:3]
    expected = ["flashtile"]  # the untimed warm-up call
    for r, row in enumerate(balanced_orders(3)):
        expected += [raced[i] for i in row] + (["textbook"] if r == 0 else [])
    assert order == expected
    assert results["flashtile"]["ms_rounds"] == [5.0, 1.0, 2.0, 2.0, 3.0, 4.0]
    assert [results[n]["ms"] for n in names] == [2.5, 4.0, 7.0, 50.0]
    assert "ms_rounds" not in results["textbook"]
    assert list(results) == list(names)


def test_time_in_rounds_drops_a_call_that_fails_and_keeps_the_others():
    from flashtile.bench.common import time_in_rounds

    calls = []

    def make(name, fail_at=None):
        def call():
            calls.append(name)
            if fail_at is not None and calls.count(name) == fail_at:
                raise RuntimeError(f"{name} failed")
            return float(calls.count(name))
        return call

    times, errors = time_in_rounds({"a": make("a"), "b": make("b", fail_at=3), "c": make("c"),
                                    "t": make("t")}, rounds=5, unraced=("t",))
    assert set(errors) == {"b"} and "b failed" in str(errors["b"])
    assert calls.count("b") == 3  # not called after it failed
    assert times["a"] == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]  # six rounds after the warm-up call
    assert times["c"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0] and times["t"] == [1.0]
    single, _ = time_in_rounds({"a": make("x")}, rounds=5)
    assert single == {"a": [1.0]}  # one racer: one pass, no warm-up


def test_source_digest_names_the_code_and_changes_with_it(tmp_path):
    from flashtile.bench.common import environment, source_digest

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    first = source_digest(tmp_path)
    assert first == source_digest(tmp_path) and len(first) == 16
    (tmp_path / "notes.txt").write_text("not code")
    assert source_digest(tmp_path) == first  # only .py files count
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    assert source_digest(tmp_path) != first
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "a.py").rename(tmp_path / "pkg" / "c.py")  # same bytes, another file
    assert source_digest(tmp_path) != first
    env = environment(torch.device("cpu"))
    assert env["source_digest"] == source_digest() and env["git_dirty"] in (True, False, None)
