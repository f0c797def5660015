"""The `elaswave` command line registers only the module of the subcommand it runs, and its map of
subcommands to modules names every subcommand those modules register."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from elaswave import cli

ROOT = Path(__file__).resolve().parents[1]


def _commands(parser: argparse.ArgumentParser) -> set[str]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices)


def test_the_map_names_every_registered_subcommand() -> None:
    assert _commands(cli.build_parser([])) == set(cli.SUBCOMMAND_MODULES)
    for command, module in cli.SUBCOMMAND_MODULES.items():
        registered = _commands(cli.build_parser(["--x", command]))
        assert command in registered, (command, module)


def test_an_agent_process_imports_neither_the_core_nor_the_planners_cli() -> None:
    probe = (
        "import json, sys\n"
        "from elaswave import cli\n"
        "cli.build_parser(['agent', '--help'])\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('core_service', 'planners', 'simulator', 'harness', 'fastapi', 'httpx', 'numpy'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def test_an_unknown_command_still_lists_every_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "elaswave.cli", "nonsense"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 2
    for command in cli.SUBCOMMAND_MODULES:
        assert command in out.stderr, command
