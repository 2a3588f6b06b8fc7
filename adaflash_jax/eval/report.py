"""How benchmark scripts hand over their results: one JSON record on stdout (and in a file)."""

from __future__ import annotations

import json


def emit_json(record: dict, out: str | None = None, *, indent: int = 1) -> dict:
    """Prints `record` as JSON and, when `out` is set, writes the same text there; returns it."""
    text = json.dumps(record, indent=indent)
    print(text)
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return record
