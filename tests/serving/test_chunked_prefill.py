"""Chunked prefill: a prompt longer than a chunk is prefilled over several scheduler
iterations, between decode steps of the running requests, with the same tokens as an
unchunked prefill (greedy: `af.generate`'s; sampled: the same seeded draws)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import adaflash_jax as af
from spec_helpers import distilled_drafter, random_prompts, tiny_target
from adaflash_jax.serving.scheduler import Request, Scheduler
from adaflash_jax.serving.slot_engine import LocalEngine

SLOTS, PROMPT, CAP = 4, 64, 24
BUDGET = 32  # chunks of 16 prompt tokens


def long_and_short():
    rng = np.random.default_rng(5)
    longs = [rng.integers(0, 32, size=n).tolist() for n in (61, 40, 23, 17)]
    return longs + random_prompts(4, seed=6)


def counted(engine):
    """`engine` whose prefill_chunk calls are counted in engine.chunks."""
    engine.chunks = 0
    chunk = engine.prefill_chunk

    def counting(*args, **kw):
        engine.chunks += 1
        return chunk(*args, **kw)

    engine.prefill_chunk = counting
    return engine


def engine(drafter=None, greedy=True, verify=None):
    return counted(LocalEngine(tiny_target(), drafter, num_slots=SLOTS, max_prompt_len=PROMPT, max_new_tokens=CAP,
                               greedy=greedy, verify=verify))


def test_chunk_size_is_half_the_budget_as_a_power_of_two():
    eng = LocalEngine(tiny_target(), None, num_slots=2, max_prompt_len=16, max_new_tokens=4)
    sizes = {b: Scheduler({"greedy": eng}, max_prefill_tokens=b).chunk_tokens for b in (1, 32, 100, 512, 2048)}
    assert sizes == {1: 16, 32: 16, 100: 32, 512: 256, 2048: 1024}


@pytest.mark.parametrize("verify", [None, "chain", "adaptive"])
def test_greedy_chunked_prefill_gives_generate_tokens(verify):
    drafter = distilled_drafter() if verify else None
    prompts = long_and_short()
    max_new = [CAP, 9, 17, CAP, 5, CAP, 12, 20]
    eng = engine(drafter, verify=verify)
    sched = Scheduler({"greedy": eng}, max_prefill_tokens=BUDGET)
    got = sched.run([Request(p, m) for p, m in zip(prompts, max_new)], arrivals=[0, 0, 1, 1, 2, 3, 3, 6])
    for p, m, out in zip(prompts, max_new, got):  # greedy speculative decoding is AR's tokens
        assert out == af.generate(tiny_target(), [p], max_new_tokens=m).token_ids[0]
    assert eng.chunks >= 3 + 2 + 1 + 1  # 61, 40, 23, 17 tokens in chunks of 16 (the last one inserts)
    assert sched.idle() and not sched.pools["greedy"].reserved


def test_seeded_sampling_is_unchanged_by_chunking():
    prompts = long_and_short()
    requests = lambda: [Request(p, CAP, temperature=0.9, top_p=0.95, seed=100 + i, stream=i)  # noqa: E731
                        for i, p in enumerate(prompts)]
    chunked = Scheduler({"sample": engine(greedy=False)}, max_prefill_tokens=BUDGET).run(requests())
    whole = Scheduler({"sample": engine(greedy=False)}, max_prefill_tokens=4096).run(requests())
    assert chunked == whole


def test_running_requests_stream_while_a_long_prompt_prefills():
    """A long prompt's four chunks take four iterations; the running request emits a token in
    each, and a short prompt arriving behind the long one starts before the long one's first token."""
    short, late = random_prompts(2, seed=8)
    long = long_and_short()[0]  # 61 tokens: chunks at 0, 16, 32 and the last 13 (the insert)
    sched = Scheduler({"greedy": engine()}, max_prefill_tokens=BUDGET)
    first = sched.submit(Request(short, CAP))
    sched.iterate()
    big = sched.submit(Request(long, CAP))
    small = sched.submit(Request(late, CAP))
    first_token_at = {}
    for it in range(6):
        for u in sched.iterate():
            if u.new_tokens:
                first_token_at.setdefault(u.ticket, it)
                if u.ticket == first:
                    first_token_at.setdefault(("running", it), True)
    assert all(("running", it) in first_token_at for it in range(6))  # never stalled
    assert first_token_at[small] < first_token_at[big] == 3


def test_serve_takes_the_prefill_budget_flag():
    from adaflash_jax import cli_serve
    from adaflash_jax.serving import scheduler
    from adaflash_jax.serving.stream_server import build_scheduler

    from adaflash_jax.cli import build_parser

    assert cli_serve.PREFILL_BUDGET == scheduler.PREFILL_BUDGET
    assert build_parser().parse_args(["serve"]).prefill_budget == scheduler.PREFILL_BUDGET
    assert build_parser().parse_args(["serve", "--prefill-budget", "64"]).prefill_budget == 64
    built = build_scheduler(tiny_target(), None, slots=2, max_prompt_len=16, max_new_tokens=4, modes=("greedy",),
                            prefill_budget=64)
    assert built.max_prefill_tokens == 64 and built.chunk_tokens == 32


def test_an_exported_engine_prefills_in_chunks_with_the_same_tokens(tmp_path):
    from adaflash_jax.decoding.export import export_decoder
    from adaflash_jax.serving.exported_engine import ExportedEngine, build_scheduler

    export_decoder(tiny_target(), str(tmp_path / "a"), max_prompt_len=PROMPT, max_new_tokens=CAP, modes=("greedy",))
    eng = counted(ExportedEngine(str(tmp_path / "a"), SLOTS, "greedy"))
    prompts, max_new = long_and_short()[:6], [CAP, 9, 17, CAP, 5, 12]
    got = Scheduler({"greedy": eng}, max_prefill_tokens=BUDGET).run([Request(p, m) for p, m in zip(prompts, max_new)])
    for p, m, out in zip(prompts, max_new, got):
        assert out == af.generate(tiny_target(), [p], max_new_tokens=m).token_ids[0]
    assert eng.chunks >= 3 + 2 + 1 + 1
    assert build_scheduler(str(tmp_path / "a"), prefill_budget=64).chunk_tokens == 32
    # An artifact exported before chunked prefill (without its two functions) takes whole prompts.
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    for name in ("engine_prefill_chunk_greedy", "engine_insert_chunked_greedy"):
        del manifest["functions"][name]
    (tmp_path / "a" / "manifest.json").write_text(json.dumps(manifest))
    older = counted(ExportedEngine(str(tmp_path / "a"), SLOTS, "greedy"))
    assert not older.chunked_prefill
    with pytest.raises(ValueError, match="exported without chunked prefill; re-export it"):
        older.prefill_chunk([0], [prompts[0][:16]], [0])
    assert Scheduler({"greedy": older}, max_prefill_tokens=BUDGET).run([Request(prompts[0], 5)])[0] == got[0][:5]
    assert older.chunks == 1  # the refused call above: the scheduler prefilled the prompt whole
