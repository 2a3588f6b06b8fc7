"""`adaflash`: the one command-line entry point.

Sub-commands register themselves in `SUBCOMMANDS` (name -> function that adds
its parser), so new jobs plug in without touching `main`. Bad input surfaces
as one `adaflash: error: ...` line and exit code 2: the library raises
`errors.InputError` for bad input (arguments, config values, prompts, paths,
checkpoints), and argparse errors are routed the same way. Any other exception,
a ValueError from a shape check included, is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable

from adaflash_jax import cli_format as fmt
from adaflash_jax import cli_serve, cli_train
from adaflash_jax.errors import InputError, as_input_error

DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_DRAFTER = "smollm2-135m-instruct-dflash"
DEFAULT_ADAFLASH = "smollm2-135m-instruct-adaflash"


class UsageError(Exception):
    """A command line argparse rejected (message already names the command)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print usage + message and exit itself
        raise UsageError(f"{self.prog}: error: {message} (see '{self.prog} --help')")


SUBCOMMANDS: dict[str, Callable] = {}


def subcommand(name: str):
    """Registers `fn(subparsers) -> parser` under `name` in SUBCOMMANDS."""

    def register(fn):
        SUBCOMMANDS[name] = fn
        return fn

    return register


def _parser_for(subparsers, name: str, summary: str, description: str, examples: str):
    return subparsers.add_parser(name, help=summary, description=description,
                                 epilog="examples:\n" + examples,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)


def _add_model_options(p) -> None:
    p.add_argument("--model", default=DEFAULT_TARGET, metavar="NAME|PATH",
                   help=f"target: built-in name, HF checkpoint dir or .gguf file (default: {DEFAULT_TARGET})")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="compute and weight dtype of the target (default: float32)")


def _add_decode_options(p) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                   help="most new tokens per prompt (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 = greedy (default); > 0 samples from the target's distribution")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus mass in (0, 1] (default: 1.0)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed (default: 0)")


def _decode_kwargs(args) -> dict:
    """Checks decode settings before the (slow) target load; returns generate() kwargs."""
    from adaflash_jax.decoding.sampling import SamplingParams
    from adaflash_jax.generation import check_numbers

    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check_numbers(temperature=args.temperature, top_p=args.top_p)  # argparse takes 'nan', 'inf'
    with as_input_error():
        SamplingParams(args.temperature, args.top_p)
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                top_p=args.top_p, seed=args.seed)


def _load_target(name: str, dtype: str):
    import adaflash_jax as af
    from adaflash_jax.target_api import resolve_target_path

    resolve_target_path(name)  # a bad name fails here, before the progress line
    print(f"loading target {name} ({dtype}) ...", file=sys.stderr, flush=True)
    return af.load_target(name, dtype=dtype)


def _load_drafter(path: str, target, allow_mismatch: bool = False):
    """`af.load_drafter`, imported late so `--help` stays fast."""
    import adaflash_jax as af

    return af.load_drafter(path, target=target, **({"allow_target_mismatch": True} if allow_mismatch else {}))


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompt_file:
        if args.prompt_file == "-":
            lines = sys.stdin.read().splitlines()
        else:
            if not os.path.isfile(args.prompt_file):
                raise InputError(f"--prompt-file {args.prompt_file}: no such file")
            with open(args.prompt_file, encoding="utf-8") as f:
                lines = f.read().splitlines()
        prompts += [line for line in lines if line.strip()]
    if not prompts:
        raise InputError("no prompt given; pass --prompt TEXT (repeatable) or --prompt-file FILE")
    return prompts


@subcommand("generate")
def _generate_parser(subparsers):
    p = _parser_for(
        subparsers, "generate", summary="decode replies to prompts with a target (and optional drafter)",
        description="Decode chat replies to one or more prompts with the target LM, autoregressively or,\n"
                    "with --drafter, speculatively (lossless: greedy output equals the target's own).\n"
                    "Prints each reply and the decode throughput (compile time is excluded).",
        examples="  adaflash generate --prompt 'What is the capital of France?'\n"
                 "  adaflash generate --prompt 'Write a haiku' --temperature 0.7 --top-p 0.9 --seed 1\n"
                 "  adaflash generate --prompt-file prompts.txt --max-new-tokens 128 --dtype bfloat16\n"
                 "  adaflash generate --prompt hi --json\n"
                 "  adaflash generate --prompt hi --drafter smollm2-135m-instruct-adaflash --attn-impl auto\n"
                 "  adaflash generate --prompt hi --drafter smollm2-135m-instruct-dflash --compare-ar\n"
                 "  adaflash generate --prompt hi --drafter ckpt/drafter --verify chain   # DFlash's fixed blocks\n"
                 "  adaflash generate --prompt hi --drafter ckpt/drafter --verify tree --tree-budget 32\n"
                 "  adaflash generate --prompt hi --drafter ckpt/drafter --verify tree --tree-budget auto")
    _add_model_options(p)
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help="a user message (chat template applied); repeat for a batch")
    p.add_argument("--prompt-file", metavar="FILE",
                   help="one prompt per non-empty line ('-' reads stdin); adds to --prompt")
    _add_decode_options(p)
    p.add_argument("--drafter", metavar="PATH",
                   help="drafter checkpoint for speculative decoding (via adaflash_jax.load_drafter)")
    cli_train.add_target_mismatch_flag(p)
    p.add_argument("--attn-impl", default="xla", choices=("xla", "pallas", "auto"),
                   help="kernels: xla (default), pallas (the Pallas kernels; interpreted, slowly, without "
                        "an accelerator) or auto (Pallas on TPU/GPU, XLA elsewhere)")
    p.add_argument("--verify", default=None, choices=("adaptive", "chain", "tree"),
                   help="with --drafter: adaptive (default: per step, plain AR steps or a best-first tree of the "
                        "size that pays, chosen from the drafter's confidence, realized acceptance and step costs "
                        "measured on this machine), chain (verify the drafted block, DFlash) or tree (a tree of "
                        "--tree-budget nodes every step); all give the target's own output")
    p.add_argument("--tree-budget", type=cli_train.tree_budget_arg, metavar="N|auto",
                   help="with --verify tree: tree nodes per step, root included (default: the block size), "
                        "or auto: per step, the budget with the most expected tokens per second")
    p.add_argument("--compare-ar", action="store_true",
                   help="with --drafter: also decode autoregressively, print speedup and whether outputs match")
    p.add_argument("--json", action="store_true", help="print one JSON record instead of text")
    p.set_defaults(run=_run_generate)
    return p


def _run_generate(args) -> int:
    import adaflash_jax as af

    prompts = _read_prompts(args)
    kw = dict(_decode_kwargs(args), attn_impl=args.attn_impl)
    if args.compare_ar and not args.drafter:
        raise InputError("--compare-ar compares speculative with autoregressive decoding; it needs --drafter PATH")
    if (args.verify is not None or args.tree_budget is not None) and not args.drafter:
        raise InputError("--verify / --tree-budget verify a drafter's proposals; they need --drafter PATH")
    spec_kw = dict(verify=args.verify, tree_budget=args.tree_budget) if args.drafter else {}
    target = _load_target(args.model, args.dtype)
    drafter = _load_drafter(args.drafter, target, args.allow_target_mismatch) if args.drafter else None
    res = af.generate(target, prompts, drafter=drafter, **kw, **spec_kw)
    ar = af.generate(target, prompts, **kw) if args.compare_ar else None
    identical = ar is not None and ar.token_ids == res.token_ids

    if args.json:
        record = {"model": args.model, "dtype": args.dtype, "drafter": args.drafter, "settings": {**kw, **spec_kw},
                  "prompts": prompts, "replies": res.texts, "token_ids": res.token_ids,
                  "stats": res.stats}
        if ar is not None:
            record["autoregressive"] = {"replies": ar.texts, "token_ids": ar.token_ids, "stats": ar.stats}
            record["speedup"] = fmt.speedup(res.stats, ar.stats)
            record["identical"] = identical
        print(json.dumps(fmt.jsonable(record)))
        return 0
    texts = res.texts or [None] * len(prompts)
    for i, (prompt, text) in enumerate(zip(prompts, texts)):
        if len(prompts) == 1:
            print(text.strip() if text is not None else res.token_ids[0])
        else:
            print(fmt.reply_block(f"prompt {i + 1}", prompt, text))
    print(("speculative " if drafter is not None else "") + fmt.stats_line(res.stats))
    if ar is not None:
        print("autoregressive " + fmt.stats_line(ar.stats))
        print(fmt.comparison_line(res.stats, ar.stats, identical, args.temperature))
    return 0


@subcommand("demo")
def _demo_parser(subparsers):
    p = _parser_for(
        subparsers, "demo", summary="the main job: AR vs speculative decoding on held-out code/math/prose/HumanEval",
        description="Load the embedded SmolLM2-135M-Instruct target and its shipped drafters and decode held-out\n"
                    "prompts of each domain (code, math, prose and HumanEval; none used in training) one at a\n"
                    "time: autoregressively, and with each drafter under the default decoder (adaptive: plain\n"
                    "AR steps or a best-first tree of drafts, whichever its measured costs and the drafter's\n"
                    "acceptance say is faster). --all-modes adds the fixed modes: DFlash chains of whole\n"
                    "blocks, the 'auto' tree budget, and the AdaFlash length head's chain policy. Prints a reply\n"
                    "per domain and a table: tokens/s, tau and speedup over AR per method (overall and per\n"
                    "domain), and whether every output equals AR's. Drafters that are not installed are skipped.",
        examples="  adaflash demo\n"
                 "  adaflash demo --all-modes\n"
                 "  adaflash demo --prompts-per-domain 4 --max-new-tokens 96\n"
                 "  adaflash demo --drafter runs/smollm2_135m/drafter --adaflash-drafter runs/smollm2_135m_opd/drafter")
    _add_model_options(p)
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                   help="most new tokens per prompt (default: 64)")
    p.add_argument("--prompts-per-domain", type=int, default=2, metavar="N",
                   help="held-out prompts per domain (default: 2)")
    p.add_argument("--drafter", metavar="NAME|PATH",
                   help=f"DFlash drafter (default: {DEFAULT_DRAFTER}, if installed)")
    p.add_argument("--adaflash-drafter", metavar="NAME|PATH",
                   help=f"drafter with a length head (default: {DEFAULT_ADAFLASH}, if installed)")
    p.add_argument("--all-modes", action="store_true",
                   help="also the fixed modes: chain of whole blocks, 'auto' tree budget, length-head chain")
    cli_train.add_target_mismatch_flag(p)
    p.set_defaults(run=_run_demo, temperature=0.0, top_p=1.0, seed=0)
    return p


def _demo_drafter(explicit, default, target, allow_mismatch: bool = False):
    """The demo's drafter, or None plus the reason; an explicit one must load."""
    if explicit:
        return _load_drafter(explicit, target, allow_mismatch), ""
    try:
        return _load_drafter(default, target, allow_mismatch), ""
    except InputError as error:
        return None, f"no drafter named {default} is installed ({error})"


def _demo_methods(dflash, adaflash, all_modes: bool) -> dict:
    """{method: generate kwargs}: each drafter's default first, the fixed modes with all_modes."""
    methods = {}
    if dflash is not None:
        methods["DFlash"] = dict(drafter=dflash)
    if adaflash is not None:
        methods["AdaFlash"] = dict(drafter=adaflash)
    if all_modes and dflash is not None:
        methods["DFlash chain"] = dict(drafter=dflash, verify="chain", length_policy="fixed")
        methods["DFlash tree auto"] = dict(drafter=dflash, verify="tree", tree_budget="auto")
    if all_modes and adaflash is not None:
        methods["AdaFlash head chain"] = dict(drafter=adaflash, verify="chain", length_policy="auto")
    return methods


def _run_demo(args) -> int:
    from adaflash_jax.eval.heldout import compare_on_domains, heldout_prompts, summarize

    kw = _decode_kwargs(args)
    if args.prompts_per_domain < 1:
        raise InputError(f"--prompts-per-domain must be >= 1, got {args.prompts_per_domain}")
    target = _load_target(args.model, args.dtype)
    dflash, reason = _demo_drafter(args.drafter, DEFAULT_DRAFTER, target, args.allow_target_mismatch)
    adaflash, reason2 = _demo_drafter(args.adaflash_drafter, DEFAULT_ADAFLASH, target,
                                      args.allow_target_mismatch)
    if adaflash is not None and not adaflash.has_length_head:
        raise InputError(f"--adaflash-drafter {adaflash.name} has no length head")
    for missing in (r for r in (reason, reason2) if r):
        print(f"{missing}; skipping it.")
    methods = _demo_methods(dflash, adaflash, args.all_modes)
    if not methods:
        print("no drafter installed; running autoregressive decoding only.")
    prompts = heldout_prompts(target, args.prompts_per_domain)
    results = compare_on_domains(target, methods, prompts, max_new_tokens=kw["max_new_tokens"],
                                 repeats=0, keep_outputs=True)  # compile is never timed: no warm-up
    shown_method = next(iter(methods), "ar")
    for domain, res in results.items():
        first = res.pop("outputs")[0]
        reply = first[shown_method]
        shown = first["prompt"].text.strip().splitlines()[0]
        print(fmt.reply_block(f"{domain} (held-out)", shown[:117] + "..." if len(shown) > 120 else shown,
                              reply.texts[0] if reply.texts else None) + "\n")
    overall = summarize(results)
    domains = list(results)
    headers = ["method", "tokens/s", "tau", "x AR", *domains, "= AR"]  # domain columns: x AR there
    rows = [["AR", overall["ar_tokens_per_s"], 1.0, 1.0, *[1.0] * len(domains), "-"]]
    for name in methods:
        m = overall["methods"][name]
        rows.append([name, m["tokens_per_s"], m["mean_tau"], m["speedup"],
                     *[results[d]["methods"][name]["speedup"] for d in domains],
                     "yes" if all(results[d]["methods"][name]["identical"] for d in domains) else "NO"])
    names = [f"{label} {d.name}" for label, d in (("DFlash", dflash), ("AdaFlash", adaflash)) if d is not None]
    print(f"summary: {target.name or args.model}, {args.dtype}, greedy, batch 1, {overall['prompts']} prompts, "
          f"max {args.max_new_tokens} new tokens\ndrafters: {', '.join(names) or 'none'}")
    print(fmt.table(headers, rows))
    print("x AR: speedup over autoregressive decoding (the domain columns too); = AR: identical output")
    return 0


subcommand("rollout")(cli_train.add_rollout_parser)
subcommand("corpus")(cli_train.add_corpus_parser)
subcommand("train")(cli_train.add_train_parser)
subcommand("opd")(cli_train.add_opd_parser)
subcommand("export")(lambda sub: cli_serve.add_export_parser(sub, DEFAULT_TARGET, DEFAULT_ADAFLASH))
subcommand("serve")(lambda sub: cli_serve.add_serve_parser(sub, DEFAULT_TARGET))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="adaflash", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="AdaFlash / DFlash speculative decoding in JAX: decode with a target LM and\n"
                    "(optionally) a block-diffusion drafter.",
        epilog="examples:\n  adaflash demo\n  adaflash generate --prompt 'Explain KV caching in one sentence.'\n"
               "\nrun 'adaflash COMMAND --help' for the options of a command.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS.values():
        add(subparsers)
    return parser


def _enable_compile_cache() -> None:
    """Persists XLA executables across runs (unless the caller already chose a cache, or set
    ADAFLASH_COMPILE_CACHE=0, as the test suite does)."""
    import jax

    if os.environ.get("ADAFLASH_COMPILE_CACHE", "1") == "0":
        return
    if not jax.config.jax_compilation_cache_dir:
        root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        jax.config.update("jax_compilation_cache_dir", os.path.join(root, "adaflash_jax", "compile_cache"))
    if jax.config.jax_compilation_cache_max_size < 0:
        # A bound turns on the cache's file lock, so processes sharing a host (launch -n 2) never
        # read an entry another one is half-way through writing.
        jax.config.update("jax_compilation_cache_max_size", 16 << 30)


def main(argv: list[str] | None = None) -> int:
    """Runs the CLI; returns the exit code (0 ok, 2 bad input)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        _enable_compile_cache()
        return int(args.run(args) or 0)
    except SystemExit as done:  # --help
        return done.code if isinstance(done.code, int) else 0
    except UsageError as error:
        print(error, file=sys.stderr)
        return 2
    except InputError as error:  # anything else is a bug: its traceback is kept
        print(f"adaflash: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
