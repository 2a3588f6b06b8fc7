"""Unique temporaries, locked read-modify-write, and the one-job-per-run-directory lock."""

import json
import os
import threading

import pytest

from adaflash_jax import atomic_io
from adaflash_jax.errors import InputError, RunDirBusyError


def test_temporaries_are_unique_and_beside_the_destination(tmp_path):
    dest = str(tmp_path / "out.json")
    a, b = atomic_io.temp_path_beside(dest), atomic_io.temp_path_beside(dest)
    assert a != b and os.path.dirname(a) == str(tmp_path)
    atomic_io.atomic_write_json(dest, {"x": 1})
    assert json.loads(open(dest).read()) == {"x": 1}


def test_file_lock_keeps_every_concurrent_update(tmp_path):
    path = str(tmp_path / "table.json")
    atomic_io.atomic_write_json(path, {})

    def add(worker):
        for i in range(25):
            with atomic_io.file_lock(path):
                table = json.loads(open(path).read())
                table[f"{worker}-{i}"] = i
                atomic_io.atomic_write_json(path, table)

    threads = [threading.Thread(target=add, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(json.loads(open(path).read())) == 100
    assert sorted(os.listdir(tmp_path)) == ["table.json", "table.json.lock"]


def test_run_dir_lock_refuses_a_second_holder_until_released(tmp_path):
    run = str(tmp_path / "run")
    with atomic_io.run_dir_lock(run):
        with pytest.raises(RunDirBusyError, match=f"{run} is in use by another job \\(pid {os.getpid()}\\)"):
            with atomic_io.run_dir_lock(run):
                pass
    with atomic_io.run_dir_lock(run):  # released on exit
        pass
    assert issubclass(RunDirBusyError, InputError)


def test_replace_dir_swaps_in_the_new_version(tmp_path):
    dest = tmp_path / "d"
    dest.mkdir()
    (dest / "old").write_text("old")
    staging = atomic_io.staging_dir_beside(str(dest))
    with open(os.path.join(staging, "new"), "w") as f:
        f.write("new")
    atomic_io.replace_dir(staging, str(dest))
    assert os.listdir(dest) == ["new"] and os.listdir(tmp_path) == ["d"]
