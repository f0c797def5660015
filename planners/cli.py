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

from planners.applicability import judge
from planners.chameleon.policy import POLICIES, PolicyDecision, decide, eq8_score
from planners.chameleon.schema import decision_to_dict, state_from_dict
from planners.chameleon.state import Candidate, ClusterState, infeasible
from planners.chameleon.to_layout import candidate_layout
from planners.elaswave_model import RankReport, registered_model
from planners.elaswave_policy import ElasWaveInput, plan_elaswave
from planners.flextrain import build_scale_table, predict_configs
from planners.layout import Layout
from planners.layout_pricing import healthy_layout, layout_candidate
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
    """state.json -> decision JSON (the library call the CLI prints).

    Only plans the executor can apply are chosen: "elaswave" is the Core's own planner
    (`planners.elaswave_policy`), and every candidate must be one pipeline whose layout
    `planners.applicability.judge` accepts from the healthy layout. The others stay in
    `alternatives` with `"applicable": false` and the reason."""
    state, policies = state_from_dict(request)
    current = healthy_layout(state)
    candidates = [_candidate(p, state, current) for p in policies]
    verdicts = [_applicability(c, state, current) for c in candidates]
    usable = [c for c, why in zip(candidates, verdicts, strict=True) if not why]
    horizon = state.expected_time_to_next_event_s
    if usable:
        decision = decide(usable, horizon)
    else:
        nothing = infeasible("none", "no policy's plan applies: " + "; ".join(filter(None, verdicts)))
        decision = PolicyDecision(nothing, (), nothing.reason)
    fault_free = POLICIES["torchft"](replace(state, failed=frozenset(), slowdown=()))
    out = decision_to_dict(decision, state, fault_free)
    for alt in out["alternatives"]:
        alt["applicable"] = True
    for cand, why in zip(candidates, verdicts, strict=True):
        if why:
            scored = eq8_score(cand, horizon)
            out["alternatives"].append(
                {
                    "policy": cand.policy,
                    "feasible": cand.feasible,
                    "applicable": False,
                    "score": 0.0,
                    "effective_ratio": scored.effective_ratio,
                    "samples_per_s": cand.throughput,
                    "step_time_s": cand.step_time_s if cand.feasible else None,
                    "transition_s": cand.transition_s,
                    "bytes_moved": cand.bytes_moved,
                    "reason": f"not applicable: {why}; {cand.reason}",
                }
            )
    return out


def _candidate(policy: str, state: ClusterState, current: Layout) -> Candidate:
    """The policy's plan; "elaswave" is the Core's planner on the healthy layout."""
    if policy != "elaswave":
        return POLICIES[policy](state)
    model = registered_model(state.profile, current)
    reports = _reports(state, current)
    result = plan_elaswave(ElasWaveInput(current, tuple(sorted(state.failed)), model, reports))
    if result.action == "refuse":
        return infeasible("elaswave", result.summary)
    layout = result.layout or current
    cand = layout_candidate(state, layout, "elaswave", result.summary)
    moved = _moved_bytes(state, current, layout)
    seconds = moved / state.profile.migrate_bytes_per_s
    return replace(
        cand,
        transition_s=state.mttr.elaswave_base_s + seconds if state.failed else seconds,
        bytes_moved=moved,
    )


def _reports(state: ClusterState, layout: Layout) -> tuple[RankReport, ...]:
    """Slow ranks as the planner sees them: a step time `factor` x their peers' 1 s."""
    if not state.slowdown:
        return ()
    slow = state.slowdown_map
    return tuple(RankReport(r, slow.get(r, 1.0), r in slow) for r in layout.ranks() if r not in state.failed)


def _moved_bytes(state: ClusterState, old: Layout, new: Layout) -> float:
    """Blocks that change stage, into the busiest receiving rank (weights + its optimizer share)."""
    prof = state.profile
    busiest = 0.0
    for p, stage in enumerate(new.stages):
        before = old.stages[p].layers if p < old.num_stages else range(0)
        incoming = sum(prof.layer_param_bytes[b] for b in stage.layers if b not in before)
        busiest = max(busiest, incoming * (1 + prof.optimizer_bytes_per_param_byte / stage.dp_size))
    return busiest


def _applicability(cand: Candidate, state: ClusterState, current: Layout) -> str:
    """Empty when the executor can apply `cand` in place from `current`, else why not."""
    if not cand.feasible:
        return ""  # infeasible plans are ranked (and explained) like any other
    if len(cand.pipelines) != 1:
        return f"{len(cand.pipelines)} pipelines cannot be expressed as one Layout for the executor"
    verdict = judge(current, candidate_layout(cand, state))
    return "" if verdict.in_place else verdict.reason


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
