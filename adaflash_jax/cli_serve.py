"""`adaflash export` and `adaflash serve`: the exported decoder on the command line."""

from __future__ import annotations

import json
import os
import sys

from adaflash_jax.cli_train import add_target_mismatch_flag, help_formatter, tree_budget_arg
from adaflash_jax.errors import InputError, as_input_error

PREFILL_BUDGET = 256  # serving.scheduler.PREFILL_BUDGET, not imported: the CLI parses before loading JAX

EXPORT_EXAMPLES = """examples:
  adaflash export --out exported/smollm2                     # SmolLM2 + the shipped AdaFlash drafter, CPU
  adaflash export --out exported/smollm2 --platforms cpu,cuda,tpu --max-prompt-len 512
  adaflash export --drafter none --modes greedy --out exported/ar-only
  adaflash export --drafter smollm2-135m-instruct-dflash --tree-budget 16 --out exported/tree16
"""

SERVE_EXAMPLES = """examples:
  adaflash serve --port 8000                                  # SmolLM2, continuous batching, 16 slots
  adaflash serve --drafter smollm2-135m-instruct-dflash --slots 32 --modes greedy
  adaflash serve --drafter smollm2-135m-instruct-adaflash     # the adaptive decoder: a budget per row and step
  adaflash serve --drafter smollm2-135m-instruct-adaflash --verify chain   # AdaFlash chain lengths ("auto")
  adaflash serve --drafter smollm2-135m-instruct-dflash --tree-budget 16   # a fixed tree of 16 nodes
  curl -sN localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Count to five."}], "stream": true}'
  curl -s localhost:8000/v1/completions -d '{"prompt": "The capital of France is", "max_tokens": 16}'
  curl -s localhost:8000/metrics                              # Prometheus text
  adaflash serve exported/smollm2 --port 8000 --slots 32      # an exported artifact, no model code
"""


def add_export_parser(subparsers, default_target: str, default_drafter: str):
    p = subparsers.add_parser(
        "export", help="export the decoding loops with jax.export (weights + manifest)",
        description="Serialize the speculative and autoregressive decoding loops with jax.export\n"
                    "(symbolic batch, fixed maximum lengths), for the platforms asked, with the\n"
                    "AdaFlash length rule when the drafter has a length head, and with the\n"
                    "weights (safetensors), the tokenizer and a manifest. `af.load_exported(DIR)` and\n"
                    "`adaflash serve DIR` run the artifact without the model code.",
        epilog=EXPORT_EXAMPLES, formatter_class=help_formatter())
    p.add_argument("--target", default=default_target, metavar="NAME|PATH",
                   help=f"target: built-in name, HF dir or .gguf (default: {default_target})")
    p.add_argument("--drafter", default=default_drafter, metavar="NAME|PATH|none",
                   help=f"drafter to export with the target, or 'none' (default: {default_drafter})")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="compute and weight dtype (default: float32)")
    p.add_argument("--out", required=True, metavar="DIR", help="artifact directory (must be new or empty)")
    p.add_argument("--platforms", default="cpu", metavar="LIST",
                   help="comma-separated subset of cpu,cuda,tpu (default: cpu)")
    p.add_argument("--modes", default="greedy,sample", metavar="LIST",
                   help="greedy and/or sample (default: greedy,sample)")
    p.add_argument("--max-prompt-len", type=int, default=256, metavar="N",
                   help="longest prompt in tokens (default: 256)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                   help="most new tokens per request (default: 128)")
    p.add_argument("--length-policy", choices=("fixed", "head"), default=None,
                   help="speculative verify lengths: fixed (whole blocks, DFlash) or head (the AdaFlash "
                        "rule, packed verification); default: head when the drafter has a length head")
    p.add_argument("--tree-budget", type=int, default=None, metavar="N",
                   help="verify a best-first tree of N nodes per step (root included) instead of the "
                        "drafted block ('auto' needs costs calibrated where it runs: serve with --target)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing artifact in --out")
    add_target_mismatch_flag(p)
    p.set_defaults(run=_run_export)
    return p


def _run_export(args) -> int:
    import adaflash_jax as af
    from adaflash_jax.decoding.export import check_options, export_decoder

    with as_input_error(ValueError, FileExistsError):  # before the (slow) model load
        check_options(args.out, args.platforms.split(","), args.modes.split(","), args.max_prompt_len,
                      args.max_new_tokens, args.overwrite)
    if args.tree_budget is not None:
        from adaflash_jax.decoding.tree_build import MAX_TREE_BUDGET

        in_range = 1 <= args.tree_budget <= MAX_TREE_BUDGET
        if args.drafter.lower() == "none" or args.length_policy == "head" or not in_range:
            raise InputError(f"--tree-budget N (1 to {MAX_TREE_BUDGET}) verifies a drafter's tree: it needs "
                             "--drafter and takes no --length-policy head")
    print(f"loading target {args.target} ({args.dtype}) ...", file=sys.stderr, flush=True)
    target = af.load_target(args.target, dtype=args.dtype)
    drafter = None
    if args.drafter.lower() != "none":
        drafter = af.load_drafter(args.drafter, target=target,
                                  allow_target_mismatch=args.allow_target_mismatch)
    print("exporting ...", file=sys.stderr, flush=True)
    manifest = export_decoder(target, args.out, drafter=drafter, platforms=args.platforms.split(","),
                              max_prompt_len=args.max_prompt_len, max_new_tokens=args.max_new_tokens,
                              modes=args.modes.split(","), length_policy=args.length_policy,
                              tree_budget=args.tree_budget, overwrite=args.overwrite)
    print(json.dumps({"out": args.out, "functions": sorted(manifest["functions"]),
                      "platforms": manifest["platforms"]}))
    return 0


def add_serve_parser(subparsers, default_target: str):
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API with continuous batching (loopback by default)",
        description="Serve the OpenAI API: POST /v1/chat/completions (messages through the chat template),\n"
                    "POST /v1/completions (a raw prompt: text or token ids), GET /v1/models, plus GET /health\n"
                    "and GET /metrics (Prometheus). The official openai client works with base_url\n"
                    "http://HOST:PORT/v1. With --target (the default), the models run in this process\n"
                    "under the continuous-batching scheduler: requests join and leave decode slots\n"
                    "between steps, stream=true answers with server-sent events, a full queue answers\n"
                    "503 + Retry-After, a disconnected client frees its slot. An artifact DIR from\n"
                    "`adaflash export` is served the same way by its exported engine, without the\n"
                    "model code; its requests may also name speculative / rho / min_len when they\n"
                    "match the server's (the length rule is set per server with --rho / --min-len).\n"
                    "SIGINT/SIGTERM finish the queued and running requests, then exit.",
        epilog=SERVE_EXAMPLES, formatter_class=help_formatter())
    p.add_argument("artifact", metavar="DIR", nargs="?", default=None,
                   help="directory written by `adaflash export` (instead of --target)")
    p.add_argument("--target", default=None, metavar="NAME|PATH",
                   help=f"target to serve in-process (default without DIR: {default_target})")
    p.add_argument("--drafter", default="none", metavar="NAME|PATH|none",
                   help="DFlash / AdaFlash drafter for speculative steps (default: none, plain AR steps)")
    p.add_argument("--verify", choices=("adaptive", "chain", "tree"), default=None,
                   help="in-process: adaptive (the default with a drafter: each step, each row verifies "
                        "a budget of 1 (a plain AR token) to 32 tree nodes, whichever commits the most tokens "
                        "per second under step costs calibrated here), chain (the drafted block, "
                        "--length-policy) or tree (--tree-budget); default: implied by those flags")
    p.add_argument("--length-policy", choices=("fixed", "head", "auto"), default=None,
                   help="in-process, chain verification: speculative verify lengths: fixed (--verify-len, DFlash), head (the "
                        "AdaFlash rule) or auto (the lengths with the most expected tokens per second under "
                        "step costs calibrated here); default: auto when the drafter has a length head")
    p.add_argument("--verify-len", type=int, default=None, metavar="N",
                   help="tokens verified per speculative step (default: the drafter's block; "
                        "artifacts: length_policy 'fixed' only)")
    p.add_argument("--tree-budget", type=tree_budget_arg, default=None, metavar="N|auto",
                   help="in-process: verify a best-first tree of N nodes per step instead of the drafted "
                        "block, or auto (the budget per step with the most expected tokens per second "
                        "under tree-step costs calibrated here); artifacts carry their own")
    p.add_argument("--slots", type=int, default=16, metavar="N", help="decode slots per mode (default: 16)")
    p.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="waiting requests before 503 (default: 256)")
    p.add_argument("--modes", default=None, metavar="LIST",
                   help="greedy and/or sample: one engine each (default: greedy,sample; artifacts: "
                        "the modes exported)")
    p.add_argument("--max-prompt-len", type=int, default=256, metavar="N",
                   help="longest prompt (default: 256; artifacts: fixed at export)")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N",
                   help="most new tokens per request (default: 256; artifacts: fixed at export)")
    p.add_argument("--prefill-budget", type=int, default=PREFILL_BUDGET, metavar="N",
                   help="prompt tokens prefilled per scheduler iteration; a prompt longer than half of it "
                        "is prefilled in chunks between decode steps, so running requests keep streaming "
                        f"(default: {PREFILL_BUDGET}; artifacts exported before chunked prefill take "
                        "whole prompts)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1, loopback)")
    p.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one (default: 8000)")
    p.add_argument("--rho", type=float, default=None, metavar="R",
                   help="length policies head / auto (in-process) or artifacts with length_policy 'head': "
                        "the AdaFlash rule's scale for every slot (default: 1.3; artifacts: the manifest's)")
    p.add_argument("--min-len", type=int, default=None, metavar="N",
                   help="length policies head / auto (in-process) or artifacts with length_policy 'head': "
                        "the rule's floor (default: 1; artifacts: the manifest's)")
    p.add_argument("--mesh", default=None, metavar="AXIS=N,...",
                   help="in-process: shard the models and slots over a device mesh, e.g. tensor=8 or "
                        "data=2,tensor=4 (axes data, fsdp, tensor; --slots a multiple of data*fsdp; "
                        "default: one device)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="in-process: compute and weight dtype of the target (default: float32)")
    add_target_mismatch_flag(p)
    p.set_defaults(run=_run_serve, default_target=default_target)
    return p


def _run_serve(args) -> int:
    if not 0 <= args.port < 65536:
        raise InputError(f"--port must lie in [0, 65535], got {args.port}")
    if args.artifact is not None:
        from adaflash_jax.serving.http_common import serve_until_signal
        from adaflash_jax.serving.server import artifact_server

        if (args.target is not None or args.drafter.lower() != "none" or args.tree_budget is not None
                or args.verify is not None):
            raise InputError("an artifact DIR brings its own models and verification: pass DIR or "
                             "--target/--drafter/--tree-budget/--verify, not both")
        if not os.path.isfile(os.path.join(args.artifact, "manifest.json")):
            raise InputError(f"{args.artifact} is not an exported decoder (no manifest.json); "
                             "write one with `adaflash export --out DIR`")
        modes = None if args.modes is None else _modes(args.modes)
        if args.slots < 1 or args.max_queue < 1 or args.prefill_budget < 1:
            raise InputError(f"--slots, --max-queue and --prefill-budget must be >= 1, got {args.slots}, "
                             f"{args.max_queue}, {args.prefill_budget}")
        with as_input_error():  # settings the artifact cannot serve
            server = artifact_server(args.artifact, host=args.host, port=args.port, slots=args.slots,
                                     modes=modes, max_queue=args.max_queue, verify_len=args.verify_len,
                                     rho=args.rho, min_len=args.min_len, prefill_budget=args.prefill_budget)
        serve_until_signal(server, args.artifact)
        return 0
    import adaflash_jax as af
    from adaflash_jax.decoding.adaptive.mode import verify_mode
    from adaflash_jax.decoding.length_policy import resolve
    from adaflash_jax.serving.stream_server import serve_models

    modes = _modes(args.modes or "greedy,sample")
    for name in ("slots", "max_queue", "max_prompt_len", "max_new_tokens", "prefill_budget"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    rule_set = args.rho is not None or args.min_len is not None
    if args.drafter.lower() == "none" and (args.verify_len is not None or args.length_policy or rule_set
                                           or args.tree_budget is not None or args.verify is not None):
        raise InputError("--verify / --verify-len / --length-policy / --rho / --min-len / --tree-budget "
                         "need a --drafter")
    with as_input_error():  # before the (slow) model load
        verify = None if args.drafter.lower() == "none" else verify_mode(
            args.verify, tree_budget=args.tree_budget, length_policy=args.length_policy, verify_len=args.verify_len)
    mesh = None
    if args.mesh is not None:
        from adaflash_jax.parallel.mesh import mesh_from_spec

        with as_input_error():
            mesh = mesh_from_spec(args.mesh)
        if args.slots % (mesh.shape["data"] * mesh.shape["fsdp"]):
            raise InputError(f"--slots {args.slots} must be a multiple of the mesh's data*fsdp size")
    target = af.load_target(args.target or args.default_target, dtype=args.dtype, mesh=mesh)
    drafter = None
    if args.drafter.lower() != "none":
        drafter = af.load_drafter(args.drafter, target=target, allow_target_mismatch=args.allow_target_mismatch)
    rule = dict(rho=1.3 if args.rho is None else args.rho, min_len=1 if args.min_len is None else args.min_len)
    with as_input_error():
        # a tree engine takes no length policy: SlotPolicy refuses one by name
        policy = (resolve(args.length_policy, drafter, args.verify_len, probe_every=8, **rule)
                  if verify == "chain" else args.length_policy)
        if policy in (None, "fixed") and rule_set:
            raise InputError("--rho / --min-len apply to chain verification with length policies head and "
                             "auto (a drafter with a length head), or to artifacts exported with length_policy "
                             "'head'")
        serve_models(target, drafter, host=args.host, port=args.port, slots=args.slots,
                     max_prompt_len=args.max_prompt_len, max_new_tokens=args.max_new_tokens, modes=modes,
                     max_queue=args.max_queue, verify_len=args.verify_len, length_policy=policy,
                     tree_budget=args.tree_budget, verify=verify, prefill_budget=args.prefill_budget, **rule)
    return 0


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(","))
    if not modes or set(modes) - {"greedy", "sample"}:
        raise InputError(f"--modes must be greedy and/or sample, got {text!r}")
    return modes
