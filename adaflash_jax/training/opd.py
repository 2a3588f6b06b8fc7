"""AdaFlash on-policy distillation (OPD) with length-head training, in one process.

`train_opd(config)` alternates two phases until `optim.total_steps`:

- rollout: every `opd.refresh_every` steps the current drafter weights go into the
  speculative engine (`generate(..., drafter=current)`, greedy or at the served sampling
  settings: `opd.rollout_temperatures`, cycled per round, and `opd.rollout_top_p`, with a
  seed fixed by the round), which decodes the next `opd.prompts_per_round` training
  prompts (seeded, domain-balanced train split: `rollout_job.interleaved_prompts`) into
  a new buffer shard (`opd_buffer`), whose target features and teacher hidden states
  are computed once, on entry.
  The rollouts' τ (mean accepted length) is logged: it is the drafter's live score.
- train: `refresh_every` steps on rows drawn uniformly from the buffer: OPD loss
  (α·CE + (1−α)·reverse KL/N, optionally clamped per position; DFlash position weights;
  `opd_loss`) for the drafter, MSE
  towards teacher-forced greedy acceptance for the length head, each with its own
  AdamW (`opd_step`). Stage 1 (`opd.head_stage1_steps`) trains the head only, on a
  frozen drafter; stage 2 trains both.

The engine is lossless: at T = 0 a rollout is the target's own greedy trajectory
whatever drafter decodes it, and at T > 0 a sample of the target's own
distribution. So rollouts written earlier (`adaflash rollout`, any drafter or
none) are valid on-policy data, and `opd.seed_rollouts` copies such a store into
the buffer first. (The drafter changes how fast rollouts come, and the τ they
report, not what they are distributed as.)

Resumable like `trainer.train`: one orbax checkpoint holds the drafter and head
parameters, both optimizer states, the base key and the round counter (which fixes
the prompt cursor and the active buffer shards); the buffer is append-only on
disk and step s draws rows seeded by (seed, s), so an interrupted run continues
the uninterrupted run's losses exactly. SIGTERM saves at a step boundary.

On a pod the two phases become separate jobs sharing a buffer directory: rollout
workers loop `adaflash rollout CONFIG --drafter <latest export> --out <buffer>/...`
over their slice of the prompts (greedy target trajectories, tokens only), and the
trainer activates shards as they land (computing their target states itself),
trains, and exports `save_drafter` every `refresh_every` steps for the workers to
pick up. Staleness only changes which rows exist when, never their content.

Run directory: checkpoints/, buffer/, drafter/ (HF layout, with the head), tensorboard/.
CLI: `adaflash opd CONFIG [key=value ...]` (adaflash_jax/cli_train.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import shutil

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from adaflash_jax.training.orbax_io import CheckpointStore
from adaflash_jax.drafter_api import Drafter, load_drafter, save_drafter
from adaflash_jax.errors import InputError
from adaflash_jax.models.length_head import LengthHead
from adaflash_jax.parallel import distributed
from adaflash_jax.parallel.kernel_sharding import kernel_mesh
from adaflash_jax.training import trainer
from adaflash_jax.training.config import TrainConfig
from adaflash_jax.training.data import place_rows
from adaflash_jax.training.opd_buffer import RolloutBuffer
from adaflash_jax.training.run_lock import locks_run_dir
from adaflash_jax.training.opd_step import OPDBatch, OPDHyper, make_head_optimizer, opd_train_step
from adaflash_jax.training.state import TrainState

LOGGED = ("loss", "ce", "reverse_kl", "kl_term", "teacher_argmax_accuracy", "grad_norm", "head_mse",
          "head_corr", "head_score_mean", "tau_teacher_forced")


@dataclasses.dataclass
class OPDResult:
    step: int
    start_step: int
    losses: dict[int, float]  # step -> OPD loss of the drafter (evaluated, not trained, in stage 1)
    head_losses: dict[int, float]  # step -> length-head MSE
    rollouts: list[dict]  # per round run by this call: {round, step, shard, temperature, rows, tau}
    buffer_rows: int
    drafter: Drafter  # with its length head
    run_dir: str
    drafter_dir: str | None = None  # set once training reached total_steps
    preempted: bool = False

    @property
    def finished(self) -> bool:
        return self.drafter_dir is not None


def _log(msg: str) -> None:
    if jax.process_index() == 0:
        tqdm.write(f"[opd] {msg}")


@functools.lru_cache(maxsize=8)
def _head_optimizer(stage1_lr, lr, stage1_steps, clip, weight_decay):
    return make_head_optimizer(stage1_lr, lr, stage1_steps, clip, weight_decay)  # stable jit identity


def prompt_pool(cfg: TrainConfig, target, exclude=frozenset()) -> tuple[list, list[str]]:
    """The rollout rounds' prompts in order: built-in train prompts (random ones for a target
    without a tokenizer), minus any in `exclude` (the seed store's). The built-in ones come
    from `interleaved_prompts`, which already skips the fixed evaluation set."""
    o = cfg.opd
    if target.tokenizer is None:
        rng = np.random.default_rng([o.prompt_seed])
        ids = rng.integers(0, target.cfg.vocab_size, (o.per_domain, cfg.data.prompt_len)).tolist()
        domains = ["random"] * len(ids)
    else:
        from adaflash_jax.data.prompts import DEFAULT_PROMPT_DIR
        from adaflash_jax.training.rollout_job import encoded_train_prompts

        ids, domains = encoded_train_prompts(target, o.data_dir or DEFAULT_PROMPT_DIR,
                                             per_domain=o.per_domain, seed=o.prompt_seed,
                                             max_prompt_tokens=o.max_prompt_tokens)
    keep = [i for i, p in enumerate(ids) if tuple(p) not in exclude]
    return [ids[i] for i in keep], [domains[i] for i in keep]


def _buffer_manifest(cfg: TrainConfig, target, layer_ids) -> dict:
    o = cfg.opd
    return {"target": target.name, "vocab_size": target.cfg.vocab_size, "seq_len": cfg.data.seq_len,
            "layer_ids": list(layer_ids), "seed_rollouts": os.path.abspath(o.seed_rollouts) if o.seed_rollouts
            else "", "seed_max_rows": o.seed_max_rows, "prompt_seed": o.prompt_seed,
            "per_domain": o.per_domain, "prompts_per_round": o.prompts_per_round,
            "max_new_tokens": o.max_new_tokens, "max_prompt_tokens": o.max_prompt_tokens,
            "rollout_temperatures": list(o.rollout_temperatures), "rollout_top_p": o.rollout_top_p}


def round_sampling(o, r: int) -> dict:
    """Round r's decoding settings: temperature (0 = greedy), top_p and a seed fixed by
    (prompt_seed, r), so a round redone after an interruption decodes with the same settings."""
    temperature = float(o.rollout_temperatures[r % len(o.rollout_temperatures)])
    seed = int(np.random.SeedSequence([o.prompt_seed, r]).generate_state(1)[0] >> 2)
    return {"temperature": temperature, "top_p": o.rollout_top_p, "seed": seed}


@locks_run_dir
def train_opd(config: TrainConfig, *, target=None, resume: bool = True, overwrite: bool = False,
              stop_at: int | None = None) -> OPDResult:
    """Runs OPD per `config` (see the module docstring); `resume` / `overwrite` / `stop_at` as
    in `trainer.train`. `overwrite` also discards the run's rollout buffer."""
    cfg, o = config, config.opd
    total = cfg.optim.total_steps
    if not cfg.checkpoint.dir:
        raise InputError("set checkpoint.dir: the run directory for checkpoints, buffer and drafter")
    if o.head_stage1_steps > total:
        raise InputError(f"opd.head_stage1_steps ({o.head_stage1_steps}) must be at most optim.total_steps "
                         f"({total}); equal makes a head-only run")
    if o.seed_rollouts and not os.path.isdir(o.seed_rollouts):
        raise InputError(f"opd.seed_rollouts={o.seed_rollouts!r} is not a directory")
    run_dir = os.path.abspath(cfg.checkpoint.dir)
    mesh = trainer.build_mesh(cfg)
    target = trainer._on_mesh(target, mesh) if target is not None else trainer.build_target(cfg, mesh)
    drafter = (load_drafter(o.init_drafter, target=target) if o.init_drafter
               else trainer.build_drafter(cfg, target))
    head = drafter.length_head
    width = drafter.cfg.block_size - 1 if o.head_confidence else 0
    if head is None or head.confidence_width != width:
        if head is not None:
            _log(f"opd.head_confidence={o.head_confidence}: the starting drafter's head differs; "
                 "a fresh head")
        head = LengthHead(drafter.cfg.hidden_size, o.head_bottleneck, rngs=nnx.Rngs(cfg.seed),
                          confidence_width=width)
    graphdef, params, rest = nnx.split(drafter.module, nnx.Param, ...)
    head_def, head_params = nnx.split(head, nnx.Param)
    head_params = trainer._replicate_strays(head_params, mesh)
    tx = trainer._optimizer(cfg.optim.lr, max(total - o.head_stage1_steps, 1), cfg.optim.warmup,
                            cfg.optim.clip, cfg.optim.weight_decay)
    head_tx = _head_optimizer(o.head_stage1_lr, o.head_lr, o.head_stage1_steps, cfg.optim.clip,
                              cfg.optim.weight_decay)
    both = nnx.State({"drafter": params, "head": head_params})
    opt = tuple(trainer._replicate_strays(t.init(p), mesh) for t, p in ((tx, params), (head_tx, head_params)))
    fresh = TrainState(0, both, opt, jax.random.key(cfg.seed), {"rounds": 0})
    meta = trainer.run_meta(cfg, target, drafter, both)
    store = CheckpointStore(os.path.join(run_dir, "checkpoints"), max_to_keep=cfg.checkpoint.max_to_keep)
    try:
        state = trainer._resume(store, meta, fresh, resume, overwrite)
        buffer_dir = os.path.join(run_dir, "buffer")
        if state is fresh and overwrite and os.path.isdir(buffer_dir):
            shutil.rmtree(buffer_dir)
        buffer = RolloutBuffer(buffer_dir, target, drafter.cfg.target_layer_ids, cfg.data.seq_len,
                               _buffer_manifest(cfg, target, drafter.cfg.target_layer_ids))
    except BaseException:
        store.close()
        raise
    seeded = int(bool(o.seed_rollouts))
    if seeded:
        if not buffer.has_records(0):
            n = buffer.import_seed(0, o.seed_rollouts, o.seed_max_rows)
            _log(f"seeded the buffer with {n} records of {o.seed_rollouts}")
        buffer.activate(0, progress=cfg.progress)
    prompts, domains = prompt_pool(cfg, target, buffer.prompts() if seeded else frozenset())
    rounds = int(state.data_state["rounds"])
    for r in range(rounds):
        buffer.activate(seeded + r, progress=cfg.progress)
    params, head_params = state.params["drafter"], state.params["head"]
    (opt_state, head_opt), step = state.opt_state, state.step
    hp = OPDHyper(cfg.data.num_blocks, cfg.gamma, o.alpha, o.temperature, o.kl_clip, o.clip_mode, cfg.attn_impl)
    end = min(total, stop_at if stop_at is not None else total)
    writer = None
    if jax.process_index() == 0:
        from tensorboardX import SummaryWriter

        writer = SummaryWriter(cfg.tensorboard_dir or os.path.join(run_dir, "tensorboard"))
    result = OPDResult(step, step, {}, {}, [], buffer.num_rows, drafter, run_dir)
    saved_step = step if step else None
    postfix: dict[str, str] = {}

    def current_drafter() -> Drafter:
        module = nnx.merge(graphdef, params, rest)
        return Drafter(drafter.cfg, *nnx.split(module), name=os.path.basename(run_dir))

    def save():
        nonlocal saved_step
        if saved_step != step:
            store.save(TrainState(step, nnx.State({"drafter": params, "head": head_params}),
                                  (opt_state, head_opt), state.rng_key, {"rounds": rounds}), meta)
            saved_step = step

    bar = tqdm(total=total, initial=step, disable=not (cfg.progress and jax.process_index() == 0), desc="opd")
    try:
        with trainer._StopFlag() as stop:
            while step < end:
                if step // o.refresh_every >= rounds and rounds * o.prompts_per_round < len(prompts):
                    lo = rounds * o.prompts_per_round
                    shard, hi = seeded + rounds, lo + o.prompts_per_round
                    sampling = round_sampling(o, rounds)
                    row = {"round": rounds, "step": step, "shard": shard, "tau": float("nan"),
                           "temperature": sampling["temperature"]}
                    if not buffer.has_records(shard):  # else: written before an interruption
                        stats = buffer.rollout(shard, prompts[lo:hi], domains[lo:hi], first_index=lo,
                                               drafter=current_drafter(), max_new_tokens=o.max_new_tokens,
                                               batch_size=o.prompts_per_round, **sampling)
                        row["tau"] = stats["mean_tau"]
                    row["rows"] = buffer.activate(shard, progress=cfg.progress)
                    rounds += 1
                    result.rollouts.append(row)
                    postfix["rollout_tau"] = f"{row['tau']:.3f}"
                    if writer:
                        if math.isfinite(row["tau"]):
                            writer.add_scalar("rollout/tau", row["tau"], step)
                        writer.add_scalar("rollout/buffer_rows", buffer.num_rows, step)
                    if not cfg.progress:
                        _log(f"round {row['round']} at step {step}: {row['rows']} rows, tau {row['tau']:.3f}, "
                             f"buffer {buffer.num_rows} rows")
                host = buffer.batch(step, cfg.data.batch_size, cfg.seed)
                batch = OPDBatch(*place_rows(list(host), mesh))
                with kernel_mesh(mesh, cfg.attn_impl):
                    params, opt_state, head_params, head_opt, m = opd_train_step(
                        target.graphdef, graphdef, head_def, tx, head_tx, target.state, params, rest,
                        opt_state, head_params, head_opt, batch, jax.random.fold_in(state.rng_key, step),
                        hp=hp, train_drafter=step >= o.head_stage1_steps)
                m = {k: float(v) for k, v in jax.device_get(m).items() if k in LOGGED}
                if not all(math.isfinite(m[k]) for k in ("loss", "head_mse", "grad_norm")):
                    raise FloatingPointError(
                        f"non-finite OPD loss at step {step} ({m}); stopped without saving this state. "
                        f"Last good checkpoint: {f'step {saved_step}' if saved_step is not None else 'none'}")
                result.losses[step], result.head_losses[step] = m["loss"], m["head_mse"]
                step += 1
                bar.update(1)
                if writer:
                    for k, v in m.items():
                        writer.add_scalar(f"train/{k}", v, step)
                postfix.update(loss=f"{m['loss']:.4f}", head_mse=f"{m['head_mse']:.4f}",
                               tau_tf=f"{m['tau_teacher_forced']:.3f}")
                bar.set_postfix(postfix)
                if not cfg.progress and (step % cfg.log_every == 0 or step == end):
                    _log(f"step {step}: " + " ".join(f"{k} {v:.4f}" for k, v in m.items()))
                if stop.requested():
                    save()
                    result.preempted = True
                    _log(f"SIGTERM: saved step {step} to {store.step_dir(step)}; exiting")
                    break
                if step % cfg.checkpoint.every_steps == 0 or step == end:
                    save()
        store.wait()
        result.drafter = trainer.final_drafter(drafter.cfg, graphdef, params, rest, os.path.basename(run_dir))
        head = head_params if jax.process_count() == 1 else distributed.to_host(head_params)
        result.drafter = result.drafter.with_length_head(nnx.merge(head_def, head)).for_target(target)
        if step >= total:
            result.drafter_dir = os.path.join(run_dir, "drafter")
            if jax.process_index() == 0:
                save_drafter(result.drafter, result.drafter_dir)
            distributed.barrier("adaflash_opd_drafter_saved")
            _log(f"done: {step} steps; drafter + length head saved to {result.drafter_dir}")
    finally:
        store.close()
        bar.close()
        if writer:
            writer.close()
    result.step, result.buffer_rows = step, buffer.num_rows
    return result
