"""A user's text data as token ids: a tokenized file on disk (memory-mapped, never read whole) or a folder
of ``.txt``/``.jsonl`` documents tokenized at start.

- ``train.bin`` (+ ``val.bin``) in a folder, nanoGPT's layout, or one ``.bin`` file: raw token ids
  (``dtype``, uint16 by default), opened with ``np.memmap``; a ``meta.json`` beside them may give
  ``vocab_size`` and ``dtype`` (``ravq.tasks.text.prepare`` writes one);
- one ``.npy`` file: a 1-D integer array, opened with ``np.load(mmap_mode="r")``;
- a folder of ``.txt`` (a file is one document) and ``.jsonl`` files (a line is one document, its
  ``text_field``), read in sorted path order and tokenized with a local tokenizer directory
  (``transformers.AutoTokenizer``, ``local_files_only``) or, without one, as UTF-8 bytes (ids 0-255);
  documents are separated by the tokenizer's end-of-text token (256 for bytes).

The held-out part is ``val.bin`` when there is one, else the last ``held_out`` of the tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

BYTE_VOCAB = 257
"""UTF-8 bytes 0-255 and the end-of-text id 256."""
BYTE_EOS = 256
DEFAULT_VOCAB = 50304
"""A ``.bin`` with no ``meta.json`` and no ``vocab_size`` option: GPT-2's 50,257 tokens padded to a multiple
of 64, as nanoGPT trains them."""
TEXT_SUFFIXES = (".txt", ".jsonl")


@dataclass(kw_only=True, slots=True, frozen=True)
class Corpus:
    train: np.ndarray
    """Training token ids (1-D; a memmap for files on disk)."""
    held_out: np.ndarray
    """Held-out token ids, never trained on."""
    vocab_size: int


@functools.lru_cache(maxsize=4)
def load_corpus(data: Path, *, tokenizer: Path | None, held_out: float, vocab_size: int | None,
                dtype: str | None, text_field: str) -> Corpus:
    """``data`` (module docstring) as token ids."""
    if data.is_dir() and (data / "train.bin").is_file():
        meta = _meta(data)
        kind = np.dtype(dtype or meta.get("dtype", "uint16"))
        train = np.memmap(data / "train.bin", dtype=kind, mode="r")
        val = data / "val.bin"
        vocab = vocab_size or meta.get("vocab_size", DEFAULT_VOCAB)
        if val.is_file():
            return Corpus(train=train, held_out=np.memmap(val, dtype=kind, mode="r"), vocab_size=vocab)
        return _split(train, held_out, vocab)
    if data.is_file() and data.suffix in (".bin", ".npy"):
        meta = _meta(data.parent)
        if data.suffix == ".npy":
            tokens = np.load(data, mmap_mode="r", allow_pickle=False)
            if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
                raise ValueError(f"data: {data} holds a {tokens.dtype} array of shape {tokens.shape}, "
                                 "not 1-D integer token ids")
        else:
            tokens = np.memmap(data, dtype=np.dtype(dtype or meta.get("dtype", "uint16")), mode="r")
        return _split(tokens, held_out, vocab_size or meta.get("vocab_size", DEFAULT_VOCAB))
    if data.is_dir():
        ids, vocab = tokenize_folder(data, tokenizer=tokenizer, text_field=text_field)
        return _split(ids, held_out, vocab_size or vocab)
    raise ValueError(f"data: {data} is not a folder of .txt/.jsonl files, a folder with train.bin, a .bin or "
                     "a .npy file")


def vocab_of(data: Path, *, tokenizer: Path | None, vocab_size: int | None) -> int:
    """The vocabulary ``load_corpus`` gives ``data``, without reading or tokenizing it (what building the
    model needs: ``ravq plan``, ``ravq export``, a profile)."""
    if vocab_size:
        return vocab_size
    if data.is_dir() and not (data / "train.bin").is_file():
        return len(_tokenizer(tokenizer)) if tokenizer is not None else BYTE_VOCAB
    return int(_meta(data if data.is_dir() else data.parent).get("vocab_size", DEFAULT_VOCAB))


@functools.lru_cache(maxsize=2)
def _tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _meta(folder: Path) -> dict[str, int | str]:
    path = folder / "meta.json"
    return orjson.loads(path.read_bytes()) if path.is_file() else {}


def _split(tokens: np.ndarray, held_out: float, vocab_size: int) -> Corpus:
    cut = int(len(tokens) * (1 - held_out))
    return Corpus(train=tokens[:cut], held_out=tokens[cut:], vocab_size=int(vocab_size))


def documents(folder: Path, text_field: str = "text") -> list[str]:
    """The folder's documents, in sorted path order (module docstring)."""
    files = sorted(p for p in folder.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
    if not files:
        raise ValueError(f"data: {folder} holds no .txt or .jsonl file (nor train.bin)")
    docs: list[str] = []
    for path in files:
        if path.suffix == ".txt":
            docs.append(path.read_text(encoding="utf-8"))
            continue
        for n, line in enumerate(path.read_bytes().splitlines(), start=1):
            if not line.strip():
                continue
            record = orjson.loads(line)
            text = record.get(text_field) if isinstance(record, dict) else None
            if isinstance(text, str):
                docs.append(text)
                continue
            raise ValueError(f"data: {path}:{n} has no string field {text_field!r} (the task option "
                             "text_field names it)")
    return docs


def tokenize_folder(folder: Path, *, tokenizer: Path | None,
                    text_field: str = "text") -> tuple[np.ndarray, int]:
    """The folder's documents as one array of token ids, each followed by end-of-text; and the vocabulary's
    size."""
    docs = documents(folder, text_field)
    if tokenizer is None:
        pieces = [np.frombuffer(doc.encode("utf-8"), dtype=np.uint8) for doc in docs]
        return _joined(pieces, BYTE_EOS, np.uint16), BYTE_VOCAB
    tok = _tokenizer(tokenizer)
    vocab = len(tok)
    kind = np.uint16 if vocab <= 1 << 16 else np.uint32
    ids = tok(docs, add_special_tokens=False)["input_ids"]
    return _joined([np.asarray(i, dtype=kind) for i in ids], tok.eos_token_id, kind), vocab


def _joined(pieces: list[np.ndarray], eos: int | None, kind: type[np.unsignedinteger]) -> np.ndarray:
    sep = np.asarray([] if eos is None else [eos], dtype=kind)
    return np.concatenate([part for piece in pieces for part in (piece.astype(kind), sep)])
