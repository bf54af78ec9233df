"""kernels/launch.py: when the direct launch steps aside for Triton's JIT."""

from __future__ import annotations

from triton import knobs

from flashtile.kernels import launch


def test_an_empty_hook_chain_is_no_hook():
    """Triton 3.6's launch_enter_hook is a HookChain, never None: only a chain with a hook in it (a
    profiler's) must send launches through the JIT, which calls the hooks."""
    assert not launch._hooks_set()

    def hook(metadata):
        return None
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert launch._hooks_set()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert not launch._hooks_set()
