"""A request whose target logits go non-finite ends with an error; the rest of its batch
finishes with unchanged tokens and the server keeps serving.

The poison is a NaN row of the target's embedding, as in `tests/decoding/test_generate_nonfinite`:
token 5 sits in TEST_PROMPTS[0] only (NaN from its prefill), token 26 is TEST_PROMPTS[2]'s
first greedy token (NaN from its first step). No other prompt or continuation holds them.
With a drafter, a drafted token passes through the verify forward, and masked attention
carries a NaN there to the earlier positions of that row (0 x NaN): a request whose drafter
proposed the poisoned token fails too (its own logits went non-finite). Chain verification
drafts the same tokens on every run, and its drafter proposes neither token to the others; the
adaptive decoder's drafting depends on measured step times, so it is not used here."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading

import jax
import jax.numpy as jnp
import openai
import pytest

import adaflash_jax as af
from adaflash_jax.serving.stream_server import SchedulerServer, build_scheduler
from spec_helpers import TEST_PROMPTS, distilled_drafter, tiny_target

MAX_NEW = 24
IN_PROMPT_0, GENERATED_BY_2 = 5, 26
POISON, FAILING = (IN_PROMPT_0, GENERATED_BY_2), {0, 2}


def poisoned(target, token: int):
    """`target` with a NaN embedding row for `token`."""
    state = jax.tree.map(lambda x: x, target.state)
    state["embed"][...] = state["embed"][...].at[token].set(jnp.nan)
    return dataclasses.replace(target, state=state, name=f"{target.name}-nan{token}")


@pytest.fixture(scope="module", params=["ar", "chain"])
def served(request):
    target = tiny_target()
    bad = target
    for token in POISON:
        bad = poisoned(bad, token)
    drafter = distilled_drafter() if request.param == "chain" else None
    scheduler = build_scheduler(bad, drafter, slots=4, max_prompt_len=16, max_new_tokens=MAX_NEW,
                                modes=("greedy",), verify=request.param if drafter else None)
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
