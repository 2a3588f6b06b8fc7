"""`adaflash serve --target NAME`: HTTP over the continuous-batching scheduler.

POST /v1/completions {"prompt": str | [int], "max_tokens", "temperature", "top_p", "seed",
"stream": bool}
  stream false -> {"text", "token_ids", "num_tokens", "timing": {"ttft_s", "total_s"}}
  stream true  -> text/event-stream: one `data: {"token_ids", "text"}` event per committed
                  chunk, then `data: {"done": true, "num_tokens", "timing"}` and `data: [DONE]`.
GET /health -> {"status", "running", "waiting", "slots", "served", "occupancy"}.

One decode thread runs `Scheduler.iterate()` while there is work and routes each
update to its request's queue; request threads only validate, submit and wait.
A full queue answers 503 with Retry-After at once (never a hang); a client
that disconnects has its request cancelled and its slot freed; SIGTERM stops
admissions (503) and drains what is queued and running before exiting.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import select
import threading
import time
from http import HTTPStatus
from http.server import ThreadingHTTPServer

from adaflash_jax.decoding.batching import encode_chat_prompts
from adaflash_jax.serving.http_common import JsonHandler, RequestError, read_payload, serve_until_signal
from adaflash_jax.serving.scheduler import QueueFull, Request, Scheduler, Update

FIELDS = {"prompt": (str, list), "max_tokens": int, "temperature": (int, float), "top_p": (int, float),
          "seed": int, "stream": bool}
RETRY_AFTER_S = 1


@dataclasses.dataclass
class _Waiter:
    """A submitted request's side of the decode thread: its updates, in order."""

    updates: queue.Queue = dataclasses.field(default_factory=queue.Queue)
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    ticket: int = -1
    checked: float = 0.0  # when the client's connection was last checked


class SchedulerServer(ThreadingHTTPServer):
    """HTTP server plus the decode thread that drives a `Scheduler`.

    tokenizer / vocab_size: how text prompts are encoded and id prompts checked.
    """

    daemon_threads = True

    def __init__(self, scheduler: Scheduler, *, tokenizer=None, vocab_size: int, host: str = "127.0.0.1",
                 port: int = 8000):
        super().__init__((host, port), _Handler)
        self.scheduler, self.tokenizer, self.vocab_size = scheduler, tokenizer, int(vocab_size)
        self.accepting, self.served = True, 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._error: Exception | None = None
        self._worker = threading.Thread(target=self._decode_loop, name="decode", daemon=True)
        self._worker.start()

    # ----- request side -----------------------------------------------------------
    def parse(self, body: bytes) -> tuple[Request, bool]:
        payload = read_payload(body, FIELDS)
        default_max = min(64, max(p.engine.max_new_tokens for p in self.scheduler.pools.values()))
        try:
            ids = encode_chat_prompts([payload["prompt"]], self.tokenizer, self.vocab_size, owner="server")[0]
            request = Request(ids, payload.get("max_tokens", default_max),
                              temperature=float(payload.get("temperature", 0.0)),
                              top_p=float(payload.get("top_p", 1.0)), seed=payload.get("seed", 0))
            self.scheduler.check(request)
        except ValueError as error:
            status = HTTPStatus.REQUEST_ENTITY_TOO_LARGE if "prompt has" in str(error) else HTTPStatus.BAD_REQUEST
            raise RequestError(str(error).replace("prompt 0", "the prompt"), status) from None
        return request, bool(payload.get("stream", False))

    def submit(self, request: Request) -> _Waiter:
        if not self.accepting:
            raise RequestError("the server is shutting down", HTTPStatus.SERVICE_UNAVAILABLE)
        waiter = _Waiter()
        request.tag = waiter
        try:
            waiter.ticket = self.scheduler.submit(request)
        except QueueFull as error:
            raise RequestError(f"busy: {error}; retry later", HTTPStatus.SERVICE_UNAVAILABLE,
                               {"Retry-After": str(RETRY_AFTER_S)}) from None
        self._wake.set()
        return waiter

    def cancel(self, waiter: _Waiter) -> None:
        self.scheduler.cancel(waiter.ticket)
        self._wake.set()

    def decode(self, ids: list[int]) -> str | None:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else None

    # ----- decode thread ------------------------------------------------------------
    def _decode_loop(self):
        while not self._stop.is_set():
            if self.scheduler.idle():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                updates = self.scheduler.iterate()
            except Exception as error:  # answer every waiting request, then stop decoding
                self._error = error
                self._fail_all(error)
                return
            for update in updates:
                update.tag.updates.put(update)
                if update.done and not update.cancelled:
                    self.served += 1

    def _fail_all(self, error: Exception):
        for request in self.scheduler.outstanding():
            request.tag.updates.put(error)

    def shutdown_gracefully(self):
        """Stops admissions (503), lets the decode thread finish queued and running work, stops."""
        self.accepting = False
        while not self.scheduler.idle() and self._worker.is_alive():
            time.sleep(0.05)
        self._stop.set()
        self._worker.join()
        self.shutdown()


class _Handler(JsonHandler):
    server: SchedulerServer

    def do_GET(self):
        if self.path != "/health":
            return self.reply(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path!r}; "
                                                     "use POST /v1/completions or GET /health"})
        s = self.server.scheduler
        slots = sum(p.engine.num_slots for p in s.pools.values())
        self.reply(HTTPStatus.OK, {
            "status": "ok" if self.server.accepting else "draining", "running": s.running,
            "waiting": s.waiting, "slots": slots, "modes": sorted(s.pools), "served": self.server.served,
            "occupancy": s.slot_steps / max(s.steps, 1) / slots * len(s.pools)})

    def do_POST(self):
        try:
            if self.path != "/v1/completions":
                raise RequestError(f"no such path {self.path!r}; use POST /v1/completions",
                                   HTTPStatus.NOT_FOUND)
            request, stream = self.server.parse(self.read_body())
            waiter = self.server.submit(request)
        except RequestError as error:
            return self.reply(error.status, {"error": str(error)}, error.headers)
        if stream:
            self._stream(waiter)
        else:
            self._complete(waiter)

    def _next(self, waiter: _Waiter) -> Update | None:
        """The next update; None when the client went away (the request is then cancelled).
        The connection is checked at least every 0.1 s, however fast updates arrive."""
        while True:
            try:
                item = waiter.updates.get(timeout=0.1)
            except queue.Empty:
                item = None
            now = time.perf_counter()
            if item is None or now - waiter.checked > 0.1:
                waiter.checked = now
                if self._client_gone():
                    self.server.cancel(waiter)
                    return None
            if isinstance(item, Exception):
                raise item
            if item is not None:
                return item

    def _client_gone(self) -> bool:
        """A closed connection reads as end-of-file (a keep-alive client sends nothing while waiting)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, 2) == b""  # 2: MSG_PEEK
        except OSError:
            return True

    def _complete(self, waiter: _Waiter):
        tokens, first = [], None
        try:
            while True:
                update = self._next(waiter)
                if update is None:
                    self.close_connection = True
                    return
                if update.new_tokens and first is None:
                    first = time.perf_counter()
                tokens += update.new_tokens
                if update.done:
                    break
        except Exception as error:
            return self.reply(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"decode failed: {error}"})
        end = time.perf_counter()
        self.reply(HTTPStatus.OK, {"text": self.server.decode(tokens), "token_ids": tokens,
                                   "num_tokens": len(tokens), "timing": _timing(waiter, first, end)})

    def _stream(self, waiter: _Waiter):
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.close_connection = True  # the stream ends with the connection (no Content-Length)
        count, first = 0, None
        try:
            while True:
                update = self._next(waiter)
                if update is None:  # gone while queued or between chunks: already cancelled
                    return
                if update.new_tokens:
                    first = first or time.perf_counter()
                    count += len(update.new_tokens)
                    self._event({"token_ids": update.new_tokens, "text": self.server.decode(update.new_tokens)})
                if update.done:
                    break
            self._event({"done": True, "num_tokens": count,
                         "timing": _timing(waiter, first, time.perf_counter())})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.server.cancel(waiter)  # the client went away: free its slot
        except Exception as error:
            self._event({"error": f"decode failed: {error}"})

    def _event(self, payload: dict):
        self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        self.wfile.flush()


def _timing(waiter: _Waiter, first: float | None, end: float) -> dict:
    return {"ttft_s": (first or end) - waiter.submitted, "total_s": end - waiter.submitted}


def build_scheduler(target, drafter=None, *, slots: int = 16, max_prompt_len: int = 256,
                    max_new_tokens: int = 256, modes=("greedy", "sample"), max_queue: int = 256,
                    attn_impl: str = "xla", verify_len: int | None = None, length_policy: str | None = None,
                    rho: float = 1.3, min_len: int = 1, probe_every: int = 8, step_costs=None,
                    admission: str = "continuous", tree_budget: int | str | None = None,
                    verify: str | None = None) -> Scheduler:
    """A scheduler with one in-process engine per mode (`serving.slot_engine.LocalEngine`).

    verify: "adaptive" (the default with a drafter), "chain" or "tree", as `LocalEngine`'s;
    length_policy / rho / min_len / probe_every (chain): the verify-length policy (default:
    "auto" with a length head, else "fixed"); step_costs: the adaptive or "auto" policy's;
    tree_budget: tree verification (N nodes or "auto"); admission: `Scheduler`'s.
    """
    from adaflash_jax.serving.slot_engine import LocalEngine

    engines = {mode: LocalEngine(target, drafter, num_slots=slots, max_prompt_len=max_prompt_len,
                                 max_new_tokens=max_new_tokens, greedy=mode == "greedy", attn_impl=attn_impl,
                                 verify_len=verify_len, length_policy=length_policy, rho=rho, min_len=min_len,
                                 probe_every=probe_every, step_costs=step_costs, tree_budget=tree_budget,
                                 verify=verify)
               for mode in modes}
    return Scheduler(engines, max_queue=max_queue, admission=admission)


def serve_models(target, drafter=None, *, host: str = "127.0.0.1", port: int = 8000, ready=None,
                 **scheduler) -> None:
    """Serves `target` (speculatively with `drafter`) until SIGINT/SIGTERM, then drains."""
    server = SchedulerServer(build_scheduler(target, drafter, **scheduler), tokenizer=target.tokenizer,
                             vocab_size=target.cfg.vocab_size, host=host, port=port)
    serve_until_signal(server, target.name + (f" + {drafter.name}" if drafter is not None else ""), ready)
