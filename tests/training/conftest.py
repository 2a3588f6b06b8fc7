"""Shared set-up for the trainer tests: the `tiny` experiment on saved greedy rollouts.

The tiny target and its own greedy continuations (`af.generate`, via the trainer's
`greedy_rollouts` in training.data) are built once per session and written as an .npz, so in-process
runs and the SIGTERM subprocess train on identical data through `data.source=arrays`.
"""

import os
import types

import numpy as np
import pytest

from adaflash_jax.training import data as training_data
from adaflash_jax.training import trainer
from adaflash_jax.training.config import load_config, override


@pytest.fixture(scope="session")
def tiny_train_env(tmp_path_factory):
    base = load_config("tiny")
    mesh = trainer.build_mesh(base)
    target = trainer.build_target(base, mesh)
    d = base.data
    arrays = training_data.greedy_rollouts(target, d.num_sequences + d.eval_sequences, d.prompt_len,
                                           d.seq_len, base.seed)
    npz = os.path.join(tmp_path_factory.mktemp("tiny_data"), "rollouts.npz")
    np.savez(npz, **arrays)

    def config(run_dir, *overrides):
        return override(base, ["data.source=arrays", f"data.path={npz}", "progress=false",
                               f"checkpoint.dir={run_dir}", *overrides])

    return types.SimpleNamespace(target=target, npz=npz, arrays=arrays, config=config)
