"""Typed training configuration, `key=value` overrides, and experiment files.

One config system: nested frozen dataclasses validated in `__post_init__`.
An experiment is a small Python file under `configs/` exposing `CONFIG` (or
`get_config()`); the CLI applies `override(cfg, ["optim.lr=1e-3", ...])`,
which parses each value by the annotated type of its field, so a typo or
a bad value fails before any compute starts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import types
import typing
from typing import Any, Sequence

from adaflash_jax.models.config import ModelConfig, resolve_dtype
from adaflash_jax.training.anchors import default_gamma
from adaflash_jax.training.opd_config import OPDSpec

DATA_SOURCES = ("arrays", "rollouts", "target_greedy")


def _positive(obj, *names):
    prefix = f"{obj.KEY}." if obj.KEY else ""
    for name in names:
        if getattr(obj, name) <= 0:
            raise ValueError(f"{prefix}{name} must be positive, got {getattr(obj, name)}")


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    """The frozen target: a built-in name / HF dir / .gguf path, or a random `tiny` model."""

    KEY = "target"  # section name in override keys (a class constant, not a field)

    name: str = ""
    tiny: ModelConfig | None = None
    seed: int = 0  # init seed of the random `tiny` target
    dtype: str = "float32"
    param_dtype: str | None = None

    def __post_init__(self):
        if bool(self.name) == (self.tiny is not None):
            raise ValueError("target: set exactly one of target.name (checkpoint) or target.tiny "
                             "(random test model)")
        resolve_dtype(self.dtype)
        if self.param_dtype is not None:
            resolve_dtype(self.param_dtype)


@dataclasses.dataclass(frozen=True)
class DrafterSpec:
    """Drafter shape; unset fields follow the target (DFlash layer rule, mask token)."""

    KEY = "drafter"

    num_layers: int = 2
    block_size: int = 16
    mask_token_id: int | None = None
    target_layer_ids: tuple[int, ...] | None = None
    param_dtype: str = "float32"  # master weights; compute follows the target's dtype
    draft_vocab_size: int | None = None  # predict over the K most frequent response tokens only
    init_from_target: bool = False  # start the layers from the target's last num_layers layers
    init_from: str = ""  # a saved drafter (dir or built-in name) to start from: fine-tuning, a grown store

    def __post_init__(self):
        _positive(self, "num_layers")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"drafter.draft_vocab_size must be >= 1, got {self.draft_vocab_size}")
        if self.block_size < 2:
            raise ValueError(f"drafter.block_size must be >= 2, got {self.block_size}")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ValueError(f"drafter.mask_token_id must be >= 0, got {self.mask_token_id}")
        resolve_dtype(self.param_dtype)
        if self.init_from and self.init_from_target:
            raise ValueError("drafter.init_from and drafter.init_from_target both say where the weights "
                             "start; set one")


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """Training sequences (prompt + target response) and how blocks are drawn from them.

    source: "arrays" (an .npz with tokens/prompt_lens/seq_lens at `path`),
    "rollouts" (a `training.rollouts` directory at `path`, or several joined by commas), or "target_greedy"
    (the target's own greedy continuations of random prompts; tests and demos).
    `eval_sequences` rows (a seeded random subset) are held out for teacher-forced τ, or
    `eval_path` names rollouts of the fixed evaluation set to measure it on instead.
    """

    KEY = "data"

    source: str = "arrays"
    path: str = ""
    seq_len: int = 512
    batch_size: int = 8
    num_blocks: int = 16  # anchors per sequence
    gamma: float | None = None  # loss decay; None = DFlash default for the block size
    eval_sequences: int = 0  # rows held out for teacher-forced τ
    num_sequences: int = 256  # target_greedy only
    prompt_len: int = 8  # target_greedy only
    cache_features: bool = False  # compute target features once (under checkpoint.dir/features)
    eval_path: str = ""  # rollouts of the fixed evaluation set (`adaflash rollout --eval-set`) for τ
    max_rows: int = 0  # train on the first N rows only (0 = all): data-size ablations, a grown store

    def __post_init__(self):
        if self.source not in DATA_SOURCES:
            raise ValueError(f"data.source must be one of {DATA_SOURCES}, got {self.source!r}")
        if self.source in ("arrays", "rollouts") and not self.path:
            raise ValueError(f"data.source={self.source!r} needs data.path")
        _positive(self, "seq_len", "batch_size", "num_blocks", "num_sequences", "prompt_len")
        if self.num_blocks > self.seq_len:
            raise ValueError(f"data.num_blocks ({self.num_blocks}) cannot exceed data.seq_len "
                             f"({self.seq_len})")
        if self.gamma is not None and self.gamma <= 0:
            raise ValueError(f"data.gamma must be positive, got {self.gamma}")
        if self.max_rows < 0:
            raise ValueError(f"data.max_rows must be >= 0 (0 = every row), got {self.max_rows}")
        if self.max_rows and self.source == "target_greedy":
            raise ValueError("data.max_rows cuts a stored data set; with data.source=target_greedy set "
                             "data.num_sequences instead")
        if self.eval_sequences < 0:
            raise ValueError(f"data.eval_sequences must be >= 0, got {self.eval_sequences}")
        if self.eval_path and self.eval_sequences:
            raise ValueError("data.eval_path (held-out rollouts) and data.eval_sequences (training rows "
                             "held out) are two sources of the held-out batch; set one")
        if self.source == "target_greedy" and self.prompt_len + 2 > self.seq_len:
            raise ValueError("data.prompt_len leaves no room for a response within data.seq_len")


@dataclasses.dataclass(frozen=True)
class OptimSpec:
    """AdamW with warmup + cosine decay after global-norm clipping (DFlash recipe)."""

    KEY = "optim"

    lr: float = 6e-4
    warmup: float = 0.04  # fraction of total_steps
    clip: float = 1.0
    weight_decay: float = 0.01
    total_steps: int = 1000

    def __post_init__(self):
        _positive(self, "lr", "clip", "total_steps")
        if not 0.0 <= self.warmup < 1.0:
            raise ValueError(f"optim.warmup is a fraction in [0, 1), got {self.warmup}")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Device mesh sizes; their product is the number of devices used."""

    KEY = "mesh"

    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        _positive(self, "data", "fsdp", "tensor")

    @property
    def num_devices(self) -> int:
        return self.data * self.fsdp * self.tensor


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    """Run directory (checkpoints/, drafter/, tensorboard/) and save cadence."""

    KEY = "checkpoint"

    dir: str = ""
    every_steps: int = 500
    max_to_keep: int = 3

    def __post_init__(self):
        _positive(self, "every_steps", "max_to_keep")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run: target, drafter, data, optimizer, mesh, checkpoints, OPD, logging."""

    KEY = ""

    target: TargetSpec
    data: DataSpec
    drafter: DrafterSpec = DrafterSpec()
    optim: OptimSpec = OptimSpec()
    mesh: MeshSpec = MeshSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    opd: OPDSpec = OPDSpec()  # on-policy distillation (`adaflash opd`); offline training ignores it
    eval_every: int = 100
    log_every: int = 10
    seed: int = 0
    tensorboard_dir: str | None = None  # None: <checkpoint.dir>/tensorboard
    progress: bool = True  # tqdm bar
    attn_impl: str = "xla"  # the training step's drafter attention: "xla", "pallas" or "auto"
    max_minutes: float | None = None  # stop (and save) once this call has trained this long

    def __post_init__(self):
        _positive(self, "eval_every", "log_every")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ValueError(f"max_minutes must be positive, got {self.max_minutes}")
        from adaflash_jax.models.layers import ATTENTION_IMPLS
        if self.attn_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attn_impl must be one of {ATTENTION_IMPLS}, got {self.attn_impl!r}")

    @property
    def gamma(self) -> float:
        return self.data.gamma if self.data.gamma is not None else default_gamma(self.drafter.block_size)

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)


# --- parsing values by annotated type -------------------------------------------------------

def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _optional(tp) -> tuple[Any, bool]:
    """(inner type, allows None) for `X | None` / Optional[X]."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], len(args) != len(typing.get_args(tp))
    return tp, False


def parse_value(text: str, tp, key: str):
    """Parses one override value as type `tp`; raises ValueError naming the key."""
    inner, nullable = _optional(tp)
    if nullable and text.strip().lower() in ("none", "null"):
        return None
    try:
        if inner is bool:
            low = text.strip().lower()
            if low not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError("expected true/false")
            return low in ("true", "1", "yes")
        if inner is int:
            return int(text)
        if inner is float:
            return float(text)
        if inner is str:
            return text
        if typing.get_origin(inner) is tuple:
            elem = typing.get_args(inner)[0]
            raw = text.strip()
            items = json.loads(raw) if raw.startswith("[") else [s for s in raw.split(",") if s.strip()]
            return tuple(parse_value(str(s), elem, key) for s in items)
    except ValueError as e:
        raise ValueError(f"config key {key!r}: cannot parse {text!r} as {_type_name(tp)} ({e})") from None
    raise ValueError(f"config key {key!r} has type {_type_name(tp)}, which cannot be set from the "
                     "command line; set the nested fields instead")


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check_path(obj, path: list[str], text: str, full_key: str):
    """Parses `text` for the field at `path` below dataclass `obj` (errors name the key)."""
    hints = _hints(type(obj))
    name = path[0]
    if name not in hints:
        known = ", ".join(f.name for f in dataclasses.fields(obj))
        raise ValueError(f"unknown config key {full_key!r}: {type(obj).__name__} has no field "
                         f"{name!r} (fields: {known})")
    if len(path) == 1:
        return parse_value(text, hints[name], full_key)
    child = getattr(obj, name)
    if child is None:
        inner, _ = _optional(hints[name])
        if not dataclasses.is_dataclass(inner):
            raise ValueError(f"unknown config key {full_key!r}: {name!r} has no sub-fields")
        raise ValueError(f"config key {full_key!r}: {name} is unset (None); it cannot be built "
                         "field by field from overrides — set it in the config file")
    if not dataclasses.is_dataclass(child):
        raise ValueError(f"unknown config key {full_key!r}: {name!r} is a {_type_name(hints[name])}, "
                         "not a section")
    return _check_path(child, path[1:], text, full_key)


def _apply(obj, changes: dict):
    """Rebuilds `obj` with nested `changes` ({field: value or sub-dict}); each changed section
    is validated once, with all of its new values in place."""
    fields = {}
    for name, change in changes.items():
        fields[name] = _apply(getattr(obj, name), change) if isinstance(change, dict) else change
    return dataclasses.replace(obj, **fields)


def override(cfg: TrainConfig, items: Sequence[str]) -> TrainConfig:
    """Applies `section.field=value` overrides (later items win) and validates the result."""
    changes: dict = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"override {item!r} is not of the form key=value")
        path = key.split(".")
        try:
            value = _check_path(cfg, path, text.strip(), key)
        except ValueError as e:
            raise ValueError(f"override {item!r}: {e}") from None
        node = changes
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[path[-1]] = value
    try:
        return _apply(cfg, changes)
    except ValueError as e:
        raise ValueError(f"overrides {list(items)}: {e}") from None


# --- experiment files -------------------------------------------------------------------------

def _config_dirs() -> list[str]:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return [os.path.join(os.getcwd(), "configs"), os.path.join(repo, "configs")]


def load_config(path_or_name: str) -> TrainConfig:
    """Imports an experiment file (a path, or a name under configs/) and returns its config."""
    path = path_or_name
    if not os.path.isfile(path):
        stem = path_or_name.replace("-", "_").removesuffix(".py")
        candidates = [os.path.join(d, stem + ".py") for d in _config_dirs()]
        found = [c for c in candidates if os.path.isfile(c)]
        if not found:
            names = sorted({f[:-3] for d in _config_dirs() if os.path.isdir(d)
                            for f in os.listdir(d) if f.endswith(".py") and not f.startswith("_")})
            raise ValueError(f"unknown config {path_or_name!r}: not a file and not one of "
                             f"{', '.join(names) or 'no configs found'}")
        path = found[0]
    spec = importlib.util.spec_from_file_location(
        "adaflash_experiment_" + os.path.basename(path)[:-3].replace("-", "_"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if hasattr(module, "get_config"):
        cfg = module.get_config()
    elif hasattr(module, "CONFIG"):
        cfg = module.CONFIG
    else:
        raise ValueError(f"config file {path} defines neither CONFIG nor get_config()")
    if not isinstance(cfg, TrainConfig):
        raise ValueError(f"config file {path} produced a {type(cfg).__name__}, not a TrainConfig")
    return cfg
