"""Tests run the real kernels through Triton's interpreter on the CPU.

TRITON_INTERPRET must be set before any @triton.jit decorator runs, so it is set here, before flashtile's
kernels are imported. Every test draws fresh random inputs: the base seed changes per session (printed in
the header, FLASHTILE_TEST_SEED=<n> replays a session) and each test offsets it by a hash of its id.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import random  # noqa: E402
import zlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

_BASE_SEED = int(os.environ.get("FLASHTILE_TEST_SEED", random.SystemRandom().randrange(2**31)))


def pytest_report_header(config):
    return f"flashtile test seed: FLASHTILE_TEST_SEED={_BASE_SEED}"


def pytest_collection_modifyitems(config, items):
    # The compile checks first (tests/test_gpu_targets.py: minutes each with an empty Triton cache), so
    # that both xdist workers start on them and the many short tests fill in after; last, one of them
    # had kept a single worker busy for minutes at the end.
    items.sort(key=lambda item: item.path.name != "test_gpu_targets.py")


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    torch.manual_seed(_BASE_SEED + zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty filled with NaN while a test runs flashtile: an output or partial element the
    kernels leave unwritten then shows up as NaN."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)
    yield
    monkeypatch.setattr(torch, "empty", real)
