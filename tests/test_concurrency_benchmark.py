"""benchmarks/concurrency.py treats every method alike: a fake `generate` records the calls.

No model runs: the fake returns fixed stats, so the test checks only the schedule (same
warm-up and timed calls per method, order rotated per repeat), the median and the rows.
"""

import types

import pytest
from bench_loader import benchmark_module


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("concurrency") as module:
        yield module


METHODS = {"ar": {"tag": "ar"}, "dflash_opd": {"tag": "dflash_opd", "drafter": "d"},
           "adaflash": {"tag": "adaflash", "drafter": "d"}}


class FakeGenerate:
    """Walls 1, 2, 3, ... per method in call order; speculative methods report acceptance."""

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, *, max_new_tokens, tag, drafter=None):
        self.calls.append(tag)
        n = sum(c == tag for c in self.calls)
        stats = {"wall_time_s": float(n), "new_tokens": 12, "compile_time_s": 5.0 if n == 1 else 0.0}
        if drafter is not None:
            stats.update(acceptance_lengths=[[2, 3], [1]], mean_tau=2.0, verify_steps=3, mean_verify_len=4.0,
                         verified_per_committed=2.0, drafted_step_fraction=1.0)
        return types.SimpleNamespace(token_ids=[[1, 2]] * len(prompts), stats=stats)


@pytest.mark.parametrize("warmup, repeats", [(1, 3), (2, 4), (0, 1)])
def test_every_method_gets_the_same_calls_in_rotated_order(bench, warmup, repeats):
    fake = FakeGenerate()
    rows = bench.measure_point(METHODS, [[5], [6]], ["code", "math"], warmup=warmup, repeats=repeats,
                               max_new_tokens=8, generate=fake)
    names = list(METHODS)
    assert all(fake.calls.count(n) == warmup + repeats for n in names)
    assert fake.calls[:warmup * len(names)] == names * warmup  # the same warm-up for all
    timed = fake.calls[warmup * len(names):]
    for r in range(repeats):
        k = r % len(names)
        assert timed[r * len(names):(r + 1) * len(names)] == names[k:] + names[:k]
    for name, row in rows.items():
        walls = [float(i) for i in range(warmup + 1, warmup + repeats + 1)]  # the timed calls only
        assert row["wall_s_runs"] == walls and row["wall_s"] == warmup + (repeats + 1) / 2  # their median
        assert row["tokens_per_s"] == 12 / row["wall_s"]
        assert row["identical_to_ar"] and row["speedup_vs_ar"] == 1.0 and row["compile_s"] == 5.0
    assert rows["adaflash"]["tau_per_domain"] == {"code": 2.5, "math": 1.0}
    assert "mean_tau" not in rows["ar"]


def test_paired_speedup_compares_the_calls_of_one_round(bench):
    """The machine slows 10x after the second round and drifts within it: each round's AR
    call still takes twice the method's, and the paired ratio is that in every round."""
    fake = FakeGenerate()
    slow = {"ar": 2.0, "adaflash": 1.0}

    def drifting(prompts, *, max_new_tokens, tag, drafter=None):
        res = fake(prompts, max_new_tokens=max_new_tokens, tag=tag, drafter=drafter)
        n = fake.calls.count(tag)  # call n of this method is in round n (no warm-up)
        res.stats["wall_time_s"] = slow[tag] * (1.0 if n <= 2 else 10.0) * (1.0 + 0.1 * n)
        return res

    methods = {k: METHODS[k] for k in ("ar", "adaflash")}
    rows = bench.measure_point(methods, [[5]], ["code"], warmup=0, repeats=4, max_new_tokens=8,
                               generate=drifting)
    assert rows["adaflash"]["paired_speedup"] == pytest.approx(2.0)
    assert rows["adaflash"]["paired_speedup_range"] == pytest.approx([2.0, 2.0])
    assert rows["ar"]["paired_speedup"] == 1.0


def test_prompts_come_from_the_fixed_set_capped_and_cycled(bench, monkeypatch):
    asked = []

    def fake_heldout(target, per_domain):
        asked.append(per_domain)
        return {d: [types.SimpleNamespace(ids=[i, j]) for j in range(per_domain)]
                for i, d in enumerate(bench.EVAL_DOMAINS)}

    monkeypatch.setattr(bench, "heldout_prompts", fake_heldout)
    ids, labels = bench.mixed_prompts(None, 200)  # 50 per domain asked: 32 exist
    assert asked == [32] and len(ids) == 200
    assert labels[:4] == list(bench.EVAL_DOMAINS) and ids[:4] == [[0, 0], [1, 0], [2, 0], [3, 0]]
    assert ids[32 * 4] == ids[0]  # cycled past the 32nd prompt of each domain
    ids, _ = bench.mixed_prompts(None, 6)
    assert asked[-1] == 2 and ids == [[0, 0], [1, 0], [2, 0], [3, 0], [0, 1], [1, 1]]


def test_defaults_and_bad_arguments(bench):
    args = bench.parse_args([])
    assert args.concurrency == "1,8,32,64" and args.repeats == 3 and args.warmup == 1
    with pytest.raises(SystemExit):
        bench.parse_args(["--repeats", "0"])


def test_batches_one_after_another_merge_into_one_result(bench):
    """Concurrency 1 over four prompts: four calls of one prompt; sums and weighted means."""
    seen = []

    def fake(prompts, *, max_new_tokens, drafted):
        seen.append(list(prompts))
        lengths = [[2, 2] if p[0] % 2 else [1, 3, 1] for p in prompts]
        stats = {"wall_time_s": 0.5, "compile_time_s": 0.0, "new_tokens": 4 * len(prompts),
                 "acceptance_lengths": lengths, "mean_tau": 0.0, "verify_steps": len(lengths[0]),
                 "mean_verify_len": 4.0 if prompts[0][0] % 2 else 1.0, "verified_per_committed": 2.0,
                 "drafted_step_fraction": drafted}
        return types.SimpleNamespace(token_ids=[[p[0]] for p in prompts], stats=stats)

    res = bench.decode_in_batches(fake, [[1], [2], [3], [4]], 1, max_new_tokens=4, drafted=0.5)
    assert seen == [[[1]], [[2]], [[3]], [[4]]] and res.token_ids == [[1], [2], [3], [4]]
    st = res.stats
    assert st["wall_time_s"] == 2.0 and st["new_tokens"] == 16 and st["verify_steps"] == 10
    assert st["mean_tau"] == 18 / 10 and st["acceptance_lengths"][1] == [1, 3, 1]
    assert st["mean_verify_len"] == (2 * 4.0 * 2 + 2 * 1.0 * 3) / 10  # weighted by row-steps
    assert st["drafted_step_fraction"] == 0.5
    two = bench.decode_in_batches(fake, [[1], [2], [3], [4]], 2, max_new_tokens=4, drafted=1.0)
    assert seen[-2:] == [[[1], [2]], [[3], [4]]] and two.stats["wall_time_s"] == 1.0


def test_resume_keeps_a_record_of_the_same_settings_and_refuses_another(bench, tmp_path, capsys):
    settings = {"model": "m", "warmup": 1, "repeats": 3, "methods": ["ar", "adaflash/default"]}
    path = str(tmp_path / "c.json")
    assert bench.resumed_record(path, settings) == {}  # nothing yet: measure everything
    partial = dict(settings, results={"1": {"ar": {"wall_s": 1.0}}}, measured_at={"1": "t"})
    bench.atomic_write_json(path, partial)
    assert bench.resumed_record(path, settings)["results"] == partial["results"]
    with pytest.raises(SystemExit, match="repeats"):
        bench.resumed_record(path, dict(settings, repeats=5))
    assert bench.resumed_record(path, settings) == partial  # the refused run wrote nothing
    with pytest.raises(SystemExit):
        bench.parse_args(["--resume"])
    assert "--resume needs --out" in capsys.readouterr().err
