"""Write the example data ``ravq.tasks.text`` ships (``ravq/tasks/text/example``), from text that ships with
Python: CPython's documentation topics (``pydoc_data.topics``, PSF license).

``python -m ravq.tasks.text.make_example [FOLDER]``: three .txt files (a file is a document) and one .jsonl
file (a line is a document, in its "text" field), about 250 KB, the same on every machine with the same
Python minor version.  The repository holds the result; this is how it was made.
"""

from __future__ import annotations

import sys
from pathlib import Path

import orjson

BUDGET_BYTES = 250_000
"""About this much text in all."""


def write_example(folder: Path) -> list[Path]:
    from pydoc_data.topics import topics

    chosen: list[str] = []
    total = 0
    for key in sorted(topics):
        if total >= BUDGET_BYTES:
            break
        chosen.append(key)
        total += len(topics[key].encode("utf-8"))
    folder.mkdir(parents=True, exist_ok=True)
    txt, lines = chosen[: 2 * len(chosen) // 3], chosen[2 * len(chosen) // 3:]
    written = []
    for part in range(3):
        path = folder / f"python-topics-{part + 1}.txt"
        path.write_text("\n\n".join(topics[k] for k in txt[part::3]), encoding="utf-8")
        written.append(path)
    path = folder / "python-topics.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"title": k, "text": topics[k]}) + b"\n" for k in lines))
    return [*written, path]


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "example"
    for written in write_example(out):
        print(f"{written}: {written.stat().st_size} bytes")
