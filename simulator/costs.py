"""What a change of the cluster costs each policy, item by item, each number with its source.

A recovery is priced as the sum of its parts (seconds without progress unless said otherwise):

- detection: from the failure to the Core (or the framework) knowing of it;
- planning: computing the new plan;
- communicator: editing or rebuilding the process groups;
- state transfer: a fixed part plus the bytes moved into the busiest receiving rank / link
  bandwidth (`transfer_s`);
- replay: the interrupted step's work is lost (the step restarts from the last committed state);
  the failure lands uniformly within a step, so the expected loss is `replay_fraction` of it;
- restore (ElasWave plans the executor cannot apply in place, `planners.applicability`): reload
  the latest durable checkpoint and redo the steps since it (expected half the interval);
- join: a node taking a slot (a spare after a preemption, or a fresh node) is a join.

Every field can be overridden from `elaswave simulate --cost NAME=SECONDS_OR_VALUE`, or read from
a cost file (`elaswave simulate --costs FILE`, `load_costs`): `simulator/cost_files/paper_scale.json`
holds these defaults with their sources (paper sections), `bench.calibrate` writes one measured
on this project's own recovery benchmarks (docs/benchmarks.md says which file produced which table).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

TorchftModel = Literal["docs", "paper"]


@dataclass(frozen=True)
class RecoveryCosts:
    # Detection: a process exit is seen in 16-99 ms here (README "Recovery time under the
    # failures clusters see"); a silent node only at a heartbeat timeout. 1 s is an assumption
    # between the two, the same for every policy so that none gains from it.
    detection_s: float = 1.0
    # ElasWave's plan: milliseconds at this scale (README "Planning latency", measured here).
    elaswave_planning_s: float = 0.05
    # ElasWave's dynamic communicator edit: 0.15-0.37 s over 8-64 ranks (ElasWave §7.4); the
    # upper end.
    elaswave_communicator_s: float = 0.37
    # A partial rebuild of the groups that hold the lost rank: 0.54-1.09 s (ElasWave §7.4). Used
    # for TorchFT's quorum change (survivors reconfigure their replica group, torchft docs) and
    # for ReCycle's rerouting (new peer-to-peer links to the stage peers).
    partial_communicator_s: float = 1.09
    # A full rebuild of every group: 12-16 s (ElasWave §7.4). Used where a policy re-instantiates
    # its pipelines (Oobleck's templates).
    full_communicator_s: float = 16.0
    # The ElasWave paper's TorchFT: a full restart of ~20 s on every change (ElasWave §7.6);
    # `torchft_model = "paper"` selects it.
    torchft_restart_s: float = 20.0
    torchft_model: TorchftModel = "docs"
    # Chameleon's dynamic parallelism: 8.2-11.2 s recovery including the matched transfer
    # (Chameleon §V-C); 6 s of restart plus the transfer priced here lands in that range.
    chameleon_restart_s: float = 6.0
    # 200 Gb/s RoCE per node (ElasWave §7.1): 25 GB/s for migration, healing and joins.
    link_bytes_per_s: float = 25e9
    # A state transfer's fixed part before its bytes flow at `link_bytes_per_s` (its groups set
    # up, the stage's model rebuilt), paid by every policy's transfer (in place, heal, restart):
    # `transfer_s`. 0 at paper scale (ElasWave §7.4's communicator figures hold the group set-up);
    # `bench.calibrate` measures it apart from the bandwidth, since a transfer of a few MB here
    # is all fixed cost, and bytes / its time is no bandwidth to move GBs at.
    transfer_fixed_s: float = 0.0
    # Checkpoint reload per device from shared storage: an assumption (not measured at scale here;
    # README "Checkpoint cost" measures the CPU reload only).
    storage_bytes_per_s: float = 2e9
    # Durable checkpoint interval: an assumption; a RESTORE redoes half of it on average.
    checkpoint_interval_s: float = 1800.0
    replay_fraction: float = 0.5
    # A joining node's start (process, registration, subscribing to plans) before it can take
    # part; the others keep training meanwhile (every policy alike, `simulator.engine`). 0: the
    # node is ready when the trace adds it (the paper-scale default; `bench.join` measures it).
    join_start_s: float = 0.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and value < 0:
                raise ValueError(f"cost {f.name} must be >= 0, got {value}")
        if self.link_bytes_per_s <= 0 or self.storage_bytes_per_s <= 0:
            raise ValueError("link_bytes_per_s and storage_bytes_per_s must be > 0")
        if not 0 <= self.replay_fraction <= 1:
            raise ValueError(f"replay_fraction must be in [0, 1], got {self.replay_fraction}")
        if self.torchft_model not in ("docs", "paper"):
            raise ValueError(f"torchft_model must be 'docs' or 'paper', got {self.torchft_model!r}")

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to move `nbytes` into one rank (nothing to move: 0)."""
        return self.transfer_fixed_s + nbytes / self.link_bytes_per_s if nbytes > 0 else 0.0

    def restore_s(self, state_bytes_per_device: float) -> float:
        """Reload the checkpoint and redo the steps since it (half the interval on average)."""
        return state_bytes_per_device / self.storage_bytes_per_s + self.checkpoint_interval_s / 2


def parse_overrides(items: list[str], base: RecoveryCosts | None = None) -> RecoveryCosts:
    """`NAME=VALUE` pairs into RecoveryCosts (over `base`, default the paper-scale defaults);
    ValueError names the bad pair and the known names."""
    names = {f.name: f for f in dataclasses.fields(RecoveryCosts)}
    changes: dict[str, object] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or name not in names:
            raise ValueError(
                f"--cost {item!r}: expected NAME=VALUE with NAME one of {', '.join(sorted(names))}"
            )
        if name == "torchft_model":
            changes[name] = raw
            continue
        try:
            changes[name] = float(raw)
        except ValueError:
            raise ValueError(f"--cost {item!r}: {raw!r} is not a number") from None
    return dataclasses.replace(base or RecoveryCosts(), **changes)  # type: ignore[arg-type]


def load_costs(path: str | Path) -> RecoveryCosts:
    """A cost file: `{"label": ..., "costs": {NAME: VALUE or {"value": VALUE, "source": ...}}}`;
    names it leaves out keep their defaults. ValueError says what is wrong and where."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cost file {p}: {e}") from None
    entries = doc.get("costs") if isinstance(doc, dict) else None
    if not isinstance(entries, dict):
        raise ValueError(f"cost file {p}: expected an object with a 'costs' object")
    items = []
    for name, entry in entries.items():
        value: Any = entry.get("value") if isinstance(entry, dict) else entry
        if value is None:
            raise ValueError(f"cost file {p}: {name!r} has no value")
        items.append(f"{name}={value}")
    try:
        return parse_overrides(items)
    except ValueError as e:
        raise ValueError(f"cost file {p}: {e}") from None


def cost_file(costs: RecoveryCosts, label: str, sources: dict[str, str]) -> dict[str, Any]:
    """The document `load_costs` reads: every field with its value and, where given, its source."""
    return {
        "label": label,
        "costs": {
            name: {"value": value} | ({"source": sources[name]} if name in sources else {})
            for name, value in describe(costs).items()
        },
    }


def describe(costs: RecoveryCosts) -> dict[str, object]:
    return dataclasses.asdict(costs)
