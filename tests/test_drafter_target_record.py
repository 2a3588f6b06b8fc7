"""A saved drafter records its training target; loading it for another target is refused."""

import dataclasses
import json

import jax.numpy as jnp
import pytest

import adaflash_jax as af
import spec_helpers as H
from adaflash_jax import cli
from adaflash_jax.checkpoints.drafter_hf import TARGET_RECORD_KEY
from adaflash_jax.errors import InputError
from adaflash_jax.target_api import BUILTIN_REGISTRY


@pytest.fixture(scope="module")
def target():
    return H.numpy_target(seed=0)


@pytest.fixture(scope="module")
def other():
    return dataclasses.replace(H.numpy_target(seed=1), name="other-target")


@pytest.fixture(scope="module")
def saved(target, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("drafter") / "d")
    af.save_drafter(af.init_drafter(target, num_layers=2, block_size=8), path, target=target)
    return path


def test_fingerprint_ignores_load_dtype_and_tells_weights_apart(target, other):
    bf16 = dataclasses.replace(target, state=jax_cast(target.state, jnp.bfloat16))
    assert target.fingerprint() == bf16.fingerprint()
    assert target.fingerprint() != other.fingerprint()
    assert target.fingerprint().startswith("sha256:")


def jax_cast(state, dtype):
    import jax

    return jax.tree.map(lambda x: x.astype(dtype), state)


def test_saved_config_records_the_target(target, saved):
    with open(f"{saved}/config.json") as f:
        record = json.load(f)[TARGET_RECORD_KEY]
    assert record == {"name": target.name, "fingerprint": target.fingerprint()}


def test_same_target_loads_and_keeps_the_record(target, saved, tmp_path):
    drafter = af.load_drafter(saved, target=target)
    assert drafter.target_record["fingerprint"] == target.fingerprint()
    af.save_drafter(drafter, str(tmp_path / "again"))  # no target given: the record is kept
    with open(tmp_path / "again" / "config.json") as f:
        assert json.load(f)[TARGET_RECORD_KEY] == drafter.target_record


def test_other_target_is_refused_naming_both(target, other, saved):
    with pytest.raises(InputError) as error:
        af.load_drafter(saved, target=other)
    message = str(error.value)
    for text in (target.name, target.fingerprint(), "other-target", other.fingerprint(),
                 "allow_target_mismatch=True"):
        assert text in message
    assert af.load_drafter(saved, target=other, allow_target_mismatch=True).cfg.num_layers == 2


def test_drafter_without_a_record_loads_for_any_target(target, other, tmp_path):
    path = str(tmp_path / "d")
    af.save_drafter(af.init_drafter(target, num_layers=2, block_size=8), path)
    with open(f"{path}/config.json") as f:
        assert TARGET_RECORD_KEY not in json.load(f)
    assert af.load_drafter(path, target=other).target_record is None


def test_cli_refuses_a_mismatch_unless_allowed(other, saved, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_load_target", lambda name, dtype: other)
    assert cli.main(["generate", "--prompt", "hi", "--drafter", saved]) == 2
    err = capsys.readouterr().err
    assert "was trained for target" in err and "--allow-target-mismatch" in err
    # allowed: loading passes; this tokenizer-less target then refuses the text prompt
    assert cli.main(["generate", "--prompt", "hi", "--drafter", saved, "--allow-target-mismatch"]) == 2
    err = capsys.readouterr().err
    assert "trained for target" not in err and "tokenizer" in err


def test_default_mask_token_comes_from_the_registry(target):
    assert target.default_mask_token_id == H.TINY.vocab_size - 1
    named = dataclasses.replace(target, name="smollm2-135m-instruct")
    assert named.default_mask_token_id == BUILTIN_REGISTRY["smollm2-135m-instruct"]["mask_token_id"] == 16
    assert af.init_drafter(named, num_layers=2, block_size=8).cfg.mask_token_id == 16
