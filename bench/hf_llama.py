"""Tokens/s of examples/llama (10.8 M parameters, tied embeddings) against what a user would
otherwise run, side by side in one invocation (ratios: the machine is shared, absolute numbers drift).

- `plain` vs `elaswave-1p`: one process. `plain` is a plain `transformers` loop: the same
  `LlamaConfig`, the same fp32, `torch.optim.AdamW` (no clipping, no schedule), the same
  `TokenFile` windows, the same global batch in one micro-batch. `elaswave-1p` is
  `elaswave.train(causal_lm(config), token_loss, ...)` with the same optimizer settings.
- `ddp` vs `elaswave-run`: two worker processes. `ddp` is `DistributedDataParallel` over gloo (each
  rank half the batch, `torch.optim.AdamW`); `elaswave-run` is `elaswave run --nproc-per-node 2`
  (PP=1 x DP=2, ZeRO-1, ring snapshots and the commit vote on: the fault-tolerant path).
  `elaswave-run-pp2` adds `--pp 2` (the tied pair on two stages).

Every process uses one thread. A configuration's rate is the tokens of the steps after `--warmup`
over their wall time (per-step commit times of the last rank to commit, for `elaswave run`);
configurations alternate over `--repeats`, and the ratio is the median of per-repeat ratios. The
one-process pair also reports tokens per CPU-second of the process (all its threads), which
other jobs competing for the cores barely change.

    python -m bench.hf_llama --data llama-data          # prepare it first: examples/llama/prepare.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEQ, BATCH = 64, 16


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASWAVE_")}
    return env | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _config(data: Path):  # noqa: ANN202
    from elaswave.data import load_tokenizer
    from examples.llama.train import model_config

    return model_config(load_tokenizer(data / "tokenizer").get_vocab_size(), SEQ)


def one_process(
    kind: str, data: Path, steps: int, warmup: int, world: int = 1, rank: int = 0
) -> tuple[float, float]:
    """(tokens per wall second, per CPU second) of `plain`, `elaswave-1p` or one rank of `ddp`."""
    import torch

    import elaswave
    from elaswave.data import TokenFile
    from elaswave.hf import causal_lm, token_loss
    from executor.sampler import GlobalBatchSampler

    torch.set_num_threads(1)
    config, tokens = _config(data), TokenFile(data / "train.bin", SEQ)
    stamps: list[tuple[float, float]] = []
    if kind == "elaswave-1p":
        elaswave.train(
            causal_lm(config), token_loss, tokens, global_batch=BATCH, steps=steps,
            optimizer=elaswave.AdamW(lr=1e-3, weight_decay=0.1),
            on_step=lambda _s, _l: stamps.append((time.perf_counter(), time.process_time())),
        )  # fmt: skip
    else:
        import transformers

        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if world > 1:
            model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        sampler, share = GlobalBatchSampler(tokens, BATCH), BATCH // world
        for step in range(steps):
            rows = sampler.rows(step, rank * share, (rank + 1) * share)
            opt.zero_grad()
            token_loss(model(rows.inputs).logits, rows.targets).mean().backward()
            opt.step()
            stamps.append((time.perf_counter(), time.process_time()))
    counted = (steps - 1 - warmup) * BATCH * SEQ
    return counted / (stamps[-1][0] - stamps[warmup][0]), counted / (stamps[-1][1] - stamps[warmup][1])


def _ddp_rank(rank: int, data: str, steps: int, warmup: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    rate = one_process("ddp", Path(data), steps, warmup, world=2, rank=rank)[0]
    if rank == 0:
        Path(out).write_text(json.dumps(rate))
    dist.destroy_process_group()


def ddp(data: Path, steps: int, warmup: int) -> float:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rate.json")
        mp.spawn(_ddp_rank, args=(str(data), steps, warmup, port, out), nprocs=2, join=True)
        return float(json.loads(Path(out).read_text()))


def elaswave_run(data: Path, steps: int, warmup: int, pp: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "elaswave.cli", "run", "--nproc-per-node", "2", "--pp", str(pp),
               str(ROOT / "examples" / "llama" / "train.py"), "--data", str(data.resolve()),
               "--steps", str(steps), "--global-batch", str(BATCH), "--seq-len", str(SEQ),
               "--micro-batches", "1" if pp == 1 else "2", "--log-every", "0"]  # fmt: skip
        subprocess.run(cmd, cwd=tmp, env=_env(), check=True, capture_output=True, timeout=1800)
        ranks = [
            json.loads(f.read_text()) for f in (Path(tmp) / "elaswave-run" / "train").glob("rank-*.json")
        ]
        done = [max(float(r["committed_unix"][str(s)]) for r in ranks) for s in range(steps)]
        return (steps - 1 - warmup) * BATCH * SEQ / (done[-1] - done[warmup])


def _in_fresh_process(kind: str, args: argparse.Namespace) -> tuple[float, float]:
    """(tokens/s, tokens per CPU-second or NaN) of one configuration in a fresh process."""
    code = (
        "import json, sys; from pathlib import Path; from bench.hf_llama import one_process, ddp, elaswave_run; "
        f"k = {kind!r}; d = Path({str(args.data)!r}); "
        f"r = (ddp(d, {args.steps}, {args.warmup}), float('nan')) if k == 'ddp' else "
        f"(elaswave_run(d, {args.steps}, {args.warmup}, 2 if k.endswith('pp2') else 1), float('nan')) "
        f"if k.startswith('elaswave-run') else one_process(k, d, {args.steps}, {args.warmup}); print(json.dumps(r))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=_env(), check=True, capture_output=True, text=True)
    wall, cpu = json.loads(out.stdout.strip().splitlines()[-1])
    return float(wall), float(cpu)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=Path("llama-data"))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    pairs = [("plain", "elaswave-1p"), ("ddp", "elaswave-run"), ("ddp", "elaswave-run-pp2")]
    kinds = sorted({k for pair in pairs for k in pair})
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(args.repeats):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            wall, per_cpu = _in_fresh_process(kind, args)
            rates[kind].append(wall)
            cpu[kind].append(per_cpu)
            print(f"repeat {r} {kind:>17}: {wall:8.0f} tokens/s {per_cpu:8.0f} tokens/CPU-s", flush=True)
    print(f"\n{'configuration':>17} {'tokens/s':>9} {'vs':>6} {'ratio':>6} {'tokens/CPU-s':>13} {'ratio':>6}")
    for base, ours in pairs:
        ratio = statistics.median(o / b for o, b in zip(rates[ours], rates[base], strict=True))
        cpu_ratio = statistics.median(o / b for o, b in zip(cpu[ours], cpu[base], strict=True))
        print(
            f"{base:>17} {statistics.median(rates[base]):9.0f} {'':>13} {statistics.median(cpu[base]):13.0f}"
        )
        print(
            f"{ours:>17} {statistics.median(rates[ours]):9.0f} {base:>6} {ratio:6.2f} "
            f"{statistics.median(cpu[ours]):13.0f} {cpu_ratio:6.2f}"
        )


if __name__ == "__main__":
    main()
