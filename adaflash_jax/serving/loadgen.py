"""Open-loop load against the streaming completion server (`serving.stream_server`).

- `poisson_arrivals`: a seeded arrival schedule (exponential gaps at a given rate),
  each arrival with its prompt and max_tokens drawn from given pools.
- `drive`: sends the schedule to a server through the official `openai` client
  (`AsyncOpenAI`, streaming completions), each request a task started at its
  arrival time (so a slow server never delays later arrivals), polls GET
  /health while it runs, and, when the drain deadline passes, cancels what is
  still outstanding.
- `summarize`: throughput, TTFT / inter-token latency percentiles, counts of
  200s, 503s and connection resets.

Each chunk carries the token ids it adds (the server's `token_ids` extension), so
tokens are counted without a tokenizer. Client-side times throughout: TTFT is
from sending the request to the first chunk that carries tokens; inter-token
latency is the gap between a request's successive token chunks; a request's
per-token latency is (last token chunk - first) / (tokens - 1).
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import threading
import time
from typing import Callable, Sequence

import numpy as np
import openai

HOST = "127.0.0.1"  # loopback only


@dataclasses.dataclass(frozen=True)
class Arrival:
    at_s: float  # offset from the start of the run
    prompt: int  # index into the prompt pool
    max_tokens: int


def poisson_arrivals(rate: float, duration_s: float, num_prompts: int, max_tokens: Sequence[int],
                     seed: int) -> list[Arrival]:
    """Arrivals of a Poisson process of `rate` requests/s over [0, duration_s)."""
    if rate <= 0 or duration_s <= 0 or num_prompts < 1 or not max_tokens:
        raise ValueError(f"need rate > 0, duration_s > 0, prompts and max_tokens; got {rate}, {duration_s}, "
                         f"{num_prompts}, {list(max_tokens)}")
    rng = np.random.default_rng(seed)
    out, t = [], float(rng.exponential(1.0 / rate))
    while t < duration_s:
        out.append(Arrival(t, int(rng.integers(num_prompts)), int(rng.choice(max_tokens))))
        t += float(rng.exponential(1.0 / rate))
    return out


@dataclasses.dataclass
class Record:
    """One request as the client saw it (times relative to the run start)."""

    arrival: Arrival
    status: int = 0  # HTTP status; 0: no answer (connection error)
    sent_s: float = 0.0
    events: list = dataclasses.field(default_factory=list)  # (time, tokens) per token event
    finished_s: float | None = None  # when the final "done" event came
    error: str | None = None

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.events)


async def stream_completion(client: openai.AsyncOpenAI, model: str, body: dict, record: Record,
                            clock: Callable[[], float]) -> None:
    """Sends `body` as a streaming completion through the openai client; fills `record` as the
    chunks arrive (status 0: the connection failed or was reset)."""
    record.sent_s = clock()
    try:
        stream = await client.completions.create(model=model, stream=True, **body)
        record.status = 200
        async for chunk in stream:
            choice = chunk.choices[0] if chunk.choices else None
            if choice is None:
                continue
            ids = (choice.model_extra or {}).get("token_ids")
            if ids:
                record.events.append((clock(), len(ids)))
            if choice.finish_reason:
                record.finished_s = clock()
    except openai.APIStatusError as error:  # an answer other than 200 (503 on overload)
        record.status, record.error = error.status_code, str(error)[:300]
    except openai.APIConnectionError as error:  # refused or reset: no answer
        record.error = f"connection: {error.__cause__ or error}"
    except openai.APIError as error:  # an error event inside a 200 stream
        record.error = str(error)[:300]


def health(port: int, timeout: float = 10.0) -> dict:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", "/health")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def drive(server, arrivals: Sequence[Arrival], prompts: Sequence[Sequence[int]], *, drain_s: float,
          temperature: float = 0.0, poll_s: float = 1.0) -> dict:
    """Runs `arrivals` against `server` (a running `SchedulerServer`); returns the records, the
    /health samples and the run's start/end. After the last arrival, outstanding requests get
    `drain_s` seconds to finish; then they are cancelled (their records say `cut`)."""
    port = server.server_address[1]
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start  # noqa: E731
    horizon = (arrivals[-1].at_s if arrivals else 0.0) + drain_s
    records = [Record(a) for a in arrivals]
    samples, done = [], threading.Event()

    def poll():
        while not done.wait(poll_s):
            try:
                samples.append({"t": clock(), **health(port)})
            except (OSError, ValueError):
                pass

    async def run() -> float | None:
        client = openai.AsyncOpenAI(base_url=f"http://{HOST}:{port}/v1", api_key="unused", max_retries=0,
                                    timeout=horizon + 120)
        tasks = []
        for i, (arrival, record) in enumerate(zip(arrivals, records)):
            await asyncio.sleep(max(0.0, arrival.at_s - clock()))
            body = {"prompt": list(map(int, prompts[arrival.prompt])), "max_tokens": arrival.max_tokens,
                    "temperature": temperature, "seed": i}
            tasks.append(asyncio.ensure_future(stream_completion(client, server.model, body, record, clock)))
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, horizon - clock())) if tasks else (set(), set())
        cut_s = None
        if pending:  # past the drain deadline: free the slots, then let the streams end
            cut_s = clock()
            for request in server.scheduler.outstanding():
                server.cancel(request.tag)
            await asyncio.wait(pending, timeout=60)
        await client.close()
        return cut_s

    poller = threading.Thread(target=poll, name="health-poll", daemon=True)
    poller.start()
    cut_s = asyncio.run(run())
    done.set()
    poller.join()
    finish = [r.events[-1][0] for r in records if r.events]
    end = cut_s if cut_s is not None else max(finish + [r.finished_s or 0.0 for r in records] + [0.0])
    return {"records": records, "health": samples, "end_s": end, "cut_s": cut_s,
            "final_health": health(port)}


def _pct(values, q) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def summarize(run: dict, slots: int) -> dict:
    """Throughput, TTFT / per-token latency percentiles (seconds), occupancy and counts of one run."""
    records, end, cut = run["records"], run["end_s"], run["cut_s"]
    ok = [r for r in records if r.status == 200]
    is_cut = [cut is not None and (r.finished_s is None or r.finished_s >= cut) for r in ok]
    complete = [r for r, c in zip(ok, is_cut) if not c and r.finished_s is not None and r.error is None]
    tokens = sum(n for r in ok for t, n in r.events if cut is None or t <= cut)
    ttft = [r.events[0][0] - r.sent_s for r in ok if r.events]
    tpot = [(r.events[-1][0] - r.events[0][0]) / (r.tokens - 1) for r in complete if r.tokens > 1]
    gaps = [b[0] - a[0] for r in ok for a, b in zip(r.events, r.events[1:])]
    samples = run["health"]
    occupancy = [s["running"] / max(s["slots"], 1) for s in samples]
    statuses: dict[str, int] = {}
    for r in records:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    return {
        "requests": len(records), "completed": len(complete), "rejected_503": statuses.get("503", 0),
        "server_errors_5xx": sum(v for k, v in statuses.items() if k.startswith("5") and k != "503"),
        "cut_at_drain": sum(is_cut), "client_errors": sum(r.error is not None and not c
                                                               for r, c in zip(ok, is_cut)),
        "ok_200": statuses.get("200", 0), "resets": statuses.get("0", 0),
        "statuses": statuses, "generated_tokens": tokens, "run_s": end,
        "throughput_tok_s": tokens / end if end > 0 else 0.0,
        "ttft_s": {"p50": _pct(ttft, 50), "p99": _pct(ttft, 99), "mean": float(np.mean(ttft)) if ttft else None},
        "per_token_s": {"p50": _pct(tpot, 50), "p99": _pct(tpot, 99)},
        "inter_token_s": {"p50": _pct(gaps, 50), "p99": _pct(gaps, 99)},
        "occupancy_time_avg": float(np.mean(occupancy)) if occupancy else None,
        "occupancy_step_avg": run["final_health"].get("occupancy"),
        "max_waiting": max((s["waiting"] for s in samples), default=0), "slots": slots,
    }
