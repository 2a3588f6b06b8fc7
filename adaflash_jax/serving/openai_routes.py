"""The HTTP routes of `SchedulerServer`, as a Starlette app.

GET  /v1/models, /v1/models/{id}      the one model served
POST /v1/completions                  a raw prompt (text or token ids), no chat template
POST /v1/chat/completions             messages through the checkpoint's chat template
GET  /health                          scheduler state (JSON)
GET  /metrics                         Prometheus text

Every answer to a generation waits on the decode thread through the request's
`Waiter` while watching the connection: a client that goes away (queued,
decoding, or mid-stream) has its request cancelled and its slot freed. A
stop string ends the request early the same way. Streams are server-sent events
in OpenAI's chunk format, ending with `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import time
from http import HTTPStatus

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from adaflash_jax.serving import openai_protocol as protocol
from adaflash_jax.serving.openai_protocol import ApiError
from adaflash_jax.serving.text_output import TextAssembler

RETRY_AFTER_S = 1
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _disconnected(receive) -> None:
    """Returns when the client closes the connection (the body has been read by then)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _sse(payload) -> bytes:
    return b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"


class _Generation:
    """One request's run: its tokens, text, finish reason and timing, fed update by update."""

    def __init__(self, server, parsed: protocol.ParsedRequest, waiter):
        self.server, self.parsed, self.waiter = server, parsed, waiter
        self.text = TextAssembler(server.tokenizer, parsed.stop)
        self.finish: str | None = None
        self.steps, self.first = 0, None

    async def next_update(self, gone: asyncio.Future):
        """The next update, or None when the client went away (the request is then cancelled)."""
        get = asyncio.ensure_future(self.waiter.updates.get())
        await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not get.done():
            get.cancel()
            self.server.service.cancel(self.waiter)
            return None
        item = get.result()
        if isinstance(item, Exception):
            raise RuntimeError(f"{type(item).__name__}: {item}") from item
        return item

    async def deltas(self, gone: asyncio.Future):
        """Yields (text delta, new token ids) until the request ends; `finish` says how it did.
        Raises RuntimeError when decoding failed; returns early when the client went away."""
        while True:
            update = await self.next_update(gone)
            if update is None:
                return
            if update.cancelled:
                raise RuntimeError("the request was cancelled by the server")
            if update.error is not None:  # this request alone failed; the others go on
                raise RuntimeError(update.error)
            if update.new_tokens and self.first is None:
                self.first = time.perf_counter()
            self.steps = update.steps
            delta = self.text.push(update.new_tokens)
            if self.text.stopped:
                if not update.done:
                    self.server.service.cancel(self.waiter)  # the rest would be trimmed: free the slot
                self.finish = "stop"
                yield delta, update.new_tokens
                return
            if update.done:
                self.finish = self._finish_reason()
                yield delta + self.text.finish(), update.new_tokens
                return
            if delta or update.new_tokens:
                yield delta, update.new_tokens

    def _finish_reason(self) -> str:
        tokens = self.text.tokens
        if tokens and tokens[-1] in self.server.stop_ids:
            return "stop"
        return "length" if len(tokens) >= self.parsed.max_tokens else "stop"

    def stats(self) -> dict:
        """The `adaflash` extension: timing and speculative statistics of this request."""
        end = time.perf_counter()
        tokens = len(self.text.tokens)
        engine = self.server.scheduler.pool_stats().get("greedy" if self.parsed.temperature == 0 else "sample", {})
        return {"ttft_s": (self.first or end) - self.waiter.submitted, "total_s": end - self.waiter.submitted,
                "steps": self.steps, "tau": (tokens - 1) / self.steps if self.steps else 0.0,  # the first: prefill
                "engine_drafted_step_fraction": engine.get("drafted_step_fraction", 0.0)}


class _EventStream:
    """An SSE answer (ASGI) that watches the connection while it waits for tokens."""

    def __init__(self, run: _Generation, rid: str):
        self.run, self.rid = run, rid

    async def __call__(self, scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        gone = asyncio.ensure_future(_disconnected(receive))
        run, parsed = self.run, self.run.parsed
        try:
            if parsed.kind == "chat":
                await send(self._body(protocol.chunk(parsed, self.rid, role=True)))
            async for text, ids in run.deltas(gone):
                if text or ids:
                    await send(self._body(protocol.chunk(parsed, self.rid, text=text, token_ids=ids)))
            if run.finish is None:  # the client went away
                return
            await send(self._body(protocol.chunk(parsed, self.rid, finish=run.finish, stats=run.stats())))
            if parsed.include_usage:
                counts = protocol.usage(len(parsed.prompt_ids), len(run.text.tokens))
                await send(self._body(protocol.chunk(parsed, self.rid, usage_counts=counts)))
        except RuntimeError as error:  # decoding failed: an error event, which the client raises
            await send(self._body(ApiError(f"decoding failed: {error}", HTTPStatus.INTERNAL_SERVER_ERROR,
                                           type="server_error").body()))
        finally:
            gone.cancel()
        await send({"type": "http.response.body", "body": _sse(b"[DONE]"), "more_body": False})

    @staticmethod
    def _body(payload) -> dict:
        return {"type": "http.response.body", "body": _sse(payload), "more_body": True}


def build_app(server) -> Starlette:
    """The Starlette app over `server` (a `SchedulerServer`: service, scheduler, parse, metrics)."""

    async def generate(request: Request, kind: str):
        endpoint = request.url.path
        try:
            size = int(request.headers.get("content-length") or 0)
            if size > protocol.MAX_BODY_BYTES:
                raise ApiError(f"request body of {size} bytes exceeds {protocol.MAX_BODY_BYTES}",
                               HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
            parsed = server.parse(kind, protocol.read_json(await request.body()))
            waiter = server.submit(parsed, asyncio.get_running_loop())
        except ApiError as error:
            server.metrics.answered(endpoint, error.status)
            return error_response(error)
        run, rid = _Generation(server, parsed, waiter), protocol.new_id(kind)
        if parsed.stream:
            server.metrics.answered(endpoint, 200)
            return _EventStream(run, rid)
        gone = asyncio.ensure_future(_disconnected(request.receive))
        ids: list[int] = []
        text = []
        try:
            async for delta, new in run.deltas(gone):
                text.append(delta)
                ids += new
        except RuntimeError as error:
            failure = ApiError(f"decoding failed: {error}", HTTPStatus.INTERNAL_SERVER_ERROR, type="server_error")
            server.metrics.answered(endpoint, failure.status)
            return error_response(failure)
        finally:
            gone.cancel()
        if run.finish is None:  # the client went away: nobody reads this
            server.metrics.answered(endpoint, 499)
            return Response(status_code=499)
        server.metrics.answered(endpoint, 200)
        return JSONResponse(protocol.response(parsed, rid, "".join(text), ids, run.finish, run.stats()))

    async def completions(request):
        return await generate(request, "completion")

    async def chat(request):
        return await generate(request, "chat")

    def model_card() -> dict:
        return {"id": server.model, "object": "model", "created": int(server.started), "owned_by": "adaflash"}

    async def models(request):
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request):
        if request.path_params["name"] != server.model:
            return error_response(ApiError(f"the model {request.path_params['name']!r} does not exist; this "
                                           f"server serves {server.model!r}", HTTPStatus.NOT_FOUND,
                                           param="model", code="model_not_found"))
        return JSONResponse(model_card())

    async def health(request):
        return JSONResponse(server.health())

    async def metrics(request):
        from adaflash_jax.serving.metrics import CONTENT_TYPE

        return Response(server.metrics.text(), headers={"Content-Type": CONTENT_TYPE})

    async def http_error(request, exc: HTTPException):
        if exc.status_code == 404:
            error = ApiError(f"no such path {request.url.path!r}; this server answers POST /v1/completions, "
                             "POST /v1/chat/completions, GET /v1/models, /health and /metrics",
                             HTTPStatus.NOT_FOUND, code="unknown_url")
        else:
            error = ApiError(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code)
        return error_response(error)

    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{name:path}", model, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})
