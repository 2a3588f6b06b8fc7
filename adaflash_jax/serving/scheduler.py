"""Continuous batching: a host loop that keeps an engine's S slots busy.

Each `iterate()`:
1. admits waiting requests into free slots (lowest slots first, so live slots stay
   a prefix and steps run on that prefix only), at most `max_prefill_tokens`
   prompt tokens per iteration: a prompt longer than half of that budget is
   prefilled in chunks (`chunk_tokens`), one chunk per iteration, so running
   requests keep streaming and short prompts are admitted beside it,
2. runs one decode step of every live slot,
3. returns what each request emitted in that step, and frees finished slots at once.

Requests with different max_tokens, temperature, top_p and seed share steps: the
engine keeps them per slot, and a request's random stream depends only on its
own (seed, stream) and output positions, so co-scheduled traffic never changes
a seeded result. Greedy (temperature 0) and sampled requests run in separate
engines (the acceptance rule is compiled per engine); give the scheduler one
engine per mode it serves. Thread-safe: HTTP threads submit and cancel while
one thread iterates.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
from typing import Any, Callable, Sequence

import numpy as np

from adaflash_jax.decoding.batching import MIN_PROMPT_BUCKET, bucket
from adaflash_jax.decoding.slot_params import SlotParams


# "continuous": a freed slot refills at the next step. "static": the baseline of fixed batches,
# admitted only when every slot of the engine is free, then decoded to completion.
ADMISSIONS = ("continuous", "static")
# The server's prompt tokens per iteration (`adaflash serve --prefill-budget`): chunks of 128
# keep a decode step between every 128 prompt tokens of a long prompt.
PREFILL_BUDGET = 256


def chunk_tokens(prefill_budget: int) -> int:
    """The chunk of a long prompt's prefill under `prefill_budget` tokens per iteration: a power
    of two (a prefill shape) of at most half the budget, so short prompts fit beside a chunk."""
    return max(MIN_PROMPT_BUCKET, 1 << max(int(prefill_budget) // 2, 1).bit_length() - 1)


class QueueFull(RuntimeError):
    """The waiting queue is at its bound: try again later (HTTP: 503 + Retry-After)."""


@dataclasses.dataclass
class SlotView:
    """What an engine's `read(k)` returns after a step: per-slot output counts, done flags, tokens."""

    num_out: np.ndarray  # int [k]
    done: np.ndarray  # bool [k]
    out: np.ndarray  # int [k, out_width]
    drafted_fraction: float | None = None  # of the engine's steps so far (None: not tracked)
    failed: np.ndarray | None = None  # bool [k]: the slot's logits went non-finite (None: read
    # from the tokens: such a slot's last token is negative)


@dataclasses.dataclass
class Request:
    prompt: Sequence[int]  # token ids
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stream: int = 0  # which stream of the seed (generate: the prompt's index in its call)
    tag: Any = None  # the caller's handle, returned in every Update

    @property
    def mode(self) -> str:
        return "greedy" if self.temperature == 0 else "sample"


@dataclasses.dataclass
class Update:
    """What one request emitted in one iteration (done: its last update)."""

    ticket: int
    tag: Any
    new_tokens: list[int]
    done: bool
    cancelled: bool = False
    steps: int = 0  # decode steps the request has been part of so far
    error: str | None = None  # set on a last update when decoding this request failed


@dataclasses.dataclass
class _Live:
    ticket: int
    request: Request
    emitted: int = 0
    steps: int = 0
    prefilled: int = 0  # prompt tokens in its slot so far (chunked prefill)
    slot: int = -1  # its slot while its prompt is prefilled in chunks


class _Pool:
    """One engine's slots and which ticket holds each."""

    def __init__(self, engine):
        self.engine = engine
        self.holder: list[_Live | None] = [None] * engine.num_slots
        self.reserved: set[int] = set()  # slots of prompts being prefilled in chunks
        self.tokens = 0  # committed by this engine's decode steps (first tokens, from prefill, not counted)
        self.slot_steps = 0  # live slots summed over this engine's steps
        self.drafted_fraction = 0.0

    def free_slots(self) -> list[int]:
        return [i for i, h in enumerate(self.holder) if h is None and i not in self.reserved]

    def live_prefix(self) -> int:
        """Smallest power of two covering every occupied slot (0 when none is)."""
        used = [i for i, h in enumerate(self.holder) if h is not None]
        return min(bucket(used[-1] + 1), self.engine.num_slots) if used else 0


class Scheduler:
    """Owns the slots of one engine per mode ({"greedy": ..., "sample": ...})."""

    def __init__(self, engines: dict, *, max_queue: int = 256, max_prefill_tokens: int = 2048,
                 admission: str = "continuous"):
        unknown = set(engines) - {"greedy", "sample"}
        if not engines or unknown:
            raise ValueError(f"engines must map 'greedy' and/or 'sample' to an engine, got {sorted(engines)}")
        for mode, eng in engines.items():
            if eng.greedy != (mode == "greedy"):
                raise ValueError(f"the {mode!r} engine was built with greedy={eng.greedy}")
        if max_queue < 1 or max_prefill_tokens < 1:
            raise ValueError("max_queue and max_prefill_tokens must be >= 1")
        if admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {admission!r}")
        self.pools = {mode: _Pool(eng) for mode, eng in engines.items()}
        self.max_queue, self.max_prefill_tokens = int(max_queue), int(max_prefill_tokens)
        self.admission = admission
        self.chunk_tokens = chunk_tokens(max_prefill_tokens)
        self._chunking: list[tuple[str, _Live]] = []  # (mode, request) being prefilled in chunks, oldest first
        self._waiting: collections.deque[_Live] = collections.deque()
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()
        self._tickets = itertools.count()
        self.steps = 0
        self.slot_steps = 0  # live slots summed over steps (occupancy = slot_steps / (steps * S))

    # ----- requests ------------------------------------------------------------------
    def check(self, request: Request) -> None:
        """Raises ValueError when no engine here can serve `request`."""
        if not 0.0 <= request.temperature < float("inf"):
            raise ValueError(f"temperature must be >= 0 and finite, got {request.temperature}")
        pool = self.pools.get(request.mode)
        if pool is None:
            raise ValueError(f"this scheduler serves {sorted(self.pools)} requests, not {request.mode!r} "
                             f"(temperature {request.temperature})")
        eng = pool.engine
        if not 1 <= len(request.prompt) <= eng.max_prompt_len:
            raise ValueError(f"the prompt has {len(request.prompt)} tokens; this engine takes 1 to "
                             f"{eng.max_prompt_len}")
        if not 1 <= int(request.max_new_tokens) <= eng.max_new_tokens:
            raise ValueError(f"max_new_tokens must lie in [1, {eng.max_new_tokens}], got "
                             f"{request.max_new_tokens}")
        if not 0.0 < request.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {request.top_p}")

    def submit(self, request: Request) -> int:
        """Queues a request; returns its ticket. Raises QueueFull at the bound."""
        self.check(request)
        with self._lock:
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (the bound)")
            live = _Live(next(self._tickets), request)
            self._waiting.append(live)
        return live.ticket

    def cancel(self, ticket: int) -> None:
        """Drops a request (waiting or running); its slot frees at the next iteration."""
        with self._lock:
            self._cancelled.add(ticket)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return sum(h is not None for pool in self.pools.values() for h in pool.holder)

    def outstanding(self) -> list[Request]:
        """Every request waiting or running."""
        with self._lock:
            waiting = [w.request for w in self._waiting]
        return (waiting + [live.request for _, live in self._chunking]
                + [h.request for pool in self.pools.values() for h in pool.holder if h is not None])

    def idle(self) -> bool:
        return not self._waiting and not self._chunking and self.running == 0

    def pool_stats(self) -> dict:
        """Per engine: slots running and free, the drafted-step fraction, and mean tau (tokens
        committed per live slot per step)."""
        return {mode: {"running": sum(h is not None for h in pool.holder),
                       "free": len(pool.free_slots()),
                       "drafted_step_fraction": pool.drafted_fraction,
                       "mean_tau": pool.tokens / pool.slot_steps if pool.slot_steps else 0.0}
                for mode, pool in self.pools.items()}

    # ----- the loop ------------------------------------------------------------------
    def iterate(self) -> list[Update]:
        """Admit, step once, collect. Returns this iteration's updates (empty when idle)."""
        updates = self._drop_cancelled()
        self._admit()
        for pool in self.pools.values():
            k = pool.live_prefix()
            if k == 0:
                continue
            pool.engine.step(k)
            self.steps += 1
            self.slot_steps += sum(h is not None for h in pool.holder)
            updates += self._collect(pool, k)
        return updates

    def run(self, requests: Sequence[Request], on_update: Callable[[Update], None] | None = None,
            arrivals: Sequence[int] | None = None) -> list[list[int]]:
        """Decodes `requests` to completion; returns each one's tokens, in order.
        arrivals[i]: the iteration at which request i is submitted (default: all at once)."""
        arrivals = [0] * len(requests) if arrivals is None else list(arrivals)
        order = sorted(range(len(requests)), key=lambda i: arrivals[i])
        tokens: dict[int, list[int]] = {}
        index_of: dict[int, int] = {}
        it, nxt = 0, 0
        while nxt < len(order) or not self.idle():
            while nxt < len(order) and arrivals[order[nxt]] <= it:
                index_of[self.submit(requests[order[nxt]])] = order[nxt]
                nxt += 1
            for update in self.iterate():
                tokens.setdefault(update.ticket, []).extend(update.new_tokens)
                if on_update is not None:
                    on_update(update)
            it += 1
        return [tokens.get(t, []) for t, _ in sorted(index_of.items(), key=lambda kv: kv[1])]

    def _drop_cancelled(self) -> list[Update]:
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            if not cancelled:
                return []
            gone = [w for w in self._waiting if w.ticket in cancelled]
            self._waiting = collections.deque(w for w in self._waiting if w.ticket not in cancelled)
        updates = [Update(w.ticket, w.request.tag, [], True, cancelled=True) for w in gone]
        for mode, live in [c for c in self._chunking if c[1].ticket in cancelled]:
            self._chunking.remove((mode, live))
            pool = self.pools[mode]
            pool.reserved.discard(live.slot)
            pool.engine.evict(np.asarray([live.slot]))
            updates.append(Update(live.ticket, live.request.tag, [], True, cancelled=True))
        for pool in self.pools.values():
            slots = [i for i, h in enumerate(pool.holder) if h is not None and h.ticket in cancelled]
            for i in slots:
                updates.append(Update(pool.holder[i].ticket, pool.holder[i].request.tag, [], True, True))
                pool.holder[i] = None
            if slots:
                pool.engine.evict(np.asarray(slots))
        return updates

    def _chunked(self, pool: _Pool, live: _Live) -> bool:
        """Whether `live`'s prompt is prefilled in chunks (longer than a chunk, and the engine can)."""
        return len(live.request.prompt) > self.chunk_tokens and getattr(pool.engine, "chunked_prefill", False)

    def _next_chunk(self) -> int:
        """Prefills the next chunk of the oldest chunked prompt (its last: the request starts
        decoding). Returns the prompt tokens it took (0: none waits)."""
        if not self._chunking:
            return 0
        mode, live = self._chunking[0]
        pool, prompt, start = self.pools[mode], list(map(int, live.request.prompt)), live.prefilled
        take = min(len(prompt) - start, self.chunk_tokens)
        if start + take < len(prompt):
            pool.engine.prefill_chunk(np.asarray([live.slot]), [prompt[start:start + take]], [start])
            live.prefilled += take
        else:  # the last chunk: the first token is drawn and the slot decodes from the next step
            self._chunking.pop(0)
            pool.reserved.discard(live.slot)
            pool.engine.insert(np.asarray([live.slot]), [prompt[start:]], self._params(pool, [live.request], 0),
                               starts=[start])
            pool.holder[live.slot] = live
        return take

    def _admit(self) -> None:
        """Moves waiting requests (oldest first) into free slots, in bucketed insert calls. A
        prompt longer than a chunk gets a slot, and its first chunk, when no other is being
        chunked; the chunked prompt in progress takes one chunk of each iteration's budget."""
        spent = self._next_chunk()
        budget = self.max_prefill_tokens - spent
        starting: list[tuple[str, _Live]] = []
        with self._lock:
            batches: dict[str, list[_Live]] = {}
            kept = collections.deque()
            free = {mode: len(pool.free_slots()) for mode, pool in self.pools.items()}
            if self.admission == "static":  # a batch runs to completion before the next is admitted
                free = {mode: n if n == pool.engine.num_slots else 0
                        for (mode, pool), n in zip(self.pools.items(), free.values())}
            while self._waiting:
                live = self._waiting.popleft()
                mode, cost = live.request.mode, len(live.request.prompt)
                taken = batches.setdefault(mode, [])
                if self.admission == "continuous" and self._chunked(self.pools[mode], live):
                    if (not self._chunking and not starting and len(taken) < free[mode]
                            and (self.chunk_tokens <= budget or not spent)):
                        starting.append((mode, live))
                        free[mode] -= 1
                        budget -= self.chunk_tokens
                        spent += self.chunk_tokens
                    else:
                        kept.append(live)
                elif len(taken) < free[mode] and (cost <= budget or not spent):
                    taken.append(live)
                    budget -= cost
                    spent += cost
                else:
                    kept.append(live)
            self._waiting = kept
        for mode, lives in batches.items():
            if lives:
                self._insert(self.pools[mode], lives)
        for mode, live in starting:  # after the inserts: those took the lowest free slots
            pool = self.pools[mode]
            live.slot = pool.free_slots()[0]
            pool.reserved.add(live.slot)
            self._chunking.append((mode, live))
            self._next_chunk()

    @staticmethod
    def _params(pool: _Pool, reqs: list[Request], pad: int) -> SlotParams:
        """Per-slot decode settings of `reqs`, and `pad` empty rows (max_new 0: they stay free)."""
        return SlotParams.build(
            np.asarray([r.max_new_tokens for r in reqs] + [0] * pad),
            temperature=np.asarray([max(r.temperature, 1e-6) for r in reqs] + [1.0] * pad),
            top_p=np.asarray([r.top_p for r in reqs] + [1.0] * pad),
            seeds=np.asarray([r.seed for r in reqs] + [0] * pad),
            streams=np.asarray([r.stream for r in reqs] + [0] * pad),
            verify_len=pool.engine.verify_len)

    def _insert(self, pool: _Pool, lives: list[_Live]) -> None:
        """One insert call per power-of-two group; padding rows go to other free slots, empty."""
        free = pool.free_slots()
        while lives:
            n = bucket(len(lives))
            if n > len(free):
                n = bucket(len(lives)) // 2
            group, lives = lives[:n], lives[n:]
            slots, free = free[:n], free[n:]
            prompts = [list(map(int, g.request.prompt)) for g in group] + [[0]] * (n - len(group))
            params = self._params(pool, [g.request for g in group], n - len(group))
            pool.engine.insert(np.asarray(slots), prompts, params)
            for slot, g in zip(slots, group):
                pool.holder[slot] = g
            free = sorted(free + slots[len(group):])

    def _collect(self, pool: _Pool, k: int) -> list[Update]:
        view = pool.engine.read(k)
        if view.drafted_fraction is not None:
            pool.drafted_fraction = view.drafted_fraction
        updates, finished = [], []
        for slot in range(k):
            live = pool.holder[slot]
            if live is None:
                continue
            count = min(int(view.num_out[slot]), live.request.max_new_tokens)
            new = view.out[slot, live.emitted:count].tolist()
            done = bool(view.done[slot])
            failed = bool(view.failed[slot]) if view.failed is not None else any(t < 0 for t in new)
            error = None
            if failed and done:  # the engine ended it at a token drawn from non-finite logits
                new = [t for t in new if t >= 0]
                error = (f"decoding stopped: the model's logits became non-finite (NaN or infinity) "
                         f"at output token {count - 1} of this request")
            if not (live.emitted == 0 and count <= 1 and done):  # else finished by its prefill: no step
                pool.tokens += len(new) - (live.emitted == 0)  # the first token came from the prefill
                pool.slot_steps += 1
                live.steps += 1
            live.emitted = count
            if new or done:
                updates.append(Update(live.ticket, live.request.tag, new, done, steps=live.steps, error=error))
            if done:
                pool.holder[slot] = None
                finished.append(slot)
        if finished:
            pool.engine.evict(np.asarray(finished))
        return updates
