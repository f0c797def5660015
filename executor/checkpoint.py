"""Layout-independent, atomic, asynchronous checkpoints (docs/api.md, "Checkpoints").

A checkpoint is a directory `<root>/step-<NNNNNNNN>/` holding, per unit of the model:

- `model/<unit>.pt`: the unit's `state_dict()` (plain `torch.save`; `unit.load_state_dict(torch.load(f))`
  works without ElasWave, and `load_model_state(dir)` merges every unit into the whole model's
  state dict under `"<unit>.<parameter>"`);
- `optim/<unit>.pt`: `{"exp_avg": flat, "exp_avg_sq": flat}` over the unit's flat parameter
  vector (its `parameters()` concatenated in order): full tensors, never shards, so any layout can
  slice them;

and `meta.json` with the step to train next (the data position: the sampler is a pure function
of the step), the optimizer's update count, the units and their sizes, the global batch, the
data and RNG seeds (all randomness is counter-based on (seed, step), so this *is* the RNG state),
the tied pairs and the model's `extra` facts (`elaswave.hf`: its `transformers` config). A tied
weight (executor.tied) is stored once, in its leader's unit file; loading fills the follower's
key from there.

Writing is collective per stage and asynchronous: at a committed step boundary the ranks of each
stage gather their units' full state into host memory (one exchange in the stage's DP group, the
only part the step waits for), then the stage's first rank writes the files on a background
thread into `<root>/.tmp-step-<N>-<run id>/`, and marks its stage done. The rank of stage 0 that writes
(the coordinator) renames the directory to `step-<N>` once every stage is done and then points
`<root>/latest` at it (write a temporary file, `os.replace`; `latest` never moves back). A
checkpoint killed mid-write is never `latest`: temporary directories carry the run's id, so a
killed run's leftovers are never counted by a later run, and are removed once it commits. The
root must be storage every node sees (a shared filesystem), as for any multi-node checkpoint.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

FORMAT_VERSION = 1
LATEST = "latest"
STAGE_DONE = "stage-{stage}.done"
COMMIT_POLL_S = 0.02  # how often a commit waiting for other stages' shares looks again


class CheckpointError(ValueError):
    """A directory that is not a usable checkpoint, or one that does not fit this model."""


@dataclass(frozen=True)
class CheckpointMeta:
    next_step: int
    step_count: int
    units: tuple[str, ...]
    unit_numel: tuple[int, ...]
    global_batch: int
    num_stages: int
    data_seed: int
    rng_seed: int
    init_seed: int
    optimizer: str
    written_unix: float
    version: int = FORMAT_VERSION
    tied: tuple[tuple[str, str], ...] = ()  # ("unit.param" leader, "unit.param" follower)
    extra: dict[str, Any] = field(default_factory=dict)  # UnitModel.extra (elaswave.hf: the config)
    # The precision that wrote it (informational: the tensors are fp32 whatever it was) and fp16's
    # loss-scaler state at this step (None otherwise); older checkpoints have neither.
    precision: str = "fp32"
    loss_scale: dict[str, float] | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @staticmethod
    def from_json(text: str, where: Path) -> CheckpointMeta:
        try:
            raw = json.loads(text)
            if raw.get("version") != FORMAT_VERSION:
                raise CheckpointError(
                    f"{where}: checkpoint format {raw.get('version')!r}, expected {FORMAT_VERSION}"
                )
            raw["units"], raw["unit_numel"] = tuple(raw["units"]), tuple(raw["unit_numel"])
            raw["tied"] = tuple((str(a), str(b)) for a, b in raw.get("tied", ()))
            return CheckpointMeta(**raw)
        except (json.JSONDecodeError, TypeError, KeyError) as exc:
            raise CheckpointError(
                f"{where}: meta.json is not an ElasWave checkpoint description ({exc})"
            ) from exc


def scheduled(step: int, steps: int, every: int) -> bool:
    """Whether the job's own schedule saves after `step`: every `every` steps (0: never) and
    after the last of `steps`."""
    return (every > 0 and (step + 1) % every == 0) or step + 1 == steps


def step_dir_name(next_step: int) -> str:
    return f"step-{next_step:08d}"


def latest_checkpoint(root: str | Path) -> Path:
    """The directory `root/latest` points at (or `root` itself if it is one checkpoint).

    Raises CheckpointError saying what is missing when `root` holds no complete checkpoint."""
    root = Path(root)
    if (root / "meta.json").is_file():
        return root
    if not root.is_dir():
        raise CheckpointError(f"{root} does not exist or is not a directory")
    pointer = root / LATEST
    if not pointer.is_file():
        raise CheckpointError(
            f"{root} is not a checkpoint directory: it has neither meta.json nor a '{LATEST}' "
            "file (pass the directory given as checkpoint_dir, or one step-NNNNNNNN inside it)"
        )
    target = root / pointer.read_text().strip()
    if not (target / "meta.json").is_file():
        raise CheckpointError(f"{root}/{LATEST} names {target.name}, which has no meta.json")
    return target


def read_meta(path: str | Path) -> CheckpointMeta:
    ckpt = latest_checkpoint(path)
    return CheckpointMeta.from_json((ckpt / "meta.json").read_text(), ckpt)


def load_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The whole model's state dict (`"<unit>.<parameter>"` keys) from a checkpoint, with plain torch."""
    ckpt = latest_checkpoint(path)
    meta = read_meta(ckpt)
    out: dict[str, torch.Tensor] = {}
    for unit in meta.units:
        for key, value in torch.load(ckpt / "model" / f"{unit}.pt", weights_only=True).items():
            out[f"{unit}.{key}"] = value
    for leader, follower in meta.tied:
        out[follower] = out[leader]
    return out


def load_unit_state(ckpt: Path, unit: str) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """(state dict, exp_avg, exp_avg_sq) of one unit, full tensors."""
    try:
        params = torch.load(ckpt / "model" / f"{unit}.pt", weights_only=True)
        optim = torch.load(ckpt / "optim" / f"{unit}.pt", weights_only=True)
        for leader, follower in read_meta(ckpt).tied:
            if follower.split(".", 1)[0] == unit:
                lunit, lkey = leader.split(".", 1)
                params[follower.split(".", 1)[1]] = torch.load(
                    ckpt / "model" / f"{lunit}.pt", weights_only=True
                )[lkey]
    except FileNotFoundError as exc:
        raise CheckpointError(f"{ckpt}: unit {unit!r} is missing ({exc.filename})") from exc
    return params, optim["exp_avg"], optim["exp_avg_sq"]


def check_fits(
    meta: CheckpointMeta,
    units: Sequence[str],
    numel: Sequence[int],
    global_batch: int,
    where: Path,
    optimizer: str | None = None,
) -> None:
    """Refuse (CheckpointError) a checkpoint of another model, batch or optimizer (their states
    mean different things: SGD's momentum is not Adam's first moment)."""
    if optimizer is not None and optimizer != meta.optimizer:
        raise CheckpointError(
            f"{where} holds the state of optimizer {meta.optimizer!r}, this job uses {optimizer!r}: "
            "resume with the optimizer that wrote it"
        )
    if tuple(units) != meta.units or tuple(numel) != meta.unit_numel:
        raise CheckpointError(
            f"{where} holds units {list(zip(meta.units, meta.unit_numel, strict=True))}, this "
            f"model has {list(zip(units, numel, strict=True))}"
        )
    if global_batch != meta.global_batch:
        raise CheckpointError(
            f"{where} was trained with global batch {meta.global_batch}, this job uses "
            f"{global_batch}: resuming would change the sample order"
        )


@dataclass
class StagePayload:
    """One stage's units, gathered to host memory at a committed step (what the writer saves)."""

    next_step: int
    step_count: int
    stage: int
    num_stages: int
    units: dict[str, nn.Module]  # host copies, for state_dict()
    moments: dict[str, tuple[torch.Tensor, torch.Tensor]]
    loss_scale: dict[str, float] | None = None  # fp16: the committed loss-scaler state


class CheckpointWriter:
    """Writes this rank's share of each checkpoint, in order, on one background thread (module
    docstring). `run_id` is the same on every rank of one run and different across runs (a
    resumed job is a new run): a run's temporary directories and stage markers are its own, so
    what a killed run left behind is never counted, and is removed when this run commits.

    `submit` returns at once (at most `max_pending` payloads wait; beyond that it blocks until the
    oldest is written); `wait(timeout_s)` blocks until every submitted write is finished (and, on
    the coordinator, committed or given up) or raises TimeoutError.

    The coordinator's commit waits for the other stages' shares without holding up its own later
    writes: a checkpoint whose shares are missing waits aside while the next ones are written and
    committed, so a stage that is slow, or gone, never stalls training through a full queue."""

    def __init__(
        self,
        root: Path,
        meta: dict[str, Any],
        run_id: str,
        commit_timeout_s: float = 600.0,
        max_pending: int = 2,
    ) -> None:
        if not run_id or not all(c.isalnum() or c in "-_" for c in run_id):
            raise ValueError(f"run_id must be a non-empty [A-Za-z0-9_-] string, got {run_id!r}")
        self.root, self.meta, self.run_id, self.commit_timeout_s = root, meta, run_id, commit_timeout_s
        self.root.mkdir(parents=True, exist_ok=True)
        self.errors: list[BaseException] = []
        self.written: list[Path] = []
        self._queue: queue.Queue[tuple[int, StagePayload] | None] = queue.Queue(maxsize=max_pending)
        self._submitted = 0  # payloads submitted so far (each is numbered in order)
        # (monotonic time, payload number, stages or None for any): commits of payloads up to
        # that number that still miss a share of those stages stop waiting at that time
        # (see give_up_waiting)
        self._give_up: list[tuple[float, int, frozenset[int] | None]] = []
        # coordinator only: (payload number, its directory, payload, deadline) of the commits
        # that wait for other stages' shares; touched by the writer thread only
        self._awaiting: list[tuple[int, Path, StagePayload, float]] = []
        self._written = 0  # the number of the last payload taken off the queue
        self.abandoned: list[Path] = []  # checkpoints given up (a stage that wrote none is gone)
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"elaswave-ckpt-{run_id}")
        self._thread.start()

    def submit(self, payload: StagePayload) -> None:
        """Write `payload` (this rank is its stage's writer; stage 0's writer also commits)."""
        self._submitted += 1
        self._queue.put((self._submitted, payload))

    def give_up_waiting(self, after_s: float, stages: Collection[int] | None = None) -> None:
        """Commits of the checkpoints submitted so far that still wait for a share of one of
        `stages` (None: of any stage) give up `after_s` from now (the job's layout changed: a
        stage whose writer is gone will never write its share). A share already on disk is still
        committed: a commit looks at the shares before it looks at the give-ups. A given-up
        checkpoint stays a temporary directory, never the latest; checkpoints submitted later
        are not affected."""
        which = None if stages is None else frozenset(stages)
        self._give_up.append((time.monotonic() + max(0.0, after_s), self._submitted, which))

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks or self._awaiting:
            if time.monotonic() > deadline:
                raise TimeoutError(f"checkpoint writes still running after {timeout_s:g} s")
            time.sleep(0.01)

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=COMMIT_POLL_S if self._awaiting else None)
            except queue.Empty:
                self._settle_commits()
                continue
            try:
                if item is not None:
                    self._write(*item)
                self._settle_commits()
            except BaseException as exc:  # noqa: BLE001 - reported by the worker, never crashes training
                self.errors.append(exc)
            finally:
                self._queue.task_done()

    def _tmp_dir(self, next_step: int) -> Path:
        return self.root / f".tmp-{step_dir_name(next_step)}-{self.run_id}"

    def _write(self, number: int, payload: StagePayload) -> None:
        self._written = number
        tmp = self._tmp_dir(payload.next_step)
        (tmp / "model").mkdir(parents=True, exist_ok=True)
        (tmp / "optim").mkdir(parents=True, exist_ok=True)
        followers = [b.split(".", 1) for _a, b in self.meta.get("tied", ())]
        for name, unit in payload.units.items():
            state = unit.state_dict()
            for key in [k for u, k in followers if u == name]:
                del state[key]  # stored once, under the leader (module docstring)
            _save(state, tmp / "model" / f"{name}.pt")
            m, v = payload.moments[name]
            _save({"exp_avg": m, "exp_avg_sq": v}, tmp / "optim" / f"{name}.pt")
        (tmp / STAGE_DONE.format(stage=payload.stage)).write_text(f"{time.time():.6f}\n")
        if payload.stage == 0:
            self._awaiting.append((number, tmp, payload, time.monotonic() + self.commit_timeout_s))

    def _settle_commits(self) -> None:
        """Commit, in order, each awaiting checkpoint whose every stage has written its share;
        give up those the worker said to (`give_up_waiting`); one past its deadline is an error."""
        now, still = time.monotonic(), []
        for entry in self._awaiting:
            number, tmp, payload, deadline = entry
            try:
                missing = {
                    s for s in range(payload.num_stages) if not (tmp / STAGE_DONE.format(stage=s)).exists()
                }
                if not missing:
                    self._commit(tmp, payload)
                elif any(
                    number <= up_to and now > at and (stages is None or missing & stages)
                    for at, up_to, stages in self._give_up
                ):
                    self.abandoned.append(tmp)
                elif now > deadline:
                    raise TimeoutError(
                        f"checkpoint {tmp}: not every stage wrote its units within {self.commit_timeout_s:g} s"
                    )
                else:
                    still.append(entry)
            except Exception as exc:  # noqa: BLE001 - reported by the worker, never crashes training
                self.errors.append(exc)
        self._awaiting = still
        # a give-up still matters to a payload not written yet or one still waiting
        self._give_up = [
            (at, up_to, stages)
            for at, up_to, stages in self._give_up
            if up_to > self._written or any(a[0] <= up_to for a in still)
        ]

    def _commit(self, tmp: Path, payload: StagePayload) -> None:
        meta = CheckpointMeta(
            next_step=payload.next_step,
            step_count=payload.step_count,
            num_stages=payload.num_stages,
            loss_scale=payload.loss_scale,
            written_unix=time.time(),
            **self.meta,
        )
        (tmp / "meta.json").write_text(meta.to_json())
        final = self.root / step_dir_name(payload.next_step)
        aside = None
        if final.exists():  # the same step saved again (a refused plan right after a periodic save)
            aside = self.root / f".old-{final.name}-{self.run_id}"
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
        os.replace(tmp, final)
        if _latest_step(self.root) <= payload.next_step:  # `latest` never goes back
            pointer = self.root / f".{LATEST}.{self.run_id}.tmp"
            pointer.write_text(final.name + "\n")
            os.replace(pointer, self.root / LATEST)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        self.written.append(final)
        for stale in self.root.glob(".tmp-step-*"):  # what killed runs left behind
            if not stale.name.endswith(f"-{self.run_id}"):
                shutil.rmtree(stale, ignore_errors=True)


def _latest_step(root: Path) -> int:
    try:
        return read_meta(root).next_step
    except (CheckpointError, OSError):
        return -1


def _save(obj: Mapping[str, Any], path: Path) -> None:
    part = path.with_suffix(".part")
    torch.save(
        {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in obj.items()}, part
    )
    os.replace(part, path)
