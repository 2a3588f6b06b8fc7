"""Qwen3-8B DFlash drafter on a TPU v5p-64 slice (reference recipe; not run in this repo's CI).

Reference hyper-parameters (DFlash): block 16, 5 drafter layers fusing target
layers [1, 9, 17, 25, 33], mask token 151669 (as in z-lab/Qwen3-8B-DFlash-b16),
512 anchors per sequence, AdamW
lr 6e-4, cosine decay with 4% warmup, global-norm clip 1.0, γ = 7 (the B=16
default). Target and compute in bfloat16; drafter master weights in float32.

Mesh: v5p-64 = 32 chips (one JAX device each) as data 2 × fsdp 4 × tensor 4.
The batch is split over data × fsdp (8 groups, 4 sequences each); tensor
parallelism splits heads, MLP and — most importantly — the vocabulary, since
512 × 16 block positions × 151,936 logits per sequence dominate activation memory.
Sequence length, batch and step count are this recipe's choices: seq_len 3072,
global batch 32, 50k steps ≈ 1.6M sequences (e.g. 800k rollouts × 2 epochs).

Launch (one process per host, same command everywhere):
  adaflash train qwen3_8b target.name=/ckpt/Qwen3-8B \
      data.path=/data/qwen3_8b_rollouts checkpoint.dir=/mnt/runs/qwen3_8b
On multi-host slices each process's data source must yield its host-local rows
(the trainer assembles global batches with `make_array_from_process_local_data`),
and checkpoint.dir must be a path every host sees (e.g. a gcsfuse mount).
"""

from adaflash_jax.training.config import (CheckpointSpec, DataSpec, DrafterSpec, MeshSpec, OptimSpec,
                                          TargetSpec, TrainConfig)

CONFIG = TrainConfig(
    target=TargetSpec(name="checkpoints/Qwen3-8B", dtype="bfloat16", param_dtype="bfloat16"),
    drafter=DrafterSpec(num_layers=5, block_size=16, mask_token_id=151669,
                        target_layer_ids=(1, 9, 17, 25, 33), param_dtype="float32"),
    data=DataSpec(source="rollouts", path="runs/qwen3_8b/rollouts", seq_len=3072, batch_size=32,
                  num_blocks=512, eval_sequences=64),
    optim=OptimSpec(lr=6e-4, warmup=0.04, clip=1.0, weight_decay=0.01, total_steps=50_000),
    mesh=MeshSpec(data=2, fsdp=4, tensor=4),
    checkpoint=CheckpointSpec(dir="runs/qwen3_8b", every_steps=1000, max_to_keep=3),
    eval_every=1000,
    log_every=50,
)
