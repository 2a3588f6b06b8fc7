"""A second trainer on a run directory in use fails at once, before any work."""

import pytest

from adaflash_jax.atomic_io import run_dir_lock
from adaflash_jax.errors import RunDirBusyError
from adaflash_jax.training.config import load_config, override
from adaflash_jax.training.opd import train_opd
from adaflash_jax.training.run_lock import locks_run_dir
from adaflash_jax.training.trainer import train


@pytest.mark.parametrize("entry, config", [(train, "tiny"), (train_opd, "tiny_opd")])
def test_trainer_on_a_busy_run_dir_is_refused(entry, config, tmp_path):
    cfg = override(load_config(config), [f"checkpoint.dir={tmp_path / 'run'}"])
    with run_dir_lock(str(tmp_path / "run")):
        with pytest.raises(RunDirBusyError, match="in use by another job"):
            entry(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_lock_is_held_for_the_call_and_released_after(tmp_path):
    class Spec:
        dir = str(tmp_path / "run")

    class Config:
        checkpoint = Spec()

    @locks_run_dir
    def job(config):
        with pytest.raises(RunDirBusyError):
            with run_dir_lock(config.checkpoint.dir):
                pass
        return "ran"

    assert job(Config()) == "ran"
    with run_dir_lock(Spec.dir):
        pass
