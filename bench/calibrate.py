"""Recovery costs from this project's own benchmarks: a cost file `elaswave simulate --costs` reads.

    python -m bench.calibrate --out simulator/cost_files/measured_cpu.json [--timeout 900]

Runs, each in its own process with a time limit, at small sizes:

- `bench.mttr` (one kill; a stage lost with its backups, restored from a checkpoint; PP=2 x DP=4
  under the Core): detection, planning, communicator edit, state remap, replay (as a fraction of
  the fault-free step) and the restore's reload;
- `bench.comm_recovery` (8 ranks): the dynamic communicator edit, a full rebuild of every group,
  and a restart (new processes + every group);
- `bench.join` (PP=2 x DP=3, a spare taken in): the joiner's start, and its state transfer as the
  fixed part of every transfer (`transfer_fixed_s`: the joiner receives a few MB, so its time is
  groups and the model rebuilt, not bytes);
- `bench.link_bandwidth` (256 MiB): the state bandwidth (a gloo send between two processes) and the
  checkpoint reload bandwidth (`torch.load` of a file that size), measured where bytes set the
  time: the recovery benchmarks move too little for bytes / time to be a bandwidth (the first
  cost files divided a few MB by fixed costs and moved paper-scale GBs at 2-5 MB/s).

Every value written names the benchmark and the row it came from; a benchmark that fails or
runs out of time leaves its costs at the paper-scale defaults, and the file says so. The numbers
are CPU/gloo on this machine, so they describe this implementation, not the paper's cluster
(`simulator/cost_files/paper_scale.json` keeps those, with their sources).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

Measured = dict[str, tuple[float, str]]  # cost name -> (value, where it came from)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def from_mttr(rows: list[dict[str, Any]]) -> Measured:
    """Phases of the in-place cases (medians) and the restore case's state phase."""
    in_place = [r for r in rows if r["mttr_s"] is not None and "restore" not in r["modes"]]
    restored = [r for r in rows if r["mttr_s"] is not None and "restore" in r["modes"]]
    out: Measured = {}
    # The simulator's planning cost runs until the executors start the edit: plan + deliver.
    phase = {
        "detection_s": ("detect",),
        "elaswave_planning_s": ("plan", "deliver"),
        "elaswave_communicator_s": ("communicator",),
    }
    for name, keys in phase.items():
        values = [sum(r["phases"].get(k, 0.0) for k in keys) for r in in_place if keys[0] in r["phases"]]
        if values:
            what = " + ".join(keys)
            out[name] = (
                _median(values),
                f"bench.mttr {what} phase, median of {len(values)} in-place case(s)",
            )
    replay = [
        min(1.0, r["phases"]["replay"] / r["fault_free_step_s"])
        for r in in_place
        if "replay" in r["phases"] and r.get("fault_free_step_s")
    ]
    if replay:
        out["replay_fraction"] = (_median(replay), "bench.mttr replay phase / fault-free step (at most 1)")
    if restored and "state" in restored[0]["phases"]:
        out["restore_reload_s"] = (
            restored[0]["phases"]["state"],
            "bench.mttr 'stage + its backups' state phase",
        )
    return out


def from_comm(m: dict[str, float]) -> Measured:
    src = "bench.comm_recovery, 8 ranks"
    return {
        "elaswave_communicator_s": (m["partial_s"], f"{src}: dynamic communicator edit"),
        "partial_communicator_s": (m["full_s"], f"{src}: survivors rebuild every group in place"),
        "full_communicator_s": (m["restart_s"], f"{src}: restart (new processes + every group)"),
        "torchft_restart_s": (m["restart_s"], f"{src}: restart"),
        "chameleon_restart_s": (m["restart_s"], f"{src}: restart"),
    }


def from_join(m: dict[str, Any] | list[dict[str, Any]]) -> Measured:
    """`bench.join --json` writes one row per spare mode run: the first (the warm spare, its
    default) is the one measured."""
    if isinstance(m, list):
        if not m:
            return {}
        m = m[0]
    out: Measured = {}
    phases = m.get("phases_s", {})
    if "start_s" in phases:
        out["join_start_s"] = (phases["start_s"], "bench.join start phase")
    received = [b["received"] for b in m.get("bytes", {}).values() if b.get("received")]
    if received and phases.get("state_s", 0) > 0:
        out["transfer_fixed_s"] = (
            phases["state_s"],
            f"bench.join state transfer phase ({max(received) / 2**20:.1f} MiB received: fixed cost)",
        )
    return out


def from_bandwidth(m: dict[str, float]) -> Measured:
    src = f"bench.link_bandwidth, {m['mib']:g} MiB"
    return {
        "link_bytes_per_s": (m["link"], f"{src}: gloo send between two processes, median"),
        "storage_bytes_per_s": (m["storage"], f"{src}: torch.load of a torch.save file, median"),
    }


# --- each step runs in a child process (`--step NAME`) and prints one JSON document ---


def _step_mttr() -> Any:
    from bench import mttr  # noqa: PLC0415 - heavy imports only in the child

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.json"
        mttr.main(["--quick", "--case", "one kill", "stage + its backups", "--json", str(path)])
        return json.loads(path.read_text())


def _step_comm() -> Any:
    from bench import comm_recovery  # noqa: PLC0415

    return comm_recovery.measure(8)


def _step_join() -> Any:
    from bench import join  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "join.json"
        join.main(["--steps", "120", "--json", str(path)])
        return json.loads(path.read_text())


def _step_bandwidth() -> Any:
    from bench import link_bandwidth as lb  # noqa: PLC0415

    mib = 256
    return {"mib": mib, "link": lb.link_bytes_per_s(mib), "storage": lb.storage_bytes_per_s(mib)}


STEPS: dict[str, tuple[Callable[[], Any], Callable[[Any], Measured]]] = {
    "mttr": (_step_mttr, from_mttr),
    "comm": (_step_comm, from_comm),
    "join": (_step_join, from_join),
    "bandwidth": (_step_bandwidth, from_bandwidth),
}


def run_step(name: str, timeout_s: float) -> tuple[Any, str]:
    """The step's JSON output, or None and why not."""
    cmd = [sys.executable, "-m", "bench.calibrate", "--step", name]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout_s:.0f} s"
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("CALIBRATE ")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return None, f"exit {done.returncode}: {tail[0]}"
    return json.loads(lines[-1][len("CALIBRATE ") :]), ""


def previous(path: Path) -> Measured:
    """The measured entries (those with a source) of an earlier cost file at `path`, if any."""
    if not path.exists():
        return {}
    entries = json.loads(path.read_text()).get("costs", {})
    return {k: (e["value"], e["source"]) for k, e in entries.items() if isinstance(e, dict) and "source" in e}


def calibrate(steps: list[str], timeout_s: float, keep: Measured | None = None) -> tuple[Measured, list[str]]:
    """Run `steps`; costs they do not measure keep `keep`'s values (an earlier file's)."""
    measured: Measured = {}
    notes = []
    for name in steps:
        raw, why = run_step(name, timeout_s)
        if raw is None:
            notes.append(f"{name}: {why}; its costs keep the paper-scale defaults")
            print(f"calibrate: {name}: {why}", file=sys.stderr, flush=True)
            continue
        got = STEPS[name][1](raw)
        measured.update({k: v for k, v in got.items() if k not in measured or name == "comm"})
        print(f"calibrate: {name}: {sorted(got)}", file=sys.stderr, flush=True)
    measured = (keep or {}) | measured
    reload_s = measured.pop("restore_reload_s", None)
    if reload_s is not None:
        notes.append(f"restore reload measured at {reload_s[0]:.3g} s per rank ({reload_s[1]})")
    return {k: v for k, v in measured.items() if v[0] == v[0]}, notes  # NaN-free


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("simulator/cost_files/measured_cpu.json"))
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per benchmark")
    parser.add_argument("--only", nargs="+", choices=sorted(STEPS), default=sorted(STEPS))
    parser.add_argument("--step", choices=sorted(STEPS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.step is not None:  # the child: run one benchmark, print its result
        print("CALIBRATE " + json.dumps(STEPS[args.step][0]()), flush=True)
        return 0
    # A partial run (--only) keeps what the file already holds for the other benchmarks, and
    # its notes (marked as an earlier run's).
    partial = set(args.only) != set(STEPS)
    keep = previous(args.out) if partial else None
    measured, notes = calibrate(args.only, args.timeout, keep)
    if partial and args.out.exists():
        earlier = json.loads(args.out.read_text()).get("notes", [])
        notes = [n if n.startswith("earlier run: ") else f"earlier run: {n}" for n in earlier] + notes
        notes.append(f"this run measured only: {', '.join(args.only)}")
    label = (
        f"measured by bench.calibrate on {platform.machine()}, {os.cpu_count()} shared CPU cores, gloo "
        "(this implementation at small sizes, not the paper's cluster)"
    )
    # The format `simulator.costs.load_costs` reads (`elaswave simulate --costs`); costs not
    # measured are left out and keep the paper-scale defaults there.
    doc = {
        "label": label,
        "costs": {k: {"value": v, "source": src} for k, (v, src) in measured.items()},
        "notes": notes,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}: {len(measured)} measured costs; " + "; ".join(notes))
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())
