"""`OPDSpec`: the on-policy distillation section (`opd.*`) of a `TrainConfig`.

Offline training ignores it; `adaflash opd` reads it together with the rest of
the config (target, drafter shape for a fresh drafter, data.seq_len /
batch_size / num_blocks / gamma, optim for the drafter, checkpoint, mesh).
Defaults follow the AdaFlash reference (α 0.8, T 1, KL clip 0.01; head lr 5e-5
in stage 1, 2e-4 in stage 2, bottleneck 256).
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
    """

    KEY = "opd"

    alpha: float = 0.8
    temperature: float = 1.0
    kl_clip: float = 0.01
    clip_mode: str = "mean"
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
    init_drafter: str = ""
    seed_rollouts: str = ""
    seed_max_rows: int = 0

    def __post_init__(self):
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"opd.alpha must lie in [0, 1], got {self.alpha}")
        if self.clip_mode not in CLIP_MODES:
            raise ValueError(f"opd.clip_mode must be one of {CLIP_MODES}, got {self.clip_mode!r}")
        for name in ("temperature", "kl_clip", "refresh_every", "prompts_per_round", "max_new_tokens",
                     "max_prompt_tokens", "per_domain", "head_lr", "head_stage1_lr", "head_bottleneck"):
            if getattr(self, name) <= 0:
                raise ValueError(f"opd.{name} must be positive, got {getattr(self, name)}")
        for name in ("head_stage1_steps", "seed_max_rows"):
            if getattr(self, name) < 0:
                raise ValueError(f"opd.{name} must be >= 0, got {getattr(self, name)}")
