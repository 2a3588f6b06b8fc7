"""A request whose target logits go non-finite ends with an error; the rest of its batch
finishes with unchanged tokens and the server keeps serving.

The poison is a NaN row of the target's embedding, as in `tests/decoding/test_generate_nonfinite`:
token 5 sits in TEST_PROMPTS[0] only (NaN from its prefill), token 26 is TEST_PROMPTS[2]'s
first greedy token (NaN from its first step). No other prompt or continuation holds them.
A drafted token passes through the verify forward, but only the queries that attend to it
(the later tokens of its chain, its subtree in a tree) see its NaN: the projections store
non-finite values as 0, so a masked NaN reaches no other query, row or later request
(`tests/models/test_nonfinite_attention`). Which requests fail is therefore what they
decode, not what their drafter proposed or which requests shared their steps: the adaptive
decoder, whose budgets depend on the whole batch, fails the same requests."""

from __future__ import annotations

import concurrent.futures
import threading

import jax
import numpy as np
import openai
import pytest

import adaflash_jax as af
from adaflash_jax.serving.scheduler import Request, Scheduler
from adaflash_jax.serving.slot_engine import LocalEngine
from adaflash_jax.serving.stream_server import SchedulerServer, build_scheduler
from nonfinite_helpers import fixed_costs, poisoned
from spec_helpers import TEST_PROMPTS, distilled_drafter, tiny_target

MAX_NEW = 24
IN_PROMPT_0, GENERATED_BY_2 = 5, 26
POISON, FAILING = (IN_PROMPT_0, GENERATED_BY_2), {0, 2}


@pytest.fixture(scope="module", params=["ar", "chain", "adaptive"])
def served(request):
    target = tiny_target()
    bad = poisoned(target, *POISON)
    drafter = distilled_drafter() if request.param != "ar" else None
    scheduler = build_scheduler(bad, drafter, slots=4, max_prompt_len=16, max_new_tokens=MAX_NEW,
                                modes=("greedy",), verify=request.param if drafter else None,
                                step_costs=fixed_costs(1.0) if request.param == "adaptive" else None)
    server = SchedulerServer(scheduler, vocab_size=target.cfg.vocab_size, stop_ids=target.eos_token_ids, port=0,
                             model=bad.name)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address
    assert host == "127.0.0.1"
    client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="unused", max_retries=0, timeout=600)
    clean = af.generate(target, TEST_PROMPTS, max_new_tokens=MAX_NEW).token_ids
    yield client, bad.name, FAILING, clean
    server.shutdown_gracefully()
    server.server_close()


def complete(client, model, prompt, **kw):
    got = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_NEW, **kw)
    return got.choices[0].model_extra["token_ids"]


def test_the_poisoned_request_fails_and_its_batch_finishes_unchanged(served):
    client, model, failing, clean = served
    with concurrent.futures.ThreadPoolExecutor(len(TEST_PROMPTS)) as pool:  # one batch of 4 slots
        futures = [pool.submit(complete, client, model, p) for p in TEST_PROMPTS]
    for i, future in enumerate(futures):
        if i in failing:
            with pytest.raises(openai.InternalServerError, match="non-finite") as info:
                future.result()
            assert info.value.body["type"] == "server_error"
        else:
            assert future.result() == clean[i]


def test_a_streamed_poisoned_request_ends_with_an_error_event(served):
    client, model, failing, _ = served
    stream = client.completions.create(model=model, prompt=TEST_PROMPTS[min(failing)], max_tokens=MAX_NEW,
                                       stream=True)
    with pytest.raises(openai.APIError, match="non-finite"):
        for _ in stream:
            pass


def test_the_server_keeps_serving_after_failures(served):
    client, model, failing, clean = served
    healthy = [i for i in range(len(TEST_PROMPTS)) if i not in failing]
    for i in healthy:
        assert complete(client, model, TEST_PROMPTS[i]) == clean[i]
    streamed = client.completions.create(model=model, prompt=TEST_PROMPTS[healthy[0]], max_tokens=MAX_NEW,
                                         stream=True)
    ids = [t for c in streamed if c.choices for t in c.choices[0].model_extra.get("token_ids", [])]
    assert ids == clean[healthy[0]]


def finite_values(engine: LocalEngine) -> bool:
    """Whether every value the engine's target and drafter caches hold is finite."""
    caches = (engine.state.tcache.v, engine.state.ctx.v)
    return all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(caches))


def test_a_slot_reused_after_a_poisoned_request_decodes_like_a_fresh_one():
    """One slot of the adaptive decoder, mostly in AR steps (whose target features wait in the
    slot's ring for the next drafted step), serves the failing request, then a clean one."""
    target, drafter = tiny_target(), distilled_drafter()
    clean = af.generate(target, [TEST_PROMPTS[3]], max_new_tokens=MAX_NEW).token_ids[0]
    engine = LocalEngine(poisoned(target, GENERATED_BY_2), drafter, num_slots=1, max_prompt_len=16,
                         max_new_tokens=MAX_NEW, step_costs=fixed_costs(1e-3))
    failed = Scheduler({"greedy": engine}).run([Request(TEST_PROMPTS[2], MAX_NEW)])[0]
    assert bool(engine.state.nonfinite[0]) and len(failed) == 1  # its first token, then the failure
    assert finite_values(engine)
    drafted = int(engine.state.drafted_steps)
    assert Scheduler({"greedy": engine}).run([Request(TEST_PROMPTS[3], MAX_NEW)])[0] == clean
    assert int(engine.state.drafted_steps) > drafted and finite_values(engine)  # the ring reached the drafter
