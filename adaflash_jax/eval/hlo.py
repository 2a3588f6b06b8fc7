"""Reading a compiled program's optimised HLO for copies of weights and KV-cache buffers.

On CPU, XLA copies a layer's weights out of a stacked `[L, ...]` array before a
matmul reads them inside a layer scan (a `dynamic-slice` fusion per weight per
layer), and copies a KV-cache buffer when a read and an in-place write of it
cannot be ordered. Both cost as much as the matmuls they feed. The per-layer
inference layout (`models.decoder_layers`) exists to avoid them, and this is how
a test or a benchmark checks that none came back.
"""

from __future__ import annotations

import math
import re

from adaflash_jax.models.decoder_layers import layer_shapes

# The result of an instruction: `%name = f32[3,64,512]{2,1,0} opcode(...`
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = \w+\[([\d,]*)\]\S* (\S+?)\(")
# Instructions that make no new buffer (views, plumbing) or update one in place.
_NOT_COPIES = ("parameter", "bitcast", "get-tuple-element", "tuple", "while", "call", "conditional",
               "dynamic-update-slice", "scatter", "custom-call")
# What a copying instruction or fusion is called after (XLA names fusions after their ops).
_COPYING = ("slice", "copy", "transpose")


def _computations(hlo_text: str):
    """(name, lines) of every computation XLA runs as a sequence of buffers: the entry and the
    loop bodies and conditions, not the bodies of fusions (their values never reach memory)."""
    name, lines = None, []
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
        if header:
            name, lines = header.group(1), []
        elif line.startswith("}") and name is not None:
            if not name.startswith(("fused_computation", "wrapped_")):
                yield name, lines
            name = None
        elif name is not None:
            lines.append(line)


def buffer_copies(hlo_text: str, sizes: dict[str, set[int]], words: tuple[str, ...] = _COPYING) -> dict[str, int]:
    """Counts, per kind of `sizes` (kind -> element counts), of instructions of the optimised
    program that materialise a new buffer of one of those sizes by copying (slices, copies,
    transposes, and fusions named after them). Views, parameters and in-place updates (scatter,
    dynamic-update-slice, and fusions wrapping them) do not count. `words`: only instructions
    named after one of these count (("slice",): the copies a layer scan's slicing makes)."""
    counts = {kind: 0 for kind in sizes}
    for _, lines in _computations(hlo_text):
        for line in lines:
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            name, dims, opcode = m.groups()
            if opcode in _NOT_COPIES or "scatter" in name or "dynamic-update-slice" in name:
                continue
            if not any(word in name or word in opcode for word in words):
                continue
            elements = math.prod(int(d) for d in dims.split(",")) if dims else 1
            for kind, wanted in sizes.items():
                if elements in wanted:
                    counts[kind] += 1
    return counts


def weight_and_cache_copies(hlo_text: str, model, batch: int, cache_len: int) -> dict[str, int]:
    """Copies of a target model's layer weights (each weight of one layer) and of one layer's K
    or V cache buffer ([batch, Hkv, cache_len, Dh]): all of them ("weight", "cache") and those
    made by slicing ("weight_slices", "cache_slices"). A multi-token step's attention also
    transposes each layer's keys for its score matmul (one "cache" copy per layer, not a slice)."""
    cfg = model.cfg
    weights = {math.prod(shape) for shape, _, _ in layer_shapes(cfg).values() if len(shape) >= 2}
    sizes = {"weight": weights, "cache": {batch * cfg.num_kv_heads * cache_len * cfg.head_dim}}
    copies = buffer_copies(hlo_text, sizes)
    copies.update({f"{kind}_slices": n for kind, n in buffer_copies(hlo_text, sizes, ("slice",)).items()})
    return copies
