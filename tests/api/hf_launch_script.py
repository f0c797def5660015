"""A tiny Llama with tied embeddings trained by `elaswave.train` on a token file: the script that
tests/api/test_hf_launch.py runs under `elaswave run` (and kills a worker of)."""

import argparse
import json

import elaswave
from elaswave.data import TokenFile
from elaswave.hf import causal_lm, token_loss
from tests.api.hf_cases import BATCH, LR, SEQ, SLOTS, WD, tiny_config

p = argparse.ArgumentParser()
p.add_argument("--data", required=True)
p.add_argument("--steps", type=int, default=60)
p.add_argument("--losses-out")
args = p.parse_args()
result = elaswave.train(
    causal_lm(tiny_config("llama")),
    token_loss,
    TokenFile(args.data, SEQ),
    global_batch=BATCH,
    micro_batches=SLOTS,
    steps=args.steps,
    optimizer=elaswave.AdamW(lr=LR, weight_decay=WD),
)
if args.losses_out:
    with open(args.losses_out, "w") as f:
        json.dump({str(k): v for k, v in result.losses.items()}, f)
