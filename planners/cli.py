"""`elaswave plan`: decide the recovery plan for a state, or solve Algorithm 1 alone.

    elaswave plan --input state.json              # chosen plan + every alternative's eq. (8) score
    elaswave plan partition --input request.json  # ElasWave Algorithm 1 (planners.partition)
    elaswave plan scale-table --input state.json  # FlexTrain scale table up to state["max_devices"]

Schemas: `planners.chameleon.schema` (state.json) and `planners.partition.solve_partition_request`.
Bad input exits with status 2 and a message naming the field; a state no policy can run prints
its JSON (policy null, every alternative's reason) and exits with status 1.
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
from planners.flextrain import build_scale_table, predict_configs
from planners.partition import solve_partition_request


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="choose a recovery plan for a job state (no side effects)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "mode",
        nargs="?",
        choices=("partition", "scale-table"),
        help="'partition': Algorithm 1 alone; 'scale-table': FlexTrain scale table",
    )
    p.add_argument("--input", required=True, help="JSON file ('-' for stdin)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        request = _read_json(args.input)
        if args.mode == "partition":
            result = solve_partition_request(request)
        elif args.mode == "scale-table":
            result = scale_table(request)
        else:
            result = plan(request)
    except ValueError as e:
        print(f"elaswave plan: {e}", file=sys.stderr)
        return 2
    json.dump(result, sys.stdout, indent=2, allow_nan=False)
    sys.stdout.write("\n")
    return 1 if args.mode is None and result["policy"] is None else 0


def plan(request: Any) -> dict[str, Any]:
    """state.json -> decision JSON (the library call the CLI prints)."""
    state, policies = state_from_dict(request)
    decision = choose_policy(state, policies)
    fault_free = POLICIES["torchft"](replace(state, failed=frozenset(), slowdown=()))
    return decision_to_dict(decision, state, fault_free)


def scale_table(request: Any) -> dict[str, Any]:
    """state.json (+ "max_devices") -> FlexTrain scale table JSON."""
    state, _ = state_from_dict(request)
    max_devices = request.get("max_devices", state.shape.num_devices)
    if (
        isinstance(max_devices, bool)
        or not isinstance(max_devices, int)
        or max_devices < state.shape.num_devices
    ):
        raise ValueError(
            f"max_devices must be an integer >= the job's {state.shape.num_devices} devices, "
            f"got {max_devices!r}"
        )
    table = build_scale_table(predict_configs(state, max_devices // state.shape.tp))
    return {
        "entries": [
            {
                "devices": e.gpus,
                "dp": e.dp,
                "pp": e.pp,
                "speedup": e.speedup,
                "modeled_speedup": e.modeled_speedup,
            }
            for e in table.entries
        ],
        "excluded": [{"devices": g, "why": why} for g, why in table.excluded],
        "reason": table.reason,
    }


def _read_json(path: str) -> Any:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as e:
        raise ValueError(f"--input: cannot read {path}: {e.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--input: {path} is not valid JSON: {e}") from None
