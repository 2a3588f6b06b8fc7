"""Serving under Poisson load through the official `openai` client: continuous vs static
batching, AR vs the default speculative mode, at multiples of the saturation rate.

The saturation rate (requests/s) is measured first: a burst of 3 x slots requests
against the first method under continuous batching, its generated tokens/s over
the mean max_tokens. For each offered load (--loads: multiples of it, 0.5 and 2 by
default) a seeded Poisson arrival schedule is drawn once: each arrival takes a
prompt of the fixed evaluation set (`eval.heldout.heldout_prompts`,
code/math/prose/HumanEval interleaved) and a max_tokens from {8, 16, 32, 64, 128,
256} capped at --max-new-tokens. The same schedule is sent to every (method,
admission), as greedy streaming completions from `openai.AsyncOpenAI` (one task
per request, `serving.loadgen`) over loopback to the real `SchedulerServer`
running in this process, with chunked prefill (--prefill-budget):

- methods: `ar` (no drafter), `adaptive` (the default of `adaflash serve
  --drafter`: the adaptive decoder with --drafter), and for comparison `dflash`
  (every step verifying the whole block) and `adaflash` (the AdaFlash drafter's
  length head under the "auto" policy);
- admissions: `continuous` (a freed slot refills at the next step) and `static`
  (a batch is admitted only when every slot is free and decodes to completion).

Requests arrive open-loop (each from its own thread at its time). After the last
arrival, what is outstanding gets --drain-s seconds, then is cancelled. A full
queue (--max-queue) answers 503; those count as rejected.

Every method is warmed up alike before anything is timed: each engine shape the
traffic can hit (insert groups x prompt buckets, step prefixes, evictions) is
compiled (AdaFlash's step costs are calibrated then too, once per prefix size),
then the same warm-up traffic (2 x slots requests) is sent to each.
The (method, admission) order is rotated per load, so drift in machine speed
spreads over all of them.

Reported per (method, admission, load): throughput (generated tokens over the
run: first arrival window start to last token), TTFT p50/p99 (send to first
token chunk), inter-token latency p50/p99 (gaps between a request's token
chunks), per-token latency p50/p99 ((last - first token chunk) / (n - 1)), slot
occupancy (time average of GET /health `running / slots`, and the scheduler's
per-step average), counts of 200s, 503s, connection resets and requests cut at
the drain deadline. JSON to stdout (and --out); --plot draws throughput and p99
TTFT against offered load.

    python benchmarks/serving_load.py [--loads 0.5,2] [--duration-s 60] [--slots 8]
        [--max-new-tokens 128] [--methods ar,adaptive] [--prompts-per-domain 8]
        [--prefill-budget 256] [--seed 0] [--out FILE.json] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import threading
import time

import jax
import numpy as np
import openai

from adaflash_jax.decoding.batching import MIN_PROMPT_BUCKET, bucket
from adaflash_jax.decoding.engine_state import SlotParams
from adaflash_jax.eval.heldout import EVAL_DOMAINS, heldout_prompts
from adaflash_jax.eval.report import emit_json
from adaflash_jax.serving.loadgen import Arrival, drive, poisson_arrivals, summarize
from adaflash_jax.serving.scheduler import ADMISSIONS, PREFILL_BUDGET, Scheduler, chunk_tokens
from adaflash_jax.serving.slot_engine import LocalEngine
from adaflash_jax.serving.stream_server import SchedulerServer

MODEL = "smollm2-135m-instruct"
METHODS = ("ar", "adaptive", "dflash", "adaflash")
MAX_TOKENS_MIX = (8, 16, 32, 64, 128, 256)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--loads", default="0.5,2",
                   help="comma-separated offered loads, as multiples of the measured saturation rate")
    p.add_argument("--duration-s", type=float, default=60.0, help="arrival window per load and run")
    p.add_argument("--drain-s", type=float, default=60.0,
                   help="after the last arrival, how long outstanding requests may finish before cancellation")
    p.add_argument("--slots", type=int, default=8, help="decode slots of each engine")
    p.add_argument("--max-queue", type=int, default=None, help="waiting-queue bound (503 past it); default 2 x slots")
    p.add_argument("--max-new-tokens", type=int, default=128, help="cap on the max_tokens mix (and the engines)")
    p.add_argument("--methods", default="ar,adaptive", help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--prefill-budget", type=int, default=PREFILL_BUDGET,
                   help="prompt tokens prefilled per scheduler iteration (longer prompts in chunks)")
    p.add_argument("--drafter", default="smollm2-135m-instruct-dflash", help="drafter of the adaptive method")
    p.add_argument("--admissions", default=",".join(ADMISSIONS), help="comma-separated subset of continuous,static")
    p.add_argument("--dflash", default="smollm2-135m-instruct-dflash", help="DFlash drafter (fixed verification)")
    p.add_argument("--adaflash", default="smollm2-135m-instruct-adaflash", help="AdaFlash drafter (length head)")
    p.add_argument("--prompts-per-domain", type=int, default=8, help="prompts per domain of the fixed set")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival schedules")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--plot", default=None, help="draw throughput and p99 TTFT against offered load to this PNG")
    args = p.parse_args(argv)
    try:
        args.loads = [float(x) for x in args.loads.split(",")]
    except ValueError:
        p.error(f"--loads needs comma-separated numbers, got {args.loads!r}")
    args.methods, args.admissions = args.methods.split(","), args.admissions.split(",")
    if min(args.loads) <= 0 or args.duration_s <= 0 or args.drain_s < 0:
        p.error("--loads and --duration-s must be > 0 and --drain-s >= 0")
    if min(args.slots, args.max_new_tokens, args.prompts_per_domain, args.prefill_budget) < 1:
        p.error("--slots, --max-new-tokens, --prompts-per-domain and --prefill-budget must be >= 1")
    if set(args.methods) - set(METHODS) or set(args.admissions) - set(ADMISSIONS):
        p.error(f"--methods from {METHODS}, --admissions from {ADMISSIONS}")
    args.max_queue = 2 * args.slots if args.max_queue is None else args.max_queue
    return args


def max_tokens_mix(cap: int) -> list[int]:
    """The max_tokens values requests draw from: the standard mix, capped at `cap`."""
    return sorted({min(m, cap) for m in MAX_TOKENS_MIX})


def prompt_pool(target, per_domain: int) -> tuple[list[list[int]], list[str]]:
    """The fixed evaluation set's first `per_domain` prompts of each domain, interleaved."""
    by_domain = heldout_prompts(target, per_domain)
    pairs = [(by_domain[d][k].ids, d) for k in range(per_domain) for d in EVAL_DOMAINS]
    return [list(ids) for ids, _ in pairs], [d for _, d in pairs]


def method_engine(method: str, target, drafter=None, **make) -> LocalEngine:
    """The slot engine of one method: AR (no drafter), the adaptive decoder (the server's default
    with a drafter), DFlash (whole blocks) or AdaFlash ("auto")."""
    if method == "ar":
        return LocalEngine(target, None, **make)
    if method == "adaptive":
        return LocalEngine(target, drafter, verify="adaptive", **make)
    if method == "dflash":
        return LocalEngine(target, drafter, length_policy="fixed", verify_len=drafter.block_size, **make)
    return LocalEngine(target, drafter, length_policy="auto", **make)


def compile_engine(engine: LocalEngine, prompt_lengths, prefill_budget: int = PREFILL_BUDGET) -> float:
    """Runs every program the scheduler can call on `engine` once; returns the seconds taken.

    Inserts come in power-of-two groups padded to the bucket of their longest prompt,
    steps run on power-of-two live prefixes, evictions take any number of slots; a prompt
    longer than a chunk is prefilled one chunk at a time and ends with a one-slot insert."""
    t0 = time.perf_counter()
    s = engine.num_slots
    groups = sorted({bucket(i) for i in range(1, s + 1) if bucket(i) <= s})  # powers of two <= s
    widths = sorted({min(bucket(n, MIN_PROMPT_BUCKET), engine.max_prompt_len) for n in prompt_lengths})
    for n in groups:
        params = SlotParams.build(np.ones(n, np.int64), temperature=np.ones(n), top_p=np.ones(n),
                                  seeds=np.zeros(n, np.int64), streams=np.zeros(n, np.int64),
                                  verify_len=engine.verify_len)
        for w in widths:
            engine.insert(np.arange(n), [[1] * w] * n, params)
            jax.block_until_ready(engine.state)
        engine.evict(np.arange(n))
    chunk = chunk_tokens(prefill_budget)
    if max(prompt_lengths) > chunk:
        one = SlotParams.build(np.ones(1, np.int64), temperature=np.ones(1), top_p=np.ones(1),
                               seeds=np.zeros(1, np.int64), streams=np.zeros(1, np.int64), verify_len=engine.verify_len)
        engine.prefill_chunk(np.arange(1), [[1] * chunk], [0])
        for w in sorted({bucket(n, MIN_PROMPT_BUCKET) for n in range(1, chunk + 1)}):
            engine.insert(np.arange(1), [[1] * w], one, starts=[chunk])
        engine.evict(np.arange(1))
    for k in sorted(set(groups) | {s}):  # live prefixes: powers of two below s, and s
        engine.step(k)
        engine.read(k)
    for m in range(1, s + 1):
        engine.evict(np.arange(m))
    jax.block_until_ready(engine.state)
    return time.perf_counter() - t0


def run_point(engine: LocalEngine, admission: str, arrivals, prompts, *, vocab_size: int, max_queue: int,
              drain_s: float, prefill_budget: int = PREFILL_BUDGET) -> dict:
    """One run of `arrivals` against a fresh scheduler + HTTP server over `engine`."""
    scheduler = Scheduler({"greedy": engine}, max_queue=max_queue, admission=admission,
                          max_prefill_tokens=prefill_budget)
    server = SchedulerServer(scheduler, tokenizer=None, vocab_size=vocab_size, host="127.0.0.1", port=0)
    thread = threading.Thread(target=server.serve_forever, name="http", daemon=True)
    thread.start()
    try:
        load_before = os.getloadavg()[0]
        run = drive(server, arrivals, prompts, drain_s=drain_s)
        row = summarize(run, engine.num_slots)
        row["host_load_avg_1m"] = [load_before, os.getloadavg()[0]]
        row["scheduler_steps"] = scheduler.steps
        return row
    finally:
        server.shutdown_gracefully()
        server.server_close()
        thread.join(timeout=10)


def warmup_arrivals(num_prompts: int, slots: int, mix) -> list[Arrival]:
    """The warm-up traffic, identical for every method: 2 x slots requests in quick succession."""
    short = [m for m in mix if m <= 32] or mix[:1]
    return [Arrival(0.02 * i, i % num_prompts, short[i % len(short)]) for i in range(2 * slots)]


def saturation_rate(engine: LocalEngine, prompts, mix, *, vocab_size: int, prefill_budget: int) -> dict:
    """Requests/s the engine sustains under continuous batching: a burst of 3 x slots requests
    (all queued at once), its generated tokens/s over the mean max_tokens of the mix."""
    n = 3 * engine.num_slots
    burst = [Arrival(0.001 * i, i % len(prompts), mix[i % len(mix)]) for i in range(n)]
    row = run_point(engine, "continuous", burst, prompts, vocab_size=vocab_size, max_queue=n, drain_s=600,
                    prefill_budget=prefill_budget)
    return {"requests_per_s": row["throughput_tok_s"] / float(np.mean(mix)), "tok_s": row["throughput_tok_s"],
            "burst": n, "completed": row["completed"]}


def measure(engines: dict, prompts, loads, *, duration_s: float, drain_s: float, seed: int, mix,
            admissions=ADMISSIONS, vocab_size: int, max_queue: int, log=print,
            prefill_budget: int = PREFILL_BUDGET) -> dict:
    """{"warmup": {method: ...}, "saturation": {...}, "results": {method: {admission: {load: row}}}}
    (see the module doc); loads are multiples of the first method's saturation rate."""
    warm = {}
    for name, engine in engines.items():
        compile_s = compile_engine(engine, [len(p) for p in prompts], prefill_budget)
        t0 = time.perf_counter()
        row = run_point(engine, "continuous", warmup_arrivals(len(prompts), engine.num_slots, mix), prompts,
                        vocab_size=vocab_size, max_queue=max(max_queue, 2 * engine.num_slots), drain_s=600,
                        prefill_budget=prefill_budget)
        warm[name] = {"compile_s": compile_s, "traffic_s": time.perf_counter() - t0,
                      "completed": row["completed"], "requests": row["requests"]}
        log(f"warm-up {name}: compile {compile_s:.1f}s, traffic {warm[name]['traffic_s']:.1f}s")
    first = next(iter(engines))
    saturation = {"method": first, **saturation_rate(engines[first], prompts, mix, vocab_size=vocab_size,
                                                     prefill_budget=prefill_budget)}
    log(f"saturation ({first}, continuous): {saturation['requests_per_s']:.2f} requests/s")
    pairs = [(m, a) for m in engines for a in admissions]
    results = {m: {a: {} for a in admissions} for m in engines}
    for li, load in enumerate(loads):
        rate = load * saturation["requests_per_s"]
        arrivals = poisson_arrivals(rate, duration_s, len(prompts), mix, seed=seed * 1000 + li)
        for name, admission in pairs[li % len(pairs):] + pairs[:li % len(pairs)]:
            row = run_point(engines[name], admission, arrivals, prompts, vocab_size=vocab_size,
                            max_queue=max_queue, drain_s=drain_s, prefill_budget=prefill_budget)
            row["offered_requests_per_s"] = rate
            row["offered_tok_s_upper"] = rate * float(np.mean([a.max_tokens for a in arrivals] or [0]))
            results[name][admission][str(load)] = row
            log(f"load {load}x ({rate:.2f}/s) {name} {admission}: {row['throughput_tok_s']:.1f} tok/s, ttft "
                f"p50/p99 {row['ttft_s']['p50']}/{row['ttft_s']['p99']}, done {row['completed']}/{row['requests']}, "
                f"503 {row['rejected_503']}, resets {row['resets']}")
    return {"warmup": warm, "saturation": saturation, "results": results, "summary": _summary(results, loads)}


def _summary(results: dict, loads) -> dict:
    """Continuous / static throughput per method and load; p99 / p50 TTFT per run."""
    out = {}
    for name, by_adm in results.items():
        rows = {}
        for load in map(str, loads):
            entry = {}
            c, s = by_adm.get("continuous", {}).get(load), by_adm.get("static", {}).get(load)
            if c and s and s["throughput_tok_s"] > 0:
                entry["continuous_over_static_throughput"] = c["throughput_tok_s"] / s["throughput_tok_s"]
            for adm, row in by_adm.items():
                t = row[load]["ttft_s"]
                if t["p50"]:
                    entry[f"ttft_p99_over_p50_{adm}"] = t["p99"] / t["p50"]
            rows[load] = entry
        out[name] = rows
    return out


def plot(record: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = record["loads"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, by_adm in record["results"].items():
        for adm, rows in by_adm.items():
            style = dict(marker="o", ls="-" if adm == "continuous" else "--", label=f"{name} {adm}")
            axes[0].plot(loads, [rows[str(x)]["throughput_tok_s"] for x in loads], **style)
            axes[1].plot(loads, [rows[str(x)]["ttft_s"]["p99"] or np.nan for x in loads], **style)
    axes[0].set_ylabel("generated tokens/s")
    axes[1].set_ylabel("p99 TTFT (s)")
    for ax in axes:
        ax.set_xlabel("offered load (x saturation)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{record['model']}: {record['slots']} slots, max_tokens {record['max_tokens_mix']} "
                 f"({record['backend']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import adaflash_jax as af

    target = af.load_target(MODEL)
    prompts, labels = prompt_pool(target, args.prompts_per_domain)
    mix = max_tokens_mix(args.max_new_tokens)
    make = dict(num_slots=args.slots, max_prompt_len=max(map(len, prompts)), max_new_tokens=max(mix), greedy=True)
    engines, drafters = {}, {}
    for name in args.methods:
        if name != "ar":
            drafters[name] = af.load_drafter(args.drafter if name == "adaptive" else getattr(args, name),
                                             target=target)
        engines[name] = method_engine(name, target, drafters.get(name), **make)
    measured = measure(engines, prompts, args.loads, duration_s=args.duration_s, drain_s=args.drain_s,
                       seed=args.seed, mix=mix, admissions=args.admissions, vocab_size=target.cfg.vocab_size,
                       max_queue=args.max_queue, prefill_budget=args.prefill_budget,
                       log=lambda msg: print(msg, file=sys.stderr, flush=True))
    record = {"model": MODEL, "drafters": {n: d.name for n, d in drafters.items()},
              "length_policy": {n: e.length_policy for n, e in engines.items()},
              "verify_len": {n: e.verify_len for n, e in engines.items() if e.length_policy == "fixed"},
              "loads": args.loads, "duration_s": args.duration_s, "drain_s": args.drain_s, "slots": args.slots,
              "max_queue": args.max_queue, "max_tokens_mix": mix, "seed": args.seed,
              "prefill_budget": args.prefill_budget, "client": f"openai {openai.__version__} (AsyncOpenAI)",
              "prompts": {"per_domain": args.prompts_per_domain, "count": len(prompts),
                          "domains": sorted(set(labels)), "max_len": max(map(len, prompts))},
              "greedy": True, "jax": jax.__version__, "backend": jax.default_backend(),
              "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(), **measured}
    emit_json(record, args.out, indent=2)
    if args.plot:
        plot(record, args.plot)
    return record


if __name__ == "__main__":
    main()
