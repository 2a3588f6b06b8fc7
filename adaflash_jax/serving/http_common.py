"""What both HTTP servers share: client errors, JSON body checks, JSON replies."""

from __future__ import annotations

import json
import signal
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler

MAX_BODY_BYTES = 1 << 20


class RequestError(ValueError):
    """A client mistake: answered with `status` and the message, never raised further."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


def read_payload(body: bytes, fields: dict) -> dict:
    """The request's JSON object, every field known and of its type (`fields`: name -> types)."""
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RequestError(f"request body is not valid JSON: {error}") from None
    if not isinstance(payload, dict):
        raise RequestError("request body must be a JSON object")
    unknown = sorted(set(payload) - set(fields))
    if unknown:
        raise RequestError(f"unknown field(s) {unknown}; allowed: {sorted(fields)}")
    if "prompt" not in payload:
        raise RequestError("missing required field 'prompt' (a string or a list of token ids)")
    for name, kinds in fields.items():
        value = payload.get(name)
        if value is not None and (not isinstance(value, kinds) or
                                  (kinds is not bool and isinstance(value, bool))):
            raise RequestError(f"field {name!r} has the wrong type ({type(value).__name__})")
    prompt = payload["prompt"]
    if isinstance(prompt, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise RequestError("'prompt' as a list must hold integer token ids")
    return payload


class JsonHandler(BaseHTTPRequestHandler):
    """Keep-alive HTTP/1.1 handler with JSON replies and a size-checked body reader."""

    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet: one line per request is noise under load
        pass

    def reply(self, status: HTTPStatus, payload: dict, headers: dict | None = None):
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def read_body(self) -> bytes:
        try:
            size = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            raise RequestError("Content-Length is not an integer") from None
        if size > MAX_BODY_BYTES:
            self.close_connection = True
            raise RequestError(f"request body of {size} bytes exceeds {MAX_BODY_BYTES}",
                               HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        return self.rfile.read(size)


def serve_until_signal(server, what: str, ready=None) -> None:
    """Serves in a thread until SIGINT/SIGTERM, then `server.shutdown_gracefully()` (drain) and
    close. `ready(server)` runs once it listens (tests take the port from it)."""
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda signum, frame: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=server.serve_forever, name="http", daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    print(f"serving {what} on http://{host}:{port} (POST /v1/completions)", flush=True)
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
