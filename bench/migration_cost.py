"""Migration bytes and time: interleaved vs contiguous ZeRO layout, blocking vs non-blocking
migration (ElasWave §6.2-6.3, Figs. 9-10), side by side.

A PP=2 x DP=D gloo job of the GPT example (examples/gpt: units embed, block_0.., head; stage 0
holds the embedding and the first `--layers-per-stage` blocks, stage 1 the other blocks and the
head; `executor.launch.run_job`) moves `--move`
blocks from the end of stage 0 to stage 1 and back again, `--migrations` times (a pipeline-only
change: every stage keeps its ranks). The same job runs once per combination of ZeRO layout
({interleaved, contiguous}) and migration mode ({blocking, non-blocking}); non-blocking needs the
interleaved layout (`check_nonblocking`), so its contiguous row says why it is not run.

Per combination, from the `MigrationReport`s every rank returns (`RankResult.migrations`):

* bytes moved: sum over ranks of `elements_sent` x 4 (float32), per migration;
* busiest rank: max over ranks of (sent + received) x 4, the critical-path volume of §6.3;
* predicted: the same two numbers derived from the planner's overlap matrix
  (`planners.zero.shard_transfers` / `migration_cost`), which the measured ones must equal;
* stall: `MigrationReport.seconds`, the time the step boundary is held (max over ranks);
* in-step wait: non-blocking only, time spent inside the first step under the new layout
  waiting for the moved block or its payback gradient (`wait_seconds`, max over ranks).

Times are medians over the migrations of one job. What `elements_sent` covers differs by mode:
blocking sends each moved block's parameters once, sharded, and the destination stage then
all-gathers them ((D-1) x |W| more, inside the stage, not in the report); non-blocking sends the
full parameters from each of the D source ranks plus a payback gradient of the same size.
Both stalls also hold what every migration pays on a rank regardless of bytes (rebuilding the
stage model for the new layout, `Trainer.reset_layout`) and, for blocking, the wait for the peer
to reach the boundary. `RankResult` carries no per-step times, so step times are not reported;
stall + in-step wait is the part of the migration the step cannot hide. All ranks share this
machine's cores, so the absolute times say little; the byte counts are exact and the ratios are
the result.

    python -m bench.migration_cost --dp 3 --layers-per-stage 4 --move 1 --migrations 8 --hidden 256
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
from dataclasses import dataclass
from typing import Any

from examples.gpt.data import MarkovWindows
from examples.gpt.model import ModelConfig, block_numel, gpt_units, per_sample_loss
from executor.launch import JobSpec, RankResult, run_job
from executor.migration import moved_layers
from executor.nonblocking_migration import check_nonblocking
from executor.optim import OptimizerConfig
from executor.trainer import TrainSpec
from planners.layout import Layout, StageLayout, ZeroLayoutKind, make_uniform_layout
from planners.zero import layer_move_cost, migration_cost, shard_transfers

BYTES = 4  # float32
MICRO_BATCHES = 4
COMBOS: tuple[tuple[ZeroLayoutKind, str], ...] = (
    ("interleaved", "blocking"),
    ("interleaved", "nonblocking"),
    ("contiguous", "blocking"),
    ("contiguous", "nonblocking"),
)


@dataclass(frozen=True)
class Setup:
    dp: int
    layers_per_stage: int
    move: int
    migrations: int
    hidden: int
    shadow_slots: int

    @property
    def num_layers(self) -> int:
        """Transformer blocks of the model."""
        return 2 * self.layers_per_stage

    @property
    def num_units(self) -> int:
        """Units (layout layers): embed, the blocks, head."""
        return self.num_layers + 2

    def model_config(self) -> ModelConfig:
        return ModelConfig(hidden=self.hidden, num_heads=4, num_layers=self.num_layers, seq_len=32)

    def train_spec(self) -> TrainSpec:
        cfg = self.model_config()
        spec = TrainSpec(
            gpt_units(cfg),
            per_sample_loss,
            MarkovWindows(cfg.vocab_size, cfg.seq_len, 1 << 14, seed=0),
            OptimizerConfig("adamw", lr=3e-3, weight_decay=0.01),
        )
        spec.unit_probes()  # the dry run, once, here (the spec carries it into the rank processes)
        return spec

    def block_numel(self) -> int:
        return block_numel(self.model_config())


@dataclass(frozen=True)
class Row:
    bytes_moved: int
    predicted_bytes: int
    busiest_rank_bytes: int
    predicted_busiest: int
    stall_s: float
    wait_s: float


def layouts(setup: Setup, zero: ZeroLayoutKind) -> tuple[Layout, Layout]:
    """The even split (embed + L blocks | L blocks + head) and the one with `move` blocks shifted
    from stage 0 to stage 1 (§6.2)."""
    even = make_uniform_layout(
        setup.num_units,
        2,
        setup.dp,
        global_batch=setup.dp * MICRO_BATCHES,
        num_micro_batches=MICRO_BATCHES,
        layer_numel=unit_numels(setup),
        zero_layout=zero,
    )
    s0, s1 = even.stages
    assert s0.layer_stop == 1 + setup.layers_per_stage, even
    cut = s0.layer_stop - setup.move
    shifted = (StageLayout(0, 0, cut, s0.ranks), StageLayout(1, cut, s1.layer_stop, s1.ranks))
    return even, even.replace(stages=shifted)


@functools.lru_cache(maxsize=4)
def train_spec(setup: Setup) -> TrainSpec:
    return setup.train_spec()


def unit_numels(setup: Setup) -> tuple[int, ...]:
    return train_spec(setup).unit_numels()


def schedule(setup: Setup, zero: ZeroLayoutKind) -> list[tuple[Layout, Layout]]:
    """(old, new) per migration: there and back, `migrations` times in all."""
    even, shifted = layouts(setup, zero)
    return [(even, shifted) if i % 2 == 0 else (shifted, even) for i in range(setup.migrations)]


def nonblocking_refusal(setup: Setup, zero: ZeroLayoutKind) -> str | None:
    old, new = layouts(setup, zero)
    try:
        check_nonblocking(old, moved_layers(old, new), setup.shadow_slots)
    except ValueError as exc:
        return str(exc)
    return None


def predicted_blocking(old: Layout, new: Layout) -> tuple[int, int]:
    """(total elements sent, busiest rank's sent + received) by `executor.migration.migrate`:
    the Adam moments of every re-owned interval (§6.3 overlap matrix), plus the parameters of
    intervals of a block that changes stage."""
    moving = {layer for layer, _, _ in moved_layers(old, new)}
    per_rank: dict[int, int] = {}
    total = 0
    for t in shard_transfers(old, new):
        n = (3 if t.layer in moving else 2) * t.size
        total += n
        per_rank[t.src_rank] = per_rank.get(t.src_rank, 0) + n
        per_rank[t.dst_rank] = per_rank.get(t.dst_rank, 0) + n
    return total, max(per_rank.values(), default=0)


def predicted_nonblocking(old: Layout, new: Layout) -> tuple[int, int]:
    """Per moved block, source DP rank j sends the full parameters, its interleaved moment shard
    (`migration_cost` counts the shards once: |O_i|) and a payback gradient (§6.2, Fig. 9)."""
    moves = moved_layers(old, new)
    numel = [old.layer_numel[layer] for layer, _, _ in moves]
    dp = old.stages[moves[0][1]].dp_size if moves else 1
    busiest = sum(2 * n + 2 * -(-n // dp) for n in numel)  # the largest shard is ceil(n / D)
    return 2 * migration_cost(old, new).total_elements + 2 * dp * sum(numel), busiest


def run(setup: Setup, zero: ZeroLayoutKind, mode: str) -> dict[int, RankResult]:
    pairs = schedule(setup, zero)
    relayouts = tuple((i + 1, new) for i, (_, new) in enumerate(pairs))
    spec = JobSpec(
        train_spec(setup),
        pairs[0][0],
        setup.migrations + 2,
        relayouts=relayouts,
        migration=mode,
        shadow_slots=setup.shadow_slots,
        timeout_s=120.0,
    )
    return run_job(spec)


def summarize(setup: Setup, zero: ZeroLayoutKind, mode: str, results: dict[int, RankResult]) -> Row:
    predict = predicted_nonblocking if mode == "nonblocking" else predicted_blocking
    reports = [[res.migrations[i] for res in results.values()] for i in range(setup.migrations)]
    for i, (old, new) in enumerate(schedule(setup, zero)):
        measured = (sum(r["elements_sent"] for r in reports[i]), busiest(reports[i]))
        if measured != predict(old, new):
            raise RuntimeError(
                f"{zero}/{mode} migration {i}: measured {measured} elements "
                f"(total, busiest rank), planner predicts {predict(old, new)}"
            )
    old, new = schedule(setup, zero)[0]
    total, top = predict(old, new)
    return Row(
        BYTES * sum(r["elements_sent"] for r in reports[0]),
        BYTES * total,
        BYTES * busiest(reports[0]),
        BYTES * top,
        statistics.median(max(r["seconds"] for r in rs) for rs in reports),
        statistics.median(max(r["wait_seconds"] for r in rs) for rs in reports),
    )


def busiest(reports: list[dict[str, Any]]) -> int:
    return max(r["elements_sent"] + r["elements_received"] for r in reports)


def format_row(zero: ZeroLayoutKind, mode: str, row: Row | str) -> str:
    if isinstance(row, str):
        return f"| {zero} | {mode} | {row} | | | | | | |"
    wait = f"{1e3 * row.wait_s:.2f}" if mode == "nonblocking" else "-"
    return (
        f"| {zero} | {mode} | {row.bytes_moved:,} | {row.predicted_bytes:,} | {row.busiest_rank_bytes:,} "
        f"| {row.predicted_busiest:,} | {1e3 * row.stall_s:.2f} | {wait} "
        f"| {1e3 * (row.stall_s + row.wait_s):.2f} |"
    )


def measure_all(setup: Setup) -> dict[tuple[str, str], Row | str]:
    rows: dict[tuple[str, str], Row | str] = {}
    for zero, mode in COMBOS:
        refusal = nonblocking_refusal(setup, zero) if mode == "nonblocking" else None
        if refusal is not None:
            rows[(zero, mode)] = f"n/a ({refusal})"
        else:
            rows[(zero, mode)] = summarize(setup, zero, mode, run(setup, zero, mode))
        print(format_row(zero, mode, rows[(zero, mode)]), flush=True)
    return rows


def print_header(setup: Setup) -> None:
    numel = setup.block_numel()
    print(
        f"# layer migration, PP=2 x DP={setup.dp} on gloo, {os.cpu_count()} shared CPU cores; "
        f"{setup.num_layers} blocks of {numel:,} params (hidden {setup.hidden}), {setup.move} block(s) "
        f"moved between stage 0 and 1, {setup.migrations} migrations per job, "
        f"shadow slots {setup.shadow_slots} of {MICRO_BATCHES}"
    )
    print(
        "| ZeRO layout | migration | bytes moved | predicted | busiest rank bytes | predicted "
        "| boundary stall ms | in-step wait ms | stall + wait ms |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "inf"


def print_ratios(setup: Setup, rows: dict[tuple[str, str], Row | str]) -> None:
    ib, cb, inb = (
        rows[("interleaved", "blocking")],
        rows[("contiguous", "blocking")],
        rows[("interleaved", "nonblocking")],
    )
    numel = setup.block_numel()
    formula = [
        layer_move_cost(z, setup.layers_per_stage, setup.dp, numel) for z in ("interleaved", "contiguous")
    ]
    print(
        f"\nplanner, one block moved (layer_move_cost, §6.3 / Fig. 10): |O| elements "
        f"{formula[0].total_elements:,} interleaved vs {formula[1].total_elements:,} contiguous "
        f"({formula[1].intra_stage_elements:,} inside stages), busiest stage "
        f"{ratio(formula[1].critical_stage_elements, formula[0].critical_stage_elements)} "
        f"(formula (D+1)/2 = {(setup.dp + 1) / 2:.1f}x)"
    )
    if isinstance(ib, Row) and isinstance(cb, Row):
        print(
            f"contiguous / interleaved (blocking): bytes moved {ratio(cb.bytes_moved, ib.bytes_moved)}, "
            f"busiest rank {ratio(cb.busiest_rank_bytes, ib.busiest_rank_bytes)}, "
            f"stall {ratio(cb.stall_s, ib.stall_s)}"
        )
    if isinstance(ib, Row) and isinstance(inb, Row):
        print(
            f"blocking / non-blocking (interleaved): boundary stall {ratio(ib.stall_s, inb.stall_s)}, "
            f"stall vs stall + in-step wait {ratio(ib.stall_s, inb.stall_s + inb.wait_s)}, "
            f"bytes moved {ratio(ib.bytes_moved, inb.bytes_moved)}"
        )


def parse_args(argv: list[str] | None) -> Setup:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=3, help="DP ranks per stage (2 stages)")
    parser.add_argument("--layers-per-stage", type=int, default=4)
    parser.add_argument("--move", type=int, default=1, help="blocks moved from stage 0 to stage 1")
    parser.add_argument("--migrations", type=int, default=8, help="migrations per job (there and back)")
    parser.add_argument("--hidden", type=int, default=256, help="model width (multiple of 4)")
    parser.add_argument("--shadow-slots", type=int, default=1, help="non-blocking: slots the shadow runs")
    args = parser.parse_args(argv)
    if args.dp < 1 or args.migrations < 1 or not 1 <= args.move < args.layers_per_stage:
        parser.error("need --dp >= 1, --migrations >= 1 and 1 <= --move < --layers-per-stage")
    if args.hidden < 4 or args.hidden % 4 or not 1 <= args.shadow_slots <= MICRO_BATCHES:
        parser.error(f"need --hidden a positive multiple of 4 and 1 <= --shadow-slots <= {MICRO_BATCHES}")
    return Setup(args.dp, args.layers_per_stage, args.move, args.migrations, args.hidden, args.shadow_slots)


def main(argv: list[str] | None = None) -> int:
    setup = parse_args(argv)
    print_header(setup)
    rows = measure_all(setup)
    print_ratios(setup, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
