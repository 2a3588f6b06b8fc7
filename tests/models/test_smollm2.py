"""SmolLM2-135M-Instruct from the shipped GGUF against transformers (fp32, torch CPU).

The reference model is built by transformers' own GGUF loader (see
`fixtures.smollm2_hf_reference`), so this checks our dequantisation, rotary un-permuting,
config and forward together, and greedy decoding end to end.
"""

import numpy as np
import pytest

import adaflash_jax as af
from fixtures import chat_ids, hf_greedy, hf_logits

# SmolLM2's residual stream carries activations near 2.5e4, so fp32 rounding alone moves
# its logits (|z| <= ~40) by ~1e-4. Measured against an exact float64 forward of the
# same weights: transformers' fp32 deviates by 0.5-0.9e-4 and ours by 0.9-1.6e-4 (XLA's
# CPU matmul accumulates with ~1.6x the rms rounding error of torch's); ours vs
# transformers is 0.8-1.4e-4. A wrong tensor, rotary table or norm moves logits by >1e-2.
TOL = 2e-4
PROMPTS = [
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Here is a short story. Once upon a time, a little robot lived in a quiet town by the "
    "river. Every morning it watered the flowers and greeted the baker. One day it found a "
    "lost kitten near the old stone bridge. What should the robot do next? Answer briefly.",
]
MAX_NEW = 40
EOS = 2


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    return [chat_ids(smollm2.tokenizer, p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference_outputs(smollm2_hf, prompt_ids):
    return [hf_greedy(smollm2_hf, ids, MAX_NEW, EOS) for ids in prompt_ids]


def test_config(smollm2):
    cfg = smollm2.cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_embeddings and cfg.rope_theta == 1e5 and cfg.vocab_size == 49152
    assert EOS in smollm2.eos_token_ids


@pytest.mark.parametrize("which", [0, 2])
def test_chat_prompt_logits_match_transformers(smollm2, smollm2_hf, prompt_ids, which):
    ids = [prompt_ids[which]]
    expected = hf_logits(smollm2_hf, ids)
    got = smollm2.score(ids)
    np.testing.assert_allclose(got, expected, rtol=0, atol=TOL)
    assert (got.argmax(-1) == expected.argmax(-1)).all()


def test_plain_text_logits_match_transformers(smollm2, smollm2_hf):
    ids = [smollm2.tokenizer.encode("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)")]
    np.testing.assert_allclose(smollm2.score(ids), hf_logits(smollm2_hf, ids), rtol=0, atol=TOL)


def test_greedy_batch_matches_transformers(smollm2, prompt_ids, reference_outputs):
    assert len({len(p) for p in prompt_ids}) == len(prompt_ids)  # really different lengths
    # At least two continuations run >= 32 tokens, so the comparison covers a long decode.
    assert sum(len(r) >= 32 for r in reference_outputs) >= 2
    res = af.generate(smollm2, PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0)
    for i, (got, want) in enumerate(zip(res.token_ids, reference_outputs)):
        assert got == want, f"prompt {i}"
    for got, text in zip(res.token_ids, res.texts):
        assert text == smollm2.tokenizer.decode(got, skip_special_tokens=True)
    assert res.stats["batch"] == len(PROMPTS) and res.stats["new_tokens"] == sum(map(len, res.token_ids))


def test_each_prompt_alone_equals_batch(smollm2, prompt_ids, reference_outputs):
    """Decoding a prompt alone (its own padding bucket) gives the batched tokens."""
    for ids, want in zip(prompt_ids, reference_outputs):
        assert af.generate(smollm2, [ids], max_new_tokens=MAX_NEW).token_ids == [want]


def test_stop_and_budget(smollm2, prompt_ids, reference_outputs):
    ended = [r for r in reference_outputs if r[-1] == EOS]
    assert ended, "expected at least one continuation to end with EOS within the budget"
    for r in reference_outputs:
        assert EOS not in r[:-1] and len(r) <= MAX_NEW
    short = af.generate(smollm2, [prompt_ids[0]], max_new_tokens=5).token_ids[0]
    assert short == reference_outputs[0][:5]
