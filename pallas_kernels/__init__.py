"""Pallas kernels for speculative decoding; a leaf package (imports only jax and numpy).

The public entry points, their plain-jnp references and their tile types are
re-exported here; pallas_kernels/README.md describes each kernel's design.
"""

from pallas_kernels.block_attention import BlockSizes as BlockAttentionSizes
from pallas_kernels.block_attention import block_attention, block_attention_reference
from pallas_kernels.block_attention_train import block_attention_train, block_attention_train_reference
from pallas_kernels.common import KernelChoice, choose_kernel
from pallas_kernels.fused_verify import BlockSizes as VerifyHeadSizes
from pallas_kernels.fused_verify import VerifyHeadOut, verify_head, verify_head_reference
from pallas_kernels.tree_attention import tree_attention, tree_attention_reference
from pallas_kernels.verify_attention import BlockSizes as VerifyAttentionSizes
from pallas_kernels.verify_attention import verify_attention, verify_attention_reference

__all__ = ["BlockAttentionSizes", "KernelChoice", "VerifyAttentionSizes", "VerifyHeadOut", "VerifyHeadSizes",
           "block_attention", "block_attention_reference", "block_attention_train",
           "block_attention_train_reference", "choose_kernel", "tree_attention", "tree_attention_reference",
           "verify_attention", "verify_attention_reference",
           "verify_head", "verify_head_reference"]
