"""The OpenAI request and response shapes the server speaks (`/v1/completions`, `/v1/chat/completions`).

Parsing turns a JSON body into a `ParsedRequest` (token ids and sampling settings)
or raises `ApiError`, which the routes answer with OpenAI's error object
`{"error": {"message", "type", "param", "code"}}`: the official client reads the
message from there and picks its exception class from the HTTP status.

Fields a client may send with a neutral value (presence_penalty 0, echo false,
n 1, ...) are accepted; any other value is refused by name, never ignored. Unknown
fields are refused, as OpenAI does. Defaults where this server differs: temperature
0 (greedy, the deterministic mode every engine serves); without a seed a sampled
request draws a fresh one.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
import uuid
from http import HTTPStatus

MAX_BODY_BYTES = 1 << 20
# A neutral value of each field this server does not implement: only it is accepted.
NEUTRAL = {"n": (1,), "best_of": (1,), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
           "echo": (False,), "logprobs": (None, False, 0), "top_logprobs": (None, 0), "logit_bias": (None, {}),
           "suffix": (None, ""), "parallel_tool_calls": (None,), "tools": (None, []), "tool_choice": (None, "none")}
COMMON_FIELDS = {"model": str, "max_tokens": int, "temperature": (int, float), "top_p": (int, float),
                 "seed": int, "stop": (str, list), "stream": bool, "stream_options": dict, "user": str}
COMPLETION_FIELDS = {**COMMON_FIELDS, "prompt": (str, list)}
CHAT_FIELDS = {**COMMON_FIELDS, "messages": list, "max_completion_tokens": int}
CHAT_ROLES = ("system", "developer", "user", "assistant")


class ApiError(Exception):
    """A request the server answers with an OpenAI error object and `status`."""

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = int(status), type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass
class ParsedRequest:
    """What a completion or chat request asks the engine for."""

    kind: str  # "completion" or "chat"
    model: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    extra: dict  # fields the server subclass accepts beyond OpenAI's (artifact engine settings)


def read_json(body: bytes) -> dict:
    if len(body) > MAX_BODY_BYTES:
        raise ApiError(f"request body of {len(body)} bytes exceeds {MAX_BODY_BYTES}", HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ApiError(f"request body is not valid JSON: {error}") from None
    if not isinstance(payload, dict):
        raise ApiError("request body must be a JSON object")
    return payload


def _check_fields(payload: dict, fields: dict) -> None:
    unknown = sorted(set(payload) - set(fields) - set(NEUTRAL))
    if unknown:
        raise ApiError(f"unknown field(s) {unknown}; allowed: {sorted(set(fields) | set(NEUTRAL))}", param=unknown[0])
    for name, allowed in NEUTRAL.items():
        if name in payload and payload[name] not in allowed:
            what = "n > 1 (several choices)" if name == "n" else f"{name}={json.dumps(payload[name])}"
            raise ApiError(f"{what} is not supported by this server; send {name}={json.dumps(allowed[0])} or "
                           "leave it out", param=name)
    for name, kinds in fields.items():
        value = payload.get(name)
        if value is not None and (not isinstance(value, kinds) or (kinds is not bool and isinstance(value, bool))):
            raise ApiError(f"field {name!r} has the wrong type ({type(value).__name__})", param=name)


def _stop_strings(stop) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) and s for s in stops):
        raise ApiError("'stop' must be a non-empty string or a list of non-empty strings", param="stop")
    return tuple(dict.fromkeys(stops))


def _prompt_ids(prompt, tokenizer, vocab_size: int) -> list[int]:
    """A completion prompt as token ids: text is encoded raw (no chat template)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ApiError("this server's model has no tokenizer; send 'prompt' as a list of token ids", param="prompt")
        ids = tokenizer.encode(prompt)
    elif all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    elif all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(f"one prompt per request: got {len(prompt)}; send them as separate requests", param="prompt")
    else:
        raise ApiError("'prompt' as a list must hold integer token ids", param="prompt")
    return _checked_ids(ids, vocab_size)


def _checked_ids(ids: list[int], vocab_size: int) -> list[int]:
    if not ids:
        raise ApiError("the prompt is empty; it needs at least one token", param="prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(f"the prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}", param="prompt")
    return ids


def _message_text(index: int, message) -> tuple[str, str]:
    if not isinstance(message, dict):
        raise ApiError(f"messages[{index}] must be an object with 'role' and 'content'", param="messages")
    role, content = message.get("role"), message.get("content")
    if role not in CHAT_ROLES:
        raise ApiError(f"messages[{index}] has role {role!r}; this server takes {list(CHAT_ROLES)}", param="messages")
    if isinstance(content, list):  # content parts: text only
        kinds = {part.get("type") if isinstance(part, dict) else type(part).__name__ for part in content}
        if kinds - {"text"}:
            raise ApiError(f"messages[{index}] has content parts {sorted(map(str, kinds - {'text'}))}; "
                           "only text parts are supported", param="messages")
        content = "".join(str(part.get("text", "")) for part in content)
    if not isinstance(content, str):
        raise ApiError(f"messages[{index}] needs string content", param="messages")
    return ("system" if role == "developer" else role), content


def chat_prompt_ids(messages: list, tokenizer, vocab_size: int) -> list[int]:
    """The conversation through the checkpoint's chat template, with the assistant's turn opened:
    one user message gives the ids `af.generate` uses for the same text."""
    if tokenizer is None:
        raise ApiError("this server's model has no tokenizer (and so no chat template); use /v1/completions "
                       "with token ids", param="messages")
    if not messages:
        raise ApiError("'messages' must hold at least one message", param="messages")
    turns = [dict(zip(("role", "content"), _message_text(i, m))) for i, m in enumerate(messages)]
    try:
        rendered = tokenizer.apply_chat_template(turns, add_generation_prompt=True)
    except ValueError as error:
        raise ApiError(str(error), param="messages") from None
    return _checked_ids(tokenizer.encode(rendered), vocab_size)


def parse(kind: str, payload: dict, *, model: str, tokenizer, vocab_size: int, max_new_tokens: int,
          extra_fields: dict | None = None) -> ParsedRequest:
    """A validated request of `kind` ("completion" or "chat"); ApiError names what is wrong."""
    extra_fields = extra_fields or {}
    fields = {**(CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS), **extra_fields}
    _check_fields(payload, fields)
    asked = payload.get("model")
    if asked is not None and asked != model:
        raise ApiError(f"the model {asked!r} does not exist; this server serves {model!r}", HTTPStatus.NOT_FOUND,
                       param="model", code="model_not_found")
    if kind == "chat":
        if "messages" not in payload:
            raise ApiError("missing required field 'messages'", param="messages")
        ids = chat_prompt_ids(payload["messages"], tokenizer, vocab_size)
        default_max = max_new_tokens  # chat: up to what the engine allows, as OpenAI's "until the context ends"
        limit = payload.get("max_completion_tokens", payload.get("max_tokens"))
    else:
        if "prompt" not in payload:
            raise ApiError("missing required field 'prompt' (a string or a list of token ids)", param="prompt")
        ids = _prompt_ids(payload["prompt"], tokenizer, vocab_size)
        default_max = min(16, max_new_tokens)  # OpenAI's documented default for completions
        limit = payload.get("max_tokens")
    stop = _stop_strings(payload.get("stop"))
    if stop and tokenizer is None:
        raise ApiError("'stop' strings need a tokenizer; this server's model has none", param="stop")
    options = payload.get("stream_options") or {}
    if set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool):
        raise ApiError("stream_options takes only include_usage (a boolean)", param="stream_options")
    if options and not payload.get("stream"):
        raise ApiError("stream_options is only allowed with stream=true", param="stream_options")
    temperature = float(payload["temperature"]) if payload.get("temperature") is not None else 0.0
    seed = payload.get("seed")
    return ParsedRequest(
        kind=kind, model=model, prompt_ids=ids, max_tokens=int(default_max if limit is None else limit),
        temperature=temperature, top_p=float(payload["top_p"]) if payload.get("top_p") is not None else 1.0,
        seed=int(seed) if seed is not None else secrets.randbelow(2 ** 31), stop=stop,
        stream=bool(payload.get("stream")), include_usage=bool(options.get("include_usage")),
        extra={k: payload[k] for k in extra_fields if k in payload})


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(parsed: ParsedRequest, rid: str, text: str, token_ids: list[int], finish: str, stats: dict) -> dict:
    """The whole answer (stream=false). `token_ids` and `adaflash` are extensions clients ignore."""
    if parsed.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish, "token_ids": token_ids}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "token_ids": token_ids}
    return {"id": rid, "object": "chat.completion" if parsed.kind == "chat" else "text_completion",
            "created": int(time.time()), "model": parsed.model, "choices": [choice],
            "usage": usage(len(parsed.prompt_ids), len(token_ids)), "adaflash": stats}


def chunk(parsed: ParsedRequest, rid: str, *, text: str | None = None, token_ids: list[int] | None = None,
          finish: str | None = None, role: bool = False, usage_counts: dict | None = None,
          stats: dict | None = None) -> dict:
    """One streamed event: a text delta, the finishing chunk, or (choices empty) the usage chunk."""
    out = {"id": rid, "object": "chat.completion.chunk" if parsed.kind == "chat" else "text_completion",
           "created": int(time.time()), "model": parsed.model}
    if usage_counts is not None:
        out["choices"], out["usage"] = [], usage_counts
    elif parsed.kind == "chat":
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        out["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    else:
        out["choices"] = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
    if token_ids is not None and out["choices"]:
        out["choices"][0]["token_ids"] = token_ids
    if stats is not None:
        out["adaflash"] = stats
    return out
