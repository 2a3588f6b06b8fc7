"""Running a server until SIGINT/SIGTERM, then draining it (both `adaflash serve` forms)."""

from __future__ import annotations

import signal
import threading


def serve_until_signal(server, what: str, ready=None) -> None:
    """Serves in a thread until SIGINT/SIGTERM, then `server.shutdown_gracefully()` (drain) and
    close. `ready(server)` runs once it listens (tests take the port from it)."""
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda signum, frame: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=server.serve_forever, name="http", daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    print(f"serving {what} on http://{host}:{port} (OpenAI API: POST /v1/chat/completions, /v1/completions; "
          "GET /v1/models, /health, /metrics)", flush=True)
    if ready is not None:
        ready(server)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.shutdown_gracefully()
        thread.join(timeout=60)
        server.server_close()
        for s, handler in previous.items():
            signal.signal(s, handler)
        print(f"stopped after serving {server.served} request(s)", flush=True)
