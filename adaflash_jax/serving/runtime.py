"""Runs an exported decoder (see `decoding.export`) with jax and the artifact alone.

Nothing here imports the model code: the loops are deserialized
`jax.export.Exported` functions, the weights come from safetensors, the
tokenizer from its saved tokenizer.json. Batches are padded to a power of two
(the functions take any batch; padding bounds the number of compiled shapes)
and prompts to the exported maximum prompt length. `generate` runs the
whole-batch loops (format versions 2 and 3); the engine functions of version 3
run under the scheduler through `serving.exported_engine`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file

from adaflash_jax.decoding.batching import encode_chat_prompts, pad_batch, trim_outputs
from adaflash_jax.decoding.decode_stats import acceptance_stats, verify_stats
from adaflash_jax.decoding.length_policy import check_rule_settings

FORMAT = "adaflash-exported-decoder"
SUPPORTED_VERSIONS = (2, 3)  # 2: the whole-batch loops only, no engine functions


class PromptTooLongError(ValueError):
    """A prompt longer than the artifact's fixed maximum prompt length."""


@dataclasses.dataclass
class ExportedResult:
    token_ids: list[list[int]]  # new tokens only, stop token included
    texts: list[str] | None
    stats: dict[str, Any]


class ExportedDecoder:
    """An exported decoder ready to generate: `load_exported(DIR).generate(prompts)`."""

    def __init__(self, path: str):
        manifest_path = os.path.join(path, "manifest.json")
        if not os.path.isfile(manifest_path):
            raise FileNotFoundError(f"{path} is not an exported decoder: no manifest.json there "
                                    "(write one with `adaflash export`)")
        with open(manifest_path) as handle:
            manifest = json.load(handle)
        if manifest.get("format") != FORMAT:
            raise ValueError(f"{manifest_path} is not an {FORMAT} manifest")
        if manifest.get("format_version") not in SUPPORTED_VERSIONS:
            raise ValueError(f"artifact format version {manifest.get('format_version')} is not supported "
                             f"by this runtime (supports {SUPPORTED_VERSIONS}); re-export it")
        self.path, self.manifest = path, manifest
        platform = jax.default_backend()
        platform = "cuda" if platform == "gpu" else platform
        if platform not in manifest["platforms"]:
            raise ValueError(f"this artifact was exported for {manifest['platforms']}, not for the "
                             f"current backend {platform!r}; re-export with --platforms {platform}")
        tensors = load_file(os.path.join(path, manifest["weights"]["file"]))
        self._weights = {group: [jnp.asarray(tensors[n]) for n in names]
                         for group, names in manifest["weights"].items() if group != "file"}
        self._exported, self._functions = {}, {}
        for name, entry in manifest["functions"].items():
            with open(os.path.join(path, entry["file"]), "rb") as handle:
                self._exported[name] = jax.export.deserialize(bytearray(handle.read()))
            self._functions[name] = jax.jit(self._exported[name].call)
        self.tokenizer = None
        if manifest.get("tokenizer"):
            from adaflash_jax.checkpoints.tokenizer import Tokenizer
            self.tokenizer = Tokenizer.from_hf_dir(os.path.join(path, manifest["tokenizer"]))

    # ----- facts -------------------------------------------------------------------
    @property
    def max_prompt_len(self) -> int:
        return self.manifest["max_prompt_len"]

    @property
    def max_new_tokens(self) -> int:
        return self.manifest["max_new_tokens"]

    @property
    def has_drafter(self) -> bool:
        return self.manifest["drafter"] is not None

    @property
    def modes(self) -> tuple[str, ...]:
        return tuple(self.manifest["modes"])

    @property
    def has_engine(self) -> bool:
        """Whether the artifact holds the engine functions (format version 3) for the scheduler."""
        return "engine" in self.manifest

    def exported(self, name: str) -> jax.export.Exported:
        """One deserialized function of the artifact (its manifest entry names the inputs)."""
        return self._exported[name]

    def weights(self, groups: Sequence[str]) -> list[list[jax.Array]]:
        """The weight leaves of `groups` ("target", "drafter", "head"), in manifest order."""
        return [self._weights[g] for g in groups]

    # ----- decoding ----------------------------------------------------------------
    def encode(self, prompts: Sequence) -> list[list[int]]:
        """Token ids for text prompts (chat template applied) or validated id prompts."""
        ids = encode_chat_prompts(prompts, self.tokenizer, self.manifest["target"]["vocab_size"],
                                  owner="artifact")
        for i, p in enumerate(ids):
            if len(p) > self.max_prompt_len:
                raise PromptTooLongError(f"prompt {i} has {len(p)} tokens; this artifact takes at most "
                                 f"{self.max_prompt_len}")
        return ids

    def head_rule(self, rho, min_len) -> tuple:
        """The "head" rule's (rho, min_len) as function inputs: manifest defaults filled in, checked."""
        d = self.manifest["drafter"]
        rho = d["rho"] if rho is None else float(rho)
        min_len = d["min_len"] if min_len is None else int(min_len)
        check_rule_settings(rho, min_len, d["block_size"])
        return np.float32(rho), np.int32(min_len)

    def check_request(self, *, max_new_tokens: int, temperature: float, top_p: float,
                      speculative: bool, rho: float | None = None, min_len: int | None = None) -> str:
        """Validates decoding options; returns the function name that serves them."""
        if not 1 <= int(max_new_tokens) <= self.max_new_tokens:
            raise ValueError(f"max_new_tokens must lie in [1, {self.max_new_tokens}] for this artifact, "
                             f"got {max_new_tokens}")
        if not float(temperature) >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0.0 < float(top_p) <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
        mode = "greedy" if float(temperature) == 0.0 else "sample"
        if mode not in self.modes:
            raise ValueError(f"this artifact was exported without {mode!r} decoding (modes: "
                             f"{list(self.modes)})")
        if speculative and not self.has_drafter:
            raise ValueError("this artifact has no drafter; request speculative=false")
        if (rho is not None or min_len is not None) and not (speculative and self.length_policy == "head"):
            raise ValueError("rho / min_len apply to speculative decoding with an artifact exported "
                             "with length_policy 'head'")
        if speculative and self.length_policy == "head":
            self.head_rule(rho, min_len)
        return f"{'speculative' if speculative else 'autoregressive'}_{mode}"

    @property
    def length_policy(self) -> str | None:
        """How the speculative loop picks verify lengths: "fixed", "head", or None (no drafter)."""
        return self.manifest["drafter"]["length_policy"] if self.has_drafter else None

    def generate(self, prompts: Sequence, *, max_new_tokens: int | None = None,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                 speculative: bool | None = None, rho: float | None = None,
                 min_len: int | None = None) -> ExportedResult:
        """Decodes a batch of prompts; output equals `af.generate` with the same settings
        (rho / min_len: the "head" policy's rule, defaults from the manifest)."""
        speculative = self.has_drafter if speculative is None else bool(speculative)
        max_new = self.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        name = self.check_request(max_new_tokens=max_new, temperature=temperature, top_p=top_p,
                                  speculative=speculative, rho=rho, min_len=min_len)
        ids = self.encode(prompts)
        padded = pad_batch(ids, max_prompt_len=self.max_prompt_len, pad_to=self.max_prompt_len)
        n, b = padded.num_prompts, padded.batch
        key = np.asarray(jax.random.key_data(jax.random.key(seed)), np.uint32)
        sampling = (key, np.float32(max(temperature, 1e-6)), np.float32(top_p),
                    np.asarray(self.manifest["eos_token_ids"], np.int32))
        batch = (padded.tokens, padded.lengths, padded.active, np.int32(max_new))
        if speculative:
            args = (*batch, np.full((b,), self.manifest["drafter"]["block_size"], np.int32), *sampling)
            if self.length_policy == "head":
                args += self.head_rule(rho, min_len)
        else:
            args = (*batch, *sampling)
        args = (*(self._weights[g] for g in self.manifest["functions"][name]["weight_groups"]), *args)
        t0 = time.perf_counter()
        outputs = jax.block_until_ready(self._functions[name](*args))
        wall = time.perf_counter() - t0
        steps = int(outputs["steps"]) + (0 if speculative else 1)  # AR counts its prefill as a step
        token_ids = trim_outputs(np.asarray(outputs["tokens"]), np.asarray(outputs["num_out"]), n)
        texts = ([self.tokenizer.decode(t, skip_special_tokens=True) for t in token_ids]
                 if self.tokenizer is not None else None)
        total = sum(len(t) for t in token_ids)
        stats = {"mode": "speculative" if speculative else "autoregressive", "steps": steps,
                 "wall_time_s": wall, "new_tokens": total, "batch": n, "padded_batch": b,
                 "tokens_per_s": total / wall if wall > 0 else float("inf")}
        if speculative:
            commits = np.asarray(outputs["commits"])[:n]
            stats.update(acceptance_stats(commits, steps))
            stats.update(verify_stats(np.asarray(outputs["verified"])[:n], commits,
                                      int(outputs["drafted_steps"]), steps))
            stats["tau"] = [float(np.mean(r)) if r else 0.0 for r in stats["acceptance_lengths"]]
            stats["length_policy"] = self.length_policy
            stats["verify"] = self.manifest["drafter"].get("verify", "chain")
        return ExportedResult(token_ids, texts, stats)


def load_exported(path: str) -> ExportedDecoder:
    """Loads an artifact written by `adaflash export` (or `decoding.export.export_decoder`)."""
    return ExportedDecoder(os.fspath(path))
