"""benchmarks/block_acceptance.py: its teacher-forced acceptance is what decoding accepts.

On the tiny target with the distilled drafter: the block the benchmark drafts at a row's
first response token accepts exactly as many drafts as the engine's first speculative
step on that prompt does, and the summary's τ and correlations follow from the blocks.
"""


import numpy as np
import pytest
from flax import nnx

import adaflash_jax as af
from adaflash_jax.models.length_head import LengthHead

from spec_helpers import TEST_PROMPTS, distilled_drafter, tiny_target
from bench_loader import benchmark_module

SEQ_LEN = 48


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("block_acceptance") as module:
        yield module


def rows_for(target, prompts, domains):
    """The target's greedy continuations as the benchmark's padded arrays."""
    out = af.generate(target, prompts, max_new_tokens=SEQ_LEN - max(map(len, prompts)))
    seqs = [p + r for p, r in zip(prompts, out.token_ids)]
    return {"tokens": np.asarray([s + [0] * (SEQ_LEN - len(s)) for s in seqs], np.int32),
            "prompt_lens": np.asarray([len(p) for p in prompts], np.int32),
            "seq_lens": np.asarray([len(s) for s in seqs], np.int32), "domains": np.asarray(domains)}


def test_first_block_accepts_what_the_engines_first_step_accepts(bench):
    target, drafter = tiny_target(), distilled_drafter()
    for prompt in TEST_PROMPTS:
        blocks = bench.measure(target, drafter, rows_for(target, [prompt], ["code"]), stride=1)
        engine = af.generate(target, [prompt], max_new_tokens=SEQ_LEN - len(prompt), drafter=drafter,
                             verify="chain")
        first_commit = engine.stats["acceptance_lengths"][0][0]
        assert blocks["accepted"][0] + 1 == first_commit, prompt
        assert np.all(blocks["scores"] == 0.0)  # no length head


def test_summary_with_a_confidence_head(bench):
    target = tiny_target()
    head = LengthHead(target.cfg.hidden_size, 8, rngs=nnx.Rngs(0), confidence_width=15)
    drafter = distilled_drafter().with_length_head(head)
    arrays = rows_for(target, TEST_PROMPTS, ["code", "math", "code", "prose"])
    blocks = bench.measure(target, drafter, arrays, stride=3)
    s = bench.summarize(blocks, drafter.block_size, True)
    a = blocks["accepted"]
    assert s["blocks"] == len(a) and s["tau_teacher_forced"] == pytest.approx(1 + a.mean())
    assert sorted(s["domains"]) == ["code", "math", "prose"]
    assert sum(d["blocks"] for d in s["domains"].values()) == len(a)
    assert np.all((blocks["scores"] > 0) & (blocks["scores"] < 1))
    assert s["pearson"] == pytest.approx(np.corrcoef(blocks["scores"], a)[0, 1])
    assert sum(c["blocks"] for c in s["calibration"]) == len(a)
    # the drafter's own expected acceptance Σ_k Π_{i≤k} p_i lies in [0, Bs-1]
    assert np.all((blocks["expected"] >= 0) & (blocks["expected"] <= drafter.block_size - 1))
    assert s["confidence_pearson"] == pytest.approx(np.corrcoef(blocks["expected"], a)[0, 1])
