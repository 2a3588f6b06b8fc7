"""A burst of more concurrent requests than slots + queue gets only 200s and 503s (no reset,
no hang), and GET /metrics, parsed as Prometheus text, counts exactly what the clients saw."""

from __future__ import annotations

import http.client
import json
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from adaflash_jax.serving.stream_server import SchedulerServer, build_scheduler
from spec_helpers import TEST_PROMPTS, distilled_drafter, tiny_target

BURST = 300


def start(drafter=None, **settings) -> SchedulerServer:
    target = tiny_target()
    scheduler = build_scheduler(target, drafter, **{**dict(slots=2, max_queue=8, max_prompt_len=16,
                                                           max_new_tokens=8, modes=("greedy",)), **settings})
    server = SchedulerServer(scheduler, vocab_size=target.cfg.vocab_size, stop_ids=target.eos_token_ids, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def stop(server: SchedulerServer) -> None:
    server.shutdown_gracefully()
    server.server_close()


def post(port: int, body: dict, timeout: float = 600) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def scrape(port: int) -> dict:
    """{(sample name, sorted labels): value} of GET /metrics."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/plain")
    text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def burst(port: int, n: int) -> list:
    """n requests sent at once, each on its own connection: (status, payload) or the exception."""
    results: list = [None] * n
    gate = threading.Barrier(n)

    def one(i):
        gate.wait()
        try:
            results[i] = post(port, {"prompt": [1 + i % 30, 2, 3], "max_tokens": 1 + i % 8})
        except Exception as error:  # a reset or timeout is what this test looks for
            results[i] = error

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    assert not any(t.is_alive() for t in threads), "a request hung"
    return results


@pytest.fixture(scope="module")
def burst_server():
    server = start()
    post(server.server_address[1], {"prompt": [1, 2], "max_tokens": 8})  # compile before the burst
    yield server
    stop(server)


def test_a_burst_beyond_slots_and_queue_gets_only_200s_and_503s(burst_server):
    port = burst_server.server_address[1]
    before = scrape(port)
    results = burst(port, BURST)
    errors = [r for r in results if isinstance(r, Exception)]
    assert not errors, f"{len(errors)} connection errors, e.g. {errors[0]!r}"
    statuses = [s for s, _ in results]
    assert set(statuses) == {200, 503}, sorted(set(statuses))
    assert statuses.count(503) >= BURST - 2 - 8 - 64, "far fewer 503s than slots + queue allow"
    assert all(p["error"]["type"] == "server_overloaded" for s, p in results if s == 503)

    after = scrape(port)  # the counters agree with the clients
    key = lambda status: ("adaflash_requests_total", (("endpoint", "/v1/completions"), ("status", status)))  # noqa: E731
    for status in ("200", "503"):
        assert after[key(status)] - before.get(key(status), 0) == statuses.count(int(status))
    tokens = sum(p["usage"]["completion_tokens"] for s, p in results if s == 200)
    grew = lambda name: after[(name, ())] - before[(name, ())]  # noqa: E731
    assert grew("adaflash_generated_tokens_total") == tokens
    assert grew("adaflash_time_to_first_token_seconds_count") == statuses.count(200)
    assert after[("adaflash_queue_depth", ())] == 0
    assert after[("adaflash_slots_running", (("engine", "greedy"),))] == 0
    assert after[("adaflash_slots_free", (("engine", "greedy"),))] == 2
    # AR: every decode step commits exactly one token, and no step drafts
    assert after[("adaflash_mean_tau", (("engine", "greedy"),))] == 1.0
    assert after[("adaflash_drafted_step_fraction", (("engine", "greedy"),))] == 0.0
    assert burst_server.health()["status"] == "ok" and post(port, {"prompt": [4], "max_tokens": 2})[0] == 200


def test_metrics_of_a_speculative_engine_report_its_drafting():
    server = start(distilled_drafter(), slots=1, max_new_tokens=32, verify="chain")
    try:
        port = server.server_address[1]
        status, payload = post(port, {"prompt": TEST_PROMPTS[2], "max_tokens": 32})
        assert status == 200 and payload["usage"]["completion_tokens"] == 32
        assert post(port, {"prompt": [1], "max_tokens": 99})[0] == 400
        got = scrape(port)
        steps = payload["adaflash"]["steps"]
        assert got[("adaflash_mean_tau", (("engine", "greedy"),))] == pytest.approx(31 / steps)
        assert 31 / steps > 1.5  # the distilled drafter is accepted, several tokens per step
        assert got[("adaflash_drafted_step_fraction", (("engine", "greedy"),))] == 1.0  # chain: every step drafts
        assert got[("adaflash_requests_total", (("endpoint", "/v1/completions"), ("status", "400")))] == 1
        assert got[("adaflash_time_to_first_token_seconds_count", ())] == 1
        # tokens after the first chunk (which counts as TTFT), each taking its chunk's share of the gap
        assert 0 < got[("adaflash_inter_token_latency_seconds_count", ())] < 32
        assert got[("adaflash_generated_tokens_total", ())] == 32
    finally:
        stop(server)
