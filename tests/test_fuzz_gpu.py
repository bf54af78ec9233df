"""benchmarks/fuzz_gpu.py, the GPU fuzzer of the public API, run small through the interpreter: every
family draws cases that pass, and a wrong kernel result is caught and recorded."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

import flashtile

ROOT = Path(__file__).resolve().parents[1]


def _fuzzer():
    spec = importlib.util.spec_from_file_location("fuzz_gpu", ROOT / "benchmarks" / "fuzz_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _result(tmp_path, seed):
    return json.loads((tmp_path / f"fuzz-gpu-{seed}.json").read_text())


def test_each_family_runs_and_passes(tmp_path):
    fuzz = _fuzzer()
    seed = int(torch.randint(1 << 20, ()).item())
    for family in ("prefill", "varlen", "kvcache", "kvcache-long", "kvcache-fp8", "kvcache-fp8-long",
                   "prefill-fp8", "varlen-fp8", "mixed", "sinks"):
        rc = fuzz.main(["--device", "cpu", "--scale", "0.02", "--seconds", "4", "--seed", str(seed),
                        "--family", family, "--out", str(tmp_path)])
        result = _result(tmp_path, seed)
        assert result["cases"] >= 1 and {c["family"] for c in result["all_cases"]} == {family}
        assert rc == 0, result["failures"]


def test_a_wrong_output_is_caught(tmp_path, monkeypatch):
    fuzz = _fuzzer()
    real = flashtile.flash_attn_with_kvcache

    def off_by_one(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        return out + 1.0, lse  # far past any budget of the rule

    monkeypatch.setattr(flashtile, "flash_attn_with_kvcache", off_by_one)
    rc = fuzz.main(["--device", "cpu", "--scale", "0.02", "--seconds", "2", "--seed", "3",
                    "--family", "kvcache", "--out", str(tmp_path)])
    result = _result(tmp_path, 3)
    assert rc == 1 and result["cases"] >= 1 and len(result["failures"]) == result["cases"]
    assert all("max error" in f["error"] for f in result["failures"])


def test_an_e4m3_output_wrong_in_both_kernels_is_caught(tmp_path, monkeypatch):
    # prefill-fp8's budget follows the portable e4m3 kernel's error; an error both kernels share (a
    # descale applied wrongly) must still fail, by the check of the portable kernel against what
    # e4m3 P alone explains.
    from flashtile import fp8
    fuzz = _fuzzer()
    real_func, real_attention = flashtile.flash_attn_func, fp8.attention

    def scaled(real):
        def call(*args, **kwargs):
            out, lse, *rest = real(*args, **kwargs)
            return (out * 1.5, lse, *rest)
        return call

    monkeypatch.setattr(flashtile, "flash_attn_func", scaled(real_func))
    monkeypatch.setattr(fp8, "attention", scaled(real_attention))
    rc = fuzz.main(["--device", "cpu", "--scale", "0.02", "--seconds", "3", "--seed", "5",
                    "--family", "prefill-fp8", "--out", str(tmp_path)])
    result = _result(tmp_path, 5)
    assert rc == 1 and result["cases"] >= 1
    # (a case whose every row sees no key has an all-zero output: scaling cannot move it)
    assert len(result["failures"]) >= result["cases"] // 2
    assert all("portable e4m3 error" in f["error"] for f in result["failures"])
