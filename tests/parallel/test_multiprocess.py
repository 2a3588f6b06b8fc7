"""Two JAX processes on loopback train like one process with two devices.

`launch/local.py` starts 2 CPU processes (1 device each, gloo collectives) running
`adaflash train` on the tiny config with a data=2 mesh spanning both; each process
loads only its half of every batch. The losses must equal an in-process run on 2
devices, process 0 alone writes the drafter, and a checkpoint of the 2-process run
resumes in a 1-process run on the same loss curve. A job missing a process fails
with a message instead of hanging.
"""

import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from adaflash_jax.parallel import distributed
from adaflash_jax.training import trainer
from adaflash_jax.training.config import load_config, override

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHER = os.path.join(REPO, "launch", "local.py")
STEPS, EVERY = 4, 2

# `adaflash train` in each process; a spy on trainer.train records the exact losses per process.
CHILD = """
import json, sys
import jax
from adaflash_jax import cli
from adaflash_jax.training import trainer
out, argv = sys.argv[1], sys.argv[2:]
real = trainer.train
def spy(*a, **k):
    r = real(*a, **k)
    with open(f"{out}.{jax.process_index()}.json", "w") as f:
        json.dump({"losses": r.losses, "evals": r.evals, "processes": jax.process_count(),
                   "devices": jax.device_count()}, f)
    return r
trainer.train = spy
sys.exit(cli.main(argv))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_available() -> bool:
    try:
        from jax._src.lib import _jax
    except ImportError:
        return False
    return hasattr(_jax, "make_gloo_tcp_collectives")


needs_gloo = pytest.mark.skipif(not _gloo_available(), reason="this jaxlib has no gloo CPU collectives")


def _overrides(npz, run_dir):
    return ["data.source=arrays", f"data.path={npz}", "mesh.data=2", f"optim.total_steps={STEPS}",
            f"checkpoint.every_steps={EVERY}", "data.batch_size=8", "data.eval_sequences=8",
            f"eval_every={EVERY}", "log_every=1", "progress=false", f"checkpoint.dir={run_dir}"]


def _child_env(**extra):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)
    return env


@pytest.fixture(scope="module")
def npz(tmp_path_factory):
    """Random training rows (the losses need identical data, not meaningful data)."""
    rng = np.random.default_rng(0)
    n, t = 24, 64
    path = tmp_path_factory.mktemp("mp_data") / "rows.npz"
    np.savez(path, tokens=rng.integers(0, 256, (n, t)).astype(np.int32),
             prompt_lens=np.full((n,), 8, np.int32), seq_lens=rng.integers(24, t + 1, n).astype(np.int32))
    return str(path)


def test_detect_reads_the_environment():
    assert distributed.detect({}).mode == "single"
    spec = distributed.detect({"ADAFLASH_COORDINATOR": "10.0.0.1:1234", "ADAFLASH_NUM_PROCESSES": "4",
                               "ADAFLASH_PROCESS_ID": "3"})
    assert (spec.mode, spec.num_processes, spec.process_id, spec.coordinator) == ("explicit", 4, 3,
                                                                                  "10.0.0.1:1234")
    spec = distributed.detect({"SLURM_NTASKS": "16", "SLURM_PROCID": "5", "SLURM_STEP_NODELIST": "gpu[01-02]"})
    assert (spec.mode, spec.num_processes, spec.process_id, spec.coordinator) == ("slurm", 16, 5, None)
    assert distributed.detect({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}).mode == "single"
    assert distributed.detect({"ADAFLASH_DISTRIBUTED": "0", "ADAFLASH_NUM_PROCESSES": "2"}).mode == "single"
    with pytest.raises(ValueError, match="ADAFLASH_COORDINATOR missing"):
        distributed.detect({"ADAFLASH_NUM_PROCESSES": "2", "ADAFLASH_PROCESS_ID": "0"})
    with pytest.raises(ValueError, match=r"must lie in \[0, ADAFLASH_NUM_PROCESSES=2\)"):
        distributed.detect({"ADAFLASH_COORDINATOR": "h:1", "ADAFLASH_NUM_PROCESSES": "2",
                            "ADAFLASH_PROCESS_ID": "2"})


@needs_gloo
def test_two_processes_train_like_one_and_checkpoints_move_between_them(npz, tmp_path):
    # The deadlock case, alongside (it mostly waits): process 0 of 2 started alone.
    lonely = subprocess.Popen(
        [sys.executable, "-m", "adaflash_jax.cli", "train", "tiny", f"checkpoint.dir={tmp_path / 'lonely'}"],
        env=_child_env(ADAFLASH_COORDINATOR=f"127.0.0.1:{_free_port()}", ADAFLASH_NUM_PROCESSES="2",
                       ADAFLASH_PROCESS_ID="0", ADAFLASH_INIT_TIMEOUT="2", JAX_PLATFORMS="cpu"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    try:
        _check_two_processes(npz, tmp_path)
        text, _ = lonely.communicate(timeout=120)
    finally:
        if lonely.poll() is None:
            lonely.kill()
            lonely.wait()
    assert lonely.returncode == 1, text[-3000:]
    assert "waited 2 s for 2 processes" in text and "ADAFLASH_PROCESS_ID" in text, text[-3000:]


def _check_two_processes(npz, tmp_path):
    run = tmp_path / "two"
    out = str(tmp_path / "result")
    job = subprocess.run([sys.executable, LAUNCHER, "-n", "2", "--timeout", "240", "--",
                          sys.executable, "-c", CHILD, out, "train", "tiny", *_overrides(npz, run)],
                         env=_child_env(), capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-2000:]
    assert "[p1] [train]" not in job.stdout  # only process 0 logs
    results = [json.load(open(f"{out}.{i}.json")) for i in range(2)]
    assert results[0]["processes"] == 2 and results[0]["devices"] == 2
    two = {int(s): v for s, v in results[0]["losses"].items()}
    assert two == {int(s): v for s, v in results[1]["losses"].items()}  # one global loss
    assert sorted(two) == list(range(STEPS))

    # One process, the same 2-device mesh (2 of the suite's 8 host devices).
    ref = trainer.train(override(load_config("tiny"), _overrides(npz, tmp_path / "one")))
    for s in range(STEPS):
        assert abs(two[s] - ref.losses[s]) <= 1e-5, (s, two[s], ref.losses[s])
    for got, want in zip(results[0]["evals"], ref.evals):
        assert got["step"] == want["step"]
        assert abs(got["tau_teacher_forced"] - want["tau_teacher_forced"]) <= 1e-5
    got = load_file(str(run / "drafter" / "model.safetensors"))  # written by process 0
    mine = load_file(str(tmp_path / "one" / "drafter" / "model.safetensors"))
    assert sorted(got) == sorted(mine)
    for name in got:
        np.testing.assert_allclose(got[name], mine[name], rtol=0, atol=1e-5, err_msg=name)

    # The 2-process checkpoint of step 2 resumes in this single process.
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(run / "checkpoints", resumed_dir / "checkpoints")
    shutil.rmtree(resumed_dir / "checkpoints" / str(STEPS))
    resumed = trainer.train(override(load_config("tiny"), _overrides(npz, resumed_dir)))
    assert resumed.start_step == EVERY and resumed.finished
    for s in range(EVERY, STEPS):
        assert abs(resumed.losses[s] - two[s]) <= 1e-5, (s, resumed.losses[s], two[s])
