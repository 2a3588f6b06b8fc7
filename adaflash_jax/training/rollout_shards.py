"""Compact rollout shards: token ids as they are, about 2 bytes a token.

A rollout store is meant to be committed and grown session after session, so its shards
hold nothing but the records' token ids and labels: per shard one compressed `.npz` of
flat uint16 token ids (uint32 for vocabularies over 65536), each record's prompt and
response lengths, index, sample number and domain. The older ArrayRecord shards of JSON
records (`rollouts-NNNNN.array_record`, block-padded: ~26 bytes a token) are still read;
`compact_store` rewrites them in this form, record for record.
"""

from __future__ import annotations

import os

import numpy as np

from adaflash_jax.atomic_io import temp_path_beside

SUFFIX = ".npz"


def write_npz_shard(path: str, records: list[dict]) -> None:
    """Writes `records` ({index, prompt_ids, sample, response_ids, domain}) atomically."""
    prompts = [list(map(int, r["prompt_ids"])) for r in records]
    responses = [list(map(int, r["response_ids"])) for r in records]
    flat = [t for p, q in zip(prompts, responses) for t in p + q]
    dtype = np.uint16 if max(flat, default=0) < (1 << 16) else np.uint32
    if min(flat, default=0) < 0:
        raise ValueError("token ids must be >= 0")
    tmp = temp_path_beside(path, suffix=SUFFIX)
    with open(tmp, "wb") as f:
        np.savez_compressed(
            f, tokens=np.asarray(flat, dtype), prompt_lens=np.asarray([len(p) for p in prompts], np.int32),
            response_lens=np.asarray([len(q) for q in responses], np.int32),
            index=np.asarray([r["index"] for r in records], np.int64),
            sample=np.asarray([r.get("sample", 0) for r in records], np.int32),
            domain=np.asarray([r["domain"] for r in records], dtype=str))
    os.replace(tmp, path)


def read_npz_shard(path: str) -> list[dict]:
    """The records of a shard written by `write_npz_shard`, in order."""
    with np.load(path) as z:
        tokens, plens, rlens = z["tokens"].astype(np.int64), z["prompt_lens"], z["response_lens"]
        index, sample, domain = z["index"], z["sample"], z["domain"]
    records, at = [], 0
    for i in range(len(plens)):
        p, q = int(plens[i]), int(rlens[i])
        records.append({"index": int(index[i]), "prompt_ids": tokens[at:at + p].tolist(), "sample": int(sample[i]),
                        "response_ids": tokens[at + p:at + p + q].tolist(), "domain": str(domain[i])})
        at += p + q
    return records
