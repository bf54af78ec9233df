"""Every shipped kernel variant compiles to a cubin for sm_90 (H100/H200), sm_80 (A100) and sm_89 (L4,
L40S, RTX 40: 99 KB of shared memory a CTA, as sm_86 and sm_120) within the shared memory a CTA may
have there, no GPU needed; so do the decode kernels of every plan the decode planner picks over a
grid of calls.

The interpreter cannot catch lowering errors (tl.dot shapes, layouts, shared memory over the limit), so
the real compiler runs here, in a subprocess without TRITON_INTERPRET.
"""

import os
import subprocess
import sys

import pytest

SHARDS = 4


@pytest.mark.parametrize("shard", range(SHARDS))
@pytest.mark.parametrize("arch", [90, 80, 89])
def test_variants_compile(arch, shard):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "flashtile.kernels.variants", "--arch", str(arch), "--shard", f"{shard}/{SHARDS}",
         # sm_89 compiles sm_80's tiles up to head dim 128 (at most 96 KB there, against its 99 KB: a
         # clean clone with an empty Triton cache took 27 minutes with them); past it its own, and
         # the e4m3 variants at every head dim (sm_80 compiles none)
         *(["--min-head-dim", "129"] if arch == 89 else [])],
        env=env, capture_output=True, text=True, timeout=900)
    lines = proc.stdout.splitlines()
    assert lines, proc.stderr[-2000:]
    failed = [line for line in lines if "FAILED" in line]
    assert proc.returncode == 0 and not failed, "\n".join(failed) + proc.stderr[-2000:]
    assert all(": ok," in line for line in lines)


@pytest.mark.parametrize("shard", range(2))
@pytest.mark.parametrize("arch", [90, 80, 89])
def test_decode_plans_compile_within_shared_memory(arch, shard):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "flashtile.kernels.variants", "--decode-plans", "--arch", str(arch),
         "--shard", f"{shard}/2"], env=env, capture_output=True, text=True, timeout=900)
    lines = proc.stdout.splitlines()
    assert len(lines) >= 10, proc.stderr[-2000:]
    failed = [line for line in lines if "FAILED" in line]
    assert proc.returncode == 0 and not failed, "\n".join(failed) + proc.stderr[-2000:]
    assert all(": ok," in line for line in lines)
