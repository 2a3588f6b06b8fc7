"""Tiny random target + one-layer drafter: the test and smoke-run experiment.

Data are the tiny target's own greedy continuations of random prompts (what
offline DFlash training uses, at toy scale), so τ rises within a few hundred
steps on a CPU in seconds.
"""

from adaflash_jax.models.config import ModelConfig
from adaflash_jax.training.config import (CheckpointSpec, DataSpec, DrafterSpec, OptimSpec, TargetSpec,
                                          TrainConfig)

TINY_TARGET = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4,
                          num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)

CONFIG = TrainConfig(
    target=TargetSpec(tiny=TINY_TARGET, seed=0),
    drafter=DrafterSpec(num_layers=1, block_size=8),
    data=DataSpec(source="target_greedy", seq_len=64, batch_size=8, num_blocks=8,
                  num_sequences=256, eval_sequences=32, prompt_len=8),
    optim=OptimSpec(lr=3e-3, total_steps=300),
    checkpoint=CheckpointSpec(dir="runs/tiny", every_steps=100, max_to_keep=2),
    eval_every=50,
    log_every=25,
)
