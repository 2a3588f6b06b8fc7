"""Tiny random target + one-layer drafter, trained by on-policy distillation: tests and smoke runs.

The target has no tokenizer, so rollout prompts are random token ids
(`data.prompt_len` long); rounds are small so a run takes seconds on a CPU:

    adaflash opd tiny_opd
"""

from adaflash_jax.training.config import CheckpointSpec, OptimSpec, load_config
from adaflash_jax.training.opd_config import OPDSpec

CONFIG = load_config("tiny").replace(
    optim=OptimSpec(lr=3e-3, total_steps=12),
    opd=OPDSpec(refresh_every=4, prompts_per_round=8, max_new_tokens=24, per_domain=32,
                head_stage1_steps=4, head_bottleneck=32, head_lr=1e-3, head_stage1_lr=1e-3),
    checkpoint=CheckpointSpec(dir="runs/tiny_opd", every_steps=4, max_to_keep=2),
    log_every=4,
)
