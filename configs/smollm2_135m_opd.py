"""SmolLM2-135M-Instruct: on-policy distillation of the shipped DFlash drafter + its length head.

Starts from the shipped `smollm2-135m-instruct-dflash` (no head yet: a fresh
one, bottleneck 256) and seeds the rollout buffer with all 1216 rows
(domain-interleaved, so balanced) of the offline recipe's rollout store:

    adaflash rollout smollm2_135m --data-dir runs/data      # (the offline recipe's data)
    adaflash opd smollm2_135m_opd

Greedy target trajectories do not depend on the drafter, so those rows are
on-policy (896 of them trained the offline drafter; 320 are new to it). Then a
rollout round every 40 steps: 32 new train-split prompts (prompt seed 1, never a
seeded row's prompt) decoded by the engine with the current drafter, into the
buffer. The loss is the published AdaFlash code's: α 0.5, each position's
reverse KL divided by N, no clamp (τ off). Steps are 8 sequences × 8 anchors;
the first 40 train the head only (lr 5e-5; the reference's 2 head-only epochs
are cut to under one here), the next 120 train drafter (AdamW 3e-4, the reference OPD lr) and head (2e-4)
jointly. Target features and teacher hidden states are computed once per buffer
row (≈ 16 min for the 1216 seed rows here) and memory-mapped from
runs/smollm2_135m_opd/buffer.

Measured on this 2-core CPU: ≈ 2.6 s per head-only step, ≈ 3.7 s per joint step
(a joint step evaluates the LM head for student and teacher, 1024 positions ×
49152, forward and backward), ≈ 1-2 min per rollout round; ≈ 45 min in all.
"""

from adaflash_jax.training.config import (CheckpointSpec, DataSpec, DrafterSpec, OptimSpec, TargetSpec,
                                          TrainConfig)
from adaflash_jax.training.opd_config import OPDSpec

CONFIG = TrainConfig(
    target=TargetSpec(name="smollm2-135m-instruct"),
    drafter=DrafterSpec(num_layers=2, block_size=16),  # shape of the shipped drafter (loaded, not built)
    data=DataSpec(source="rollouts", path="runs/smollm2_135m/rollouts", seq_len=256, batch_size=8,
                  num_blocks=8, cache_features=True),
    optim=OptimSpec(lr=3e-4, warmup=0.04, clip=1.0, weight_decay=0.01, total_steps=160),
    opd=OPDSpec(alpha=0.5, temperature=1.0, kl_clip=None, clip_mode="position", refresh_every=40,
                prompts_per_round=32, max_new_tokens=128, max_prompt_tokens=128, per_domain=200,
                prompt_seed=1, data_dir="runs/data", head_lr=2e-4, head_stage1_lr=5e-5,
                head_stage1_steps=40, head_bottleneck=256, init_drafter="smollm2-135m-instruct-dflash",
                seed_rollouts="runs/smollm2_135m/rollouts", seed_max_rows=1216),
    checkpoint=CheckpointSpec(dir="runs/smollm2_135m_opd", every_steps=40, max_to_keep=3),
    log_every=10,
)
