"""bfloat16 targets (weights, activations and KV cache in bf16; logits float32).

bf16 keeps 8 mantissa bits (relative rounding 2^-9), so logits cannot match fp32
closely; what must hold is that the distribution is nearly the same: top-1 agrees almost
everywhere and the mean logit error is a small fraction of the mean logit size.
Measured on these models: top-1 agreement 0.97 (tiny) / 1.0 (SmolLM2), relative mean
error 0.015 / 0.028, KL(fp32 || bf16) mean 0.002 nats on SmolLM2.
"""

import numpy as np
import pytest

import adaflash_jax as af
from fixtures import chat_ids, hf_logits, hf_tiny_model, save_hf

MIN_TOP1_AGREEMENT = 0.9
MAX_RELATIVE_MEAN_ERROR = 0.05
BF16_LOGIT_NOISE = 0.5  # largest |bf16 - fp32| logit change seen on SmolLM2 decode steps: ~0.45


def log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def assert_close_to_fp32(bf16_logits, fp32_logits):
    assert bf16_logits.dtype == np.float32
    top1 = (bf16_logits.argmax(-1) == fp32_logits.argmax(-1)).mean()
    rel = np.abs(bf16_logits - fp32_logits).mean() / np.abs(fp32_logits).mean()
    assert top1 >= MIN_TOP1_AGREEMENT, top1
    assert rel <= MAX_RELATIVE_MEAN_ERROR, rel
    assert rel > 0  # really computed in bf16


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    pytest.importorskip("torch")
    return save_hf(hf_tiny_model("llama", seed=1), tmp_path_factory.mktemp("tiny"))


def test_tiny_bf16_close_to_fp32(tiny_dir):
    fp32 = af.load_target(tiny_dir)
    bf16 = af.load_target(tiny_dir, dtype="bfloat16")
    assert bf16.state["layers"]["wq"][...].dtype == np.dtype("bfloat16")
    assert bf16.cfg.compute_dtype == np.dtype("bfloat16")
    ids = np.random.default_rng(0).integers(0, 300, (4, 64))
    assert_close_to_fp32(bf16.score(ids), fp32.score(ids))


def test_tiny_bf16_generates(tiny_dir):
    bf16 = af.load_target(tiny_dir, dtype="bfloat16")
    res = af.generate(bf16, [[5, 6, 7], [8] * 12], max_new_tokens=10, stop_token_ids=[])
    assert [len(t) for t in res.token_ids] == [10, 10]
    assert all(0 <= t < 300 for row in res.token_ids for t in row)
    sampled = af.generate(bf16, [[5, 6, 7]], max_new_tokens=10, temperature=1.0, seed=3)
    assert 1 <= len(sampled.token_ids[0]) <= 10


def test_bf16_weights_float32_compute(tiny_dir):
    """param_dtype=bfloat16 with float32 compute sits between the two."""
    mixed = af.load_target(tiny_dir, dtype="float32", param_dtype="bfloat16")
    assert mixed.state["layers"]["wq"][...].dtype == np.dtype("bfloat16")
    ids = np.random.default_rng(1).integers(0, 300, (2, 32))
    assert_close_to_fp32(mixed.score(ids), af.load_target(tiny_dir).score(ids))


def test_bf16_checkpoint_is_read_exactly(tmp_path):
    """A bf16 safetensors file upcast to float32 matches transformers on the same weights."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen3ForCausalLM

    path = save_hf(hf_tiny_model("qwen3", seed=2).to(torch.bfloat16), tmp_path / "bf16")
    # Reloaded rather than `.float()`: casting the model also rounds its rotary buffer.
    reference = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert reference.model.embed_tokens.weight.dtype == torch.float32
    target = af.load_target(path, dtype="float32")
    ids = np.random.default_rng(2).integers(0, 300, (2, 40))
    np.testing.assert_allclose(target.score(ids), hf_logits(reference, ids), rtol=0, atol=1e-4)


def test_smollm2_bf16_close_to_fp32(smollm2):
    bf16 = af.load_target("smollm2-135m-instruct", dtype="bfloat16")
    prompt = "Write a haiku about the sea."
    ids = [chat_ids(smollm2.tokenizer, prompt)]
    got, want = bf16.score(ids), smollm2.score(ids)
    assert_close_to_fp32(got, want)
    p = np.exp(log_softmax(want.astype(np.float64)))
    kl = (p * (log_softmax(want.astype(np.float64)) - log_softmax(got.astype(np.float64)))).sum(-1)
    assert kl.mean() < 0.01, kl.mean()
    # Greedy decoding: bf16 must follow fp32 until a near-tie. Where fp32's top-2 logits are
    # closer than bf16's own logit noise the choice is legitimately decided by rounding
    # (this prompt: fp32 margins 0.11, 0.13, 1.1, 3.9, 0.11, ... and bf16 cached decoding
    # moves logits by up to ~0.45), so the first divergence must sit at such a step.
    fp32_tokens = af.generate(smollm2, [prompt], max_new_tokens=12).token_ids[0]
    bf16_tokens = af.generate(bf16, [prompt], max_new_tokens=12).token_ids[0]
    steps = smollm2.score([ids[0] + fp32_tokens])[0][len(ids[0]) - 1:-1]
    top2 = np.sort(steps, axis=-1)[:, -2:]
    margins = top2[:, 1] - top2[:, 0]
    differ = [i for i, (a, b) in enumerate(zip(bf16_tokens, fp32_tokens)) if a != b]
    if differ:
        assert margins[differ[0]] < BF16_LOGIT_NOISE, (differ[0], margins, bf16_tokens, fp32_tokens)
