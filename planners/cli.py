"""`elaswave plan`: decide the recovery plan for a state, or solve Algorithm 1 alone.

    elaswave plan --input state.json              # chosen plan + every alternative's eq. (8) score
    elaswave plan partition --input request.json  # ElasWave Algorithm 1 (planners.partition)

Schemas: `planners.chameleon.schema` (state.json) and `planners.partition.solve_partition_request`.
Bad input exits with status 2 and a message naming the field.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from planners.chameleon.policy import POLICIES, choose_policy
from planners.chameleon.schema import decision_to_dict, state_from_dict
from planners.partition import solve_partition_request


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="choose a recovery plan for a job state (no side effects)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", choices=("partition",), help="'partition': run Algorithm 1 alone")
    p.add_argument("--input", required=True, help="JSON file ('-' for stdin)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        request = _read_json(args.input)
        result = solve_partition_request(request) if args.mode == "partition" else plan(request)
    except ValueError as e:
        print(f"elaswave plan: {e}", file=sys.stderr)
        return 2
    json.dump(result, sys.stdout, indent=2, allow_nan=False)
    sys.stdout.write("\n")
    return 0


def plan(request: Any) -> dict[str, Any]:
    """state.json -> decision JSON (the library call the CLI prints)."""
    state, policies = state_from_dict(request)
    decision = choose_policy(state, policies)
    fault_free = POLICIES["torchft"](replace(state, failed=frozenset(), slowdown=()))
    return decision_to_dict(decision, state, fault_free)


def _read_json(path: str) -> Any:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as e:
        raise ValueError(f"--input: cannot read {path}: {e.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--input: {path} is not valid JSON: {e}") from None
