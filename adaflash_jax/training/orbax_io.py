"""Training checkpoints with Orbax: async saves, retention, safe restores.

One step directory holds `params` (pure dict) and `opt_state` (StandardSave),
`rng` (the base key's data), `meta` (config, drafter/target architecture,
parameter shapes, array fingerprints) and `data` (the data-source position)
as JSON. Restores check `meta` first, so an incompatible checkpoint fails
with a list of what differs before any array is read, and verify the
fingerprints after, so bytes that decode but are wrong are caught too.
Nothing is deleted unless the caller passes `overwrite=True`.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding

from adaflash_jax.errors import InputError
from adaflash_jax.training import state as st


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read back as saved (missing/truncated files, wrong bytes)."""


class CheckpointMismatchError(InputError):
    """A readable checkpoint that belongs to a different drafter or target (the user resumes
    the wrong run, or wants --overwrite): bad input, not a bug."""


def abstract_like(tree):
    """ShapeDtypeStructs (with shardings) that tell Orbax the exact tree to rebuild."""
    def one(shape, x):
        sharding = x.sharding if isinstance(getattr(x, "sharding", None), NamedSharding) else None
        return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding)
    return jax.tree.map(one, jax.eval_shape(lambda t: t, tree), tree)


def _key_bytes(key) -> np.ndarray:
    """The base key's data as numpy: the key lives on one device, and a multi-process save
    refuses process-local device arrays, while numpy leaves are written once by process 0."""
    return np.asarray(jax.random.key_data(key))


class CheckpointStore:
    """Step checkpoints of one run under `directory` (an `ocp.CheckpointManager`)."""

    def __init__(self, directory: str, *, max_to_keep: int = 3):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def save(self, state: st.TrainState, meta: dict) -> None:
        """Starts an async save of `state` (returns once arrays are copied off the device)."""
        meta = dict(meta, step=state.step, fingerprint={
            "params": st.fingerprint(nnx.to_pure_dict(state.params)),
            "opt_state": st.fingerprint(state.opt_state)})
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(nnx.to_pure_dict(state.params)),
            opt_state=ocp.args.StandardSave(state.opt_state),
            rng=ocp.args.StandardSave({"key": _key_bytes(state.rng_key)}),
            meta=ocp.args.JsonSave(meta),
            data=ocp.args.JsonSave(st.encode_data_state(state.data_state)))
        self.manager.save(state.step, args=args, force=True)

    def read_meta(self, step: int) -> dict:
        try:
            return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception as e:  # noqa: BLE001 - any read failure means the same thing here
            raise self._corrupt(step, "its metadata", e) from e

    def check_compatible(self, step: int, current_meta: dict) -> list[str]:
        """Raises CheckpointMismatchError on architecture differences; returns the others."""
        blocking, info = st.compare_meta(self.read_meta(step), current_meta)
        if blocking:
            raise CheckpointMismatchError(
                f"checkpoint step {step} in {self.directory} was written for a different model:\n  "
                + "\n  ".join(blocking) + "\nUse another checkpoint.dir, or pass overwrite=True to "
                "discard these checkpoints.")
        return info

    def restore(self, step: int, template: st.TrainState) -> st.TrainState:
        """Reads step `step` into the structure/shardings of `template` and verifies it."""
        args = ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_like(nnx.to_pure_dict(template.params))),
            opt_state=ocp.args.StandardRestore(abstract_like(template.opt_state)),
            rng=ocp.args.StandardRestore({"key": _key_bytes(template.rng_key)}),
            meta=ocp.args.JsonRestore(), data=ocp.args.JsonRestore())
        try:
            out = self.manager.restore(step, args=args)
            params = jax.tree.map(lambda x: x, template.params)
            nnx.replace_by_pure_dict(params, out.params)
            data_state = st.decode_data_state(out.data)
            saved_fp = out.meta["fingerprint"]
        except Exception as e:  # noqa: BLE001
            raise self._corrupt(step, "its arrays", e) from e
        bad = [f"params{k}" for k in st.fingerprint_mismatches(saved_fp["params"],
                                                              st.fingerprint(out.params))]
        bad += [f"opt_state{k}" for k in st.fingerprint_mismatches(saved_fp["opt_state"],
                                                                  st.fingerprint(out.opt_state))]
        if bad:
            raise CheckpointError(f"checkpoint step {step} at {self.step_dir(step)} is corrupt: "
                                  f"restored values differ from those saved in {', '.join(bad[:5])}"
                                  + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else ""))
        key = jax.random.wrap_key_data(out.rng["key"], impl=jax.random.key_impl(template.rng_key))
        return st.TrainState(int(out.meta["step"]), params, out.opt_state, key, data_state)

    def _corrupt(self, step: int, what: str, e: Exception) -> CheckpointError:
        earlier = [s for s in self.all_steps() if s < step]
        hint = (f"; delete {self.step_dir(step)} to resume from step {earlier[-1]}" if earlier
                else "; delete it (or pass overwrite=True) to start over")
        return CheckpointError(f"checkpoint step {step} at {self.step_dir(step)} is corrupt or "
                               f"incomplete: cannot read {what} ({type(e).__name__}: "
                               f"{str(e).splitlines()[0][:300] if str(e) else ''}){hint}")

    def delete_all(self) -> None:
        """Removes every step of this run (only on an explicit overwrite)."""
        self.manager.wait_until_finished()
        for step in self.all_steps():
            self.manager.delete(step)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
