"""``flashtile bench train``: its CPU path end to end, the fwd+bwd FLOP convention, the packed-sequence
set-up, the backward check's rule, and the timing plumbing with a stand-in timer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flashtile import reference
from flashtile.bench import check, train
from flashtile.bench.common import attention_flops, attention_train_flops, write_json
from flashtile.bench.prefill import Point

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def test_train_flops_are_three_and_a_half_forwards():
    # FA2 paper: backward = 2.5 x forward (five matmuls against two), so fwd + bwd = 3.5 x forward.
    assert attention_train_flops(1, 16, 16384, 16384, 128, causal=False) == 3.5 * 4 * 16 * 16384**2 * 128
    assert attention_train_flops(1, 16, 16384, 16384, 128, causal=True) == 3.5 * 2 * 16 * 16384**2 * 128
    assert attention_train_flops(2, 12, 1000, 3000, 64, False) == 3.5 * attention_flops(2, 12, 1000, 3000,
                                                                                          64, False)
    assert train.train_flops(Point("seed", 1, 12, 2, 8192, 128, True)) == 3.5 * 2 * 12 * 8192**2 * 128
    # Packed sequences count each sequence's own square, not batch x the longest.
    assert train.varlen_train_flops([1000, 3000, 96], 16, 128, causal=True) == \
        3.5 * 2 * 16 * 128 * (1000**2 + 3000**2 + 96**2)
    assert train.varlen_train_flops([64], 2, 64, causal=False) == 3.5 * 4 * 2 * 64 * 64**2


def test_varlen_lengths_are_fixed_and_spread():
    lengths = train.varlen_lengths()
    assert lengths == train.varlen_lengths()  # same seed, same list
    assert len(lengths) == 64
    assert all(isinstance(n, int) for n in lengths)
    for required in (1000, 3000, 96):
        assert required in lengths
    assert all(64 <= n <= 8192 for n in lengths)
    # A realistic spread: most sequences short, a long tail.
    ordered = sorted(lengths)
    assert ordered[32] < 1500 and ordered[-1] >= 3000 and ordered[0] <= 100
    assert train.varlen_lengths(seed=1) != lengths
    assert len(train.varlen_lengths(count=10)) == 10


def test_padded_batch_is_the_packed_sequences_and_causal_sdpa_is_exact_on_them():
    lengths = [5, 17, 1, 12]
    heads, head_dim, max_len = 2, 8, max(lengths)
    q, k, v = (torch.randn(sum(lengths), heads, head_dim, dtype=torch.float64) for _ in range(3))
    padded = [train.pad_packed(t, lengths, max_len) for t in (q, k, v)]
    assert padded[0].shape == (len(lengths), heads, max_len, head_dim) and padded[0].is_contiguous()
    out = F.scaled_dot_product_attention(*padded, is_causal=True)
    cu = train.cu_seqlens_of(lengths, CPU).tolist()
    assert cu == [0, 5, 22, 23, 35]
    for b, n in enumerate(lengths):
        s = slice(cu[b], cu[b + 1])
        assert torch.equal(padded[0][b, :, :n], q[s].transpose(0, 1))
        assert not padded[0][b, :, n:].any()  # zero padding
        # The real rows of the padded causal batch are each sequence's own attention.
        exact, _ = reference.attention(q[s][None], k[s][None], v[s][None], causal=True)
        torch.testing.assert_close(out[b, :, :n], exact[0].transpose(0, 1))


def test_backward_cases_cover_the_features_and_fit_the_reference_memory():
    for on_gpu in (False, True):
        cases = check.backward_cases(on_gpu)
        assert {c.dtype for c in cases} == {torch.float16, torch.bfloat16}
        assert {64, 80, 128, 256} <= {c.head_dim for c in cases}
        assert any(c.causal for c in cases) and any(not c.causal for c in cases)
        assert any((c.heads, c.heads_k) == (12, 2) for c in cases)
        assert any(c.heads_k == 1 and c.heads > 1 for c in cases)
        assert any(c.window != (-1, -1) for c in cases)
        assert any(c.softcap for c in cases) and any(c.alibi for c in cases)
        assert any(c.seqlen_q != c.seqlen_k and c.lengths is None for c in cases)
        assert any(c.dropout_p for c in cases) and any(c.lengths for c in cases)
    assert max(max(c.seqlen_q, c.seqlen_k) for c in check.backward_cases(False)) <= 96
    for c in check.backward_cases(True):
        assert c.score_elements() * check.GRAD_REF_BYTES_PER_SCORE <= check.GRAD_REF_MAX_BYTES, c.label()
        tokens = sum(c.lengths) if c.lengths else max(c.seqlen_q, c.seqlen_k)
        assert tokens <= 8192, c.label()


def _exact_out_grads(q, k, v, dout, **kwargs):
    out, grads = check.reference_out_grads(q.double(), k.double(), v.double(), dout.double(), **kwargs)
    return out.to(q.dtype), tuple(g.to(q.dtype) for g in grads)


def test_backward_rule_accepts_exact_and_rejects_wrong():
    case = check.BackwardCase(torch.float16, 1, 2, 1, 40, 30, 32, causal=True)  # rows with no key
    assert check.run_backward_case(case, CPU, out_grads=_exact_out_grads)["passed"]

    def dk_off_by_a_bit(*args, **kwargs):
        out, (dq, dk, dv) = _exact_out_grads(*args, **kwargs)
        return out, (dq, dk + 1e-2, dv)

    result = check.run_backward_case(case, CPU, out_grads=dk_off_by_a_bit)
    assert not result["passed"] and result["grad_err"]["dk"] > result["grad_budget"]["dk"]
    assert result["grad_err"]["dq"] <= result["grad_budget"]["dq"]

    def nan_dv(*args, **kwargs):
        out, (dq, dk, dv) = _exact_out_grads(*args, **kwargs)
        return out, (dq, dk, torch.full_like(dv, float("nan")))

    assert not check.run_backward_case(case, CPU, out_grads=nan_dv)["passed"]
    varlen = check.varlen_case(torch.bfloat16, (7, 1, 20), 2, 2, 16, causal=True, alibi=True)
    assert check.run_backward_case(varlen, CPU, out_grads=_exact_out_grads)["passed"]


def test_dropout_case_needs_the_mask_flashtile_draws():
    case = check.BackwardCase(torch.float16, 1, 2, 2, 24, 30, 16, causal=True, dropout_p=0.3)
    assert check.run_backward_case(case, CPU, seed=5)["passed"]

    def other_seed(*args, **kwargs):
        torch.manual_seed(1234)  # flashtile draws a different Philox seed than the reference's mask
        return check.flashtile_out_grads(*args, **kwargs)

    assert not check.run_backward_case(case, CPU, seed=5, out_grads=other_seed)["passed"]


def test_timing_plumbing_with_a_stand_in_timer(monkeypatch, tmp_path):
    """The GPU path's code on CPU tensors: each provider's step returns (dq, dk, dv), the records
    serialise, the table and the varlen line print."""
    steps = []

    def timer(fn):
        grads = fn()
        steps.append(len(grads))
        return 2.0

    monkeypatch.setattr(train, "VARLEN_HEADS", 2)
    monkeypatch.setattr(train, "varlen_lengths", lambda: [9, 1, 40])
    point = Point("seed", 1, 4, 2, 40, 32, True)
    records, varlen = train.run_sweep([point], torch.bfloat16, CPU, timer=timer)
    assert set(steps) == {3}
    flashtile = records[0]["providers"]["flashtile"]
    assert flashtile["available"], flashtile
    assert flashtile["tflops"] == pytest.approx(train.train_flops(point) / 2e-3 / 1e12)
    assert varlen["providers"]["flashtile"]["available"], varlen
    assert varlen["max_len"] == 40 and varlen["total_tokens"] == 50
    assert records[0]["providers"]["sdpa-cudnn"]["available"] is False  # no cuDNN on a CPU
    write_json(tmp_path / "train.json", {"points": records, "varlen": varlen})
    table = train.format_table(records, "title")
    assert table.splitlines()[-1].split()[:5] == ["32", "yes", "1", "4/2", "40"]
    assert train.format_varlen(varlen).startswith("varlen 3 seqs L1..40 (50 tokens, padded 3x40)")
    assert train.skip_reason("textbook", Point("fa2", 1, 16, 16, 16384, 128, False))
    assert train.skip_reason("textbook", point) is None


def test_cli_without_gpu_runs_the_checks_and_skips_timings(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    out_dir = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "flashtile", "bench", "train", "--quick", "--out", str(out_dir)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    verdicts = [line.split()[0] for line in done.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    extras = 4  # determinism, dropout kept fraction, torch.compile, opcheck
    assert len(verdicts) == len(check.backward_cases(on_gpu=False)) + extras, log
    assert set(verdicts) == {"PASS"}, log
    assert "Training extras: 4/4 passed" in done.stdout, log
    assert "timings need a gpu" in done.stdout.lower(), log
    assert not out_dir.exists()  # nothing written without timings


def test_training_extras_pass_on_cpu():
    """Determinism, dropout's kept fraction, torch.compile against eager and opcheck, as bench train
    runs them before timing."""
    results = check.run_training_extras(CPU, log=lambda line: None)
    assert [r["label"].split()[0] for r in results] == [
        "deterministic=True,", "dropout", "torch.compile(fullgraph=True)", "opcheck"]
    failed = [r for r in results if not r["passed"]]
    assert not failed, failed
