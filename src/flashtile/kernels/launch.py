"""Launching a compiled Triton kernel again without the JIT's per-call dispatch.

``kernel[grid](...)`` specializes every argument (type, 16-byte alignment of pointers, ints equal to
1 or divisible by 16) in Triton's binder before it finds the compiled kernel: about 40 of the 60
microseconds a decode launch cost on the H200's host, paid by every layer at every decode step.
``launch`` keys a call by what that specialization can depend on (each tensor's dtype and pointer
alignment, None, each scalar's exact value, the constexprs and the grid) and, from the second
call with a key on, hands the arguments straight to the kernel's launcher. A call whose exact key is
new but whose scalars fall in the same specialization classes as an earlier call's (Triton's: an int
equal to 1, divisible by 16 or not, 32- or 64-bit; a float; a bool) launches that call's kernel
directly too: lengths and strides that change from call to call (variable-length prefill, a KV
cache that grows every step) no longer send every call through the JIT. Only the first call of a
class key goes through the JIT, which compiles and picks the kernel; both keys are at least as fine
as Triton's own, so the kernel found for them is the kernel the JIT would have launched.

Kernels with TMA descriptor parameters (the Gluon ones) skip one more layer: Triton's launcher
encodes every descriptor (cuTensorMapEncodeTiled behind a few Python calls) on every launch; here the
encoded descriptor of each (parameter, address, shape, strides) is kept with the kernel's entry and
handed straight to the C launcher underneath (Triton 3.6's ``CudaLauncher`` and
``wrap_handle_tensordesc``, whose wrapping this reads: where it does not look as expected, or the
kernel needs scratch memory, launches go through ``kernel.run`` as before).

The JIT path is kept when kernels run in the interpreter, when Triton's launch hooks are set (a
profiler such as proton needs them), with a Triton other than 3.6 and with ``FLASHTILE_DIRECT_LAUNCH=0``.
"""

from __future__ import annotations

import os

import torch
import triton
from triton import knobs

from .forward import interpreting

try:  # Triton's own descriptor encoding (NVIDIA backend), used when a cached one is missing
    from triton.backends.nvidia.driver import make_tensordesc_arg
except ImportError:  # pragma: no cover - depends on the installed triton
    make_tensordesc_arg = None

# The launcher's calling convention and the JIT's caches are Triton internals: used only with the
# Triton release this was written and checked against (3.6), the JIT's path with any other.
ENABLED = (os.environ.get("FLASHTILE_DIRECT_LAUNCH", "1") not in ("", "0")
           and triton.__version__.split(".")[:2] == ["3", "6"])

# key -> (compiled kernel, the arguments the launcher takes after the call's own: constexprs and
# defaulted parameters, as Triton's binder ordered them). Bounded: transformers' growing cache gives
# each decode step new strides, hence new keys.
_KERNELS: dict = {}
_MAX_KERNELS = 4096
# The same entries by class key (scalars by specialization class, no grid: the grid is a launch
# argument, not part of what Triton compiles for).
_BY_CLASS: dict = {}

# Encoded TMA descriptors kept per kernel entry (training sees each layer's activations at the
# same addresses step after step; a benchmark loop, the same few).
_MAX_TMAPS = 256

_I32 = (-2 ** 31, 2 ** 31)
_I64 = (-2 ** 63, 2 ** 63)


def scalar_classes(scalars: tuple) -> tuple:
    """What Triton 3.6's specialization sees of each scalar argument (native_specialize_impl): an
    int's value when it is 1 (a constant then), else its width and whether 16 divides it; a float
    or bool by its type; None as itself."""
    out = []
    for x in scalars:
        kind = type(x)
        if kind is int:
            if x == 1:
                out.append(1)
            else:
                width = 32 if _I32[0] <= x < _I32[1] else 64 if _I64[0] <= x < _I64[1] else 65
                out.append((width, x % 16 == 0))
        elif kind is float or kind is bool or x is None:
            out.append(kind)
        else:  # anything else (numpy scalars, constexpr objects): by value, as before
            out.append((kind, x))
    return tuple(out)


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
    descriptors: CUDA tensors on one device (the first not None) or None; may be empty when
    descriptors are given. ``scalars``: the rest, each position always given the same type by its
    call site (an int is never a float there: the
    key compares values). ``options`` (constexprs and launch options) is keyed by identity: pass the
    same dict object for the same options (a cached plan's), never mutate it. ``descriptors``: TMA
    tensor descriptors (Gluon's), whose block shape and layout ``options`` must determine (their
    tensors' dtypes are keyed), or light stand-ins with the launcher's fields (``base``, ``shape``,
    ``strides``, ``padding``) and a ``real()`` that builds the descriptor for the JIT."""
    if not ENABLED or interpreting() or jit.pre_run_hooks or _hooks_set():
        jit[grid](*_jit_descriptors(descriptors), *tensors, *scalars, **options)
        return
    device = torch._C._cuda_getDevice()
    first = next((t for t in tensors if t is not None), None)
    if first is None:
        first = descriptors[0].base
    if first.get_device() != device:  # the JIT's path (and its checks) for another GPU's tensors
        jit[grid](*_jit_descriptors(descriptors), *tensors, *scalars, **options)
        return
    ptrs = [None if t is None else t.data_ptr() for t in tensors]
    args = (*[d.base.dtype for d in descriptors],
            *[None if t is None else (t.dtype, p % 16 == 0) for t, p in zip(tensors, ptrs)])
    key = (jit, id(options), device, grid, scalars, *args)
    entry = _KERNELS.get(key)
    if entry is None:
        class_key = (jit, id(options), device, scalar_classes(scalars), *args)
        entry = _BY_CLASS.get(class_key)
        if entry is None:
            descriptors = _jit_descriptors(descriptors)
            kernel = jit[grid](*descriptors, *tensors, *scalars, **options)
            if hasattr(kernel, "result"):  # an asynchronous compile's future
                kernel = kernel.result()
            binder = jit.device_caches[device][4]
            bound, _, _ = binder(*descriptors, *tensors, *scalars, **options)
            values = tuple(bound.values())
            if len(_BY_CLASS) >= _MAX_KERNELS:
                _BY_CLASS.clear()
            # The entry holds ``options`` so that its id stays unique while the entry lives.
            entry = (kernel, values[len(descriptors) + len(tensors) + len(scalars):], options,
                     raw_launcher(kernel) if descriptors else None, {})
            _BY_CLASS[class_key] = entry
            _remember(key, entry)
            return
        _remember(key, entry)
    kernel, tail, _, raw, tmaps = entry
    g = grid + (1,) * (3 - len(grid))
    stream = torch._C._cuda_getCurrentRawStream(device)
    if raw is not None:
        launcher, metas, cooperative, pdl = raw
        encoded = []
        for i, d in enumerate(descriptors):
            key = (i, d.base.data_ptr(), tuple(d.shape), tuple(d.strides), d.padding)
            arg = tmaps.get(key)
            if arg is None:
                if len(tmaps) >= _MAX_TMAPS:
                    tmaps.clear()
                arg = tmaps[key] = tuple(make_tensordesc_arg(d, metas[i]))
            encoded += arg
        launcher(g[0], g[1], g[2], stream, kernel.function, cooperative, pdl, None, None,
                 kernel.packed_metadata, None, None, None, *encoded, *ptrs, *scalars, *tail)
        return
    # Pointers as ints: given a tensor, the launcher calls its data_ptr() and asks the driver about
    # the address (cuPointerGetAttribute), a microsecond per pointer. The callers' argument checks
    # have put every tensor on the first one's device, the current one.
    kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, None, None, None,
               *descriptors, *ptrs, *scalars, *tail)


def raw_launcher(kernel):
    """(C launcher, descriptor metadata, cooperative, pdl) under a compiled kernel whose first
    parameters are its TMA descriptors, as Triton 3.6's launcher wraps it; None where the wrapping
    is not that one (or the kernel needs scratch memory), and launches keep going through it."""
    run = kernel.run
    inner = getattr(run, "launch", None)
    code = getattr(inner, "__code__", None)
    if (make_tensordesc_arg is None or code is None or not inner.__closure__
            or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)):
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in inner.__closure__)))
    if code.co_name != "inner" or not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= cells.keys():
        return None
    indices, metas = cells["tensordesc_indices"], cells["tensordesc_meta"]
    if sorted(indices) != list(range(len(indices))) or not metas or any(m is None for m in metas):
        return None
    return cells["launcher"], tuple(metas), run.launch_cooperative_grid, run.launch_pdl


def _remember(key, entry) -> None:
    if len(_KERNELS) >= _MAX_KERNELS:
        _KERNELS.clear()
    _KERNELS[key] = entry
