"""Token data offline: `examples/llama/prepare.py` makes a corpus and trains a BPE tokenizer with
`tokenizers`; `elaswave tokenize` writes the flat token file `TokenFile` serves as (tokens, next
tokens) windows that decode back to the text; the example trains on it and exports a directory
`from_pretrained` loads with its tokenizer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from elaswave.cli import main as cli_main
from elaswave.data import TokenFile, load_tokenizer

pytest.importorskip("tokenizers", reason="the optional extra elaswave[hf]")
transformers = pytest.importorskip("transformers", reason="the optional extra elaswave[hf]")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "llama"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llama-data")
    subprocess.run(
        [sys.executable, str(EXAMPLE / "prepare.py"), "--out", str(out), "--stories", "300"],
        check=True,
        timeout=120,
        capture_output=True,
    )
    return out


def test_tokenize_writes_what_token_file_serves(prepared: Path, tmp_path: Path) -> None:
    text = prepared / "corpus" / "val.txt"
    out = tmp_path / "val.bin"
    assert (
        cli_main(["tokenize", "--tokenizer", str(prepared / "tokenizer"), "--out", str(out), str(text)]) == 0
    )
    assert out.read_bytes() == (prepared / "val.bin").read_bytes()  # what prepare.py wrote too
    tok = load_tokenizer(prepared / "tokenizer")
    ids = np.fromfile(out, dtype="<u2")
    assert tok.decode(ids.tolist()) == text.read_text()
    data = TokenFile(out, 16, vocab_size=tok.get_vocab_size())
    assert len(data) == (len(ids) - 1) // 16
    x, y = data[3]
    assert x.dtype == torch.int64 and torch.equal(x[1:], y[:-1])
    assert torch.equal(x, torch.from_numpy(ids[48:64].astype(np.int64)))


@pytest.mark.timeout(180)
def test_the_llama_example_trains_and_exports_with_its_tokenizer(prepared: Path, tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable, str(EXAMPLE / "train.py"), "--data", str(prepared), "--steps", "2",
            "--global-batch", "4", "--seq-len", "32", "--checkpoint-dir", str(tmp_path / "ck"),
        ],
        check=True, timeout=150, capture_output=True, text=True, cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert "held-out loss" in run.stdout
    out = tmp_path / "hf"
    assert (
        cli_main(["export-hf", str(tmp_path / "ck"), str(out), "--tokenizer", str(prepared / "tokenizer")])
        == 0
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    ids = tok("Ada had a small cat.", return_tensors="pt").input_ids
    assert model.config.tie_word_embeddings and model(ids).logits.shape[-1] == model.config.vocab_size
