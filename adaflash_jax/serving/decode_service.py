"""The decode thread between the HTTP event loop and the continuous-batching `Scheduler`.

JAX calls block, so one thread runs `Scheduler.iterate()` while there is work and
hands each update to its request's `Waiter`, an asyncio queue on the event loop
(`call_soon_threadsafe`): request handlers never block the loop, and the loop
never waits on a decode step. A full waiting queue raises `QueueFull` at once
(HTTP 503), so overload is answered, never queued without bound.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

from adaflash_jax.serving.scheduler import QueueFull, Request, Scheduler


@dataclasses.dataclass
class Waiter:
    """A submitted request's side of the decode thread: its updates, in order, on `loop`.
    An item is an `Update`, or an Exception when decoding failed."""

    loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    ticket: int = -1
    last_tokens_at: float | None = None  # when this request's latest tokens arrived

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.updates.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass


class DecodeService:
    """Owns the decode thread that drives `scheduler`; `metrics` (a `ServerMetrics`) sees every token."""

    def __init__(self, scheduler: Scheduler, metrics=None):
        self.scheduler, self.metrics = scheduler, metrics
        self.accepting, self.served = True, 0
        self.error: Exception | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._worker = threading.Thread(target=self._loop, name="decode", daemon=True)
        self._worker.start()

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> Waiter:
        """Queues `request` (ValueError: invalid; QueueFull: at the bound; RuntimeError: draining)."""
        if not self.accepting:
            raise RuntimeError("the server is shutting down")
        if self.error is not None:
            raise RuntimeError(f"decoding failed earlier and stopped: {self.error}")
        waiter = Waiter(loop, asyncio.Queue())
        request.tag = waiter
        waiter.ticket = self.scheduler.submit(request)
        self._wake.set()
        return waiter

    def cancel(self, waiter: Waiter) -> None:
        """Drops the request (waiting or running); its slot frees before the next step."""
        self.scheduler.cancel(waiter.ticket)
        self._wake.set()

    def alive(self) -> bool:
        return self._worker.is_alive()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self.scheduler.idle():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                updates = self.scheduler.iterate()
            except Exception as error:  # answer every waiting request, then stop decoding
                self.error = error
                for request in self.scheduler.outstanding():
                    request.tag.put(error)
                return
            now = time.perf_counter()
            for update in updates:
                waiter: Waiter = update.tag
                if update.new_tokens:
                    if self.metrics is not None:
                        gap = None if waiter.last_tokens_at is None else now - waiter.last_tokens_at
                        self.metrics.emitted(len(update.new_tokens), now - waiter.submitted, gap)
                    waiter.last_tokens_at = now
                waiter.put(update)
                if update.done and not update.cancelled and update.error is None:
                    self.served += 1

    def drain(self, poll_s: float = 0.05) -> None:
        """Stops admissions, lets queued and running requests finish, then stops the thread."""
        self.accepting = False
        while not self.scheduler.idle() and self._worker.is_alive():
            time.sleep(poll_s)
        self._stop.set()
        self._worker.join()


__all__ = ["DecodeService", "QueueFull", "Waiter"]
