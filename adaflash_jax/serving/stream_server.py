"""`adaflash serve --target NAME`: an OpenAI-compatible HTTP server over the continuous-batching scheduler.

Routes and shapes: `serving.openai_routes` and `serving.openai_protocol` (the official
`openai` client works against it). One decode thread runs the scheduler
(`serving.decode_service`); HTTP runs on an asyncio event loop in another thread.

The HTTP stack is uvicorn (0.54) + Starlette (1.10), pinned in pyproject.toml. Both
are widely deployed and maintained, and they do what a hand-written `http.server`
got wrong or did by hand: a listen backlog sized for bursts (`BACKLOG`; the stdlib
default of 5 reset 138 of 300 concurrent connections before the queue saw them),
connection handling on one event loop instead of a thread per connection,
disconnect events (a gone client frees its slot), and graceful shutdown of
in-flight responses. Starlette is small: routing and responses, nothing generated
from type hints, so request checks stay explicit in `openai_protocol`.

A full queue answers 503 with Retry-After at once (never a hang); SIGTERM stops
admissions (503) and drains what is queued and running before exiting; the
server binds loopback unless told otherwise.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from http import HTTPStatus

import uvicorn

from adaflash_jax.serving import openai_protocol as protocol
from adaflash_jax.serving.decode_service import DecodeService, Waiter
from adaflash_jax.serving.http_common import serve_until_signal
from adaflash_jax.serving.metrics import ServerMetrics
from adaflash_jax.serving.openai_protocol import ApiError
from adaflash_jax.serving.openai_routes import RETRY_AFTER_S, build_app
from adaflash_jax.serving.scheduler import PREFILL_BUDGET, QueueFull, Request, Scheduler

BACKLOG = 4096  # pending connections the kernel holds before the event loop accepts them
GRACEFUL_TIMEOUT_S = 30.0  # after draining, how long open responses may take to finish


class SchedulerServer:
    """The HTTP server and the decode thread that drives `scheduler`.

    tokenizer / vocab_size: how text prompts are encoded and id prompts checked; model: the
    id clients name (GET /v1/models); stop_ids: the engine's stop tokens (finish_reason
    "stop" rather than "length" when one is the last token). The socket listens from
    construction; `serve_forever()` (blocking, any thread) answers on it.
    """

    extra_fields: dict = {}  # request fields beyond OpenAI's that a subclass accepts

    def __init__(self, scheduler: Scheduler, *, tokenizer=None, vocab_size: int, model: str = "adaflash",
                 stop_ids=(), host: str = "127.0.0.1", port: int = 8000):
        self.scheduler, self.tokenizer, self.vocab_size = scheduler, tokenizer, int(vocab_size)
        self.model, self.stop_ids, self.started = model, frozenset(int(i) for i in stop_ids), time.time()
        self.socket = socket.create_server((host, port), backlog=BACKLOG, reuse_port=False)
        self.server_address = self.socket.getsockname()[:2]
        self.metrics = ServerMetrics(scheduler)
        self.service = DecodeService(scheduler, self.metrics)
        config = uvicorn.Config(build_app(self), log_level="warning", lifespan="off", backlog=BACKLOG,
                                timeout_graceful_shutdown=GRACEFUL_TIMEOUT_S, access_log=False)
        self._uvicorn = uvicorn.Server(config)
        self._serving = threading.Event()
        self._stopped = threading.Event()

    @property
    def accepting(self) -> bool:
        return self.service.accepting

    @property
    def served(self) -> int:
        return self.service.served

    # ----- requests -------------------------------------------------------------------
    def parse(self, kind: str, payload: dict) -> protocol.ParsedRequest:
        """A validated request (ApiError otherwise); subclasses check their `extra_fields` here."""
        max_new = max(p.engine.max_new_tokens for p in self.scheduler.pools.values())
        return protocol.parse(kind, payload, model=self.model, tokenizer=self.tokenizer, vocab_size=self.vocab_size,
                              max_new_tokens=max_new, extra_fields=self.extra_fields)

    def submit(self, parsed: protocol.ParsedRequest, loop: asyncio.AbstractEventLoop) -> Waiter:
        """Queues the request with the decode thread: 400 when no engine can serve it, 503 when
        the queue is full or the server is draining."""
        request = Request(parsed.prompt_ids, parsed.max_tokens, temperature=parsed.temperature,
                          top_p=parsed.top_p, seed=parsed.seed)
        busy = {"Retry-After": str(RETRY_AFTER_S)}
        try:
            return self.service.submit(request, loop)
        except QueueFull as error:
            raise ApiError(f"busy: {error}; retry later", HTTPStatus.SERVICE_UNAVAILABLE, type="server_overloaded",
                           headers=busy) from None
        except RuntimeError as error:  # draining, or the decode thread stopped
            raise ApiError(str(error), HTTPStatus.SERVICE_UNAVAILABLE, type="server_unavailable",
                           headers=busy) from None
        except ValueError as error:
            param = "prompt" if "prompt has" in str(error) else None
            code = "context_length_exceeded" if param else None
            raise ApiError(str(error).replace("max_new_tokens", "max_tokens"), param=param, code=code) from None

    def cancel(self, waiter: Waiter) -> None:
        self.service.cancel(waiter)

    def health(self) -> dict:
        s = self.scheduler
        slots = sum(p.engine.num_slots for p in s.pools.values())
        status = "ok" if self.accepting and self.service.alive() else "draining" if not self.accepting else "failed"
        return {"status": status, "running": s.running, "waiting": s.waiting, "slots": slots,
                "modes": sorted(s.pools), "served": self.served, "model": self.model,
                "occupancy": s.slot_steps / max(s.steps, 1) / slots * len(s.pools)}

    # ----- lifecycle ------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Answers HTTP until `shutdown_gracefully()` (uvicorn's own signal handling stays off:
        the caller decides when to drain)."""
        self._serving.set()
        try:
            asyncio.run(self._uvicorn.serve(sockets=[self.socket]))
        finally:
            self._stopped.set()

    def shutdown_gracefully(self) -> None:
        """Stops admissions (503), finishes queued and running requests, then stops HTTP once the
        last responses are written."""
        self.service.drain()
        self._uvicorn.should_exit = True
        if self._serving.is_set():
            self._stopped.wait(GRACEFUL_TIMEOUT_S + 10)

    def server_close(self) -> None:
        self.socket.close()


def build_scheduler(target, drafter=None, *, slots: int = 16, max_prompt_len: int = 256,
                    max_new_tokens: int = 256, modes=("greedy", "sample"), max_queue: int = 256,
                    attn_impl: str = "xla", verify_len: int | None = None, length_policy: str | None = None,
                    rho: float = 1.3, min_len: int = 1, probe_every: int = 8, step_costs=None,
                    admission: str = "continuous", tree_budget: int | str | None = None,
                    verify: str | None = None, prefill_budget: int = PREFILL_BUDGET) -> Scheduler:
    """A scheduler with one in-process engine per mode (`serving.slot_engine.LocalEngine`).

    verify: "adaptive" (the default with a drafter), "chain" or "tree", as `LocalEngine`'s;
    length_policy / rho / min_len / probe_every (chain): the verify-length policy (default:
    "auto" with a length head, else "fixed"); step_costs: the adaptive or "auto" policy's;
    tree_budget: tree verification (N nodes or "auto"); admission: `Scheduler`'s; prefill_budget:
    its max_prefill_tokens (prompts longer than half of it are prefilled in chunks).
    """
    from adaflash_jax.serving.slot_engine import LocalEngine

    engines = {mode: LocalEngine(target, drafter, num_slots=slots, max_prompt_len=max_prompt_len,
                                 max_new_tokens=max_new_tokens, greedy=mode == "greedy", attn_impl=attn_impl,
                                 verify_len=verify_len, length_policy=length_policy, rho=rho, min_len=min_len,
                                 probe_every=probe_every, step_costs=step_costs, tree_budget=tree_budget,
                                 verify=verify)
               for mode in modes}
    return Scheduler(engines, max_queue=max_queue, admission=admission, max_prefill_tokens=prefill_budget)


def serve_models(target, drafter=None, *, host: str = "127.0.0.1", port: int = 8000, ready=None,
                 **scheduler) -> None:
    """Serves `target` (speculatively with `drafter`) until SIGINT/SIGTERM, then drains."""
    server = SchedulerServer(build_scheduler(target, drafter, **scheduler), tokenizer=target.tokenizer,
                             vocab_size=target.cfg.vocab_size, model=target.name, stop_ids=target.eos_token_ids,
                             host=host, port=port)
    serve_until_signal(server, target.name + (f" + {drafter.name}" if drafter is not None else ""), ready)
