"""``flashtile bench paged``: ``bench decode``'s measurement through a block table (page size 16 at every
point, 1 and 256 at one context) against the contiguous cache in the same run; see bench/decode.py."""

from __future__ import annotations

from .decode import add_arguments, run_paged as run

__all__ = ["add_arguments", "run"]
