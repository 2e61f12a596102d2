"""Tokenize a folder of .txt/.jsonl documents once, into nanoGPT's layout, so that training memory-maps it
instead of tokenizing at every start:

    python -m ravq.tasks.text.prepare SRC OUT [--tokenizer DIR] [--held-out 0.05] [--text-field text]

writes ``OUT/train.bin`` and ``OUT/val.bin`` (the last ``--held-out`` of the tokens: raw token ids, uint16,
or uint32 for a vocabulary over 65,536) and ``OUT/meta.json`` (``vocab_size``, ``dtype``), which the task
reads with ``task_options: {data: OUT}``.  The tokens are the ones training on SRC directly would see.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import orjson

from ravq.tasks.text.tokens import tokenize_folder


def prepare(src: Path, out: Path, *, tokenizer: Path | None, held_out: float,
            text_field: str) -> dict[str, int]:
    """Write OUT's three files; the tokens in each split."""
    ids, vocab = tokenize_folder(src, tokenizer=tokenizer, text_field=text_field)
    cut = int(len(ids) * (1 - held_out))
    out.mkdir(parents=True, exist_ok=True)
    ids[:cut].tofile(out / "train.bin")
    ids[cut:].tofile(out / "val.bin")
    meta = {"vocab_size": vocab, "dtype": str(ids.dtype),
            "tokenizer": str(tokenizer) if tokenizer else "bytes"}
    (out / "meta.json").write_bytes(orjson.dumps(meta, option=orjson.OPT_INDENT_2))
    return {"train": cut, "val": len(ids) - cut}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m ravq.tasks.text.prepare", description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path, help="a folder of .txt/.jsonl documents")
    p.add_argument("out", type=Path, help="the folder to write train.bin, val.bin and meta.json to")
    p.add_argument("--tokenizer", type=Path, default=None, help="a local tokenizer directory; default bytes")
    p.add_argument("--held-out", type=float, default=0.05)
    p.add_argument("--text-field", default="text", help="the field of a .jsonl line holding its document")
    args = p.parse_args()
    counts = prepare(args.src, args.out, tokenizer=args.tokenizer, held_out=args.held_out,
                     text_field=args.text_field)
    print(f"{args.out}: {counts['train']:,} training and {counts['val']:,} held-out tokens")


if __name__ == "__main__":
    main()
