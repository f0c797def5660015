"""The `elaswave` command line: one subcommand per part, each registered by its own module."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Each module exposes `register(subparsers)`, which adds its subcommand(s) and sets `func`
# on the parsed namespace. Imported lazily so `elaswave plan` never pays for torch or grpc.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "core_service.cli",
    "agent.cli",
    "harness.demo",
    "planners.cli",
    "simulator.cli",
    "elaswave.launcher",
    "elaswave.hf_cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elaswave",
        description=(
            "ElasWave keeps hybrid-parallel (DP x PP x ZeRO) training jobs running through "
            "failures, stragglers and preemption without a restart."
        ),
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
