"""The exported serving engine: S decode slots run from an artifact with jax alone.

`ExportedEngine` has the interface the scheduler drives (`serving.scheduler`),
like the in-process `slot_engine.LocalEngine`, but its insert / step / evict
are the functions `adaflash export` serialized (format version 3), so
`Scheduler({"greedy": ExportedEngine(DIR, 16, "greedy")})` serves an artifact
with continuous batching and never imports the model code.

The decode state is held as the flat list of leaves the functions take and
return; the manifest names each leaf and its slot axis. A live-prefix step of
k slots calls the exported step (symbolic in the slot count) on the first k
rows of every leaf and writes them back, inside one jitted function per k that
donates the state: the full buffers are updated in place and only the live
rows are copied, as `slot_engine.step_prefix` does in process.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from adaflash_jax.decoding.batching import slot_rows
from adaflash_jax.serving.runtime import ExportedDecoder, load_exported
from adaflash_jax.serving.scheduler import SlotView


class ExportedEngine:
    """num_slots slots of one sampling mode ("greedy" or "sample") of an exported artifact.

    artifact: a directory from `adaflash export` or a loaded `ExportedDecoder` (engines of
    both modes can share one, and with it the weights). The engine decodes speculatively
    when the artifact has a drafter, else autoregressively. verify_len: tokens verified
    per step under the "fixed" length policy (default: the drafter's block); rho / min_len:
    the "head" policy's rule for every slot (default: the manifest's).
    """

    def __init__(self, artifact, num_slots: int, mode: str = "greedy", *, verify_len: int | None = None,
                 rho: float | None = None, min_len: int | None = None):
        decoder = artifact if isinstance(artifact, ExportedDecoder) else load_exported(os.fspath(artifact))
        manifest = decoder.manifest
        if not decoder.has_engine:
            raise ValueError(f"{decoder.path} (format version {manifest['format_version']}) holds only "
                             "whole-batch decode loops; re-export it with `adaflash export` to serve it "
                             "with continuous batching")
        if mode not in decoder.modes:
            raise ValueError(f"this artifact was exported without {mode!r} decoding "
                             f"(modes: {list(decoder.modes)})")
        if int(num_slots) < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        layout = manifest["engine"]
        impl = str(jax.random.key_impl(jax.random.key(0)))
        if impl != layout["prng_impl"]:
            raise ValueError(f"the artifact's random streams use {layout['prng_impl']!r} keys, this process "
                             f"uses {impl!r}; set jax_default_prng_impl to match")
        self.decoder, self.mode, self.greedy = decoder, mode, mode == "greedy"
        self.num_slots = int(num_slots)
        self.max_prompt_len, self.max_new_tokens = decoder.max_prompt_len, decoder.max_new_tokens
        self.speculative = bool(layout["speculative"])
        self.length_policy = decoder.length_policy if self.speculative else None
        self.verify_len, self._step_inputs = self._settings(verify_len, rho, min_len)
        # the "head" rule every slot steps with: (rho, min_len), or None for other policies
        self.rule = ((float(self._step_inputs[0]), int(self._step_inputs[1]))
                     if self.length_policy == "head" else None)
        self._axes = [leaf["slot_axis"] for leaf in layout["leaves"]]
        index = {leaf["name"]: i for i, leaf in enumerate(layout["leaves"])}
        self._read = [index["num_out"], index["done"], index["out"]]
        functions = manifest["functions"]
        init = decoder.exported("engine_init")
        self._weights = decoder.weights(functions["engine_init"]["weight_groups"])
        self._insert_fn = decoder.exported(f"engine_insert_{mode}")
        self._step_fn = decoder.exported(f"engine_step_{mode}")
        evict = decoder.exported("engine_evict")
        # the state is donated to every call (updated in place, never copied whole)
        self._insert = _stateful(self._insert_fn)
        # chunked prefill (`Scheduler`): artifacts exported before it lack these two functions
        self.chunked_prefill = f"engine_prefill_chunk_{mode}" in functions
        if self.chunked_prefill:
            self._chunk = _stateful(decoder.exported(f"engine_prefill_chunk_{mode}"))
            self._insert_last = _stateful(decoder.exported(f"engine_insert_chunked_{mode}"))
        self._evict = jax.jit(lambda state, slots: evict.call(*state, slots), donate_argnums=0)
        self._steps: dict[int, object] = {}
        eos = np.asarray(manifest["eos_token_ids"], np.int32)
        self.state = list(jax.jit(init.call)(*self._weights, jnp.arange(self.num_slots, dtype=jnp.int32), eos))

    def _settings(self, verify_len, rho, min_len) -> tuple[int, tuple]:
        """(verify_len for SlotParams, the step's extra inputs), checked against the artifact."""
        if self.length_policy == "head":
            if verify_len is not None:
                raise ValueError("verify_len applies to the 'fixed' length policy; this artifact's "
                                 "speculative engine picks lengths with the length head ('head')")
            return 1, self.decoder.head_rule(rho, min_len)
        if rho is not None or min_len is not None:
            raise ValueError("rho / min_len apply to artifacts exported with length_policy 'head'")
        if not self.speculative:
            if verify_len is not None:
                raise ValueError("verify_len needs an artifact with a drafter")
            return 1, ()
        drafter = self.decoder.manifest["drafter"]
        block = drafter["block_size"]
        if drafter.get("verify", "chain") == "tree" and verify_len is not None:
            raise ValueError(f"this artifact verifies a tree of {drafter['tree_budget']} nodes per step; "
                             "verify_len applies to chain verification")
        verify_len = block if verify_len is None else int(verify_len)
        if not 1 <= verify_len <= block:
            raise ValueError(f"verify_len must lie in [1, {block}], got {verify_len}")
        return verify_len, ()

    def insert(self, slots, prompts: list[list[int]], params, starts=None) -> None:
        """Prefills `prompts` into `slots` (distinct; rows with params.max_new == 0 stay free).
        params: a `SlotParams` (rows per prompt), as the scheduler builds them. starts: per slot,
        the prompt tokens already there (`prefill_chunk`); `prompts` are then the last chunks."""
        tokens, lengths = slot_rows(prompts, self.max_prompt_len if starts is None else None)
        rest = (params.max_new, params.temperature, params.top_p, jax.random.key_data(params.seed_key),
                params.stream, params.verify_len)
        slots = jnp.asarray(slots, jnp.int32)
        if starts is None:
            self.state = self._insert(self._weights, self.state, slots, tokens, lengths, *rest)
        else:
            self._check_chunked()
            self.state = self._insert_last(self._weights, self.state, slots, tokens, lengths, *rest,
                                           jnp.asarray(starts, jnp.int32))

    def prefill_chunk(self, slots, chunks: list[list[int]], starts) -> None:
        """Chunked prefill: writes `chunks` (not the prompts' last) at positions starts[i] of
        `slots`; the slots decode nothing until `insert` with starts adds the last chunks."""
        self._check_chunked()
        tokens, lengths = slot_rows(chunks)
        self.state = self._chunk(self._weights, self.state, jnp.asarray(slots, jnp.int32), tokens, lengths,
                                 jnp.asarray(starts, jnp.int32))

    def _check_chunked(self) -> None:
        if not self.chunked_prefill:
            raise ValueError(f"{self.decoder.path} was exported without chunked prefill; re-export it with "
                             "`adaflash export` to prefill long prompts in chunks")

    def step(self, k: int) -> None:
        """One decode step of slots [0, k) (k: a power of two <= num_slots)."""
        k = int(k)
        if k not in self._steps:
            self._steps[k] = jax.jit(self._prefix_step(k), donate_argnums=1)
        self.state = self._steps[k](self._weights, self.state, self._step_inputs)

    def _prefix_step(self, k: int):
        axes, fn, full = self._axes, self._step_fn, k == self.num_slots

        def run(weights, state, extra):
            if full:
                return fn.call(*weights, *state, *extra)
            part = [x if a < 0 else jax.lax.slice_in_dim(x, 0, k, axis=a) for x, a in zip(state, axes)]
            new = fn.call(*weights, *part, *extra)
            return [p if a < 0 else jax.lax.dynamic_update_slice_in_dim(x, p, 0, axis=a)
                    for x, p, a in zip(state, new, axes)]
        return run

    def evict(self, slots) -> None:
        self.state = self._evict(self.state, jnp.asarray(slots, jnp.int32))

    def read(self, k: int) -> SlotView:
        num_out, done, out = jax.device_get([self.state[i][:k] for i in self._read])
        return SlotView(np.asarray(num_out), np.asarray(done), np.asarray(out))


def _stateful(fn):
    """An exported engine function (weights, state leaves, inputs) -> state leaves, jitted with
    the state donated (updated in place, never copied whole)."""
    return jax.jit(lambda weights, state, *rest: fn.call(*weights, *state, *rest), donate_argnums=1)


def build_scheduler(artifact, *, slots: int = 16, modes=None, max_queue: int = 256,
                    admission: str = "continuous", prefill_budget: int | None = None, **engine):
    """A `Scheduler` with one `ExportedEngine` per mode (default: every mode of the artifact),
    sharing one loaded artifact. prefill_budget: prompt tokens per iteration (`Scheduler`'s
    max_prefill_tokens; artifacts exported without chunked prefill take whole prompts)."""
    from adaflash_jax.serving.scheduler import PREFILL_BUDGET, Scheduler

    decoder = artifact if isinstance(artifact, ExportedDecoder) else load_exported(os.fspath(artifact))
    modes = decoder.modes if modes is None else tuple(modes)
    return Scheduler({m: ExportedEngine(decoder, slots, m, **engine) for m in modes}, max_queue=max_queue,
                     admission=admission, max_prefill_tokens=prefill_budget or PREFILL_BUDGET)
