"""benchmarks/tree_eval.py: the methods it compares, its prompt pool and its summary.

No model runs: a fake `generate` stands in (as for the concurrency benchmark), so the
test checks which calls each method makes and how the JSON summary is derived.
"""

import types

import pytest
from bench_loader import benchmark_module


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("tree_eval") as module:
        yield module


def test_methods_compare_chain_fixed_tree_and_auto_tree(bench):
    drafter = types.SimpleNamespace(block_size=16)
    methods = bench.methods_for(drafter, 16)
    assert list(methods) == [m.format(n=16) for m in bench.METHODS]
    assert list(bench.methods_for(drafter, 32)) == ["ar", "chain16", "tree32", "tree_auto"]
    assert methods["chain16"]["verify_len"] == 16 and "verify" not in methods["chain16"]
    assert methods["tree16"]["tree_budget"] == 16 and methods["tree_auto"]["tree_budget"] == "auto"


def test_prompt_pool_interleaves_domains(bench, monkeypatch):
    monkeypatch.setattr(bench, "heldout_prompts", lambda target, n: {
        d: [types.SimpleNamespace(ids=[i, j]) for j in range(n)] for i, d in enumerate(bench.EVAL_DOMAINS)})
    ids, labels = bench.prompt_pool(None, 2)
    assert labels == list(bench.EVAL_DOMAINS) * 2 and ids[:2] == [[0, 0], [1, 0]] and ids[4] == [0, 1]
    assert bench.cycled(ids, 10)[8:] == ids[:2]


def fake_generate(calls):
    def generate(prompts, *, max_new_tokens, drafter=None, **kw):
        calls.append(kw.get("tree_budget", kw.get("verify_len", "ar")))
        stats = {"wall_time_s": 2.0 if drafter is None else 1.0, "new_tokens": 10, "compile_time_s": 0.0}
        if drafter is not None:
            tau = 3.0 if kw.get("verify") == "tree" else 2.0
            stats.update(acceptance_lengths=[[tau]] * len(prompts), mean_tau=tau, verify_steps=2, mean_verify_len=8.0,
                         verified_per_committed=2.0, drafted_step_fraction=1.0)
        return types.SimpleNamespace(token_ids=[[1]] * len(prompts), stats=stats)
    return generate


def test_summary_from_the_point_with_the_most_prompts(bench):
    calls = []
    methods = bench.methods_for(types.SimpleNamespace(block_size=16), 16)
    results = {str(c): bench.measure_point(methods, [[1]] * c, ["code"] * c, warmup=1, repeats=1, max_new_tokens=4,
                                           generate=fake_generate(calls)) for c in (1, 8)}
    assert len(calls) == 2 * 2 * len(methods)
    summary = bench.summarize(results, pool_size=4)
    assert summary["tau_point"] == 8 and summary["tau"] == {"chain16": 2.0, "tree16": 3.0, "tree_auto": 3.0}
    assert summary["tau_tree_over_chain"] == 1.5 and summary["all_identical_to_ar"]
    assert summary["speedup_vs_ar"]["1"]["tree_auto"] == 2.0


def test_bad_arguments(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--repeats", "0"])
    assert bench.parse_args([]).concurrency == "1,32"
