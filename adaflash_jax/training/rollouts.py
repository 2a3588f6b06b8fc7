"""Target rollouts: the target's own responses to training prompts, on disk.

Responses come from the engine (speculative with the current drafter when
one is given — lossless, so identical to AR — else AR), by continuous batching
over `batch_size` slots (`rollout_stream`), and are
written as compact shards of records {index, prompt_ids, sample, response_ids,
domain} (sample 0: greedy; 1..n: sampled at T > 0 when asked for): token ids at about
2 bytes a token (`rollout_shards`), so a store can be committed and grown over time;
older ArrayRecord shards of JSON records are read as well.
Shard k holds prompts [k*S, (k+1)*S) and appears only complete (written to a
temporary name, then renamed), so a killed job restarts at the first missing
shard: nothing written is lost or duplicated. A job over more prompts of the
same order extends the store.
"""

from __future__ import annotations

import json
import os
import re
from typing import Iterator, Sequence

import numpy as np

from adaflash_jax.atomic_io import atomic_write_json
from adaflash_jax.generation import generate
from adaflash_jax.training import rollout_shards
from adaflash_jax.training.rollout_stream import stream_shards

SHARD_RE = re.compile(r"^rollouts-(\d{5})\.(array_record|npz)$")
LEGACY = ".array_record"


def _shard_path(out_dir: str, shard: int) -> str:
    """Where shard `shard` is (an older ArrayRecord shard if that exists), else is written."""
    stem = os.path.join(out_dir, f"rollouts-{shard:05d}")
    return stem + LEGACY if os.path.exists(stem + LEGACY) else stem + rollout_shards.SUFFIX


def completed_shards(out_dir: str) -> list[int]:
    if not os.path.isdir(out_dir):
        return []
    return sorted({int(m.group(1)) for n in os.listdir(out_dir) if (m := SHARD_RE.match(n))})


def _write_shard(path: str, records: list[dict]) -> None:
    """Writes a shard in the compact form; an older ArrayRecord copy is removed after it."""
    stem = path[:-len(LEGACY)] if path.endswith(LEGACY) else path[:-len(rollout_shards.SUFFIX)]
    rollout_shards.write_npz_shard(stem + rollout_shards.SUFFIX, records)
    if os.path.exists(stem + LEGACY):
        os.remove(stem + LEGACY)


def compact_store(out_dir: str) -> int:
    """Rewrites every ArrayRecord shard of `out_dir` in the compact form (same records);
    returns how many were rewritten."""
    legacy = [s for s in completed_shards(out_dir) if _shard_path(out_dir, s).endswith(LEGACY)]
    for shard in legacy:
        _write_shard(_shard_path(out_dir, shard), read_shard(out_dir, shard))
    return len(legacy)


GROWABLE = ("num_prompts",)  # a store can be extended with more prompts of the same order
RECORDED_LATER = ("target_fingerprint",)  # settings a store made before they existed gains on its next run
# Stores (and OPD buffers) written before these settings existed.
OLDER_DEFAULTS = {"samples": 0, "temperature": None, "greedy": True, "rollout_temperatures": [0.0],
                  "rollout_top_p": 1.0}


def _check_manifest(out_dir: str, manifest: dict) -> None:
    """Refuses a store made with other settings or for another target (by fingerprint);
    records the manifest when the store is new, grows, or gains a RECORDED_LATER setting."""
    path = os.path.join(out_dir, "manifest.json")
    if os.path.exists(path):
        with open(path) as f:
            stored = json.load(f)
        old = {**OLDER_DEFAULTS, **stored}
        gained = {k: manifest[k] for k in RECORDED_LATER if k in manifest and k not in old}
        old.update(gained)
        if "target_fingerprint" in manifest and old["target_fingerprint"] != manifest["target_fingerprint"]:
            raise ValueError(f"{out_dir} holds rollouts of another target (fingerprint "
                             f"{old['target_fingerprint']}, this target's {manifest['target_fingerprint']}); "
                             "use a new output directory (existing rollouts are kept)")
        diff = {k: (old.get(k), v) for k, v in manifest.items() if old.get(k) != v and k not in GROWABLE}
        if diff:
            raise ValueError(f"{out_dir} holds rollouts made with different settings {diff}; "
                             "use a new output directory (existing rollouts are kept)")
        grown = any(manifest.get(k, 0) > old.get(k, 0) for k in GROWABLE)
        if not (grown or gained):
            return
        if not grown:
            manifest = {**stored, **gained}
    os.makedirs(out_dir, exist_ok=True)
    atomic_write_json(path, manifest, indent=2)


def generate_rollouts(target, prompt_ids: Sequence[Sequence[int]], domains: Sequence[str],
                      out_dir: str, *, drafter=None, max_new_tokens: int = 256,
                      batch_size: int = 16, shard_size: int | None = None,
                      samples: int = 0, temperature: float = 0.7, greedy: bool = True,
                      progress: bool = True, shards: tuple[int, int] | None = None) -> dict:
    """Writes the target's greedy responses for every prompt (unless not `greedy`: a store of
    sampled responses only), plus `samples` sampled ones (T = `temperature`) each; resumes where it stopped, and extends a store made from a
    prefix of the same prompts. shards=(start, stop): only the job's shards in [start, stop)
    (prompts not yet trained on; or one machine's part of a job split across several)."""
    if samples < 0 or (samples and not temperature > 0):
        raise ValueError(f"samples must be >= 0 and temperature > 0 to sample, got {samples}, {temperature}")
    if not greedy and samples < 1:
        raise ValueError("a store without greedy responses needs samples >= 1")
    if len(prompt_ids) != len(domains):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(domains)} domains")
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError("batch_size and max_new_tokens must be >= 1")
    shard_size = shard_size or batch_size
    num_shards = -(-len(prompt_ids) // shard_size)
    start, stop = (0, num_shards) if shards is None else (int(shards[0]), min(int(shards[1]), num_shards))
    if not 0 <= start < stop:
        raise ValueError(f"shards {shards} select none of this job's {num_shards} shards "
                         f"({len(prompt_ids)} prompts, {shard_size} per shard)")
    _check_manifest(out_dir, {"num_prompts": len(prompt_ids), "shard_size": shard_size,
                              "max_new_tokens": max_new_tokens, "target": target.name,
                              "target_fingerprint": target.fingerprint(),
                              "vocab_size": target.cfg.vocab_size, "samples": samples,
                              "temperature": temperature if samples else None, "greedy": greedy})
    done = set(completed_shards(out_dir))
    _check_shard_prompts(out_dir, done, prompt_ids, shard_size, first_sample=0 if greedy else 1)
    todo = [s for s in range(start, stop) if s not in done]
    stats = {"shards_total": num_shards, "shards_selected": stop - start,
             "shards_skipped": stop - start - len(todo), "tokens": 0}
    if todo:
        decoded = stream_shards(target, prompt_ids, domains, todo,
                                lambda shard, records: _write_shard(_shard_path(out_dir, shard), records),
                                shard_size=shard_size, slots=batch_size, max_new_tokens=max_new_tokens,
                                drafter=drafter, samples=samples, temperature=temperature, greedy=greedy,
                                progress=progress)
        stats["tokens"] = decoded["tokens"]
        stats["tokens_per_s"] = decoded["tokens"] / max(decoded["wall_s"], 1e-9)
    return stats


def _check_shard_prompts(out_dir: str, shards, prompt_ids, shard_size: int, first_sample: int = 0) -> None:
    """Each stored shard must hold the prompts it would hold now (same order, same ids), so a
    store extended with more prompts, or resumed, never mixes two prompt orders."""
    for shard in sorted(shards):
        lo = shard * shard_size
        records = read_shard(out_dir, shard)
        want = [list(map(int, p)) for p in prompt_ids[lo:lo + shard_size]]
        if [r["prompt_ids"] for r in records if r.get("sample", 0) == first_sample] != want:
            raise ValueError(f"{out_dir}: shard {shard} holds other prompts than this job's prompts "
                             f"{lo}..{lo + len(want) - 1} (another prompt order or selection); use a new "
                             "output directory (existing rollouts are kept)")


def write_rollout_shard(target, prompt_ids, domains, out_dir: str, shard: int, *, first_index: int = 0,
                        drafter=None, max_new_tokens: int = 256, batch_size: int = 16,
                        samples: int = 0, temperature: float = 0.7, top_p: float = 1.0,
                        greedy: bool = True, seed: int | None = None) -> dict:
    """Decodes `prompt_ids` (greedy unless `greedy=False`, plus `samples` responses sampled at
    `temperature` / `top_p` each, seeded by `seed` (default shard * 1000) plus the sample number
    so a rewritten shard is identical) and writes them as shard `shard` of `out_dir`, records
    indexed from `first_index` ("sample": 0 is the greedy one).
    Returns {tokens, tokens_per_s, mean_tau (speculative only)}."""
    if not greedy and samples < 1:
        raise ValueError("a shard without greedy responses needs samples >= 1")
    records, taus, wall = [], [], 0.0
    base = shard * 1000 if seed is None else seed
    for sample in range(0 if greedy else 1, samples + 1):
        sampling = {} if sample == 0 else {"temperature": temperature, "top_p": top_p, "seed": base + sample}
        for start in range(0, len(prompt_ids), batch_size):
            chunk = [list(map(int, p)) for p in prompt_ids[start:start + batch_size]]
            res = generate(target, chunk, drafter=drafter, max_new_tokens=max_new_tokens, **sampling)
            for j, (prompt, response) in enumerate(zip(chunk, res.token_ids)):
                records.append({"index": first_index + start + j, "prompt_ids": prompt, "sample": sample,
                                "response_ids": response, "domain": domains[start + j]})
            wall += res.stats["wall_time_s"]
            taus += [c for row in res.stats.get("acceptance_lengths", []) for c in row]
    _write_shard(_shard_path(out_dir, shard), records)
    tokens = sum(len(r["response_ids"]) for r in records)
    return {"tokens": tokens, "tokens_per_s": tokens / wall if wall > 0 else float("inf"),
            "mean_tau": float(np.mean(taus)) if taus else float("nan")}


def read_shard(out_dir: str, shard: int) -> list[dict]:
    from array_record.python.array_record_module import ArrayRecordReader

    path = _shard_path(out_dir, shard)
    if not path.endswith(LEGACY):
        return rollout_shards.read_npz_shard(path)
    reader = ArrayRecordReader(path)
    try:
        return [json.loads(raw) for raw in reader.read_all()]
    finally:
        reader.close()


def read_rollouts(out_dir: str) -> Iterator[dict]:
    """All records in prompt order."""
    for shard in completed_shards(out_dir):
        yield from read_shard(out_dir, shard)


def rollout_arrays(out_dir: str, seq_len: int) -> dict[str, np.ndarray]:
    """Padded training arrays: tokens [N, seq_len], prompt_lens, seq_lens, domains.

    `out_dir` may name several stores separated by commas (a greedy store and a sampled
    one, say): their records in that order. Sequences longer than seq_len are truncated (the response tail is cut);
    records whose prompt leaves no room for 2 response tokens are skipped.
    """
    stores = [d for d in out_dir.split(",") if d]
    missing = [d for d in stores if not completed_shards(d)]
    if missing:
        raise ValueError(f"no rollout shards in {missing}")
    arrays = records_to_arrays((rec for d in stores for rec in read_rollouts(d)), seq_len)
    if not len(arrays["tokens"]):
        raise ValueError(f"no usable rollouts in {out_dir} for seq_len={seq_len}")
    return arrays


def records_to_arrays(records, seq_len: int) -> dict[str, np.ndarray]:
    """`rollout_arrays` of any records (possibly none usable: then N = 0)."""
    rows, prompt_lens, seq_lens, domains = [], [], [], []
    for rec in records:
        seq = rec["prompt_ids"] + rec["response_ids"]
        if len(rec["prompt_ids"]) + 2 > seq_len or len(rec["response_ids"]) < 2:
            continue
        seq = seq[:seq_len]
        rows.append(seq + [0] * (seq_len - len(seq)))
        prompt_lens.append(len(rec["prompt_ids"]))
        seq_lens.append(len(seq))
        domains.append(rec["domain"])
    return {"tokens": np.asarray(rows, np.int32).reshape(-1, seq_len),
            "prompt_lens": np.asarray(prompt_lens, np.int32), "seq_lens": np.asarray(seq_lens, np.int32),
            "domains": np.asarray(domains)}
