"""kernels/launch.py: when the direct launch steps aside for Triton's JIT."""

from __future__ import annotations

import torch
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


def test_descriptor_stand_ins_become_real_descriptors_for_the_jit():
    """The Gluon forward passes light stand-ins for its TMA descriptors; the JIT (first call of a
    signature, interpreter, hooks) gets real TensorDescriptors with the same fields."""
    import torch

    from flashtile.kernels import gluon_forward
    q = torch.randn(1, 64, 4, 128, dtype=torch.bfloat16)
    layout = gluon_forward._layouts(64, 128, 128, torch.bfloat16)[0]
    stand_in = gluon_forward._Descriptor(q, q.shape, q.stride(), (1, 64, 1, 128), layout)
    plain = object()
    real, same = launch._jit_descriptors((stand_in, plain))
    assert isinstance(real, gluon_forward.TensorDescriptor) and same is plain
    assert real.base is q and real.shape == list(q.shape) and real.strides == list(q.stride())
    assert real.block_shape == [1, 64, 1, 128] and real.layout == layout and real.padding == "zero"


def test_scalar_classes_are_at_least_as_fine_as_tritons_specialization():
    """Two scalars launch one compiled kernel only if Triton would have compiled them alike: equal
    classes must mean equal native specialization (type and the 1 / divisible-by-16 flags)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    values = [0, 1, 2, 15, 16, 17, 32, 48, 4096, 4097, -1, -16, -17, 2 ** 31 - 16, 2 ** 31 - 1,
              2 ** 31, 2 ** 31 + 16, -2 ** 31, -2 ** 31 - 16, 2 ** 40, 2 ** 63 - 16, 0.0, 1.0, 0.125,
              -3.5, True, False, None]
    native = {repr(v): native_specialize_impl(BaseBackend, v, False, True, True) for v in values}
    for a in values:
        for b in values:
            if launch.scalar_classes((a,)) == launch.scalar_classes((b,)):
                assert native[repr(a)] == native[repr(b)], (a, b)
    # and it does merge what Triton merges: lengths that differ but share a class
    assert launch.scalar_classes((1000, 4096, 0.5)) == launch.scalar_classes((1002, 8192, 0.25))
    assert launch.scalar_classes((16,)) != launch.scalar_classes((17,))
    assert launch.scalar_classes((1,)) != launch.scalar_classes((2,))


def test_raw_launcher_reproduces_tritons_descriptor_wrapping(monkeypatch):
    """Behind Triton 3.6's launcher, wrap_handle_tensordesc expands each descriptor parameter into
    (encoded map, shape, strides) before the C launcher; raw_launcher finds that C launcher, and
    launch's cached encoding hands it the same arguments the wrapper would."""
    import torch
    from triton.backends.nvidia import driver

    calls = []

    def c_launcher(*args):
        calls.append(args)

    def encode(arg, meta):  # stands in for cuTensorMapEncodeTiled (needs a GPU)
        return [("map", arg.base.data_ptr(), meta["swizzle"]), *arg.shape, *arg.strides]
    monkeypatch.setattr(driver, "make_tensordesc_arg", encode)
    monkeypatch.setattr(launch, "make_tensordesc_arg", encode)
    signature = {"a_desc": "tensordesc<bf16[64, 64]>", "b_desc": "tensordesc<bf16[64, 64]>",
                 "ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    metas = [{"swizzle": 128}, {"swizzle": 64}]

    class Run:  # the attributes CudaLauncher.__call__ reads
        launch = driver.wrap_handle_tensordesc(c_launcher, signature, metas)
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid, launch_pdl = False, True

    class Kernel:
        run = Run()
    raw = launch.raw_launcher(Kernel)
    assert raw is not None and raw[0] is c_launcher and raw[1] == tuple(metas) and raw[2:] == (False, True)

    from flashtile.kernels.gluon_forward import _Descriptor
    a, b = torch.zeros(64, 64), torch.zeros(128, 64)
    descs = (_Descriptor(a, a.shape, a.stride(), (64, 64), None),
             _Descriptor(b, b.shape, b.stride(), (64, 64), None))
    base = (1, 2, 3, 7, 9, False, True, None, None, "meta", None, None, None)
    Run.launch(*base, *descs, 1234, 5, 64)  # what Triton's own path passes to the C launcher
    tritons = calls.pop()
    launcher, found_metas, cooperative, pdl = raw
    encoded = []
    for i, d in enumerate(descs):
        encoded += tuple(launch.make_tensordesc_arg(d, found_metas[i]))
    launcher(1, 2, 3, 7, 9, cooperative, pdl, None, None, "meta", None, None, None, *encoded, 1234, 5, 64)
    assert calls.pop() == tritons


def test_raw_launcher_steps_aside_for_unexpected_wrappers():
    class Plain:  # no descriptor wrapping: launches keep going through kernel.run
        class run:
            launch = staticmethod(lambda *args: None)
            global_scratch_size = profile_scratch_size = 0
    assert launch.raw_launcher(Plain) is None


def test_launch_finds_the_device_past_leading_none_pointers(monkeypatch):
    """Pointer arguments may start with None (the Gluon backward's offsets without packing): the
    device check looks at the first tensor given (here on another GPU, so the JIT's path)."""
    from flashtile.kernels import launch as launch_module

    class OtherGpuTensor:
        def get_device(self):
            return 1

    calls = []

    class Jit:
        pre_run_hooks = []

        def __getitem__(self, grid):
            return lambda *args, **options: calls.append((grid, args))
    monkeypatch.setattr(launch_module, "ENABLED", True)
    monkeypatch.setattr(launch_module, "interpreting", lambda: False)
    monkeypatch.setattr(launch_module, "_hooks_set", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)  # a CPU build has none
    tensor = OtherGpuTensor()
    launch_module.launch(Jit(), (1,), (None, None, tensor), (3,), {})
    assert calls == [((1,), (None, None, tensor, 3))]
