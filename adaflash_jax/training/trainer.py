"""The offline DFlash training loop: data -> jitted step -> metrics/checkpoints -> drafter.

`train(config)` builds the mesh, the frozen target and a random drafter,
resumes from the run's latest checkpoint when one exists, and steps until
`optim.total_steps`. Step `s` uses the key `fold_in(key(seed), s)` and the
data source's restored position, so an interrupted run continues the loss
curve of an uninterrupted one exactly. SIGTERM saves a checkpoint and
returns; a non-finite loss raises before anything is saved, so the last
good checkpoint survives. The result is written in the HF drafter layout.

Run directory layout (`checkpoint.dir`): checkpoints/<step>/, drafter/, tensorboard/.
CLI: `adaflash train CONFIG [key=value ...]` (adaflash_jax/cli_train.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import signal
import sys
import threading
from typing import Iterable

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

from adaflash_jax.training.orbax_io import CheckpointError, CheckpointMismatchError, CheckpointStore
from adaflash_jax.drafter_api import Drafter, save_drafter
from adaflash_jax.errors import InputError
from adaflash_jax.parallel.distributed import barrier, is_main_process, to_host
from adaflash_jax.parallel.kernel_sharding import kernel_mesh
from adaflash_jax.parallel.mesh import make_mesh
from adaflash_jax.models.drafter import DFlashDrafter, drafter_config_for
from adaflash_jax.models.target import TargetLM
from adaflash_jax.parallel.rules import logical_to_spec, shard_state
from adaflash_jax.target_api import Target, load_target
from adaflash_jax.training.config import TrainConfig
from adaflash_jax.training.data import build_data, place_batch
from adaflash_jax.training.run_lock import locks_run_dir
from adaflash_jax.training.losses import combine_counts
from adaflash_jax.training.drafter_init import prepare_drafter
from adaflash_jax.training.run_clock import RunClock
from adaflash_jax.training.state import TrainState
from adaflash_jax.training.step import Batch, eval_step, make_optimizer, train_step

EVAL_KEY_FOLD = 2**31 - 1  # eval anchors: one fixed key, so τ is comparable across evaluations


@dataclasses.dataclass
class TrainResult:
    step: int  # optimizer steps done in total
    start_step: int  # where this call began (0, or the resumed checkpoint's step)
    losses: dict[int, float]  # step index -> loss, for the steps this call ran
    evals: list[dict]  # {"step", "tau_teacher_forced", "accuracy"} on the held-out batch
    drafter: Drafter
    run_dir: str
    drafter_dir: str | None  # set once training reached total_steps
    preempted: bool = False  # stopped by SIGTERM after saving
    time_limited: bool = False  # stopped by max_minutes after saving

    @property
    def finished(self) -> bool:
        return self.drafter_dir is not None


def _log(msg: str) -> None:
    if is_main_process():
        tqdm.write(f"[train] {msg}", file=sys.stdout)


# --- setup ----------------------------------------------------------------------------------------

def build_mesh(cfg: TrainConfig):
    n = cfg.mesh.num_devices
    devices = jax.devices()
    if n > len(devices):
        raise ValueError(f"mesh {cfg.mesh.data}x{cfg.mesh.fsdp}x{cfg.mesh.tensor} needs {n} devices, "
                         f"only {len(devices)} are available")
    if n < len(devices):
        _log(f"mesh uses {n} of {len(devices)} devices")
    return make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=devices[:n])


def _jit_init(make, mesh):
    """(graphdef, state) of module `make()`, initialised in one compiled program directly
    into its sharded layout (eager init compiles once per parameter shape, and would
    materialise every weight on one device first)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(make))

    def sharding(var):  # rules.state_shardings, for abstract (ShapeDtypeStruct) variables
        shape = var.get_value().shape
        names = var.get_metadata().get("logical_axes") or (None,) * len(shape)
        return NamedSharding(mesh, logical_to_spec(names, shape, mesh))

    shardings = jax.tree.map(sharding, abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return graphdef, jax.jit(lambda: nnx.split(make())[1], out_shardings=shardings)()


def build_target(cfg: TrainConfig, mesh) -> Target:
    spec = cfg.target
    if spec.tiny is None:
        return load_target(spec.name, dtype=spec.dtype, param_dtype=spec.param_dtype, mesh=mesh)
    graphdef, state = _jit_init(lambda: TargetLM(spec.tiny, rngs=nnx.Rngs(spec.seed)), mesh)
    return Target(spec.tiny, graphdef, state, None, name=f"random-{spec.seed}", mesh=mesh)


def build_drafter(cfg: TrainConfig, target: Target) -> Drafter:
    """A random drafter for `target` (DFlash layer rule unless the config names layers)."""
    d = cfg.drafter
    dcfg = drafter_config_for(target.cfg, num_layers=d.num_layers, block_size=d.block_size,
                              mask_token_id=target.default_mask_token_id if d.mask_token_id is None
                              else d.mask_token_id, target_layer_ids=d.target_layer_ids,
                              param_dtype=d.param_dtype, draft_vocab_size=d.draft_vocab_size)
    dcfg.check_target(target.cfg)
    graphdef, state = _jit_init(lambda: DFlashDrafter(dcfg, rngs=nnx.Rngs(cfg.seed)), target.mesh)
    return Drafter(dcfg, graphdef, state, f"random-{cfg.seed}")


def _on_mesh(target: Target, mesh) -> Target:
    if target.mesh is mesh:
        return target
    return dataclasses.replace(target, state=shard_state(target.state, mesh), mesh=mesh)


@functools.lru_cache(maxsize=8)
def _optimizer(lr: float, total_steps: int, warmup: float, clip: float, weight_decay: float):
    """One optimizer object per setting: `tx` is a static jit argument, so a stable identity
    lets later runs in the same process reuse the compiled step."""
    return make_optimizer(lr, total_steps, warmup_frac=warmup, clip=clip, weight_decay=weight_decay)


def _replicate_strays(tree, mesh):
    """Leaves not already laid out on `mesh` (optimizer counters) become replicated on it."""
    rep = NamedSharding(mesh, PartitionSpec())
    keep = lambda x: isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh  # noqa: E731
    return jax.tree.map(lambda x: x if keep(x) else jax.device_put(x, rep), tree)


def run_meta(cfg: TrainConfig, target: Target, drafter: Drafter, params) -> dict:
    """What a checkpoint records about the run that wrote it (JSON-normalised)."""
    shapes = {jax.tree_util.keystr(p): list(x.shape)
              for p, x in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params))[0]}
    return json.loads(json.dumps({"train_config": cfg.to_dict(),
                                  "drafter_config": dataclasses.asdict(drafter.cfg),
                                  "target_config": dataclasses.asdict(target.cfg),
                                  "param_shapes": shapes}))


def _resume(store: CheckpointStore, meta: dict, fresh: TrainState, resume: bool,
            overwrite: bool) -> TrainState:
    """The state to start from: the latest checkpoint, or `fresh` (never discarding data silently)."""
    latest = store.latest_step()
    if latest is None:
        return fresh
    if not resume:
        if not overwrite:
            raise FileExistsError(f"{store.directory} already holds checkpoints (steps "
                                  f"{store.all_steps()}); resume, or pass overwrite=True to discard them")
        store.delete_all()
        return fresh
    try:
        for line in store.check_compatible(latest, meta):
            _log(f"config differs from the checkpoint's: {line}")
        state = store.restore(latest, fresh)
    except (CheckpointMismatchError, CheckpointError):
        if not overwrite:
            raise
        _log(f"discarding unusable checkpoints in {store.directory} (overwrite=True)")
        store.delete_all()
        return fresh
    _log(f"resumed from step {state.step} ({store.step_dir(state.step)})")
    return state


# --- the loop ---------------------------------------------------------------------------------------

class _StopFlag:
    """Records SIGTERM so the loop can save at a step boundary instead of dying mid-step."""

    def __init__(self):
        self.signum, self._prev = None, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._prev = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame):
        self.signum = signum

    def requested(self) -> bool:
        """Whether any process got SIGTERM: all processes must stop at the same step, or the
        ones still stepping would wait forever in a collective for the ones saving."""
        if jax.process_count() == 1:
            return self.signum is not None
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(self.signum is not None))
        return bool(np.any(flags))

    def __exit__(self, *exc):
        if self._prev is not None:
            signal.signal(signal.SIGTERM, self._prev)


@locks_run_dir
def train(config: TrainConfig, *, data: Iterable[Batch] | None = None, eval_batch: Batch | None = None,
          target: Target | None = None, resume: bool = True, overwrite: bool = False,
          stop_at: int | None = None) -> TrainResult:
    """Trains a drafter per `config`; see the module docstring for the guarantees.

    data: an iterable of host `Batch`es (with get_state/set_state to be resumable);
    default: the configured data set. eval_batch: held-out batch for τ (default:
    the configured held-out rows). resume: continue from the latest checkpoint.
    overwrite: discard checkpoints that are incompatible (or when not resuming)
    instead of refusing. stop_at: save and return after this step (a planned stop).
    """
    cfg = config
    if not cfg.checkpoint.dir:
        raise InputError("set checkpoint.dir: the run directory for checkpoints and the drafter")
    run_dir = os.path.abspath(cfg.checkpoint.dir)
    mesh = build_mesh(cfg)
    target = _on_mesh(target, mesh) if target is not None else build_target(cfg, mesh)
    drafter = build_drafter(cfg, target)
    if data is None:
        data, default_eval = build_data(cfg, target, drafter.cfg.target_layer_ids)
        eval_batch = eval_batch if eval_batch is not None else default_eval
    source = data if hasattr(data, "__next__") else iter(data)
    drafter, init_info = prepare_drafter(cfg, target, drafter, source, run_dir, eval_batch)
    for key, value in init_info.items():
        _log(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")
    graphdef, params, rest = nnx.split(drafter.module, nnx.Param, ...)
    o = cfg.optim
    tx = _optimizer(o.lr, o.total_steps, o.warmup, o.clip, o.weight_decay)
    state = TrainState(0, params, _replicate_strays(tx.init(params), mesh), jax.random.key(cfg.seed))
    resumable = callable(getattr(source, "get_state", None)) and callable(getattr(source, "set_state", None))
    meta = run_meta(cfg, target, drafter, params)
    store = CheckpointStore(os.path.join(run_dir, "checkpoints"), max_to_keep=cfg.checkpoint.max_to_keep)
    fresh = state
    try:
        state = _resume(store, meta, fresh, resume, overwrite)
        saved_step = state.step if state is not fresh else None
        if saved_step is not None:
            if not resumable:
                raise ValueError("cannot resume: the data source has no get_state/set_state, so "
                                 "its position at the checkpoint cannot be restored")
            source.set_state(state.data_state)
    except BaseException:
        store.close()
        raise
    end = min(o.total_steps, stop_at if stop_at is not None else o.total_steps)
    seq_len, vocab, gamma = cfg.data.seq_len, target.cfg.vocab_size, cfg.gamma
    eval_dev = eval_chunks(eval_batch, mesh, seq_len, vocab, cfg.data.batch_size)
    eval_key = jax.random.fold_in(state.rng_key, EVAL_KEY_FOLD)
    writer = None
    if is_main_process():
        from tensorboardX import SummaryWriter

        writer = SummaryWriter(cfg.tensorboard_dir or os.path.join(run_dir, "tensorboard"))
    result = TrainResult(state.step, state.step, {}, [], drafter, run_dir, None)
    clock = RunClock(run_dir, state.step if saved_step is not None else None, cfg.max_minutes)
    postfix: dict[str, str] = {}

    def evaluate():
        m = combine_counts([jax.device_get(eval_step(
            target.graphdef, graphdef, target.state, state.params, rest, chunk, eval_key,
            num_blocks=cfg.data.num_blocks)["counts"]) for chunk in eval_dev])
        row = {"step": state.step, "tau_teacher_forced": float(m["tau_teacher_forced"]),
               "accuracy": float(m["accuracy"]), "accuracy_first": float(m["accuracy_per_position"][1]),
               "train_seconds": round(clock.seconds(), 1)}
        result.evals.append(row)
        if is_main_process():
            clock.log_eval(row)
        postfix["eval_tau"] = f"{row['tau_teacher_forced']:.3f}"
        if writer:
            writer.add_scalar("eval/tau_teacher_forced", row["tau_teacher_forced"], state.step)
            writer.add_scalar("eval/accuracy", row["accuracy"], state.step)
            writer.add_scalar("eval/accuracy_first_position", row["accuracy_first"], state.step)
            # τ against compute: the step axis here counts training seconds (all resumes).
            writer.add_scalar("eval_vs_train_seconds/tau_teacher_forced", row["tau_teacher_forced"],
                              int(row["train_seconds"]))
        if not cfg.progress:
            _log(f"eval step {state.step}: tau {row['tau_teacher_forced']:.3f} acc {row['accuracy']:.3f}")

    def save():
        nonlocal saved_step
        if saved_step != state.step:
            state.data_state = source.get_state() if resumable else None
            store.save(state, meta)
            saved_step = state.step
            if is_main_process():
                clock.record(state.step)

    bar = tqdm(total=o.total_steps, initial=state.step, disable=not (cfg.progress and is_main_process()),
               desc="train")
    try:
        with _StopFlag() as stop:
            if eval_dev is not None and state.step == 0:
                evaluate()
            while state.step < end:
                batch = place_batch(next(source), mesh, seq_len, vocab, global_rows=cfg.data.batch_size)
                key = jax.random.fold_in(state.rng_key, state.step)
                with kernel_mesh(mesh, cfg.attn_impl):
                    state.params, state.opt_state, m = train_step(
                        target.graphdef, graphdef, tx, target.state, state.params, rest, state.opt_state,
                        batch, key, num_blocks=cfg.data.num_blocks, gamma=gamma, attn_impl=cfg.attn_impl)
                loss, gnorm = (float(x) for x in jax.device_get((m["loss"], m["grad_norm"])))
                if not (math.isfinite(loss) and math.isfinite(gnorm)):
                    last = f"step {saved_step} in {store.directory}" if saved_step is not None else "none"
                    raise FloatingPointError(
                        f"non-finite training loss at step {state.step} (loss={loss}, grad_norm={gnorm}); "
                        f"stopped without saving this state. Last good checkpoint: {last}")
                result.losses[state.step] = loss
                state.step += 1
                bar.update(1)
                if writer:
                    writer.add_scalar("train/loss", loss, state.step)
                if state.step % cfg.log_every == 0 or state.step == end:
                    _log_metrics(jax.device_get(m), state.step, writer, postfix, cfg.progress)
                    bar.set_postfix(postfix)
                if eval_dev is not None and (state.step % cfg.eval_every == 0 or state.step == o.total_steps):
                    evaluate()
                    bar.set_postfix(postfix)
                if stop.requested():
                    save()
                    result.preempted = True
                    _log(f"SIGTERM: saved step {state.step} to {store.step_dir(state.step)}; exiting")
                    break
                if clock.out_of_time() and state.step < end:
                    save()
                    result.time_limited = True
                    _log(f"max_minutes={cfg.max_minutes} reached: saved step {state.step}; resume to continue")
                    break
                if state.step % cfg.checkpoint.every_steps == 0 or state.step == end:
                    save()
        store.wait()
        result.drafter = final_drafter(drafter.cfg, graphdef, state.params, rest,
                                       os.path.basename(run_dir)).for_target(target)
        if state.step >= o.total_steps:
            result.drafter_dir = os.path.join(run_dir, "drafter")
            if is_main_process():
                save_drafter(result.drafter, result.drafter_dir)
            barrier("adaflash_drafter_saved")
            _log(f"done: {state.step} steps; drafter saved to {result.drafter_dir}")
    finally:
        store.close()
        bar.close()
        if writer:
            writer.close()
    result.step = state.step
    return result


def eval_chunks(batch: Batch | None, mesh, seq_len: int, vocab: int, rows: int) -> list[Batch] | None:
    """The held-out batch as device batches of at most max(`rows`, 16) rows (an evaluation set
    of hundreds of rows does not fit one step's logits); their metrics combine exactly."""
    if batch is None:
        return None
    n, size = len(batch.tokens), max(rows, 16)
    cut = lambda a, lo: None if a is None else a[lo:lo + size]  # noqa: E731
    return [place_batch(Batch(*(cut(a, lo) for a in batch)), mesh, seq_len, vocab)
            for lo in range(0, n, size)]


def final_drafter(dcfg, graphdef, params, rest, name: str) -> Drafter:
    """The trained drafter; with several processes its weights are gathered into host
    memory on every process (each holds only some shards), so process 0 can write them."""
    if jax.process_count() > 1:
        params, rest = to_host(params), to_host(rest)
    return Drafter(dcfg, *nnx.split(nnx.merge(graphdef, params, rest)), name=name)


def _log_metrics(m: dict, step: int, writer, postfix: dict, progress: bool) -> None:
    postfix.update(loss=f"{float(m['loss']):.4f}", tau=f"{float(m['tau_teacher_forced']):.3f}",
                   gnorm=f"{float(m['grad_norm']):.3f}")
    if writer:
        for name in ("grad_norm", "accuracy", "tau_teacher_forced"):
            writer.add_scalar(f"train/{name}", float(m[name]), step)
        for k, acc in enumerate(np.asarray(m["accuracy_per_position"])[1:], start=1):
            writer.add_scalar(f"train_accuracy_per_position/{k:02d}", float(acc), step)
    if not progress:
        _log(f"step {step}: " + " ".join(f"{k} {v}" for k, v in postfix.items()))
