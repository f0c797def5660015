"""A Llama with tied embeddings (10.8 M parameters) trained on the corpus `prepare.py` makes.

    python examples/llama/prepare.py --out llama-data                    # once: corpus, tokenizer, tokens
    python examples/llama/train.py --data llama-data                     # one process
    elaswave run --nproc-per-node 4 --pp 2 --checkpoint-dir ckpt examples/llama/train.py --data llama-data

The model is `transformers.LlamaConfig(...)` drawn at random (seed 0) and cut into units by
`elaswave.hf.causal_lm`; the data is `elaswave.data.TokenFile` windows of `--seq-len` tokens;
the loss is `elaswave.hf.token_loss`. At the end, the process that holds the trained weights (the
single process, or the rank that committed the final checkpoint) loads them into a plain
`transformers` model and reports its loss on held-out windows.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import torch

import elaswave
from elaswave.data import TokenFile, load_tokenizer
from elaswave.hf import causal_lm, to_hf_state_dict, token_loss


def model_config(vocab_size: int, seq_len: int):  # noqa: ANN201 - transformers is the optional extra
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=(vocab_size + 63) // 64 * 64,  # rounded up: the tokenizer's ids all fit
        hidden_size=384,
        intermediate_size=1152,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=seq_len,
        tie_word_embeddings=True,
    )


def held_out_loss(
    config, state: dict[str, torch.Tensor], data: Path, seq_len: int, windows: int = 32
) -> float:  # noqa: ANN001
    """The trained weights in a plain transformers model, on the first windows of val.bin."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(to_hf_state_dict(config, state))
    val = TokenFile(data / "val.bin", seq_len)
    x, y = (torch.stack(t) for t in zip(*(val[i] for i in range(min(windows, len(val)))), strict=True))
    with torch.no_grad():
        return float(token_loss(model.eval()(x).logits, y).mean())


def kill_drill(rank: int | None, at_step: int) -> Callable[[int, float | None], None] | None:
    """A drill for `elaswave run`: the worker of rank `rank` SIGKILLs itself once step `at_step`
    has committed (as `kill -9 PID` from a shell would; the job must carry on without it)."""
    if rank is None or os.environ.get("ELASWAVE_RANK") != str(rank):
        return None

    def on_step(step: int, _loss: float | None) -> None:
        if step == at_step:
            print(f"rank {rank}: SIGKILL at step {step} (--kill-rank)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    return on_step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", type=Path, default=Path("llama-data"))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--recompute", action="store_true", help="recompute every unit's forward in the backward")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", default=None)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--losses-out", default=None, help="write {step: loss} as JSON")
    p.add_argument(
        "--kill-rank", type=int, default=None, help="under elaswave run: this rank kills itself..."
    )
    p.add_argument("--kill-at", type=int, default=40, help="...after this step (default 40)")
    args = p.parse_args()

    tokenizer = load_tokenizer(args.data / "tokenizer")
    config = model_config(tokenizer.get_vocab_size(), args.seq_len)
    data = TokenFile(args.data / "train.bin", args.seq_len, vocab_size=config.vocab_size)
    result = elaswave.train(
        causal_lm(config, recompute=args.recompute),
        token_loss,
        data,
        global_batch=args.global_batch,
        micro_batches=args.micro_batches,
        steps=args.steps,
        optimizer=elaswave.AdamW(
            lr=args.lr,
            weight_decay=0.1,
            no_decay=elaswave.no_decay_norms_and_biases,
            schedule=elaswave.warmup_cosine(min(20, args.steps), args.steps, min_factor=0.1),
            max_grad_norm=1.0,
        ),
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        log_every=args.log_every,
        on_step=kill_drill(args.kill_rank, args.kill_at),
    )
    if args.losses_out and result.losses:
        Path(args.losses_out).write_text(json.dumps({str(k): v for k, v in sorted(result.losses.items())}))
    state = result.state_dict
    if state is None and result.checkpoints:  # under a launcher: the rank that committed the last one
        state = elaswave.load_model_state(result.checkpoints[-1])
    if state is not None:
        print(f"held-out loss {held_out_loss(config, state, args.data, args.seq_len):.4f}", flush=True)


if __name__ == "__main__":
    main()
