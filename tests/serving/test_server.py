"""`adaflash serve`: correct results under concurrent load, 4xx for bad requests, clean shutdown."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import subprocess
import sys
import threading

import pytest

import adaflash_jax as af
from adaflash_jax.decoding.export import export_decoder
from adaflash_jax.serving.server import BatchingServer
from spec_helpers import BLOCK, TEST_PROMPTS, distilled_drafter, random_prompts, tiny_target


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("served") / "artifact")
    export_decoder(tiny_target(), out, drafter=distilled_drafter(), max_prompt_len=16,
                   max_new_tokens=32, modes=("greedy",))
    return out


@pytest.fixture(scope="module")
def server(artifact):
    srv = BatchingServer(af.load_exported(artifact), "127.0.0.1", 0, max_batch=4, batch_window_s=0.02)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown_gracefully()
    srv.server_close()


def request(port: int, body, path="/v1/completions", method="POST"):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    payload = json.loads(resp.read())
    conn.close()
    return resp.status, payload


def test_concurrent_requests_are_batched_and_correct(server):
    prompts = TEST_PROMPTS + random_prompts(4, seed=3, hi=12)
    lengths = [24 if i % 2 else 9 for i in range(len(prompts))]
    expected = []  # greedy: a shorter request gets the prefix of the longer decode
    for group in (prompts[:4], prompts[4:]):
        expected += af.generate(tiny_target(), group, max_new_tokens=24, drafter=distilled_drafter()).token_ids
    port = server.server_address[1]
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        results = list(pool.map(lambda i: request(port, {"prompt": prompts[i], "max_tokens": lengths[i]}),
                                range(len(prompts))))
    for i, (status, payload) in enumerate(results):
        assert status == 200, payload
        assert payload["token_ids"] == expected[i][:lengths[i]]
        assert 1.0 <= payload["tau"] <= BLOCK and payload["timing"]["decode_s"] > 0
    # the drafter was distilled on TEST_PROMPTS' greedy decodes: its drafts must be accepted there
    taus = [payload["tau"] for _, payload in results[:len(TEST_PROMPTS)]]
    assert sum(taus) / len(taus) >= 4.0, taus  # as tests/decoding/test_speculative.py asks of it
    assert max(p["timing"]["batch"] for _, p in results) > 1  # concurrent requests shared calls
    assert all(p["timing"]["batch"] <= 4 for _, p in results)


@pytest.mark.parametrize("body,status,match", [
    (b"{not json", 400, "not valid JSON"),
    ("[1, 2]", 400, "must be a JSON object"),
    ({"max_tokens": 4}, 400, "missing required field 'prompt'"),
    ({"prompt": 5}, 400, "'prompt' has the wrong type"),
    ({"prompt": [1, "a"]}, 400, "integer token ids"),
    ({"prompt": [1, 2], "max_tokens": "4"}, 400, "'max_tokens' has the wrong type"),
    ({"prompt": [1, 2], "max_tokens": 99}, 400, r"max_new_tokens must lie in \[1, 32\]"),
    ({"prompt": [1, 2], "temperature": 0.5}, 400, "without 'sample' decoding"),
    ({"prompt": [1, 2], "stream": True}, 400, "unknown field"),
    ({"prompt": [1, 77]}, 400, "outside the vocabulary"),
    ({"prompt": list(range(1, 20))}, 413, "at most 16"),
    ({"prompt": "hi"}, 400, "no tokenizer"),
])
def test_malformed_requests_get_a_clear_4xx(server, body, status, match):
    got, payload = request(server.server_address[1], body)
    assert got == status
    assert __import__("re").search(match, payload["error"]), payload


def test_unknown_paths_and_health(server):
    port = server.server_address[1]
    assert request(port, {"prompt": [1]}, path="/v2/x")[0] == 404
    assert request(port, None, path="/nope", method="GET")[0] == 404
    status, health = request(port, None, path="/health", method="GET")
    assert status == 200 and health["status"] == "ok" and health["max_batch"] == 4
    assert request(port, {"prompt": [3, 4], "max_tokens": 4})[0] == 200  # still serving


def test_cli_server_shuts_down_gracefully_on_sigterm(artifact):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "adaflash_jax.cli", "serve", artifact, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "serving" in line, line + proc.stderr.read()
        port = int(line.split("http://127.0.0.1:")[1].split()[0])
        status, payload = request(port, {"prompt": TEST_PROMPTS[0], "max_tokens": 8})
        assert status == 200 and len(payload["token_ids"]) == 8
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert "stopped after serving 1 request(s)" in out
