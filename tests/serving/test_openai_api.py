"""The official `openai` client against the server on loopback: models, completions (a raw
prompt), chat (the same text as `af.generate` on the same message), streamed chat (deltas
concatenate to the whole answer), stop strings, usage, a 400, a 404 and a 503.

The target is tiny and random but carries SmolLM2's tokenizer and chat template, so text,
templates and stop strings are the real ones at a fraction of the compute."""

from __future__ import annotations

import concurrent.futures
import threading

import openai
import pytest

import adaflash_jax as af
from adaflash_jax.checkpoints.gguf import smollm2_gguf_path
from adaflash_jax.checkpoints.tokenizer import Tokenizer
from adaflash_jax.models.config import ModelConfig
from adaflash_jax.serving.stream_server import SchedulerServer, build_scheduler

MESSAGE = "Name three prime numbers."
MAX_NEW = 24


@pytest.fixture(scope="module")
def texty_target():
    tokenizer = Tokenizer.from_gguf(smollm2_gguf_path())
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
                      eos_token_ids=tuple(tokenizer.eos_token_ids))
    return af.random_target(cfg, seed=1, tokenizer=tokenizer)


def start_server(target, **settings) -> SchedulerServer:
    scheduler = build_scheduler(target, None, **{**dict(slots=4, max_prompt_len=64, max_new_tokens=MAX_NEW,
                                                        modes=("greedy",)), **settings})
    server = SchedulerServer(scheduler, tokenizer=target.tokenizer, vocab_size=target.cfg.vocab_size,
                             model=target.name, stop_ids=target.eos_token_ids, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def stop_server(server: SchedulerServer) -> None:
    server.shutdown_gracefully()
    server.server_close()


def client_for(server: SchedulerServer) -> openai.OpenAI:
    host, port = server.server_address
    assert host == "127.0.0.1"
    # first requests compile the engine's programs: slow on a loaded CPU
    return openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def server(texty_target):
    srv = start_server(texty_target)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def client(server):
    return client_for(server)


@pytest.fixture(scope="module")
def chat_answer(client, texty_target):
    return client.chat.completions.create(model=texty_target.name, max_tokens=MAX_NEW,
                                          messages=[{"role": "user", "content": MESSAGE}])


def test_models_lists_the_served_model(client, texty_target):
    assert [m.id for m in client.models.list().data] == [texty_target.name]
    assert client.models.retrieve(texty_target.name).id == texty_target.name
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4")


def test_chat_returns_the_text_of_generate_on_the_same_message(chat_answer, texty_target):
    want = af.generate(texty_target, [MESSAGE], max_new_tokens=MAX_NEW)
    choice = chat_answer.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want.texts[0]
    assert choice.message.content.strip(), "an empty answer compares nothing"
    assert choice.finish_reason == ("length" if len(want.token_ids[0]) == MAX_NEW else "stop")
    prompt = texty_target.tokenizer.encode(texty_target.tokenizer.apply_chat_template(
        [{"role": "user", "content": MESSAGE}]))
    assert chat_answer.usage.prompt_tokens == len(prompt)
    assert chat_answer.usage.completion_tokens == len(want.token_ids[0])
    assert chat_answer.usage.total_tokens == len(prompt) + len(want.token_ids[0])
    assert chat_answer.model_extra["adaflash"]["steps"] > 0


def test_streamed_chat_deltas_concatenate_to_the_whole_answer(client, chat_answer, texty_target):
    stream = client.chat.completions.create(model=texty_target.name, max_tokens=MAX_NEW, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": MESSAGE}])
    chunks = list(stream)
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert sum(bool(d) for d in deltas) > 1  # streamed in pieces, not at the end
    assert "".join(deltas) == chat_answer.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [chat_answer.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == chat_answer.usage.model_dump()


def test_completions_continue_a_raw_prompt_without_the_chat_template(client, texty_target):
    prompt = "The three primary colours are"
    got = client.completions.create(model=texty_target.name, prompt=prompt, max_tokens=12)
    ids = texty_target.tokenizer.encode(prompt)  # raw: no template
    want = af.generate(texty_target, [ids], max_new_tokens=12)
    assert got.choices[0].text == texty_target.tokenizer.decode(want.token_ids[0], skip_special_tokens=True)
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(want.token_ids[0])
    by_ids = client.completions.create(model=texty_target.name, prompt=ids, max_tokens=12)
    assert by_ids.choices[0].text == got.choices[0].text


def test_stop_strings_end_the_text_before_them(client, chat_answer, texty_target):
    full = chat_answer.choices[0].message.content
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip() and full.index(stop) > 0
    messages = [{"role": "user", "content": MESSAGE}]
    got = client.chat.completions.create(model=texty_target.name, max_tokens=MAX_NEW, stop=[stop, "\x00never"],
                                         messages=messages)
    assert got.choices[0].message.content == full[:full.index(stop)]
    assert got.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model=texty_target.name, max_tokens=MAX_NEW, stop=stop, stream=True,
                                              messages=messages)
    parts = [(c.choices[0].delta.content or "", c.choices[0].finish_reason) for c in streamed if c.choices]
    assert "".join(p for p, _ in parts) == full[:full.index(stop)]
    assert [f for _, f in parts if f] == ["stop"]


@pytest.mark.parametrize("kwargs,match", [
    (dict(n=2), "n > 1"),
    (dict(max_tokens=MAX_NEW + 1), rf"max_tokens must lie in \[1, {MAX_NEW}\]"),
    (dict(temperature=0.7), "serves \\['greedy'\\] requests"),
    (dict(messages=[{"role": "tool", "content": "x"}]), "role 'tool'"),
    (dict(messages=[]), "at least one message"),
    (dict(presence_penalty=0.5), "presence_penalty=0.5 is not supported"),
])
def test_bad_input_raises_bad_request_error(client, texty_target, kwargs, match):
    args = {"model": texty_target.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError, match=match) as caught:
        client.chat.completions.create(**args)
    assert caught.value.status_code == 400 and caught.value.type == "invalid_request_error"


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError, match="'gpt-4' does not exist") as caught:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.code == "model_not_found"


def test_a_full_queue_answers_503_with_retry_after(texty_target):
    srv = start_server(texty_target, slots=1, max_queue=1)
    try:
        client = client_for(srv)

        def ask(i):
            try:
                client.completions.create(model=texty_target.name, prompt=[5 + i, 6, 7], max_tokens=MAX_NEW)
                return 200, None
            except openai.APIStatusError as error:
                return error.status_code, error

        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            got = list(pool.map(ask, range(8)))
        statuses = [s for s, _ in got]
        assert set(statuses) == {200, 503}, statuses
        busy = [e for s, e in got if s == 503]
        assert all(isinstance(e, openai.InternalServerError) and e.response.headers["retry-after"] == "1"
                   and "busy" in e.message for e in busy)
    finally:
        stop_server(srv)
