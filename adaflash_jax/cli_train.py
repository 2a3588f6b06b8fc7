"""`adaflash train`, `rollout`, `corpus` and `opd`: the training jobs on the command line.

All take an experiment config (a name under configs/ or a file) plus
`key=value` overrides, so the command line and the Python API share one
config system. `rollout` writes the target's responses to the built-in
training prompts where the config's `data.path` expects them; `train` then
trains the drafter on them (resuming from the run's checkpoints); `corpus`
writes natural text for pre-training one (`data.source=arrays`); `opd`
continues from a trained drafter with on-policy distillation and trains its
adaptive length head.
"""

from __future__ import annotations

import argparse
import sys

from adaflash_jax.errors import InputError, as_input_error

TRAIN_EXAMPLES = """examples:
  adaflash train tiny                                   # seconds on a CPU: a smoke run
  adaflash train smollm2_135m                           # the shipped SmolLM2 drafter's recipe
  adaflash train configs/smollm2_135m.py optim.lr=1e-3 optim.total_steps=2000
  adaflash train smollm2_135m --fresh --overwrite       # discard the run's checkpoints, start over
"""

ROLLOUT_EXAMPLES = """examples:
  adaflash rollout smollm2_135m                         # writes to the config's data.path
  adaflash rollout smollm2_135m --per-domain 100 --max-new-tokens 64 --out runs/small_rollouts
  adaflash rollout smollm2_135m --drafter smollm2-135m-instruct-dflash   # same output; pays at small --batch-size only
  adaflash rollout smollm2_135m --per-domain 2800 --max-new-tokens 256 --shards 148:263 --out runs/new_rows
  adaflash rollout smollm2_135m --per-domain 2800 --max-new-tokens 256 --samples 1 --sampled-only \
      --out data/rollouts/smollm2-135m-instruct-t0.7   # sampled rows; train on both: data.path=A,B
"""

CORPUS_EXAMPLES = """examples:
  adaflash corpus smollm2_135m --rows 4000 --out runs/text_corpus.npz
  adaflash train smollm2_135m data.source=arrays data.path=runs/text_corpus.npz checkpoint.dir=runs/text_pre
"""

OPD_EXAMPLES = """examples:
  adaflash opd tiny_opd                                 # seconds on a CPU: a smoke run
  adaflash opd smollm2_135m_opd                         # from the shipped drafter, buffer seeded from
                                                        # runs/rollouts_256 (adaflash rollout)
  adaflash opd smollm2_135m_opd opd.refresh_every=25 opd.head_stage1_steps=50 optim.total_steps=200
  adaflash opd smollm2_135m_opd opd.head_confidence=true opd.head_stage1_steps=200 optim.total_steps=200
                                                        # head-only: a head that reads draft probabilities
  adaflash opd smollm2_135m_opd --fresh --overwrite     # discard checkpoints AND the rollout buffer
"""


def help_formatter():
    return argparse.RawDescriptionHelpFormatter


def tree_budget_arg(text: str):
    """--tree-budget: a node count, or "auto"."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a node count or 'auto', got {text!r}") from None


def add_target_mismatch_flag(p) -> None:
    p.add_argument("--allow-target-mismatch", action="store_true",
                   help="load a drafter even if it records a different training target (fingerprint)")


def _add_config_args(p, config_help: str) -> None:
    """The experiment config and its `key=value` overrides (shared by the jobs)."""
    p.add_argument("config", help=config_help)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. optim.lr=1e-3")


def _add_resume_args(p, also: str = "") -> None:
    p.add_argument("--fresh", action="store_true", help="do not resume from the run's checkpoints")
    p.add_argument("--overwrite", action="store_true",
                   help="discard checkpoints that are incompatible (or, with --fresh, all of them)" + also)


def _join_cluster() -> bool:
    """Joins the multi-process job the environment describes (launch/); False after printing
    why the processes could not find each other."""
    from adaflash_jax.parallel.distributed import DistributedInitError, initialize_from_env

    try:
        initialize_from_env()
    except DistributedInitError as error:
        print(f"adaflash: error: {error}", file=sys.stderr)
        return False
    return True


def _is_main() -> bool:
    import jax

    return jax.process_index() == 0


def _load_config(args):
    from adaflash_jax.training.config import load_config, override

    with as_input_error():  # config files and overrides are user input
        return override(load_config(args.config), args.overrides)


def add_train_parser(subparsers):
    p = subparsers.add_parser(
        "train", help="train a DFlash drafter (offline) from an experiment config",
        description="Train a DFlash drafter for the config's target on its data (rollouts or arrays).\n"
                    "Checkpoints (orbax), TensorBoard logs and the final drafter (HF layout) go under\n"
                    "checkpoint.dir; a rerun resumes from the latest checkpoint, SIGTERM saves and exits.",
        epilog=TRAIN_EXAMPLES, formatter_class=help_formatter())
    _add_config_args(p, "a configs/ name (tiny, smollm2_135m, qwen3_8b) or a config file")
    _add_resume_args(p)
    p.set_defaults(run=_run_train)
    return p


def _run_train(args) -> int:
    cfg = _load_config(args)
    if not _join_cluster():
        return 1
    from adaflash_jax.training.trainer import train

    with as_input_error(FileExistsError):  # --fresh on a run with checkpoints, no --overwrite
        result = train(cfg, resume=not args.fresh, overwrite=args.overwrite)
    last = result.evals[-1] if result.evals else {}
    if _is_main():
        print(f"stopped at step {result.step}/{cfg.optim.total_steps} (preempted={result.preempted}); "
              f"held-out teacher-forced tau {last.get('tau_teacher_forced', float('nan')):.3f}; "
              f"drafter: {result.drafter_dir or 'not written (unfinished)'}")
    return 0


def add_rollout_parser(subparsers):
    p = subparsers.add_parser(
        "rollout", help="write the target's responses to the built-in training prompts",
        description="Generate the config's target's greedy responses to the built-in code, math and\n"
                    "prose TRAIN prompts (round-robin over domains) as ArrayRecord shards. A killed job\n"
                    "resumes at its first missing shard; nothing written is lost or duplicated.",
        epilog=ROLLOUT_EXAMPLES, formatter_class=help_formatter())
    _add_config_args(p, "a configs/ name or a config file (its target, and data.path as output)")
    p.add_argument("--out", metavar="DIR", help="output directory (default: the config's data.path)")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="where the built-in prompt sets are built/read (default: ~/.cache/adaflash_jax/prompts)")
    p.add_argument("--per-domain", type=int, default=400, metavar="N", help="prompts per domain (default: 400)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="response cap (default: 128)")
    p.add_argument("--max-prompt-tokens", type=int, default=128, metavar="N",
                   help="skip longer prompts (default: 128)")
    p.add_argument("--batch-size", type=int, default=32, metavar="N", help="prompts per decode call (default: 32)")
    p.add_argument("--drafter", metavar="NAME|PATH", help="decode speculatively with this drafter (lossless)")
    add_target_mismatch_flag(p)
    p.add_argument("--seed", type=int, default=0, metavar="S", help="prompt selection seed (default: 0)")
    p.add_argument("--samples", type=int, default=0, metavar="N",
                   help="also N sampled responses per prompt (default: 0, greedy only)")
    p.add_argument("--temperature", type=float, default=0.7, metavar="T",
                   help="sampling temperature of --samples (default: 0.7)")
    p.add_argument("--sampled-only", action="store_true",
                   help="write only the --samples sampled responses (a store beside the greedy one: more "
                        "rows from the same prompts)")
    p.add_argument("--shards", metavar="START:STOP", type=_shard_range,
                   help="decode only the job's shards START..STOP-1 (shard k holds prompts "
                        "k*batch-size onward): new prompts for a drafter trained on the first ones, "
                        "or one machine's part of a job split across several")
    p.add_argument("--eval-set", action="store_true",
                   help="decode the fixed evaluation set's prompts instead (held-out τ: data.eval_path)")
    p.set_defaults(run=_run_rollout)
    return p


def _shard_range(text: str) -> tuple[int, int]:
    """'START:STOP' -> (START, STOP), 0 <= START < STOP (STOP may be left out: to the end)."""
    start, sep, stop = text.partition(":")
    try:
        lo, hi = int(start), (int(stop) if stop else 1 << 62)
    except ValueError:
        lo = hi = -1
    if not sep or not 0 <= lo < hi:
        raise argparse.ArgumentTypeError(f"expected START:STOP with 0 <= START < STOP, got {text!r}")
    return lo, hi


def _run_rollout(args) -> int:
    import adaflash_jax as af
    from adaflash_jax.data.prompts import DEFAULT_PROMPT_DIR
    from adaflash_jax.training.rollout_job import run_rollout_job

    cfg = _load_config(args)
    if cfg.target.tiny is not None:
        raise InputError("rollouts use a checkpoint target (target.name); this config has a random tiny target")
    out = args.out or cfg.data.path
    if not out:
        raise InputError("no output directory: pass --out DIR or use a config with data.path set")
    if args.sampled_only and (args.samples < 1 or args.eval_set):
        raise InputError("--sampled-only needs --samples N >= 1 (and is not for --eval-set)")
    for flag in ("per_domain", "max_new_tokens", "max_prompt_tokens", "batch_size"):
        if getattr(args, flag) < 1:
            raise InputError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    target = af.load_target(cfg.target.name, dtype=cfg.target.dtype, param_dtype=cfg.target.param_dtype)
    drafter = af.load_drafter(args.drafter, target=target, allow_target_mismatch=args.allow_target_mismatch
                              ) if args.drafter else None
    if args.eval_set:
        from adaflash_jax.training.rollout_job import run_eval_set_rollouts

        stats = run_eval_set_rollouts(target, out, drafter=drafter, max_new_tokens=args.max_new_tokens,
                                      batch_size=args.batch_size)
    else:
        stats = run_rollout_job(target, out, data_dir=args.data_dir or DEFAULT_PROMPT_DIR,
                                per_domain=args.per_domain, seed=args.seed, drafter=drafter,
                                max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                max_prompt_tokens=args.max_prompt_tokens, samples=args.samples,
                                temperature=args.temperature, greedy=not args.sampled_only, shards=args.shards)
    print(f"rollouts in {out}: {stats}")
    return 0


def add_corpus_parser(subparsers):
    p = subparsers.add_parser(
        "corpus", help="write natural-text token windows for pre-training a drafter",
        description="Tokenize Python standard-library sources and man pages, Info manuals, Vim help and\n"
                    "stdlib docs (never a document the fixed evaluation set quotes) with the config's\n"
                    "target tokenizer into padded windows: an .npz for data.source=arrays. Features cost\n"
                    "one prefill per token, far cheaper than rollouts; fine-tune on rollouts after it.",
        epilog=CORPUS_EXAMPLES, formatter_class=help_formatter())
    _add_config_args(p, "a configs/ name or a config file (its target's tokenizer, data.seq_len)")
    p.add_argument("--out", metavar="FILE.npz", required=True, help="output file (replaced atomically)")
    p.add_argument("--rows", type=int, default=4000, metavar="N", help="windows to write (default: 4000)")
    p.add_argument("--code-fraction", type=float, default=0.5, metavar="F",
                   help="share of windows from Python sources, the rest prose (default: 0.5)")
    p.add_argument("--context", type=int, default=16, metavar="N",
                   help="tokens before the first anchor of a window (default: 16)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="document order seed (default: 0)")
    p.set_defaults(run=_run_corpus)
    return p


def _run_corpus(args) -> int:
    import adaflash_jax as af
    from adaflash_jax.data.text_corpus import build_text_corpus

    cfg = _load_config(args)
    if cfg.target.tiny is not None:
        raise InputError("a corpus needs a checkpoint target's tokenizer (target.name); this config has a "
                         "random tiny target")
    if not args.out.endswith(".npz"):
        raise InputError(f"--out must name an .npz file, got {args.out!r}")
    if args.rows < 1 or not 0.0 <= args.code_fraction <= 1.0 or args.context < 0:
        raise InputError(f"need --rows >= 1, --code-fraction in [0, 1] and --context >= 0; got {args.rows}, "
                         f"{args.code_fraction}, {args.context}")
    with as_input_error():
        tokenizer = af.load_target(cfg.target.name).tokenizer
        if tokenizer is None:
            raise InputError(f"target {cfg.target.name} has no tokenizer (no tokenizer.json beside its "
                             "weights): a corpus is tokenized with the target's own")
        stats = build_text_corpus(tokenizer, args.out, rows=args.rows,
                                  seq_len=cfg.data.seq_len, context=args.context,
                                  code_fraction=args.code_fraction, seed=args.seed)
    print(f"natural-text corpus in {args.out}: {stats}")
    return 0


def add_opd_parser(subparsers):
    p = subparsers.add_parser(
        "opd", help="on-policy distillation of a drafter, with its adaptive length head",
        description="AdaFlash on-policy distillation: alternate rollout rounds (the speculative engine\n"
                    "with the current drafter decodes opd.prompts_per_round training prompts into a\n"
                    "buffer under checkpoint.dir) and opd.refresh_every training steps (OPD loss for\n"
                    "the drafter, MSE towards greedy acceptance for the length head; head only for the\n"
                    "first opd.head_stage1_steps). Starts from opd.init_drafter (a drafter dir or\n"
                    "built-in name; empty: a fresh drafter). Checkpoints, the buffer, TensorBoard logs\n"
                    "and the final drafter with its head (HF layout) go under checkpoint.dir; a rerun\n"
                    "resumes, SIGTERM saves and exits. Settings: the opd.* keys of the config.",
        epilog=OPD_EXAMPLES, formatter_class=help_formatter())
    _add_config_args(p, "a configs/ name (tiny_opd, smollm2_135m_opd) or a config file")
    _add_resume_args(p, "; also discards the rollout buffer")
    p.set_defaults(run=_run_opd)
    return p


def _run_opd(args) -> int:
    cfg = _load_config(args)
    if not _join_cluster():
        return 1
    from adaflash_jax.training.opd import train_opd

    with as_input_error(FileExistsError):  # --fresh on a run with checkpoints, no --overwrite
        r = train_opd(cfg, resume=not args.fresh, overwrite=args.overwrite)
    taus = [row["tau"] for row in r.rollouts if row["tau"] == row["tau"]]
    if _is_main():
        print(f"stopped at step {r.step}/{cfg.optim.total_steps} (preempted={r.preempted}); buffer "
              f"{r.buffer_rows} rows; rollout tau {taus[0] if taus else float('nan'):.3f} -> "
              f"{taus[-1] if taus else float('nan'):.3f}; drafter: "
              f"{r.drafter_dir or 'not written (unfinished)'}")
    return 0
