"""`adaflash serve DIR`: an exported artifact behind the continuous-batching HTTP server.

The artifact's engine functions (`serving.exported_engine`) run under the same
scheduler and HTTP front end as in-process models (`serving.stream_server`):
requests join and leave decode slots between steps, stream=true answers with
server-sent events, a full queue answers 503 + Retry-After, a disconnected
client frees its slot, SIGINT/SIGTERM drain. Nothing here imports the model code.

The API is the OpenAI-compatible one of `serving.stream_server`. Request fields
beyond OpenAI's, kept from the static-batch artifact server where they still
mean something now that every slot shares one compiled step:

- "speculative": accepted when it matches how the server decodes (speculatively
  when the artifact has a drafter); a different value is a 400, since the
  engine, not the request, picks the step.
- "rho" / "min_len": the "head" length rule is one setting for every slot, set
  when the server starts (`--rho`, `--min-len`); a request may repeat those
  values, any other value is a 400.

Responses no longer carry a per-request "tau" or the static batch's timing.
"""

from __future__ import annotations

import os

from adaflash_jax.serving.http_common import serve_until_signal
from adaflash_jax.serving.openai_protocol import ApiError
from adaflash_jax.serving.runtime import ExportedDecoder
from adaflash_jax.serving.stream_server import SchedulerServer

ENGINE_FIELDS = {"speculative": bool, "rho": (int, float), "min_len": int}


class ArtifactServer(SchedulerServer):
    """`SchedulerServer` over the engines of one artifact (see `exported_engine.build_scheduler`)."""

    extra_fields = ENGINE_FIELDS

    def __init__(self, decoder: ExportedDecoder, scheduler, host: str = "127.0.0.1", port: int = 8000,
                 model: str = "adaflash"):
        super().__init__(scheduler, tokenizer=decoder.tokenizer, vocab_size=decoder.manifest["target"]["vocab_size"],
                         model=model, stop_ids=decoder.manifest.get("eos_token_ids", ()), host=host, port=port)
        self.decoder = decoder
        engine = next(iter(scheduler.pools.values())).engine
        self.speculative, self.length_policy = engine.speculative, engine.length_policy
        self.rule = engine.rule

    def parse(self, kind: str, payload: dict):
        parsed = super().parse(kind, payload)
        self.check_engine_fields(parsed.extra)
        return parsed

    def check_engine_fields(self, payload: dict) -> None:
        """400 for per-request engine settings this server cannot honour (see the module doc)."""
        speculative = payload.get("speculative")
        if speculative is not None and bool(speculative) != self.speculative:
            how = "speculatively" if self.speculative else "autoregressively (the artifact has no drafter)"
            raise ApiError(f"this server decodes every request {how}; speculative={str(speculative).lower()} "
                               "is not supported (all slots share one compiled step)", param="speculative")
        asked = {k: payload[k] for k in ("rho", "min_len") if payload.get(k) is not None}
        if not asked:
            return
        if self.length_policy != "head":
            raise ApiError("rho / min_len apply to speculative decoding with an artifact exported with "
                               "length_policy 'head'")
        server = dict(zip(("rho", "min_len"), self.rule))
        if any(abs(float(v) - server[k]) > 1e-6 * max(1.0, abs(server[k])) for k, v in asked.items()):
            raise ApiError(f"rho / min_len are set for the whole server (rho={server['rho']:g}, "
                               f"min_len={int(server['min_len'])}: every slot shares one step); restart it "
                               "with `adaflash serve DIR --rho R --min-len N` to change them")


def artifact_server(path: str, *, host: str = "127.0.0.1", port: int = 8000, slots: int = 16, modes=None,
                    max_queue: int = 256, verify_len: int | None = None, rho: float | None = None,
                    min_len: int | None = None, prefill_budget: int | None = None) -> ArtifactServer:
    """Loads the artifact and starts its engines and decode thread (ValueError: bad settings)."""
    from adaflash_jax.serving.exported_engine import build_scheduler
    from adaflash_jax.serving.runtime import load_exported

    decoder = load_exported(path)
    engine = {k: v for k, v in dict(verify_len=verify_len, rho=rho, min_len=min_len).items() if v is not None}
    scheduler = build_scheduler(decoder, slots=slots, modes=modes, max_queue=max_queue,
                                prefill_budget=prefill_budget, **engine)
    name = os.path.basename(os.path.normpath(path))  # the id clients name: the artifact's directory
    return ArtifactServer(decoder, scheduler, host, port, model=name)


def serve(path: str, *, ready=None, **settings) -> None:
    """Serves the artifact (`artifact_server` settings) until SIGINT/SIGTERM, then drains."""
    serve_until_signal(artifact_server(path, **settings), path, ready)
