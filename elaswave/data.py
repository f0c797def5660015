"""Token data: a memory-mapped flat file of token ids (`TokenFile`) and the writer behind
`elaswave tokenize` (`tokenize_files`).

The file format is the one nanoGPT's `prepare.py` and many torchtitan setups already write: the
token ids of the whole corpus back to back, no header, little-endian `uint16` (vocabularies up
to 65,535 ids) or `uint32`. `TokenFile` serves non-overlapping windows: item `i` is
`(ids[i*T : i*T+T], ids[i*T+1 : i*T+T+1])`, the tokens and the next tokens, as int64. Nothing is
read until an item is asked for, and the mapping is reopened lazily in every process that
unpickles the dataset (loader processes), so a file of any size costs no memory up front.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


class TokenFileError(ValueError):
    """A token file that cannot be what the caller says it is."""


def _dtype(dtype: Any) -> np.dtype[Any]:
    key = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if key not in DTYPES:
        raise TokenFileError(f"dtype must be uint16 or uint32 (flat token files), got {dtype!r}")
    return DTYPES[key]


class TokenFile(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """`(tokens, next tokens)` windows of `seq_len` from a flat token file (module docstring).

    `vocab_size`, when given, is checked against the largest id in the file (one pass): ids
    beyond it mean the file was written with another dtype or tokenizer. Errors (TokenFileError,
    a ValueError) say what does not fit, before any training."""

    def __init__(
        self, path: str | Path, seq_len: int, dtype: Any = "uint16", vocab_size: int | None = None
    ) -> None:
        self.path, self.seq_len, self.dtype = Path(path), int(seq_len), _dtype(dtype)
        if self.seq_len < 1:
            raise TokenFileError(f"seq_len must be >= 1, got {seq_len}")
        if not self.path.is_file():
            raise TokenFileError(f"token file {self.path} does not exist")
        size = self.path.stat().st_size
        if size % self.dtype.itemsize:
            raise TokenFileError(
                f"{self.path} has {size} bytes, not a whole number of {self.dtype.name} tokens: it was "
                f"written with another dtype (try {'uint16' if self.dtype.itemsize == 4 else 'uint32'}?)"
            )
        self.num_tokens = size // self.dtype.itemsize
        self._len = (self.num_tokens - 1) // self.seq_len
        if self._len < 1:
            raise TokenFileError(
                f"{self.path} holds {self.num_tokens} tokens: one window of seq_len={self.seq_len} needs "
                f"{self.seq_len + 1} (the targets are the next tokens)"
            )
        self._map: np.memmap[Any, Any] | None = None
        if vocab_size is not None:
            top = int(self._tokens().max())
            if top >= vocab_size:
                raise TokenFileError(
                    f"{self.path} holds token id {top} >= vocab_size {vocab_size}: the file was written "
                    f"with another tokenizer or dtype (read as {self.dtype.name})"
                )

    def _tokens(self) -> np.memmap[Any, Any]:
        if self._map is None:
            self._map = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
        return self._map

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_map": None}  # each process maps the file itself

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self._len:
            raise IndexError(f"window {i} of {self._len}")
        start = i * self.seq_len
        window = torch.from_numpy(np.array(self._tokens()[start : start + self.seq_len + 1], dtype=np.int64))
        return window[:-1], window[1:]


def write_tokens(ids: Iterable[int], path: str | Path, dtype: Any = "uint16") -> int:
    """Write ids to a flat token file (replacing it); returns the number of tokens written."""
    dt, path = _dtype(dtype), Path(path)
    limit = np.iinfo(dt).max
    count = 0
    part = path.with_suffix(path.suffix + ".part")
    with part.open("wb") as f:
        for chunk in _chunks(ids, 1 << 16):
            arr = np.asarray(chunk, dtype=np.int64)
            if arr.size and (arr.min() < 0 or arr.max() > limit):
                raise TokenFileError(
                    f"token id {int(arr.max())} does not fit {dt.name} (max {limit}): use uint32"
                )
            f.write(arr.astype(dt).tobytes())
            count += arr.size
    part.replace(path)
    return count


def _chunks(ids: Iterable[int], n: int) -> Iterator[list[int]]:
    chunk: list[int] = []
    for i in ids:
        chunk.append(i)
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def load_tokenizer(path: str | Path) -> Any:
    """A `tokenizers.Tokenizer` from a tokenizer.json file or a directory holding one, else a
    `transformers` tokenizer from a local directory (never downloaded)."""
    path = Path(path)
    file = path if path.is_file() else path / "tokenizer.json"
    if file.is_file():
        from tokenizers import Tokenizer  # noqa: PLC0415 - the optional extra elaswave[hf]

        return Tokenizer.from_file(str(file))
    if not path.is_dir():
        raise FileNotFoundError(
            f"no tokenizer at {path}: give a tokenizer.json or a local tokenizer directory"
        )
    from transformers import AutoTokenizer  # noqa: PLC0415

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _encode(tokenizer: Any, text: str) -> list[int]:
    out = tokenizer.encode(text)
    return list(out.ids if hasattr(out, "ids") else out)


def _vocab_size(tokenizer: Any) -> int:
    size = tokenizer.get_vocab_size() if hasattr(tokenizer, "get_vocab_size") else len(tokenizer)
    return int(size)


def tokenize_files(
    tokenizer_path: str | Path,
    texts: Iterable[str | Path],
    out: str | Path,
    dtype: str = "auto",
    eos: str | None = None,
) -> tuple[int, str]:
    """Tokenize text files (one document each) into one flat token file; `eos` (a token string)
    is appended after each document. Returns (tokens written, dtype)."""
    tokenizer = load_tokenizer(tokenizer_path)
    vocab = _vocab_size(tokenizer)
    chosen = ("uint16" if vocab <= 65536 else "uint32") if dtype == "auto" else dtype
    eos_id = None
    if eos is not None:
        eos_id = (
            tokenizer.token_to_id(eos)
            if hasattr(tokenizer, "token_to_id")
            else tokenizer.convert_tokens_to_ids(eos)
        )
        if eos_id is None:
            raise ValueError(f"the tokenizer has no token {eos!r}")

    def ids() -> Iterator[int]:
        for text in texts:
            yield from _encode(tokenizer, Path(text).read_text(encoding="utf-8"))
            if eos_id is not None:
                yield int(eos_id)

    return write_tokens(ids(), out, chosen), chosen
