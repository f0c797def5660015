"""`elaswave tokenize` and `elaswave export-hf`: token files in, `transformers` directories out."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    t = subparsers.add_parser(
        "tokenize",
        help="write a flat token file (nanoGPT format) from text files with a local tokenizer",
        description="Tokenize text files into one flat uint16/uint32 token file for elaswave.data.TokenFile.",
    )
    t.add_argument("texts", nargs="+", help="text files, one document each")
    t.add_argument("--tokenizer", required=True, help="a tokenizer.json, or a local tokenizer directory")
    t.add_argument("--out", required=True, help="the token file to write")
    t.add_argument("--dtype", default="auto", choices=("auto", "uint16", "uint32"))
    t.add_argument("--eos", default=None, help="a token appended after every document (e.g. '<|endoftext|>')")
    t.set_defaults(func=_tokenize)
    e = subparsers.add_parser(
        "export-hf",
        help="write a checkpoint as a transformers directory (safetensors, config, tokenizer)",
        description="Export a checkpoint of elaswave.hf.causal_lm units for AutoModelForCausalLM.from_pretrained.",
    )
    e.add_argument("checkpoint", help="a checkpoint root (its latest) or one step-NNNNNNNN directory")
    e.add_argument("out", help="the directory to write")
    e.add_argument(
        "--config", default=None, help="a directory with config.json, when the checkpoint has none"
    )
    e.add_argument("--tokenizer", default=None, help="a local tokenizer directory to copy along")
    e.set_defaults(func=_export)


def _tokenize(args: argparse.Namespace) -> int:
    from elaswave.data import tokenize_files  # noqa: PLC0415

    count, dtype = tokenize_files(args.tokenizer, args.texts, args.out, args.dtype, args.eos)
    print(f"wrote {count:,} tokens ({dtype}) to {args.out}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from elaswave.hf import export_hf  # noqa: PLC0415

    out = export_hf(args.checkpoint, args.out, config=args.config, tokenizer=args.tokenizer)
    print(f"wrote {out} (load it with transformers.AutoModelForCausalLM.from_pretrained)")
    return 0
