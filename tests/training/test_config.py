"""TrainConfig: typed overrides, clear errors, experiment files."""

import json

import pytest

from adaflash_jax.training.config import TrainConfig, load_config, override


@pytest.fixture(scope="module")
def tiny():
    return load_config("tiny")


def test_override_parses_by_field_type(tiny):
    cfg = override(tiny, ["optim.lr=1e-3", "optim.total_steps=7", "progress=false",
                          "drafter.target_layer_ids=0,2", "drafter.mask_token_id=5",
                          "target.tiny.num_layers=6", "data.gamma=none", "tensorboard_dir=/tmp/tb",
                          "seed=3"])
    assert cfg.optim.lr == 1e-3 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.total_steps == 7 and cfg.progress is False and cfg.seed == 3
    assert cfg.drafter.target_layer_ids == (0, 2) and cfg.drafter.mask_token_id == 5
    assert cfg.target.tiny.num_layers == 6 and cfg.data.gamma is None
    assert cfg.tensorboard_dir == "/tmp/tb"
    assert tiny.optim.lr != 1e-3  # the original is untouched (frozen dataclasses)
    assert override(cfg, ["drafter.target_layer_ids=[1, 3]"]).drafter.target_layer_ids == (1, 3)
    assert override(cfg, ["drafter.mask_token_id=None"]).drafter.mask_token_id is None
    # Fields that are only valid together are validated after all of them are set.
    both = override(tiny, ["data.source=arrays", "data.path=x.npz", "optim.lr=1", "optim.lr=2"])
    assert (both.data.source, both.data.path, both.optim.lr) == ("arrays", "x.npz", 2.0)


@pytest.mark.parametrize("item, message", [
    ("optim.lrr=1", "unknown config key 'optim.lrr'.*fields: lr, warmup"),
    ("nosuch=1", "unknown config key 'nosuch'"),
    ("optim.lr.x=1", "'lr' is a float, not a section"),
    ("optim.lr=abc", "cannot parse 'abc' as float"),
    ("optim.total_steps=1.5", "cannot parse '1.5' as int"),
    ("progress=maybe", "cannot parse 'maybe' as bool"),
    ("optim.lr", "not of the form key=value"),
    ("optim.total_steps=0", "optim.total_steps must be positive"),
    ("data.num_blocks=1000", r"num_blocks \(1000\) cannot exceed data.seq_len"),
    ("data.source=web", "data.source must be one of"),
    ("drafter.block_size=1", "block_size must be >= 2"),
    ("target.tiny.num_kv_heads=3", "multiple of num_kv_heads"),
    ("target.name=x", "exactly one of target.name"),
    ("optim.warmup=1.5", "warmup is a fraction"),
    ("data.source=arrays", "needs data.path"),
    ("data.max_rows=-1", "data.max_rows must be >= 0"),
    ("data.max_rows=5", "with data.source=target_greedy set data.num_sequences"),
])
def test_override_errors_are_clear(tiny, item, message):
    with pytest.raises(ValueError, match=message):
        override(tiny, [item])


def test_gamma_defaults_follow_block_size(tiny):
    assert [override(tiny, [f"drafter.block_size={b}"]).gamma for b in (16, 10, 8)] == [7.0, 5.0, 4.0]
    assert override(tiny, ["data.gamma=2.5"]).gamma == 2.5


def test_load_config_names_and_files(tmp_path, tiny):
    assert load_config("smollm2_135m").drafter.block_size == 16
    q = load_config("qwen3-8b")
    assert (q.drafter.num_layers, q.drafter.target_layer_ids, q.drafter.mask_token_id) == (
        5, (1, 9, 17, 25, 33), 151669)
    assert q.data.num_blocks == 512 and q.target.dtype == "bfloat16"
    assert q.optim.lr == 6e-4 and q.optim.warmup == 0.04 and q.optim.clip == 1.0
    assert q.mesh.num_devices == 32  # v5p-64: 32 chips
    path = tmp_path / "exp.py"
    path.write_text("from adaflash_jax.training.config import load_config, override\n"
                    "def get_config():\n    return override(load_config('tiny'), ['seed=9'])\n")
    assert load_config(str(path)).seed == 9
    with pytest.raises(ValueError, match="unknown config 'nope'.*tiny"):
        load_config("nope")
    bad = tmp_path / "bad.py"
    bad.write_text("X = 1\n")
    with pytest.raises(ValueError, match="neither CONFIG nor get_config"):
        load_config(str(bad))


def test_to_json_is_complete(tiny):
    d = json.loads(tiny.to_json())
    assert d["target"]["tiny"]["hidden_size"] == tiny.target.tiny.hidden_size
    assert d["optim"]["lr"] == tiny.optim.lr and set(d) == {
        f.name for f in TrainConfig.__dataclass_fields__.values()}
