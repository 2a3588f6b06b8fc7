"""SmolLM2-135M-Instruct: on-policy distillation of the shipped DFlash drafter + its length head.

Starts from the shipped `smollm2-135m-instruct-dflash` (K = 8192 draft vocabulary; no
head yet: a fresh one, bottleneck 256) and seeds the rollout buffer with the first
1216 rows (domain-interleaved, so balanced) of the offline recipe's rollout store:

    adaflash rollout smollm2_135m --per-domain 2800 --max-new-tokens 256 --batch-size 32 \
      --out runs/rollouts_256                              # the offline recipe's data
    adaflash opd smollm2_135m_opd

Greedy target trajectories do not depend on the drafter, so those rows are on-policy
(the offline drafter trained on them). Then a rollout round every 100 steps: 32 new
train-split prompts (prompt seed 1, never a seeded row's prompt) decoded by the engine
with the current drafter into the buffer, alternating greedy and T 0.7 rounds (the
served settings; the engine is lossless at both). The loss is the published AdaFlash
code's: α 0.5, each position's reverse KL divided by N, no clamp (τ off). Steps have the
offline recipe's shape (8 sequences × 16 anchors, γ 7); the first 60 train the head only
(stage 1, lr 5e-5), the rest train drafter (AdamW 3e-4, the reference OPD lr) and head
(2e-4) jointly (stage 2). Target features and teacher hidden states are computed once per
buffer row and memory-mapped from runs/smollm2_135m_opd/buffer.

The drafter card of `smollm2-135m-instruct-adaflash` gives the measured times and the
controlled comparison with continued offline training for the same minutes.
"""

from adaflash_jax.training.config import (CheckpointSpec, DataSpec, DrafterSpec, OptimSpec, TargetSpec,
                                          TrainConfig)
from adaflash_jax.training.opd_config import OPDSpec

CONFIG = TrainConfig(
    target=TargetSpec(name="smollm2-135m-instruct"),
    # shape of the shipped drafter (loaded from opd.init_drafter, not built)
    drafter=DrafterSpec(num_layers=2, block_size=16, draft_vocab_size=8192),
    data=DataSpec(source="rollouts", path="runs/rollouts_256", seq_len=384, batch_size=8,
                  num_blocks=16, cache_features=True),
    optim=OptimSpec(lr=3e-4, warmup=0.04, clip=1.0, weight_decay=0.01, total_steps=400),
    opd=OPDSpec(alpha=0.5, temperature=1.0, kl_clip=None, clip_mode="position",
                rollout_temperatures=(0.0, 0.7), refresh_every=100, prompts_per_round=32,
                max_new_tokens=256, max_prompt_tokens=128, per_domain=200, prompt_seed=1,
                head_lr=2e-4, head_stage1_lr=5e-5, head_stage1_steps=60, head_bottleneck=256,
                init_drafter="smollm2-135m-instruct-dflash", seed_rollouts="runs/rollouts_256",
                seed_max_rows=1216),
    checkpoint=CheckpointSpec(dir="runs/smollm2_135m_opd", every_steps=20, max_to_keep=3),
    log_every=10,
)
