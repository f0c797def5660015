"""The `elaswave` command line: one subcommand per part, each registered by its own module."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Each subcommand's module exposes `register(subparsers)`, which adds its subcommand(s) and sets
# `func` on the parsed namespace. Only the module of the subcommand being run is imported: every
# agent, Core and store the launcher starts is an `elaswave` process, and importing all seven
# (fastapi, httpx, numpy, the planners, the simulator) cost each of them ~0.5 s of CPU at start.
SUBCOMMAND_MODULES: dict[str, str] = {
    "core": "core_service.cli",
    "agent": "agent.cli",
    "demo": "harness.demo",
    "plan": "planners.cli",
    "simulate": "simulator.cli",
    "run": "elaswave.launcher",
    "tokenize": "elaswave.hf_cli",
    "export-hf": "elaswave.hf_cli",
}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv`: with only the module of its subcommand registered when it names
    one, every module otherwise (`elaswave --help`, a typo: the full list of commands)."""
    parser = argparse.ArgumentParser(
        prog="elaswave",
        description=(
            "ElasWave keeps hybrid-parallel (DP x PP x ZeRO) training jobs running through "
            "failures, stragglers and preemption without a restart."
        ),
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    command = next((a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")), None)
    chosen = SUBCOMMAND_MODULES.get(command or "")
    for name in dict.fromkeys([chosen] if chosen else SUBCOMMAND_MODULES.values()):
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
