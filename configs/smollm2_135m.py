"""SmolLM2-135M-Instruct DFlash drafter on a 2-core CPU (the recipe this repo can run).

Target: the built-in GGUF (30 layers, D 576, vocab 49152, tied embeddings);
drafter: 2 layers fusing target layers (1, 27) by the DFlash rule, block 16,
mask token 16 (`<empty_output>`, never generated in chat), γ = 7.

Cost model, measured on this machine kind (2 cores, float32, random-init
drafter, batch 4 × 256 tokens, 16 anchors per sequence): 7.7 s per step
(median of 5 through `train`; 10 s in an earlier bare-step measurement). From
component timings, the frozen target's forward over 1024 tokens is ≈ 3 s and the shared LM
head over 1024 block positions × 49152 logits, forward and backward, ≈ 2 s.
A 3-layer drafter measured 14 s per step and batch 8 18 s, so neither fits.
600 steps × 7.7-10 s ≈ 77-100 min, plus ≈ 1 min of compilation and target
loading and 7 held-out evaluations: inside the 1-2 h budget
(38.4k blocks, 576k predicted positions).

Data: the target's own greedy responses, written by `training.rollouts`
(`generate_rollouts(target, prompts, domains, "runs/smollm2_135m/rollouts")`),
which is a separate, earlier step whose cost is not included above.
"""

from adaflash_jax.training.config import (CheckpointSpec, DataSpec, DrafterSpec, OptimSpec, TargetSpec,
                                          TrainConfig)

CONFIG = TrainConfig(
    target=TargetSpec(name="smollm2-135m-instruct"),
    drafter=DrafterSpec(num_layers=2, block_size=16),
    data=DataSpec(source="rollouts", path="runs/smollm2_135m/rollouts", seq_len=256, batch_size=4,
                  num_blocks=16, eval_sequences=16),
    optim=OptimSpec(lr=6e-4, warmup=0.04, clip=1.0, weight_decay=0.01, total_steps=600),
    checkpoint=CheckpointSpec(dir="runs/smollm2_135m", every_steps=50, max_to_keep=3),
    eval_every=100,
    log_every=10,
)
