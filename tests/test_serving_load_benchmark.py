"""benchmarks/serving_load.py on the tiny test models: a short Poisson run through the openai
client over loopback, at multiples of the measured saturation rate, for AR and DFlash under
both admissions (the adaptive method's engine is built, not run: its calibration is long on
a CPU), the JSON fields present and sane."""

import json

import pytest
from flax import nnx

from adaflash_jax.decoding.length_policy import unit_costs
from adaflash_jax.decoding.packing import default_buckets
from adaflash_jax.models.length_head import LengthHead
from adaflash_jax.serving.loadgen import poisson_arrivals
from spec_helpers import BLOCK, TINY, distilled_drafter, random_prompts, tiny_target
from bench_loader import benchmark_module


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("serving_load") as module:
        yield module


def test_arrivals_are_seeded_poisson_within_the_window():
    a = poisson_arrivals(50.0, 4.0, num_prompts=7, max_tokens=[8, 16], seed=3)
    assert a == poisson_arrivals(50.0, 4.0, num_prompts=7, max_tokens=[8, 16], seed=3)
    assert a != poisson_arrivals(50.0, 4.0, num_prompts=7, max_tokens=[8, 16], seed=4)
    assert 150 < len(a) < 250  # ~200 expected
    assert all(0 <= x.at_s < 4.0 and 0 <= x.prompt < 7 and x.max_tokens in (8, 16) for x in a)
    assert [x.at_s for x in a] == sorted(x.at_s for x in a)


def test_arguments_and_the_max_tokens_mix(bench):
    args = bench.parse_args([])
    assert args.loads == [0.5, 2.0] and args.slots == 8 and args.max_queue == 16
    assert args.methods == ["ar", "adaptive"] and args.admissions == ["continuous", "static"]
    assert args.prefill_budget == 256 and args.drafter == "smollm2-135m-instruct-dflash"
    assert bench.max_tokens_mix(128) == [8, 16, 32, 64, 128]
    assert bench.max_tokens_mix(256) == [8, 16, 32, 64, 128, 256]
    assert bench.max_tokens_mix(20) == [8, 16, 20]
    for bad in (["--loads", "0"], ["--methods", "beam"], ["--admissions", "eager"], ["--loads", "a,b"],
                ["--prefill-budget", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_short_run_on_tiny_models_measures_both_admissions(bench, tmp_path):
    target = tiny_target()
    drafter = distilled_drafter()
    with_head = drafter.with_length_head(LengthHead(TINY.hidden_size, 16, rngs=nnx.Rngs(3)))
    # unit step costs: AdaFlash's "auto" policy without calibrating (only it reads them)
    make = dict(num_slots=4, max_prompt_len=32, max_new_tokens=32, greedy=True,
                step_costs=lambda k: unit_costs(default_buckets(k, BLOCK)))
    engines = {name: bench.method_engine(name, target, d, **make)
               for name, d in (("ar", None), ("dflash", drafter))}
    assert {n: e.length_policy for n, e in engines.items()} == {"ar": None, "dflash": "fixed"}
    assert bench.method_engine("adaflash", target, with_head, **make).length_policy == "auto"
    assert bench.method_engine("adaptive", target, drafter, **{**make, "step_costs": None}).verify == "adaptive"
    # two prompts longer than a chunk of the 32-token budget: chunked prefill runs too
    prompts = random_prompts(6, seed=3) + random_prompts(2, seed=4, lo=20, hi=30)
    mix = bench.max_tokens_mix(32)
    loads = [0.5, 2.0]
    out = bench.measure(engines, prompts, loads, duration_s=1.5, drain_s=60.0, seed=1, mix=mix,
                        vocab_size=target.cfg.vocab_size, max_queue=8, log=lambda msg: None, prefill_budget=32)
    assert out["saturation"]["method"] == "ar" and out["saturation"]["requests_per_s"] > 0
    assert out["saturation"]["completed"] == out["saturation"]["burst"] == 12
    assert set(out["warmup"]) == set(engines)
    assert all(w["completed"] == w["requests"] == 8 for w in out["warmup"].values())
    for name in engines:
        for admission in ("continuous", "static"):
            for load in map(str, loads):
                row = out["results"][name][admission][load]
                assert row["server_errors_5xx"] == 0 and row["client_errors"] == 0, row
                assert set(row["statuses"]) <= {"200", "503"} and row["resets"] == 0, row
                assert row["ok_200"] + row["rejected_503"] == row["requests"]
                assert row["completed"] + row["rejected_503"] + row["cut_at_drain"] == row["requests"] > 0
                assert row["completed"] > 0 and row["generated_tokens"] > 0 and row["throughput_tok_s"] > 0
                ttft, tpot, itl = row["ttft_s"], row["per_token_s"], row["inter_token_s"]
                assert 0 < ttft["p50"] <= ttft["p99"] and 0 < tpot["p50"] <= tpot["p99"]
                assert 0 < itl["p50"] <= itl["p99"]
                assert 0 < row["occupancy_step_avg"] <= 1 and 0 <= row["occupancy_time_avg"] <= 1
                assert row["offered_tok_s_upper"] > 0
                assert row["offered_requests_per_s"] == pytest.approx(float(load) * out["saturation"]["requests_per_s"])
        # every (method, admission) saw the same schedule at a load
        requests = {out["results"][name][a][str(loads[0])]["requests"] for a in ("continuous", "static")}
        assert len(requests) == 1
    assert out["results"]["ar"]["static"]["0.5"]["requests"] == out["results"]["dflash"]["continuous"]["0.5"][
        "requests"]
    assert "continuous_over_static_throughput" in out["summary"]["dflash"]["2.0"]
    record = {"model": "tiny", "loads": loads, "slots": 4, "max_tokens_mix": mix, "backend": "cpu", **out}
    json.dumps(record)  # serializable
    bench.plot(record, str(tmp_path / "load.png"))
    assert (tmp_path / "load.png").stat().st_size > 0
