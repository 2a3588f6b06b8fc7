"""SmolLM2-135M-Instruct DFlash drafter on a 2-core CPU: the recipe of the shipped drafter.

Target: the built-in GGUF (30 layers, D 576, vocab 49152, tied embeddings);
drafter: 2 Qwen3-style layers fusing target layers (1, 27) by the DFlash rule,
block 16, mask token 16 (`<empty_output>`, never generated in chat), γ = 7.

Levers for a CPU budget (measured in the drafter card):
- a reduced draft vocabulary of the 8192 most frequent response tokens: the LM head
  (49152 × 576, 3.5× the two layers per predicted position) shrinks 6×, a step ≈ 2.1×;
- longer responses (≤ 256 new tokens) and 16 anchors per sequence;
- data: 832 sequences are overfit within 40 minutes; 2464 follow the same held-out curve
  and keep climbing to step 3000.
Starting the layers from the target's last two (`drafter.init_from_target=true`) was
measured against random init at equal compute and did not help, so the recipe starts random.

Data: the target's own greedy responses to the built-in code / math / prose TRAIN
prompts (never the fixed evaluation set), and for held-out τ its responses to the
fixed evaluation set (the shipped drafter trained on the store's first 2464 rows,
`data.max_rows=2464`):

    adaflash rollout smollm2_135m --per-domain 2800 --max-new-tokens 256
    adaflash rollout smollm2_135m --eval-set --max-new-tokens 256 --out runs/smollm2_135m_eval_rollouts
    adaflash train smollm2_135m

Target features are computed once per row (`data.cache_features`, length-sorted at
trimmed widths) and memory-mapped from the run directory, so a step is only the drafter.
"""

from adaflash_jax.training.config import (CheckpointSpec, DataSpec, DrafterSpec, OptimSpec, TargetSpec,
                                          TrainConfig)

CONFIG = TrainConfig(
    target=TargetSpec(name="smollm2-135m-instruct"),
    drafter=DrafterSpec(num_layers=2, block_size=16, draft_vocab_size=8192),
    data=DataSpec(source="rollouts", path="runs/smollm2_135m_rollouts", seq_len=384, batch_size=8,
                  num_blocks=16, cache_features=True, eval_path="runs/smollm2_135m_eval_rollouts"),
    optim=OptimSpec(lr=6e-4, warmup=0.04, clip=1.0, weight_decay=0.01, total_steps=3000),
    checkpoint=CheckpointSpec(dir="runs/smollm2_135m", every_steps=50, max_to_keep=3),
    eval_every=100,
    log_every=10,
)
