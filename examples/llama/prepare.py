"""Everything `train.py` reads, made offline: a generated English-like corpus, a byte-level BPE
tokenizer trained on it with `tokenizers`, and flat uint16 token files (nanoGPT's format).

    python examples/llama/prepare.py --out llama-data

writes `llama-data/corpus/{train,val}.txt`, `llama-data/tokenizer/` (tokenizer.json plus the
files `transformers.AutoTokenizer` reads, so `elaswave export-hf --tokenizer` can ship it) and
`llama-data/{train,val}.bin` (through `elaswave.data.tokenize_files`, what `elaswave tokenize`
runs). The corpus is a fixed-seed stream of short stories from a small grammar: the same bytes on
every machine, nothing downloaded.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

NAMES = ["Ada", "Ben", "Cleo", "Dev", "Ema", "Finn", "Gus", "Hana", "Ivo", "Juno", "Kai", "Lena"]
ANIMALS = ["cat", "dog", "fox", "owl", "hen", "goat", "frog", "bear", "mole", "crow", "seal", "wolf"]
PLACES = [
    "the garden",
    "the river",
    "the old mill",
    "the market",
    "the hill",
    "the forest",
    "the barn",
    "the harbour",
    "the library",
    "the bridge",
    "the meadow",
    "the kitchen",
]
ADJECTIVES = ["small", "quiet", "brave", "sleepy", "clever", "muddy", "bright", "hungry", "curious", "grey"]
OBJECTS = ["apple", "ball", "lamp", "map", "key", "hat", "book", "kite", "rope", "bell", "cup", "box"]
FEELINGS = ["happy", "tired", "proud", "worried", "glad", "surprised", "calm", "cold"]
EOS = "<|endoftext|>"


def story(rng: random.Random) -> str:
    """One short story: a character, a goal, a place, a turn and an ending that refers back."""
    name, animal, place = rng.choice(NAMES), rng.choice(ANIMALS), rng.choice(PLACES)
    adj, obj, feeling = rng.choice(ADJECTIVES), rng.choice(OBJECTS), rng.choice(FEELINGS)
    count = rng.randint(2, 9)
    lines = [
        f"{name} had a {adj} {animal}.",
        f"One morning the {animal} lost its {obj} near {place}.",
        f"{name} looked for the {obj} for {count} hours.",
    ]
    if rng.random() < 0.5:
        lines.append(f"A {rng.choice(ADJECTIVES)} {rng.choice(ANIMALS)} found the {obj} under a stone.")
        lines.append(f"It gave the {obj} back, and {name} said thank you.")
    else:
        lines.append(f"At last {name} saw the {obj} in {rng.choice(PLACES)}.")
        lines.append(f"The {animal} took the {obj} and ran home.")
    lines.append(f"That night {name} and the {animal} were {feeling}.")
    return " ".join(lines)


def write_corpus(path: Path, stories: int, seed: int) -> None:
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(story(rng) for _ in range(stories)) + "\n", encoding="utf-8")


def train_tokenizer(corpus: Path, out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train([str(corpus)], trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS).save_pretrained(str(out))


def main() -> None:
    from elaswave.data import tokenize_files

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="llama-data")
    p.add_argument("--stories", type=int, default=40_000, help="training stories (val: a tenth)")
    p.add_argument("--vocab-size", type=int, default=2048)
    args = p.parse_args()
    out = Path(args.out)
    write_corpus(out / "corpus" / "train.txt", args.stories, seed=0)
    write_corpus(out / "corpus" / "val.txt", max(1, args.stories // 10), seed=1)
    train_tokenizer(out / "corpus" / "train.txt", out / "tokenizer", args.vocab_size)
    for split in ("train", "val"):
        count, dtype = tokenize_files(
            out / "tokenizer", [out / "corpus" / f"{split}.txt"], out / f"{split}.bin"
        )
        print(f"{split}: {count:,} tokens ({dtype}) in {out / f'{split}.bin'}")


if __name__ == "__main__":
    main()
