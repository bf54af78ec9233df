"""Pieces shared by the benchmark commands: device choice, FLOP counts, environment, files, formatting.

Nothing here imports Triton or flashtile's kernels at module level: the device choice has to set
TRITON_INTERPRET before the first ``@triton.jit`` decorator runs, and that happens on first use of
``flashtile.flash_attn_func``.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_OUT = Path("benchmarks") / "results"


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                    causal: bool) -> float:
    """Forward FLOPs as the FlashAttention-2 paper counts them.

    Two matmuls (Q K^T and P V) of 2 * Sq * Sk * D each per head; causal halves it, whatever the
    exact number of visible keys, so numbers stay comparable with the paper and flash_attn's scripts.
    """
    flops = 4 * batch * heads * seqlen_q * seqlen_k * head_dim
    return flops / 2 if causal else float(flops)


# FlashAttention-2's convention for training: the backward's five matmuls count 2.5 forwards.
FWD_BWD_FACTOR = 3.5


def attention_train_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                          causal: bool) -> float:
    """Forward + backward FLOPs as the FlashAttention-2 paper counts them: 3.5 x the forward."""
    return FWD_BWD_FACTOR * attention_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal)


def tflops(flops: float, ms: float | None) -> float | None:
    return None if ms is None or ms <= 0 else flops / (ms * 1e-3) / 1e12


def gbps(nbytes: float, ms: float | None) -> float | None:
    """Bytes moved in ``ms`` milliseconds as GB/s (GB = 1e9 bytes)."""
    return None if ms is None or ms <= 0 else nbytes / (ms * 1e-3) / 1e9


def interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def choose_device() -> torch.device:
    """CUDA when present and not overridden; otherwise the CPU through Triton's interpreter.

    Must run before anything touches ``flashtile.kernels``: Triton decides between compiling and
    interpreting when the kernels are decorated, i.e. on import of the kernel module.
    """
    if torch.cuda.is_available() and not interpreter_requested():
        return torch.device("cuda")
    if "flashtile.kernels.forward" in sys.modules and not interpreter_requested():
        raise RuntimeError("flashtile's kernels were imported before TRITON_INTERPRET=1 could be set; "
                           "set TRITON_INTERPRET=1 in the environment to run on the CPU")
    os.environ["TRITON_INTERPRET"] = "1"
    return torch.device("cpu")


def slug(text: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200': safe in file names."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def result_path(out_dir: Path | str, command: str, gpu_name: str, ext: str) -> Path:
    stamp = datetime.date.today().strftime("%Y%m%d")
    return Path(out_dir) / f"{command}-{slug(gpu_name)}-{stamp}.{ext}"


def _git_commit() -> str | None:
    # Ties a result file to the code that produced it; the device copy may have no .git, hence None.
    try:
        root = Path(__file__).resolve().parents[3]
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10)
        if done.returncode != 0:
            return None
        return done.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _git_dirty() -> bool | None:
    """Whether the package's tracked sources differ from HEAD (then git_commit alone does not name
    the code that ran); None without git."""
    try:
        root = Path(__file__).resolve().parents[3]
        done = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "src"],
                              cwd=root, capture_output=True, text=True, timeout=10)
        return None if done.returncode != 0 else bool(done.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None


def source_digest(root: Path | str | None = None) -> str:
    """sha256 (16 hex digits) over the relative path and bytes of every .py file of the package (or
    of ``root``), in sorted order: names the code a result came from where git cannot (a device's
    copy of a working tree with uncommitted changes, or one without .git). Compare with
    ``python -c "from flashtile.bench.common import source_digest; print(source_digest())"`` run
    on a checkout."""
    root = Path(root) if root is not None else Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def environment(device: torch.device) -> dict:
    """Versions and hardware that a result file must carry to be comparable with another one."""
    import triton

    import flashtile

    env = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "flashtile": flashtile.__version__,
        "git_commit": _git_commit(),
        "git_dirty": _git_dirty(),
        "source_digest": source_digest(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": device.type,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, sm_count=props.multi_processor_count,
                   compute_capability=f"{props.major}.{props.minor}",
                   gpu_memory_gb=round(props.total_memory / 1e9, 1))
    else:
        env.update(gpu=None, sm_count=None)
    return env


def _strict_json(value):
    # JSON has no inf/NaN (an LSE error can be inf); strings keep the file readable everywhere.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_strict_json(payload), indent=2, default=str, allow_nan=False) + "\n")


def format_seqlen(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def format_number(x: float | None, fmt: str = "{:.1f}", missing: str = "-") -> str:
    return missing if x is None else fmt.format(x)


def progress(total: int, desc: str):
    """A tqdm bar, or a stand-in with the same three methods that prints instead."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainProgress(total, desc)
    # A slow refresh keeps logs readable when stderr is a file rather than a terminal.
    return tqdm(total=total, desc=desc, unit="run", dynamic_ncols=True, mininterval=1.0)


class _PlainProgress:
    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.done = total, desc, 0

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        print(f"[{self.done}/{self.total}] {self.desc}: {text}", flush=True)

    def update(self, n: int = 1) -> None:
        self.done += n

    def write(self, text: str) -> None:
        print(text, flush=True)

    def close(self) -> None:
        pass


def add_common_arguments(parser, quick_help: str, check_help: str, with_dtype: bool = True) -> None:
    """The options every benchmark command takes."""
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--no-check", action="store_true", help=check_help)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"directory for the JSON and PNG results (default: {DEFAULT_OUT})")
    if with_dtype:
        parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                            help="input dtype of the benchmark (the check covers both)")


def check_without_gpu(command: str, what: str, checks, args) -> int:
    """The CPU-only path of a benchmark command: run its checks through the interpreter and say that
    timings need a GPU. ``checks`` are callables returning lists of check records."""
    import warnings

    from .check import all_passed

    why = "TRITON_INTERPRET=1 is set" if torch.cuda.is_available() else "no CUDA GPU"
    print(f"flashtile bench {command}: {why}, so flashtile's kernels run on the CPU through the Triton "
          "interpreter (small shapes only).")
    passed = True
    if not args.no_check:
        # Rows that see no key divide by zero inside tl.where's unused branch; numpy warns, the
        # result is right.
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
        passed = all([all_passed(check()) for check in checks])
        if not passed:
            print("CORRECTNESS CHECK FAILED")
    print(f"Timings need a GPU: skipped the {what} benchmark (no timings are taken through the "
          "interpreter; nothing was written).")
    return 0 if passed else 1


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of n timed providers, one per round, in which every provider runs in every position
    and right after every other one equally often (a Williams design: n rows for even n, 2n for
    odd). Run after run the GPU's clocks follow the power the previous seconds drew, so a fixed order,
    or a fixed one rotated, hands one provider the same predecessor every round."""
    if n <= 1:
        return [list(range(n))]
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(x + i) % n for x in first] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return rows


def time_in_rounds(calls: dict, rounds: int, unraced=()) -> tuple[dict, dict]:
    """Time each named call (a function that times one pass of its provider and returns ms).
    With ``rounds`` > 1 the racing ones (all but ``unraced``) run in at least that many rounds, a
    whole number of ``balanced_orders``, after one untimed call of the first; ``unraced`` calls run
    once, after the first round. Returns ({name: [ms per round]}, {name: exception}); a call that
    raises is dropped from the later rounds."""
    raced = [name for name in calls if name not in unraced]
    once = [name for name in calls if name in unraced]
    warm_up: list = []
    if rounds <= 1 or len(raced) < 2:
        passes = [raced + once]
    else:
        orders = [[raced[i] for i in row] for row in balanced_orders(len(raced))]
        passes = orders * -(-rounds // len(orders))
        passes[0] = passes[0] + once
        warm_up = [raced[0]]  # heat the GPU as the rounds will: the first timed call must not start cold
    times: dict = {name: [] for name in calls}
    errors: dict = {}
    for order in [warm_up] + passes:
        for name in order:
            if name in errors:
                continue
            try:
                ms = calls[name]()
            except Exception as exc:
                errors[name] = exc
            else:
                if order is not warm_up:
                    times[name].append(ms)
    return times, errors


def speed_ratios(results: dict, mine: str, others, time_key: str = "ms") -> dict:
    """``mine``'s speed relative to each of ``others`` (> 1: ``mine`` is faster); None where either
    was unavailable."""
    me = results.get(mine, {})
    out = {}
    for other in others:
        them = results.get(other, {})
        both = me.get("available") and them.get("available")
        out[other] = them[time_key] / me[time_key] if both else None
    return out


def save_figure(fig, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return f"Wrote {path}"


def cuda_event_median(fn, reps: int, before=None) -> float:
    """Median milliseconds of ``fn`` between CUDA events, after one warm-up call; ``before`` (e.g. a
    barrier) runs ahead of each timed call, outside the timing."""
    import statistics
    fn()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
