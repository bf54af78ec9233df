"""Launching a compiled Triton kernel again without the JIT's per-call dispatch.

``kernel[grid](...)`` specializes every argument (type, 16-byte alignment of pointers, ints equal to
1 or divisible by 16) in Triton's binder before it finds the compiled kernel: about 40 of the 60
microseconds a decode launch cost on the H200's host, paid by every layer at every decode step.
``launch`` keys a call by what that specialization can depend on (each tensor's dtype and pointer
alignment, None, each scalar's exact value, the constexprs and the grid) and, from the second
call with a key on, hands the arguments straight to the kernel's launcher. The first call of a key goes
through the JIT, which compiles and picks the kernel; the key is at least as fine as Triton's own, so
the kernel found for it is the kernel the JIT would have launched.

The JIT path is kept when kernels run in the interpreter, when Triton's launch hooks are set (a
profiler such as proton needs them), with a Triton other than 3.6 and with ``FLASHTILE_DIRECT_LAUNCH=0``.
"""

from __future__ import annotations

import os

import torch
import triton
from triton import knobs

from .forward import interpreting

# The launcher's calling convention and the JIT's caches are Triton internals: used only with the
# Triton release this was written and checked against (3.6), the JIT's path with any other.
ENABLED = (os.environ.get("FLASHTILE_DIRECT_LAUNCH", "1") not in ("", "0")
           and triton.__version__.split(".")[:2] == ["3", "6"])

# key -> (compiled kernel, the arguments the launcher takes after the call's own: constexprs and
# defaulted parameters, as Triton's binder ordered them). Bounded: transformers' growing cache gives
# each decode step new strides, hence new keys.
_KERNELS: dict = {}
_MAX_KERNELS = 4096


def _hooks_set() -> bool:
    # Triton 3.6 keeps its launch hooks in a HookChain that is never None; older ones use None.
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


def _jit_descriptors(descriptors: tuple) -> tuple:
    # The JIT specializes on real descriptor objects; light stand-ins say how to make one (``real``).
    return tuple(d.real() if hasattr(d, "real") else d for d in descriptors)


def launch(jit, grid: tuple, tensors: tuple, scalars: tuple, options: dict,
           descriptors: tuple = ()) -> None:
    """``jit[grid](*descriptors, *tensors, *scalars, **options)``.

    ``tensors``: the kernel's pointer parameters, first in its signature after any tensor
    descriptors: CUDA tensors on one device (the first not None) or None. ``scalars``: the rest,
    each position always given the same type by its call site (an int is never a float there: the
    key compares values). ``options`` (constexprs and launch options) is keyed by identity: pass the
    same dict object for the same options (a cached plan's), never mutate it. ``descriptors``: TMA
    tensor descriptors (Gluon's), whose block shape and layout ``options`` must determine (their
    tensors' dtypes are keyed), or light stand-ins with the launcher's fields (``base``, ``shape``,
    ``strides``, ``padding``) and a ``real()`` that builds the descriptor for the JIT."""
    if not ENABLED or interpreting() or jit.pre_run_hooks or _hooks_set():
        jit[grid](*_jit_descriptors(descriptors), *tensors, *scalars, **options)
        return
    device = torch._C._cuda_getDevice()
    if tensors[0].get_device() != device:  # the JIT's path (and its checks) for another GPU's tensors
        jit[grid](*_jit_descriptors(descriptors), *tensors, *scalars, **options)
        return
    ptrs = [None if t is None else t.data_ptr() for t in tensors]
    key = (jit, id(options), device, grid, scalars, *[d.base.dtype for d in descriptors],
           *[None if t is None else (t.dtype, p % 16 == 0) for t, p in zip(tensors, ptrs)])
    entry = _KERNELS.get(key)
    if entry is None:
        descriptors = _jit_descriptors(descriptors)
        kernel = jit[grid](*descriptors, *tensors, *scalars, **options)
        if hasattr(kernel, "result"):  # an asynchronous compile's future
            kernel = kernel.result()
        binder = jit.device_caches[device][4]
        bound, _, _ = binder(*descriptors, *tensors, *scalars, **options)
        values = tuple(bound.values())
        if len(_KERNELS) >= _MAX_KERNELS:
            _KERNELS.clear()
        # The entry holds ``options`` so that its id stays unique while the entry lives.
        _KERNELS[key] = (kernel, values[len(descriptors) + len(tensors) + len(scalars):], options)
        return
    kernel, tail, _ = entry
    g = grid + (1,) * (3 - len(grid))
    # Pointers as ints: given a tensor, the launcher calls its data_ptr() and asks the driver about
    # the address (cuPointerGetAttribute), a microsecond per pointer. The callers' argument checks
    # have put every tensor on the first one's device, the current one.
    kernel.run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(device), kernel.function,
               kernel.packed_metadata, None, None, None, *descriptors, *ptrs, *scalars, *tail)
