"""`adaflash serve DIR`: an artifact under the continuous-batching server. Correct results under
concurrent load, streaming, 4xx for bad requests (and for engine settings a request cannot
change), clean shutdown on SIGTERM."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading

import pytest

import adaflash_jax as af
from adaflash_jax.decoding.export import export_decoder
from adaflash_jax.serving.server import artifact_server
from spec_helpers import TEST_PROMPTS, distilled_drafter, random_prompts, tiny_target


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("served") / "artifact")
    export_decoder(tiny_target(), out, drafter=distilled_drafter(), max_prompt_len=16,
                   max_new_tokens=32, modes=("greedy",))
    return out


@pytest.fixture(scope="module")
def server(artifact):
    srv = artifact_server(artifact, port=0, slots=4)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown_gracefully()
    srv.server_close()


def request(port: int, body, path="/v1/completions", method="POST"):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)  # first calls compile: slow on a loaded CPU
    data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    streamed = resp.getheader("Content-Type", "").startswith("text/event-stream")
    return resp.status, raw if streamed else json.loads(raw)


def generate(prompt, n):
    return af.generate(tiny_target(), [prompt], max_new_tokens=n, drafter=distilled_drafter()).token_ids[0]


def test_concurrent_requests_match_per_prompt_generate(server):
    prompts = TEST_PROMPTS + random_prompts(4, seed=3, hi=12)
    lengths = [24 if i % 2 else 9 for i in range(len(prompts))]
    port = server.server_address[1]
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        results = list(pool.map(lambda i: request(port, {"prompt": prompts[i], "max_tokens": lengths[i],
                                                         "speculative": True}), range(len(prompts))))
    for p, n, (status, payload) in zip(prompts, lengths, results):
        assert status == 200, payload
        assert payload["choices"][0]["token_ids"] == generate(p, n)
        assert 0 < payload["adaflash"]["ttft_s"] <= payload["adaflash"]["total_s"]


def test_streaming(server):
    port = server.server_address[1]
    status, raw = request(port, {"prompt": TEST_PROMPTS[1], "max_tokens": 30, "stream": True})
    chunks = [c[len(b"data: "):] for c in raw.split(b"\n\n") if c.startswith(b"data: ")]
    assert status == 200 and chunks[-1] == b"[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    tokens = [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]
    assert events[-1]["choices"][0]["finish_reason"] == "length" and tokens == generate(TEST_PROMPTS[1], 30)


@pytest.mark.parametrize("body,status,match", [
    (b"{not json", 400, "not valid JSON"),
    ("[1, 2]", 400, "must be a JSON object"),
    ({"max_tokens": 4}, 400, "missing required field 'prompt'"),
    ({"prompt": 5}, 400, "'prompt' has the wrong type"),
    ({"prompt": [1, "a"]}, 400, "integer token ids"),
    ({"prompt": [1, 2], "max_tokens": "4"}, 400, "'max_tokens' has the wrong type"),
    ({"prompt": [1, 2], "max_tokens": 99}, 400, r"max_tokens must lie in \[1, 32\]"),
    ({"prompt": [1, 2], "temperature": 0.5}, 400, "serves \\['greedy'\\] requests, not 'sample'"),
    ({"prompt": [1, 2], "beam": 2}, 400, "unknown field"),
    ({"prompt": [1, 2], "speculative": False}, 400, "decodes every request speculatively"),
    ({"prompt": [1, 2], "speculative": 1}, 400, "'speculative' has the wrong type"),
    ({"prompt": [1, 2], "rho": 1.0}, 400, "length_policy 'head'"),
    ({"prompt": [1, 77]}, 400, "outside the vocabulary"),
    ({"prompt": list(range(1, 20))}, 400, "prompt has 19 tokens"),
    ({"prompt": "hi"}, 400, "no tokenizer"),
])
def test_malformed_requests_get_a_clear_4xx(server, body, status, match):
    got, payload = request(server.server_address[1], body)
    assert got == status
    assert re.search(match, payload["error"]["message"]), payload


def test_unknown_paths_and_health(server):
    port = server.server_address[1]
    assert request(port, {"prompt": [1]}, path="/v2/x")[0] == 404
    status, payload = request(port, None, path="/nope", method="GET")
    assert status == 404 and payload["error"]["code"] == "unknown_url"
    status, health = request(port, None, path="/health", method="GET")
    assert status == 200 and health["status"] == "ok" and health["slots"] == 4 and health["modes"] == ["greedy"]
    assert request(port, {"prompt": [3, 4], "max_tokens": 4})[0] == 200  # still serving


def test_cli_server_shuts_down_gracefully_on_sigterm(artifact):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "adaflash_jax.cli", "serve", artifact, "--port", "0",
                             "--slots", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "serving" in line, line + proc.stderr.read()
        port = int(line.split("http://127.0.0.1:")[1].split()[0])
        status, payload = request(port, {"prompt": TEST_PROMPTS[0], "max_tokens": 8})
        assert status == 200 and len(payload["choices"][0]["token_ids"]) == 8
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert "stopped after serving 1 request(s)" in out


def test_cli_names_settings_an_artifact_cannot_serve(artifact, capsys):
    from adaflash_jax import cli

    assert cli.main(["serve", artifact, "--port", "0", "--modes", "sample"]) == 2
    assert "without 'sample'" in capsys.readouterr().err
    assert cli.main(["serve", artifact, "--port", "0", "--rho", "1.0"]) == 2
    assert "length_policy 'head'" in capsys.readouterr().err
    assert cli.main(["serve", artifact, "--drafter", "x"]) == 2
    assert "not both" in capsys.readouterr().err
