"""``python -m flashtile`` / ``flashtile``: command-line entry point (benchmarks for now)."""

from __future__ import annotations

import argparse
import importlib
import sys

from .bench import COMMANDS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashtile", description="flashtile command-line tools")
    groups = parser.add_subparsers(dest="group", metavar="COMMAND", required=True)
    bench = groups.add_parser("bench", help="benchmarks (with a correctness check first)",
                              description="Benchmarks; each runs a correctness check first.")
    benches = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, help_text in COMMANDS.items():
        sub = benches.add_parser(name, help=help_text, description=help_text)
        # Only the options are needed here; the module itself is imported again when it runs.
        importlib.import_module(f"flashtile.bench.{name.replace('-', '_')}").add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Line buffering keeps stdout (results) and stderr (progress bar) in order in a captured log.
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    module = importlib.import_module(f"flashtile.bench.{args.benchmark.replace('-', '_')}")
    return module.run(args)


if __name__ == "__main__":
    sys.exit(main())
