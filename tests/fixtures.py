"""Builders shared by the model, decoding and parallel tests.

Random weights are drawn at scales that give O(1) activations and logits of a few
units: with HF's default init (std 0.02, unit norms, zero biases) logits stay near
zero and a wrong bias, norm or rotary table would hide inside a 1e-4 tolerance.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

import adaflash_jax as af
from adaflash_jax.checkpoints import hf
from adaflash_jax.models.config import ModelConfig
from adaflash_jax.models.target import TargetLM
from adaflash_jax.target_api import target_from_params

TINY_HF = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)


def _scale(name: str) -> tuple[float, float]:
    """(mean, std) of a random parameter, from its HF or model name."""
    if "norm" in name:
        return 1.0, 0.2
    if name.endswith("bias") or name in ("bq", "bk", "bv", "bo"):
        return 0.0, 0.2
    if "embed" in name or "lm_head" in name:
        return 0.0, 0.5
    return 0.0, 0.15


def hf_tiny_model(family: str = "llama", seed: int = 0, **overrides):
    """A tiny random `LlamaForCausalLM` / `Qwen3ForCausalLM` with every tensor randomised."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                             "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[family]
    kwargs = dict(TINY_HF, **overrides)
    if family == "qwen3":
        kwargs.setdefault("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
    model = model_cls(config_cls(**kwargs)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            mean, std = _scale(name)
            param.copy_(mean + std * torch.randn(param.shape, generator=gen))
    return model


def save_hf(model, path, max_shard_size=None) -> str:
    """`save_pretrained` as safetensors (sharded with an index when max_shard_size is set)."""
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(path), safe_serialization=True, **kwargs)
    return str(path)


def hf_logits(model, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids), dtype=torch.long)).logits.float().numpy()


def tiny_config(**overrides) -> ModelConfig:
    """A tiny JAX-native config whose dims divide a 2x4 or 2x2x2 mesh."""
    fields = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=8, num_kv_heads=4, head_dim=16, max_position_embeddings=256,
                  rms_norm_eps=1e-6, eos_token_ids=(2,))
    fields.update(overrides)
    return ModelConfig(**fields)


def random_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """A model-layout pure dict of random float32 numpy weights for `cfg`."""
    abstract = nnx.eval_shape(lambda: TargetLM(cfg, rngs=nnx.Rngs(0)))
    pure = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    rng = np.random.default_rng(seed)

    def fill(tree):
        out = {}
        for key, leaf in tree.items():
            if isinstance(leaf, dict):
                out[key] = fill(leaf)
            else:
                mean, std = _scale(str(key))
                out[key] = (mean + std * rng.standard_normal(leaf.shape)).astype(np.float32)
        return out

    return fill(pure)


def tiny_target(cfg: ModelConfig | None = None, seed: int = 0, mesh=None) -> af.Target:
    cfg = cfg or tiny_config()
    return target_from_params(cfg, random_params(cfg, seed), name=f"tiny-{seed}", mesh=mesh)


def smollm2_hf_reference():
    """transformers' `LlamaForCausalLM` for the shipped SmolLM2 GGUF, via its own GGUF loader.

    `from_pretrained(gguf_file=...)` needs `accelerate`, which is not installed; for llama
    files it calls `load_gguf_checkpoint`, so that is called directly (as in
    tests/checkpoints/test_gguf.py) and the state dict is loaded into a fresh model.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from adaflash_jax.checkpoints.gguf import read_gguf, smollm2_gguf_path

    path = smollm2_gguf_path()
    config = LlamaConfig(**read_gguf(path).config)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    loaded = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)
    model = LlamaForCausalLM(config)
    result = model.load_state_dict(loaded["tensors"], strict=False)
    assert result.unexpected_keys == [] and result.missing_keys == ["lm_head.weight"], result
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


def chat_ids(tokenizer, text: str) -> list[int]:
    """The ids `af.generate` uses for a text prompt (chat template, generation prompt)."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True)
    return tokenizer.encode(rendered)


def hf_greedy(model, ids: list[int], max_new_tokens: int, eos_token_id: int) -> list[int]:
    """transformers greedy decoding; new tokens only, stop token included."""
    import torch

    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                             pad_token_id=eos_token_id, temperature=None, top_p=None, top_k=None)
    return out[0, len(ids):].tolist()


def params_to_hf_dir(cfg: ModelConfig, params: dict, path, hf_config: dict) -> str:
    """Writes model-layout params as an HF safetensors dir with `hf_config` as config.json."""
    import json
    import os

    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in hf.params_to_hf(cfg, params).items()},
              os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f)
    return str(path)
