"""`adaflash`: the one command-line entry point.

Sub-commands register themselves in `SUBCOMMANDS` (name -> function that adds
its parser), so new jobs plug in without touching `main`. Bad input surfaces
as one `adaflash: error: ...` line and exit code 2, never a traceback: the
library raises ValueError for bad input, and argparse errors are routed the
same way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable

from adaflash_jax import cli_format as fmt

DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_DRAFTER = "smollm2-135m-instruct-dflash"
DEMO_PROMPTS = (
    ("code", "Write a Python function that returns the n-th Fibonacci number."),
    ("math", "A train travels 120 km in 1.5 hours. What is its average speed? Show the steps."),
    ("prose", "Write a short paragraph describing a rainy morning in a harbour town."),
)


class UsageError(Exception):
    """A command line argparse rejected (message already names the command)."""


class DrafterUnavailable(ValueError):
    """This build has no speculative engine (`adaflash_jax.load_drafter` is missing)."""


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

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    SamplingParams(args.temperature, args.top_p)  # raises ValueError on bad values
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                top_p=args.top_p, seed=args.seed)


def _load_target(name: str, dtype: str):
    import adaflash_jax as af
    from adaflash_jax.target_api import resolve_target_path

    resolve_target_path(name)  # a bad name fails here, before the progress line
    print(f"loading target {name} ({dtype}) ...", file=sys.stderr, flush=True)
    return af.load_target(name, dtype=dtype)


def _load_drafter(path: str, target):
    """`af.load_drafter(path, target=...)`, or DrafterUnavailable when the build lacks it."""
    import adaflash_jax as af

    load = getattr(af, "load_drafter", None)
    if load is None:
        try:
            from adaflash_jax.decoding import speculative
        except ModuleNotFoundError as error:
            if error.name != "adaflash_jax.decoding.speculative":
                raise
            speculative = None
        load = getattr(speculative, "load_drafter", None)
    if load is None:
        raise DrafterUnavailable("speculative decoding is not available in this build "
                                 "(adaflash_jax.load_drafter is missing)")
    return load(path, target=target)


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompt_file:
        if args.prompt_file == "-":
            lines = sys.stdin.read().splitlines()
        else:
            if not os.path.isfile(args.prompt_file):
                raise ValueError(f"--prompt-file {args.prompt_file}: no such file")
            with open(args.prompt_file, encoding="utf-8") as f:
                lines = f.read().splitlines()
        prompts += [line for line in lines if line.strip()]
    if not prompts:
        raise ValueError("no prompt given; pass --prompt TEXT (repeatable) or --prompt-file FILE")
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
                 "  adaflash generate --prompt hi --drafter ckpt/drafter --compare-ar")
    _add_model_options(p)
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help="a user message (chat template applied); repeat for a batch")
    p.add_argument("--prompt-file", metavar="FILE",
                   help="one prompt per non-empty line ('-' reads stdin); adds to --prompt")
    _add_decode_options(p)
    p.add_argument("--drafter", metavar="PATH",
                   help="drafter checkpoint for speculative decoding (via adaflash_jax.load_drafter)")
    p.add_argument("--compare-ar", action="store_true",
                   help="with --drafter: also decode autoregressively, print speedup and whether outputs match")
    p.add_argument("--json", action="store_true", help="print one JSON record instead of text")
    p.set_defaults(run=_run_generate)
    return p


def _run_generate(args) -> int:
    import adaflash_jax as af

    prompts = _read_prompts(args)
    kw = _decode_kwargs(args)
    if args.compare_ar and not args.drafter:
        raise ValueError("--compare-ar compares speculative with autoregressive decoding; it needs --drafter PATH")
    target = _load_target(args.model, args.dtype)
    drafter = _load_drafter(args.drafter, target) if args.drafter else None
    res = af.generate(target, prompts, drafter=drafter, **kw)
    ar = af.generate(target, prompts, **kw) if args.compare_ar else None
    identical = ar is not None and ar.token_ids == res.token_ids

    if args.json:
        record = {"model": args.model, "dtype": args.dtype, "drafter": args.drafter, "settings": kw,
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
        subparsers, "demo", summary="the main job: decode built-in code/math/prose prompts, print a summary",
        description="Load the embedded SmolLM2-135M-Instruct target, answer a few built-in prompts from\n"
                    "different domains (code, math, prose) with greedy decoding, and print each reply with\n"
                    f"its throughput and a summary table. When a drafter named {DEFAULT_DRAFTER}\n"
                    "is installed, each prompt is also decoded speculatively and compared with AR.",
        examples="  adaflash demo\n"
                 "  adaflash demo --max-new-tokens 32 --dtype bfloat16\n"
                 "  adaflash demo --drafter ckpt/drafter")
    _add_model_options(p)
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                   help="most new tokens per prompt (default: 64)")
    p.add_argument("--drafter", metavar="NAME|PATH",
                   help=f"drafter to compare against AR (default: {DEFAULT_DRAFTER}, if installed)")
    p.set_defaults(run=_run_demo, temperature=0.0, top_p=1.0, seed=0)
    return p


def _demo_drafter(args, target):
    """The demo's drafter, or None plus the reason; an explicit --drafter must load."""
    if args.drafter:
        return _load_drafter(args.drafter, target), ""
    try:
        return _load_drafter(DEFAULT_DRAFTER, target), ""
    except DrafterUnavailable as error:
        return None, str(error)
    except (ValueError, FileNotFoundError) as error:
        return None, f"no drafter named {DEFAULT_DRAFTER} is installed ({error})"


def _run_demo(args) -> int:
    import adaflash_jax as af

    kw = _decode_kwargs(args)
    target = _load_target(args.model, args.dtype)
    drafter, reason = _demo_drafter(args, target)
    if drafter is None:
        print(f"{reason}; running autoregressive decoding only.")
    headers = ["domain", "tokens", "AR s", "AR tokens/s"]
    if drafter is not None:
        headers += ["spec tokens/s", "tau", "speedup", "identical"]
    rows, total_tokens, total_s = [], 0, 0.0
    for domain, prompt in DEMO_PROMPTS:
        ar = af.generate(target, [prompt], **kw)
        print(fmt.reply_block(domain, prompt, ar.texts[0] if ar.texts else None))
        print(fmt.stats_line(ar.stats) + "\n")
        row = [domain, ar.stats["new_tokens"], ar.stats["wall_time_s"], ar.stats["tokens_per_s"]]
        total_tokens += ar.stats["new_tokens"]
        total_s += ar.stats["wall_time_s"]
        if drafter is not None:
            spec = af.generate(target, [prompt], drafter=drafter, **kw)
            same = spec.token_ids == ar.token_ids
            print("speculative " + fmt.stats_line(spec.stats))
            print(fmt.comparison_line(spec.stats, ar.stats, same, 0.0) + "\n")
            row += [spec.stats["tokens_per_s"], spec.stats.get("mean_tau"),
                    fmt.speedup(spec.stats, ar.stats), "yes" if same else "NO"]
        rows.append(row)
    total = ["all", total_tokens, total_s, total_tokens / total_s if total_s else None]
    rows.append(total + [None] * (len(headers) - len(total)))
    print(f"summary ({target.name or args.model}, {args.dtype}, greedy, "
          f"max {args.max_new_tokens} new tokens, batch 1):")
    print(fmt.table(headers, rows))
    return 0


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
    """Persists XLA executables across runs (unless the caller already chose a cache)."""
    import jax

    if not jax.config.jax_compilation_cache_dir:
        root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        jax.config.update("jax_compilation_cache_dir", os.path.join(root, "adaflash_jax", "xla"))


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
    except (ValueError, FileNotFoundError) as error:
        print(f"adaflash: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
