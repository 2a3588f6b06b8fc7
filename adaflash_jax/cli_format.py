"""Plain-text and JSON formatting for the `adaflash` CLI.

Kept apart from `cli.py` so that argument handling stays readable and the
formatting rules (what a stats line shows, how tables align, what JSON may
contain) live in one place.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np


def jsonable(value: Any) -> Any:
    """Strict-JSON version of `value`: numpy scalars to Python, inf/nan to None."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def stats_line(stats: dict) -> str:
    """One line summarising a generate() call; compile time is shown apart."""
    parts = [f"{stats.get('new_tokens', 0)} tokens",
             f"{stats.get('wall_time_s', 0.0):.2f} s",
             f"{stats.get('tokens_per_s', 0.0):.1f} tokens/s"]
    if "mean_tau" in stats:
        parts.append(f"tau {stats['mean_tau']:.2f}")
    parts.append(f"{stats.get('steps', 0)} steps")
    if stats.get("compile_time_s"):
        parts.append(f"compile {stats['compile_time_s']:.1f} s (not counted)")
    return "[" + ", ".join(parts) + "]"


def comparison_line(spec_stats: dict, ar_stats: dict, identical: bool, temperature: float) -> str:
    """Speculative vs autoregressive on the same prompts: speedup and output identity."""
    ratio = speedup(spec_stats, ar_stats)
    same = "identical" if identical else "DIFFERENT"
    note = "" if temperature == 0 else " (sampling: identity is not expected)"
    return (f"speculative {spec_stats.get('tokens_per_s', 0.0):.1f} tokens/s vs autoregressive "
            f"{ar_stats.get('tokens_per_s', 0.0):.1f} tokens/s: speedup "
            f"{'-' if ratio is None else f'{ratio:.2f}x'}; outputs {same}{note}")


def speedup(spec_stats: dict, ar_stats: dict) -> float | None:
    """Throughput ratio speculative / autoregressive (None when AR produced nothing)."""
    ar_tps = ar_stats.get("tokens_per_s") or 0.0
    return spec_stats.get("tokens_per_s", 0.0) / ar_tps if ar_tps else None


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A fixed-width text table; numbers are right-aligned, text left-aligned."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return "-" if not math.isfinite(v) else f"{v:.2f}"
        return "-" if v is None else str(v)

    cells = [[cell(v) for v in row] for row in rows]
    numeric = [all(isinstance(row[i], (int, float)) or row[i] is None for row in rows)
               for i in range(len(headers))]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric)).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep] + [line(r) for r in cells])


def reply_block(title: str, prompt: str, reply: str | None) -> str:
    """A prompt and its reply, clearly delimited for the terminal."""
    text = reply if reply is not None else "(no tokenizer: see token ids with --json)"
    return f"=== {title}\n> {prompt}\n{text.strip()}"
