"""`OPDSpec`: the on-policy distillation section (`opd.*`) of a `TrainConfig`.

Offline training ignores it; `adaflash opd` reads it together with the rest of
the config (target, drafter shape for a fresh drafter, data.seq_len /
batch_size / num_blocks / gamma, optim for the drafter, checkpoint, mesh).
Defaults follow the published AdaFlash code (α 0.5, T 1, no clamp on the per-position
KL/N (τ = `kl_clip` None), head lr 5e-5 in stage 1, 2e-4 in stage 2, bottleneck 256).
Rollout rounds decode greedily unless `rollout_temperatures` lists T > 0 settings: the
engine is lossless at any T, so each round's responses are samples of the target's own
distribution at the settings served, whatever the drafter.
"""

from __future__ import annotations

import dataclasses

from adaflash_jax.training.opd_loss import CLIP_MODES


@dataclasses.dataclass(frozen=True)
class OPDSpec:
    """On-policy distillation: rollout rounds, the OPD loss, and the length head's two stages.

    init_drafter: drafter dir or built-in name to start from ("" = a fresh drafter shaped by
    the `drafter` section). seed_rollouts: an `adaflash rollout` store copied into the buffer
    first ("" = none; valid on-policy data because greedy (T = 0) target trajectories do not
    depend on the drafter). seed_max_rows: use only its first rows (0 = all; the store is
    domain-interleaved, so a prefix stays balanced). Prompts for the rollout rounds: `per_domain`
    train-split prompts of each domain, drawn with `prompt_seed` from `data_dir` ("" = the
    default prompt cache), minus those already in the seed store.

    kl_clip: τ of the reference's per-position clamp of KL/N (None = off, the reference's
    default); clip_mode "mean" clips the batch-mean KL instead, which is NOT the reference's
    and zeroes the KL gradient whenever that mean exceeds τ (kept to reproduce older runs).
    head_confidence: give the length head the drafts' probabilities as a second input (this
    framework's extension, `models.length_head`; False = the published head). A starting
    drafter whose head differs in that gets a fresh head. head_stage1_steps equal to
    optim.total_steps makes a head-only run (the drafter never changes).
    rollout_temperatures: round r decodes at `rollout_temperatures[r % len]` (0 = greedy),
    with `rollout_top_p` and a seed fixed by (prompt_seed, r), so a rewritten round is the
    same; e.g. (0.0, 0.7) alternates greedy and served-temperature rounds.
    """

    KEY = "opd"

    alpha: float = 0.5
    temperature: float = 1.0
    kl_clip: float | None = None
    clip_mode: str = "position"
    rollout_temperatures: tuple[float, ...] = (0.0,)
    rollout_top_p: float = 1.0
    refresh_every: int = 50  # optimizer steps per round (then new weights go to the rollout engine)
    prompts_per_round: int = 32
    max_new_tokens: int = 128
    max_prompt_tokens: int = 128
    per_domain: int = 200
    prompt_seed: int = 1
    data_dir: str = ""
    head_lr: float = 2e-4
    head_stage1_lr: float = 5e-5
    head_stage1_steps: int = 100  # head only, drafter frozen; then joint
    head_bottleneck: int = 256
    head_confidence: bool = False
    init_drafter: str = ""
    seed_rollouts: str = ""
    seed_max_rows: int = 0

    def __post_init__(self):
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"opd.alpha must lie in [0, 1], got {self.alpha}")
        if self.clip_mode not in CLIP_MODES:
            raise ValueError(f"opd.clip_mode must be one of {CLIP_MODES}, got {self.clip_mode!r}")
        if self.kl_clip is not None and self.kl_clip <= 0:
            raise ValueError(f"opd.kl_clip must be positive or None (no clamp), got {self.kl_clip}")
        if not self.rollout_temperatures or any(t < 0 for t in self.rollout_temperatures):
            raise ValueError("opd.rollout_temperatures must list at least one temperature >= 0 "
                             f"(0 = greedy), got {self.rollout_temperatures}")
        if not 0.0 < self.rollout_top_p <= 1.0:
            raise ValueError(f"opd.rollout_top_p must lie in (0, 1], got {self.rollout_top_p}")
        for name in ("temperature", "refresh_every", "prompts_per_round", "max_new_tokens",
                     "max_prompt_tokens", "per_domain", "head_lr", "head_stage1_lr", "head_bottleneck"):
            if getattr(self, name) <= 0:
                raise ValueError(f"opd.{name} must be positive, got {getattr(self, name)}")
        for name in ("head_stage1_steps", "seed_max_rows"):
            if getattr(self, name) < 0:
                raise ValueError(f"opd.{name} must be >= 0, got {getattr(self, name)}")
