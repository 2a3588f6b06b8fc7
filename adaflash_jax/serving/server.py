"""`adaflash serve`: a small HTTP JSON endpoint over an exported decoder (loopback by default).

POST /v1/completions {"prompt": str | [int], "max_tokens": int, "temperature": float,
"top_p": float, "seed": int, "speculative": bool, "rho": float, "min_len": int} ->
{"text", "token_ids", "tau", "timing": {"queue_s", "decode_s", "batch"}} (rho / min_len:
the length head's rule, for artifacts exported with length_policy "head").
GET /health -> {"status": "ok", ...}.

Request threads only validate and enqueue; one decode thread takes what is
queued (waiting `batch_window_s` for more), groups requests that can share a
call (same loop, sampling settings and seed) into batches of at most
`max_batch`, and runs them. Bad requests get a 4xx JSON error naming the
problem; a failure inside a decode call answers 500 to that batch only.
SIGINT/SIGTERM stop accepting, finish the queued work, then exit.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import signal
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from adaflash_jax.serving.runtime import ExportedDecoder, PromptTooLongError

MAX_BODY_BYTES = 1 << 20
FIELDS = {"prompt": (str, list), "max_tokens": int, "temperature": (int, float), "top_p": (int, float),
          "seed": int, "speculative": bool, "rho": (int, float), "min_len": int}


class RequestError(ValueError):
    """A client mistake: answered with `status` and the message, never raised further."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass
class Job:
    prompt: Any  # as sent; token ids once the request is validated
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    speculative: bool
    rho: float | None = None
    min_len: int | None = None
    enqueued: float = dataclasses.field(default_factory=time.perf_counter)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    response: dict | None = None
    status: HTTPStatus = HTTPStatus.OK

    def group(self) -> tuple:
        """Requests with equal groups share one decode call (per-row results are unchanged)."""
        rule = (self.rho, self.min_len)
        if self.temperature == 0:
            return (self.speculative, 0.0, 1.0, 0, rule)
        return (self.speculative, self.temperature, self.top_p, self.seed, rule)


def parse_request(body: bytes, decoder: ExportedDecoder) -> Job:
    """Validates one completions request; raises RequestError with a client-facing message."""
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RequestError(f"request body is not valid JSON: {error}") from None
    if not isinstance(payload, dict):
        raise RequestError("request body must be a JSON object")
    unknown = sorted(set(payload) - set(FIELDS))
    if unknown:
        raise RequestError(f"unknown field(s) {unknown}; allowed: {sorted(FIELDS)}")
    if "prompt" not in payload:
        raise RequestError("missing required field 'prompt' (a string or a list of token ids)")
    for name, kinds in FIELDS.items():
        value = payload.get(name)
        if value is not None and (not isinstance(value, kinds) or
                                  (kinds is not bool and isinstance(value, bool))):
            raise RequestError(f"field {name!r} has the wrong type ({type(value).__name__})")
    prompt = payload["prompt"]
    if isinstance(prompt, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise RequestError("'prompt' as a list must hold integer token ids")
    job = Job(prompt=prompt, max_tokens=payload.get("max_tokens", min(64, decoder.max_new_tokens)),
              temperature=float(payload.get("temperature", 0.0)), top_p=float(payload.get("top_p", 1.0)),
              seed=payload.get("seed", 0), speculative=payload.get("speculative", decoder.has_drafter),
              rho=payload.get("rho"), min_len=payload.get("min_len"))
    try:
        decoder.check_request(max_new_tokens=job.max_tokens, temperature=job.temperature,
                              top_p=job.top_p, speculative=job.speculative, rho=job.rho,
                              min_len=job.min_len)
        job.prompt = decoder.encode([prompt])[0]  # token ids: the decode thread never re-tokenizes
    except ValueError as error:
        status = (HTTPStatus.REQUEST_ENTITY_TOO_LARGE if isinstance(error, PromptTooLongError)
                  else HTTPStatus.BAD_REQUEST)
        raise RequestError(str(error).replace("prompt 0", "the prompt"), status) from None
    return job


class BatchingServer(ThreadingHTTPServer):
    """HTTP server plus the decode thread that batches queued requests."""

    daemon_threads = True

    def __init__(self, decoder: ExportedDecoder, host: str = "127.0.0.1", port: int = 8000, *,
                 max_batch: int = 8, batch_window_s: float = 0.005):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        super().__init__((host, port), _Handler)
        self.decoder, self.max_batch, self.batch_window_s = decoder, int(max_batch), float(batch_window_s)
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.accepting = True
        self.served = 0
        self._worker = threading.Thread(target=self._decode_loop, name="decode", daemon=True)
        self._worker.start()

    def submit(self, job: Job) -> Job:
        if not self.accepting:
            raise RequestError("the server is shutting down", HTTPStatus.SERVICE_UNAVAILABLE)
        self.jobs.put(job)
        job.done.wait()
        return job

    def _take_batch(self) -> list[Job] | None:
        try:
            first = self.jobs.get(timeout=0.1)
        except queue.Empty:
            return None
        jobs, deadline = [first], time.perf_counter() + self.batch_window_s
        while True:
            try:
                jobs.append(self.jobs.get(timeout=max(0.0, deadline - time.perf_counter())))
            except queue.Empty:
                return jobs

    def _decode_loop(self):
        while self.accepting or not self.jobs.empty():
            jobs = self._take_batch()
            if not jobs:
                continue
            groups: dict[tuple, list[Job]] = {}
            for job in jobs:
                groups.setdefault(job.group(), []).append(job)
            for group in groups.values():
                for start in range(0, len(group), self.max_batch):
                    self._run(group[start:start + self.max_batch])

    def _run(self, jobs: list[Job]):
        first, began = jobs[0], time.perf_counter()
        try:
            result = self.decoder.generate(
                [j.prompt for j in jobs], max_new_tokens=max(j.max_tokens for j in jobs),
                temperature=first.temperature, top_p=first.top_p, seed=first.seed,
                speculative=first.speculative, rho=first.rho, min_len=first.min_len)
        except Exception as error:  # one failed call answers its own batch, the server lives on
            for job in jobs:
                job.status, job.response = HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"decode failed: {error}"}
                job.done.set()
            return
        decode_s = time.perf_counter() - began
        for i, job in enumerate(jobs):
            ids = result.token_ids[i][:job.max_tokens]
            text = (self.decoder.tokenizer.decode(ids, skip_special_tokens=True)
                    if self.decoder.tokenizer is not None else None)
            job.response = {"text": text, "token_ids": ids, "num_tokens": len(ids),
                            "tau": result.stats["tau"][i] if "tau" in result.stats else None,
                            "timing": {"queue_s": began - job.enqueued, "decode_s": decode_s,
                                       "batch": len(jobs)}}
            job.done.set()
        self.served += len(jobs)

    def shutdown_gracefully(self):
        """Stops taking requests, lets the decode thread drain the queue, stops the server."""
        self.accepting = False
        self._worker.join()
        while not self.jobs.empty():  # raced in after the last batch: answer, never hang
            job = self.jobs.get()
            job.status, job.response = HTTPStatus.SERVICE_UNAVAILABLE, {"error": "the server is shutting down"}
            job.done.set()
        self.shutdown()


class _Handler(BaseHTTPRequestHandler):
    server: BatchingServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet: one line per request is noise under load
        pass

    def _reply(self, status: HTTPStatus, payload: dict):
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path != "/health":
            return self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path!r}; "
                                                      "use POST /v1/completions or GET /health"})
        d = self.server.decoder
        self._reply(HTTPStatus.OK, {"status": "ok" if self.server.accepting else "draining",
                                    "drafter": d.manifest["drafter"], "modes": list(d.modes),
                                    "max_prompt_len": d.max_prompt_len, "max_new_tokens": d.max_new_tokens,
                                    "max_batch": self.server.max_batch, "served": self.server.served})

    def do_POST(self):
        try:
            if self.path != "/v1/completions":
                raise RequestError(f"no such path {self.path!r}; use POST /v1/completions",
                                   HTTPStatus.NOT_FOUND)
            try:
                size = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                raise RequestError("Content-Length is not an integer") from None
            if size > MAX_BODY_BYTES:
                self.close_connection = True
                raise RequestError(f"request body of {size} bytes exceeds {MAX_BODY_BYTES}",
                                   HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
            job = self.server.submit(parse_request(self.rfile.read(size), self.server.decoder))
            self._reply(job.status, job.response)
        except RequestError as error:
            self._reply(error.status, {"error": str(error)})


def serve(path: str, *, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 8,
          batch_window_ms: float = 5.0, ready=None) -> None:
    """Loads the artifact and serves until SIGINT/SIGTERM, then drains and returns."""
    from adaflash_jax.serving.runtime import load_exported

    server = BatchingServer(load_exported(path), host, port, max_batch=max_batch,
                            batch_window_s=batch_window_ms / 1000)
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=server.serve_forever, name="http", daemon=True)
    thread.start()
    print(f"serving {path} on http://{host}:{server.server_address[1]} (POST /v1/completions)", flush=True)
    if ready is not None:
        ready(server)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.shutdown_gracefully()
        server.server_close()
        for s, handler in previous.items():
            signal.signal(s, handler)
        print(f"stopped after serving {server.served} request(s)", flush=True)
