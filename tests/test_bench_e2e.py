"""``flashtile bench e2e``: its CPU path (tiny model, teacher-forced check against fp32 through the
interpreter) and its table from a stand-in payload."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")  # an optional extra; `make test` installs it
from flashtile.bench import e2e  # noqa: E402


def test_cpu_path_runs_the_teacher_forced_check():
    model = e2e.build_model(e2e.tiny_config(), torch.device("cpu"))
    lines = []
    result = e2e.check(model, torch.device("cpu"), prompt=20, steps=6, log=lines.append)
    assert result["passed"], result
    assert result["prompt"] == 20 and result["steps"] == 6
    assert 0 < result["sdpa_max_error"] and result["error_budget"] >= 2 * result["sdpa_max_error"]
    assert result["flashtile_max_error"] <= result["error_budget"]
    assert result["flashtile_max_error"] == max(result["flashtile_max_error_prefill"],
                                                result["flashtile_max_error_decode"])
    assert 0 <= result["greedy_steps_agreeing"] <= 6  # informational only
    assert lines and lines[0].startswith("PASS") and "teacher-forced" in lines[0]
    assert model.dtype == torch.bfloat16  # the fp32 reference was a copy


@pytest.mark.parametrize("part", ["prefill", "decode"])
def test_check_fails_when_one_path_is_off(monkeypatch, part):
    """Attention output 10% off on the prefill path alone, or on the decode path alone (the kernel's
    launches, which the integration's prepared decode steps reach without flash_attn_with_kvcache),
    fails the check."""
    if part == "prefill":
        from flashtile import interface
        exact = interface.flash_attn_func
        monkeypatch.setattr(interface, "flash_attn_func", lambda *a, **k: 1.1 * exact(*a, **k))
    else:
        from flashtile.kernels import decode
        exact = decode.run_decode

        def off(*args, **kwargs):
            out, lse = exact(*args, **kwargs)
            return 1.1 * out, lse
        monkeypatch.setattr(decode, "run_decode", off)
    model = e2e.build_model(e2e.tiny_config(), torch.device("cpu"))
    result = e2e.check(model, torch.device("cpu"), prompt=20, steps=6, log=lambda line: None)
    assert not result["passed"], result
    assert result[f"flashtile_max_error_{part}"] > result["error_budget"]


def test_table_reports_ratios_against_sdpa():
    ok = lambda **kw: {"available": True, **kw}  # noqa: E731
    payload = {"model": "m", "gpu": "g",
               "ttft": {"2048": {"flashtile": ok(ms=10.0), "sdpa": ok(ms=15.0),
                                 "eager": {"available": False, "error": "OutOfMemoryError"}}},
               "decode": {"1": {"flashtile": ok(tokens_per_s=200.0), "sdpa": ok(tokens_per_s=100.0),
                                "eager": ok(tokens_per_s=50.0)}}}
    table = e2e.format_table(payload)
    ttft_line = next(line for line in table.splitlines() if line.startswith("TTFT ms, prompt 2048"))
    assert "1.50x" in ttft_line and ttft_line.split()[-2] == "-"
    decode_line = next(line for line in table.splitlines() if line.startswith("decode tok/s, batch 1"))
    assert "2.00x" in decode_line


def test_generate_example_runs():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root / "src"))
    proc = subprocess.run([sys.executable, str(root / "examples" / "generate.py"), "--max-new-tokens", "4"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import ast
    tokens = ast.literal_eval(proc.stdout.strip().splitlines()[-1])  # the new token ids
    assert isinstance(tokens, list) and len(tokens) == 4
