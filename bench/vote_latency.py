"""How late a waiting voter learns the commit decision: the store's own wait against polling.

Every step of the fault-tolerant path ends in the commit vote (`executor.commit_vote`): the last
worker to vote writes the decision, the others wait for it. This runs the vote alone, in
`--voters` processes against one TCPStore server (as the executors' rendezvous store), for
`--steps` decisions per mode, each voter arriving after a random delay of up to `--skew-ms`
(the spread of a fault-free step's ends). Modes, alternated decision by decision so that both
see the same machine:

  watch  the default: a helper thread blocks in the store's `wait` on a second connection
         (`DecisionWatch`) and wakes the voter when the decision is written;
  poll   the same voters on a store that offers no second connection: polled with back-off
         from 0.5 ms to 10 ms (what every store did before 2026-12-07).

Reported per mode, over every waiting voter's decisions: how long after the decision was written
the voter had read it ("late", ms; both ends on the host's monotonic clock, which every process
shares), and the whole vote as the waiter saw it. Medians and means in ms.

    .venv/bin/python -m bench.vote_latency [--voters 2] [--steps 300] [--skew-ms 2]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import random
import statistics
import time
from datetime import timedelta
from typing import Any

from torch.distributed import Store, TCPStore

from executor.commit_vote import CommitVote, decision_base

MODES = ("watch", "poll")


class _NoSecondConnection:
    """The store as a client that cannot `clone`: the vote polls it (mode "poll")."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        if name == "clone":
            raise AttributeError(name)
        return getattr(self._store, name)


def _voter(rank: int, voters: int, port: int, steps: int, skew_s: float, out: Any) -> None:
    """One voter: `steps` decisions per mode, alternated; puts its records on `out`."""
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    stores: dict[str, Any] = {"watch": client, "poll": _NoSecondConnection(client)}
    votes = {mode: CommitVote() for mode in MODES}
    rng, records = random.Random(rank), []
    for step in range(steps):
        for mode in MODES:
            base = decision_base(f"bench-{mode}", 0, step, 0)
            # every voter starts the decision together, then arrives after its own delay
            client.add(f"{base}/start", 1)
            while int(client.add(f"{base}/start", 0)) < voters:
                time.sleep(0.0002)
            time.sleep(rng.uniform(0.0, skew_s))
            t0 = time.monotonic()
            ok = votes[mode].decide(
                stores[mode], base, voters, ok=True, should_abort=lambda: False, deadline=t0 + 30
            )
            records.append((mode, base, t0, time.monotonic(), ok))
    for vote in votes.values():  # the old keys' deletions, before the process and its connection go
        vote.collector.settle()
    out.put((rank, records))


def run(voters: int, steps: int, skew_ms: float) -> dict[str, dict[str, float]]:
    """Run the vote in `voters` processes; per mode, the waiters' lateness and wait (ms)."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_voter, args=(r, voters, server.port, steps, skew_ms / 1000, out))
        for r in range(voters)
    ]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"voter processes exited with {failed}")
    return summarise(results)


def summarise(results: dict[int, list[tuple[str, str, float, float, bool]]]) -> dict[str, dict[str, float]]:
    """The decision was written when its last voter's `decide` returned (that voter wrote it):
    a waiter is late by how much later than that its own `decide` returned."""
    by_base: dict[str, list[tuple[float, float, bool]]] = {}
    for records in results.values():
        for mode, base, t0, t1, ok in records:
            if not ok:
                raise RuntimeError(f"decision {base} was ABORT in a fault-free vote")
            by_base.setdefault(base, []).append((t0, t1, mode == "watch"))
    rows: dict[str, dict[str, list[float]]] = {m: {"late": [], "wait": []} for m in MODES}
    for entries in by_base.values():
        writer = max(entries, key=lambda e: e[0])  # the last to arrive wrote the decision
        mode = "watch" if writer[2] else "poll"
        for e in entries:
            if e is not writer:
                rows[mode]["late"].append(1000 * max(e[1] - writer[1], 0.0))
                rows[mode]["wait"].append(1000 * (e[1] - e[0]))
    return {
        m: {
            f"{k} {stat}": fn(v)
            for k, v in cols.items()
            for stat, fn in (("median", statistics.median), ("mean", statistics.fmean))
        }
        for m, cols in rows.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--voters", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300, help="decisions per mode (default 300)")
    parser.add_argument("--skew-ms", type=float, default=2.0, help="voters arrive up to this far apart")
    args = parser.parse_args()
    if args.voters < 2:
        parser.error("--voters must be at least 2: with one voter nobody waits")
    print(
        f"- machine: nproc {os.cpu_count()}, {platform.processor() or platform.machine()}, "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at start"
    )
    print(
        f"- {args.voters} voter processes, {args.steps} decisions per mode, arrivals up to {args.skew_ms} ms apart\n"
    )
    table = run(args.voters, args.steps, args.skew_ms)
    cols = list(next(iter(table.values())))
    print("| mode | " + " | ".join(f"{c} ms" for c in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for mode, row in table.items():
        print(f"| {mode} | " + " | ".join(f"{row[c]:.3f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
