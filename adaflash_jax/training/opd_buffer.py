"""The OPD rollout buffer: append-only shards of target trajectories with cached target states.

Layout of `<run_dir>/buffer/`: `manifest.json` (what the buffer is built from;
a mismatch is an error, never a silent mix), and per shard k the records
`rollouts-k.array_record` (the format of `training.rollouts`), plus
`features-k.npy` [n, T, k·D] (target features at the drafter's layers) and
`teacher-k.npy` [n, T, D] (target final-norm hidden states: the OPD teacher).
The target states are computed once, when a shard enters the buffer, and are
memory-mapped afterwards: a training step then runs only the drafter and the LM
head. Every file appears complete or not at all (temporary name, then rename),
and shards never change, so the rows a step may draw are fixed by how many
shards were in use at that step, which is what makes a resumed run exact.
"""

from __future__ import annotations

import json
import os

import numpy as np

from adaflash_jax.atomic_io import temp_path_beside
from adaflash_jax.training import rollouts
from adaflash_jax.training.features import compute_features
from adaflash_jax.training.opd_step import OPDBatch


class RolloutBuffer:
    """Shards 0..k-1 of a buffer directory, activated in order, sampled per step."""

    def __init__(self, directory: str, target, layer_ids, seq_len: int, manifest: dict):
        self.directory, self.target, self.seq_len = directory, target, int(seq_len)
        self.layer_ids = tuple(int(i) for i in layer_ids)
        rollouts._check_manifest(directory, manifest)
        self.shards: list[dict] = []

    @property
    def num_rows(self) -> int:
        return sum(len(s["tokens"]) for s in self.shards)

    def has_records(self, shard: int) -> bool:
        return os.path.exists(rollouts._shard_path(self.directory, shard))

    def import_seed(self, shard: int, seed_dir: str, max_rows: int = 0) -> int:
        """Copies the first `max_rows` (0 = all) records of a rollout store in as shard `shard`."""
        manifest = os.path.join(seed_dir, "manifest.json")
        if not rollouts.completed_shards(seed_dir):
            raise ValueError(f"opd.seed_rollouts={seed_dir!r} holds no completed rollout shards")
        if os.path.exists(manifest):
            with open(manifest) as f:
                made_by = json.load(f).get("target")
            if made_by not in (None, self.target.name):
                raise ValueError(f"opd.seed_rollouts={seed_dir!r} holds rollouts of target {made_by!r}, "
                                 f"not of this run's target {self.target.name!r}")
        records = []
        for rec in rollouts.read_rollouts(seed_dir):
            records.append(rec)
            if max_rows and len(records) == max_rows:
                break
        rollouts._write_shard(rollouts._shard_path(self.directory, shard), records)
        return len(records)

    def rollout(self, shard: int, prompt_ids, domains, *, first_index: int, drafter, max_new_tokens: int,
                batch_size: int, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> dict:
        """Decodes the prompts with the speculative engine into shard `shard`, greedily at
        `temperature` 0, else one sampled response each (`top_p`, `seed`); returns its stats."""
        sampling = {} if temperature == 0 else dict(samples=1, greedy=False, temperature=temperature,
                                                    top_p=top_p, seed=seed)
        return rollouts.write_rollout_shard(self.target, prompt_ids, domains, self.directory, shard,
                                            first_index=first_index, drafter=drafter,
                                            max_new_tokens=max_new_tokens, batch_size=batch_size, **sampling)

    def prompts(self) -> set[tuple[int, ...]]:
        """Prompt ids of the active shards' records (to keep later rounds off them)."""
        return {tuple(rec["prompt_ids"]) for k in range(len(self.shards))
                for rec in rollouts.read_shard(self.directory, k)}

    def activate(self, shard: int, *, progress: bool = True) -> int:
        """Makes shard `shard` (the next one) drawable, computing its target states if missing.
        Returns its number of usable rows."""
        if shard != len(self.shards):
            raise ValueError(f"buffer shards activate in order: expected {len(self.shards)}, got {shard}")
        arrays = rollouts.records_to_arrays(rollouts.read_shard(self.directory, shard), self.seq_len)
        arrays["features"], arrays["teacher"] = self._target_states(shard, arrays, progress)
        self.shards.append(arrays)
        return len(arrays["tokens"])

    def _target_states(self, shard: int, arrays: dict, progress: bool):
        n, t = arrays["tokens"].shape
        d = self.target.cfg.hidden_size
        shapes = {"features": (n, t, len(self.layer_ids) * d), "teacher": (n, t, d)}
        if n == 0:
            return tuple(np.zeros(s, np.float32) for s in shapes.values())
        paths = {k: os.path.join(self.directory, f"{k}-{shard:05d}.npy") for k in shapes}
        if not all(os.path.exists(p) for p in paths.values()):
            names = {k: temp_path_beside(paths[k], ".npy") for k in shapes}  # unique per writer
            tmp = {k: np.lib.format.open_memmap(names[k], mode="w+", dtype=np.float32,
                                                shape=shapes[k]) for k in shapes}
            compute_features(self.target, arrays["tokens"], self.layer_ids, tmp["features"],
                             hidden_out=tmp["teacher"], progress=progress)
            for k in shapes:  # the teacher file last: its presence marks a complete pair
                tmp[k].flush()
                del tmp[k]
                os.replace(names[k], paths[k])
        out = []
        for k, path in paths.items():
            arr = np.load(path, mmap_mode="r")
            if arr.shape != shapes[k]:
                raise ValueError(f"{path} has shape {arr.shape}, expected {shapes[k]} (corrupt? remove it)")
            out.append(arr)
        return tuple(out)

    def batch(self, step: int, batch_size: int, seed: int) -> OPDBatch:
        """The host batch of `step`: rows drawn uniformly from the active shards, seeded by
        (seed, step) only, so a resumed run draws the same rows."""
        sizes = [len(s["tokens"]) for s in self.shards]
        n = sum(sizes)
        if n == 0:
            raise ValueError(f"the rollout buffer {self.directory} holds no usable rows yet")
        rows = np.sort(np.random.default_rng([seed, 2, step]).choice(n, batch_size, replace=n < batch_size))
        bounds = np.cumsum([0] + sizes)
        parts = {k: [] for k in OPDBatch._fields}
        for k, s in enumerate(self.shards):
            local = rows[(rows >= bounds[k]) & (rows < bounds[k + 1])] - bounds[k]
            if len(local):
                for name in OPDBatch._fields:
                    parts[name].append(np.asarray(s[name][local]))
        return OPDBatch(*(np.concatenate(parts[name]) for name in OPDBatch._fields))
