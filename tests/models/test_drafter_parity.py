"""The drafter matches an independent torch implementation of the published DFlash layout.

The torch code below follows z-lab/dflash's description: Qwen3 layers whose
queries come from the block only, keys/values from [fused context ; block]
through the same k/v projections (k_norm on both), RoPE at true positions, no
mask; `fc` + `hidden_norm` fuse the target layer outputs; final `norm`. The
target is a transformers Qwen3 model loaded into adaflash_jax from its
`save_pretrained` directory, so both sides see the same target features.
Both directions of the checkpoint format are checked: a drafter written by
`af.save_drafter` runs in torch, and a torch-written state dict runs here.
"""

import json
import math

import jax
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

import adaflash_jax as af  # noqa: E402
import spec_helpers as H  # noqa: E402
from adaflash_jax.drafter_api import Drafter  # noqa: E402

TOL = 1e-4


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta):
    """x [B, heads, S, Dh] rotated (rotate-half layout) at integer positions [S]."""
    dh = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dh, 2, dtype=torch.float32) / dh)
    ang = positions.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    rotated = torch.cat([-x[..., dh // 2:], x[..., :dh // 2]], -1)
    return x * cos + rotated * sin


def dflash_forward(sd, cfg, target_hidden, noise, positions):
    """Final-norm block states [B, Q, D] from context features [B, C, kD] and block embeddings."""
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    nh, nkv, dh = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    b, q_len, c_len = noise.shape[0], noise.shape[1], target_hidden.shape[1]
    ctx = rms(target_hidden @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)
    x = noise
    for i in range(cfg["num_hidden_layers"]):
        w = {k[len(f"layers.{i}."):]: v for k, v in sd.items() if k.startswith(f"layers.{i}.")}
        h = rms(x, w["input_layernorm.weight"], eps)
        q = (h @ w["self_attn.q_proj.weight"].T).view(b, q_len, nh, dh)
        q = rms(q, w["self_attn.q_norm.weight"], eps).transpose(1, 2)
        kv_in = torch.cat([ctx, h], dim=1)
        k = (kv_in @ w["self_attn.k_proj.weight"].T).view(b, c_len + q_len, nkv, dh)
        k = rms(k, w["self_attn.k_norm.weight"], eps).transpose(1, 2)
        v = (kv_in @ w["self_attn.v_proj.weight"].T).view(b, c_len + q_len, nkv, dh).transpose(1, 2)
        q, k = rope(q, positions[c_len:], theta), rope(k, positions, theta)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dh), dim=-1)  # non-causal
        attn = (probs @ v).transpose(1, 2).reshape(b, q_len, nh * dh)
        x = x + attn @ w["self_attn.o_proj.weight"].T
        h = rms(x, w["post_attention_layernorm.weight"], eps)
        mlp = torch.nn.functional.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)
        x = x + mlp @ w["mlp.down_proj.weight"].T
    return rms(x, sd["norm.weight"], eps)


@torch.no_grad()
def torch_block_logits(hf_model, sd, cfg, ids):
    """Block [last token, MASK...] after the context ids[:, :-1]; logits of offsets 1..B-1."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    layer_ids = cfg["dflash_config"]["target_layer_ids"]
    outputs = {}
    hooks = [hf_model.model.layers[i].register_forward_hook(
        lambda mod, inp, out, i=i: outputs.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        for i in layer_ids]
    try:
        hf_model(ids[:, :-1])
    finally:
        for hook in hooks:
            hook.remove()
    feats = torch.cat([outputs[i] for i in layer_ids], dim=-1)  # decoder layer outputs
    bs = cfg["block_size"]
    block = torch.full((ids.shape[0], bs), cfg["dflash_config"]["mask_token_id"], dtype=torch.long)
    block[:, 0] = ids[:, -1]
    noise = hf_model.model.embed_tokens(block)
    positions = torch.arange(ids.shape[1] - 1 + bs)
    hidden = dflash_forward({k: v.float() for k, v in sd.items()}, cfg, feats, noise, positions)
    return hf_model.lm_head(hidden)[:, 1:].numpy()


@pytest.fixture(scope="module")
def hf_target(tmp_path_factory):
    """A tiny transformers Qwen3 (TINY's shapes) and the same model as an adaflash_jax Target."""
    torch.manual_seed(0)
    c = H.TINY
    config = transformers.Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 20000.0}, tie_word_embeddings=False)
    model = transformers.Qwen3ForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(path)
    return model, af.load_target(str(path))


@pytest.fixture(scope="module")
def token_ids():
    return np.random.default_rng(0).integers(0, H.TINY.vocab_size, size=(2, 11))


def perturbed(drafter: Drafter, seed: int = 0) -> Drafter:
    """The drafter with every weight moved off its init (norms off 1, larger matrices)."""
    rng = np.random.default_rng(seed)
    module = drafter.module
    params = drafter.params()
    noisy = jax.tree.map(lambda a: np.asarray(a) + rng.normal(0, 0.15, a.shape).astype(np.float32), params)
    state = nnx.state(module, nnx.Param)
    nnx.replace_by_pure_dict(state, noisy)
    nnx.update(module, state)
    graphdef, state = nnx.split(module)
    return Drafter(drafter.cfg, graphdef, state, "perturbed")


def test_saved_drafter_runs_in_torch(hf_target, token_ids, tmp_path):
    model, target = hf_target
    drafter = perturbed(af.init_drafter(target, num_layers=2, block_size=8, seed=0))
    af.save_drafter(drafter, str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    sd = load_file(str(tmp_path / "model.safetensors"))
    ours = af.draft_logits(target, drafter, token_ids)
    theirs = torch_block_logits(model, sd, cfg, token_ids)
    assert ours.shape == theirs.shape == (2, 7, H.TINY.vocab_size)
    assert np.abs(theirs).max() > 1.0  # not a vacuous comparison of near-zero logits
    np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=TOL)


def zlab_state_dict(cfg, seed=0):
    """Random torch tensors under the published parameter names."""
    g = torch.Generator().manual_seed(seed)
    d, f, dh = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nh, nkv, k = cfg["num_attention_heads"], cfg["num_key_value_heads"], len(
        cfg["dflash_config"]["target_layer_ids"])

    def mat(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    def norm(n):
        return 1.0 + 0.2 * torch.randn(n, generator=g)

    sd = {"fc.weight": mat(d, k * d), "hidden_norm.weight": norm(d), "norm.weight": norm(d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        sd.update({
            p + "self_attn.q_proj.weight": mat(nh * dh, d), p + "self_attn.k_proj.weight": mat(nkv * dh, d),
            p + "self_attn.v_proj.weight": mat(nkv * dh, d), p + "self_attn.o_proj.weight": mat(d, nh * dh),
            p + "self_attn.q_norm.weight": norm(dh), p + "self_attn.k_norm.weight": norm(dh),
            p + "mlp.gate_proj.weight": mat(f, d), p + "mlp.up_proj.weight": mat(f, d),
            p + "mlp.down_proj.weight": mat(d, f), p + "input_layernorm.weight": norm(d),
            p + "post_attention_layernorm.weight": norm(d)})
    return sd


def zlab_config(**changes):
    c = H.TINY
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False,
           "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_hidden_layers": 1, "num_attention_heads": c.num_heads,
           "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "hidden_act": "silu",
           "vocab_size": c.vocab_size, "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
           "rope_scaling": None, "max_position_embeddings": 4096, "tie_word_embeddings": False,
           "torch_dtype": "float32", "block_size": 6, "num_target_layers": c.num_layers,
           "dflash_config": {"target_layer_ids": [0, 2, 4], "mask_token_id": 5}}
    cfg.update(changes)
    return cfg


def test_torch_written_drafter_loads(hf_target, token_ids, tmp_path):
    model, target = hf_target
    cfg = zlab_config()
    sd = zlab_state_dict(cfg)
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    drafter = af.load_drafter(str(tmp_path), target=target)
    assert drafter.block_size == 6 and drafter.cfg.target_layer_ids == (0, 2, 4)
    assert drafter.cfg.mask_token_id == 5 and drafter.cfg.rope_theta == 50000.0
    ours = af.draft_logits(target, drafter, token_ids)
    theirs = torch_block_logits(model, sd, cfg, token_ids)
    assert ours.shape == (2, 5, H.TINY.vocab_size)
    assert np.abs(theirs).max() > 1.0
    np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=TOL)
