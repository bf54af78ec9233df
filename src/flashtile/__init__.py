"""flashtile: FlashAttention-family attention kernels in pure Python/Triton, with flash_attn's API.

The public functions load on first use, so ``import flashtile`` does not compile or decorate any
Triton kernel: a program (the benchmark CLI, a test's conftest) can still choose TRITON_INTERPRET=1
after importing the package.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "flash_attn_func": "interface",
    "flash_attn_kvpacked_func": "interface",
    "flash_attn_qkvpacked_func": "interface",
    "flash_attn_varlen_func": "interface",
    "flash_attn_varlen_kvpacked_func": "interface",
    "flash_attn_varlen_qkvpacked_func": "interface",
    "flash_attn_with_kvcache": "interface",
    "flash_attn_combine": "interface",
    "scaled_dot_product_attention": "interface",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flashtile' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
