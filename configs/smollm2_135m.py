"""SmolLM2-135M-Instruct DFlash drafter on a 2-core CPU: the recipe of the shipped drafter.

Target: the built-in GGUF (30 layers, D 576, vocab 49152, tied embeddings);
drafter: 2 Qwen3-style layers fusing target layers (1, 27) by the DFlash rule,
block 16, mask token 16 (`<empty_output>`, never generated in chat), γ = 7.

Data: the target's own greedy responses (≤ 128 new tokens) to the built-in
code / math / prose TRAIN prompts, interleaved round-robin:

    adaflash rollout smollm2_135m --data-dir runs/data      # 400 prompts per domain
    adaflash train smollm2_135m

Target features are computed once for every sequence (`data.cache_features`,
≈ 10 min here) and memory-mapped from the run directory, so a step is only
the drafter: 8 sequences × 8 anchors = 64 blocks = 1024 predicted positions,
dominated by the shared LM head (1024 × 49152 logits, forward and backward).
Measured here: ≈ 4-5 s per step (on-the-fly features: ≈ 7.7 s at 4 × 16 anchors).
"""

from adaflash_jax.training.config import (CheckpointSpec, DataSpec, DrafterSpec, OptimSpec, TargetSpec,
                                          TrainConfig)

CONFIG = TrainConfig(
    target=TargetSpec(name="smollm2-135m-instruct"),
    drafter=DrafterSpec(num_layers=2, block_size=16),
    data=DataSpec(source="rollouts", path="runs/smollm2_135m/rollouts", seq_len=256, batch_size=8,
                  num_blocks=8, eval_sequences=16, cache_features=True),
    optim=OptimSpec(lr=6e-4, warmup=0.04, clip=1.0, weight_decay=0.01, total_steps=700),
    checkpoint=CheckpointSpec(dir="runs/smollm2_135m", every_steps=50, max_to_keep=3),
    eval_every=100,
    log_every=10,
)
