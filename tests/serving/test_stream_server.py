"""The continuous-batching HTTP server over raw HTTP: correct outputs under concurrency,
streaming in OpenAI's chunk format, 503 under overload (never 500, never a hang),
disconnects free slots, drain on shutdown, bounded memory over a soak. Loopback only.
(The official `openai` client against it: test_openai_api.py.)"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import socket
import threading
import time

import pytest

import adaflash_jax as af
from adaflash_jax.serving.stream_server import SchedulerServer, build_scheduler
from spec_helpers import TEST_PROMPTS, distilled_drafter, random_prompts, tiny_target

SOAK_S = float(os.environ.get("ADAFLASH_SOAK_SECONDS", "45"))


def start(drafter=None, **kw) -> SchedulerServer:
    target = tiny_target()
    sched = build_scheduler(target, drafter, **{**dict(slots=4, max_prompt_len=16, max_new_tokens=32), **kw})
    srv = SchedulerServer(sched, tokenizer=None, vocab_size=target.cfg.vocab_size, stop_ids=target.eos_token_ids,
                          port=0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def stop(srv: SchedulerServer) -> None:
    srv.shutdown_gracefully()
    srv.server_close()


@pytest.fixture(scope="module")
def server():
    srv = start(distilled_drafter())
    yield srv
    stop(srv)


def post(port: int, body, timeout=600):  # first calls compile: slow on a loaded CPU
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, dict(resp.getheaders()), raw


def complete(port: int, body):
    status, _, raw = post(port, body)
    return status, json.loads(raw)


def events(raw: bytes) -> list:
    chunks = [line[len(b"data: "):] for line in raw.split(b"\n\n") if line.startswith(b"data: ")]
    assert chunks[-1] == b"[DONE]"
    return [json.loads(c) for c in chunks[:-1]]


def token_ids(payload: dict) -> list[int]:
    return payload["choices"][0]["token_ids"]


def test_concurrent_requests_match_per_prompt_generate(server):
    prompts = TEST_PROMPTS + random_prompts(5, seed=4, hi=12)
    lengths = [3 + 3 * i for i in range(len(prompts))]
    port = server.server_address[1]
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        got = list(pool.map(lambda i: complete(port, {"prompt": prompts[i], "max_tokens": lengths[i]}),
                            range(len(prompts))))
    for p, n, (status, payload) in zip(prompts, lengths, got):
        assert status == 200, payload
        want = af.generate(tiny_target(), [p], max_new_tokens=n, drafter=distilled_drafter()).token_ids[0]
        assert token_ids(payload) == want
        assert payload["usage"] == {"prompt_tokens": len(p), "completion_tokens": len(want),
                                    "total_tokens": len(p) + len(want)}
        assert payload["choices"][0]["finish_reason"] == ("length" if len(want) == n else "stop")
        assert 0 < payload["adaflash"]["ttft_s"] <= payload["adaflash"]["total_s"]


def test_streaming_sends_one_event_per_committed_chunk(server):
    port = server.server_address[1]
    body = {"prompt": TEST_PROMPTS[1], "max_tokens": 30}
    status, headers, raw = post(port, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    evs = events(raw)
    assert all(e["object"] == "text_completion" for e in evs)
    chunks = [e["choices"][0]["token_ids"] for e in evs[:-2]]
    assert len(chunks) > 1 and all(chunks)  # several steps, each committing >= 1 token
    finish, usage = evs[-2], evs[-1]
    assert finish["choices"][0]["finish_reason"] == "length" and finish["adaflash"]["steps"] > 0
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == sum(map(len, chunks)) == 30
    assert [t for c in chunks for t in c] == token_ids(complete(port, body)[1])


def test_seeded_sampling_through_the_server_equals_generate(server):
    port = server.server_address[1]
    body = {"prompt": TEST_PROMPTS[0], "max_tokens": 20, "temperature": 0.8, "seed": 5}
    noise = [{"prompt": p, "max_tokens": 25, "temperature": 1.0, "seed": i} for i, p in enumerate(TEST_PROMPTS)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        got = list(pool.map(lambda b: complete(port, b), noise + [body]))[-1]
    want = af.generate(tiny_target(), [TEST_PROMPTS[0]], max_new_tokens=20, temperature=0.8, seed=5,
                       drafter=distilled_drafter()).token_ids[0]  # the adaptive default: AR's samples
    assert got[0] == 200 and token_ids(got[1]) == want


@pytest.mark.parametrize("body,status,match", [
    ({"prompt": [1, 2], "max_tokens": 99}, 400, r"max_tokens must lie in \[1, 32\]"),
    ({"prompt": [1, 2], "temperature": -1.0}, 400, "temperature must be >= 0 and finite"),
    ({"prompt": [1, 2], "top_p": 0.0}, 400, "top_p"),
    ({"prompt": [1, 77]}, 400, "outside the vocabulary"),
    ({"prompt": list(range(1, 20))}, 400, "prompt has 19 tokens"),
    ({"prompt": "hi"}, 400, "no tokenizer"),
    ({"prompt": [1], "speculative": True}, 400, "unknown field"),
    ({"prompt": [1], "n": 2}, 400, "n > 1"),
    ({"prompt": [1], "stop": "x"}, 400, "'stop' strings need a tokenizer"),
    ({"prompt": [1], "model": "gpt-4"}, 404, "'gpt-4' does not exist"),
])
def test_bad_requests_get_a_clear_4xx(server, body, status, match):
    got, payload = complete(server.server_address[1], body)
    assert got == status and __import__("re").search(match, payload["error"]["message"]), payload
    assert payload["error"]["type"] == "invalid_request_error"


def test_overload_answers_503_with_retry_after_never_500():
    srv = start(slots=1, max_queue=2, modes=("greedy",))
    try:
        port = srv.server_address[1]
        with concurrent.futures.ThreadPoolExecutor(max_workers=12) as pool:
            got = list(pool.map(lambda i: post(port, {"prompt": [5 + i, 6], "max_tokens": 32}), range(12)))
        statuses = [s for s, _, _ in got]
        assert set(statuses) <= {200, 503} and 503 in statuses and 200 in statuses
        assert all(h.get("retry-after") for s, h, _ in got if s == 503)
        assert all(json.loads(raw)["error"]["message"].startswith("busy") for s, _, raw in got if s == 503)
    finally:
        stop(srv)


def _wait_idle(srv, seconds=30.0) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline and not srv.scheduler.idle():
        time.sleep(0.05)
    return srv.scheduler.idle()


def test_disconnect_frees_the_slot():
    srv = start(slots=1, max_new_tokens=32, modes=("greedy",))
    try:
        port = srv.server_address[1]
        for stream in (False, True):
            sock = socket.create_connection(("127.0.0.1", port))
            body = json.dumps({"prompt": [7, 8, 9], "max_tokens": 32, "stream": stream}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            deadline = time.time() + 30
            while srv.scheduler.running == 0 and time.time() < deadline:
                time.sleep(0.01)
            sock.close()  # gone mid-decode
            assert _wait_idle(srv), f"stream={stream}: the slot was not freed"
        assert complete(port, {"prompt": [1, 2], "max_tokens": 4})[0] == 200  # the slot serves again
    finally:
        stop(srv)


def test_shutdown_drains_running_requests_and_refuses_new_ones():
    srv = start(slots=2, modes=("greedy",))
    port = srv.server_address[1]
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        running = pool.submit(complete, port, {"prompt": [4, 5, 6], "max_tokens": 32})
        while srv.scheduler.running == 0:
            time.sleep(0.01)
        closer = pool.submit(srv.shutdown_gracefully)
        while srv.accepting:
            time.sleep(0.01)
        late = complete(port, {"prompt": [1], "max_tokens": 2})
        status, payload = running.result(timeout=60)
        closer.result(timeout=60)
    srv.server_close()
    assert status == 200 and len(token_ids(payload)) == 32
    assert late[0] == 503 and "shutting down" in late[1]["error"]["message"]


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_soak_under_overload_keeps_memory_bounded():
    """SOAK_S seconds of more traffic than 2 slots take: mixed lengths, streams, disconnects."""
    srv = start(slots=2, max_queue=4, modes=("greedy", "sample"))
    port = srv.server_address[1]
    counts = {200: 0, 503: 0}
    stop_at = [0.0]

    def client(i):
        while time.time() < stop_at[0]:
            body = {"prompt": [3 + i % 25, 4 + i % 7], "max_tokens": 1 + (i * 7) % 32,
                    "temperature": 0.0 if i % 3 else 0.9, "seed": i, "stream": i % 4 == 0}
            status, _, raw = post(port, body)
            assert status in counts, raw
            counts[status] += 1
            i += 16

    try:
        def run(seconds):
            stop_at[0] = time.time() + seconds
            with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
                list(pool.map(client, range(16)))

        run(5)  # warm-up: every shape compiled
        before = _rss_mb()
        run(SOAK_S)
        assert _wait_idle(srv)
        grown = _rss_mb() - before
    finally:
        stop(srv)
    assert counts[200] > 0 and counts[503] > 0
    assert grown < 64, f"RSS grew by {grown:.0f} MB over the soak"
