"""``train-tiny`` and ``train-draft``: the parsers, kept apart from the training code so that
``--help`` appears without importing torch and transformers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import console
from errors import UserError, fail
from moe import models
from tasks import benchmarks

TINY_EXAMPLES = """
train-tiny --model tiny-olmoe --steps 1500 --seed 0
train-tiny --model tiny-deepseek-v3 --steps 900 --threads 1 --out /tmp/dsv3
"""
DRAFT_EXAMPLES = """
train-draft --model tiny-olmoe --steps 1200 --seed 0
train-draft --model tiny-gpt-oss --steps 700 --threads 1 --out /tmp/gptoss-head
"""


def refuse_overwrite(parser, out: Path, force: bool) -> None:
    """Never replace a folder that holds something (the shipped models included) unless told;
    never a link or a file, even when told (checked before any training)."""
    if out.is_symlink():
        parser.error(f"--out {out} is a symbolic link; outputs never follow or replace links, "
                     "give the real folder's path or another --out")
    if out.exists() and not out.is_dir():
        parser.error(f"--out {out} is a file, not a folder; give a folder path")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        parser.error(f"--out {out} exists and is not empty (a trained model lives there?); pass "
                     "--force to replace it, or another --out")


def _at_least_one(parser, args, names) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} {value} must be at least 1")


@console.pipes.quiet_broken_pipe
def train_tiny(argv: list[str] | None = None) -> int:
    p = console.ArgumentParser(
        prog="train-tiny", examples=TINY_EXAMPLES,
        description="Train one embedded tiny MoE model on the offline corpus and write it, with "
                    "its tokenizer and quality record, as a Hugging Face folder. Each family "
                    "balances its own way (training/tiny_moe.py): tiny-deepseek-v3 with "
                    "DeepSeek-V3's selection-bias updates (γ 1e-3).")
    p.add_argument("--model", required=True, choices=models.EMBEDDED, help="which tiny model")
    p.add_argument("--steps", type=int, default=1500, help="optimizer steps")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and data order")
    p.add_argument("--out", type=Path, default=None,
                   help=f"output folder (default: {models.EMBEDDED_DIR}/<model>)")
    p.add_argument("--benchmarks", default=None, help="benchmarks folder (train splits)")
    console.threads.add_argument(p)
    p.add_argument("--force", action="store_true",
                   help="replace an existing, non-empty --out folder (never done otherwise)")
    args = p.parse_args(argv)
    _at_least_one(p, args, ("steps", "batch", "seq_len"))
    if args.lr <= 0:
        p.error(f"--lr {args.lr} must be positive")
    out = args.out or models.EMBEDDED_DIR / args.model
    refuse_overwrite(p, out, args.force)
    try:
        benchmarks.benchmarks_dir(args.benchmarks)
    except UserError as exc:
        return fail("train-tiny", exc)
    console.threads.apply(args.threads)  # before torch and transformers start their pools
    from training.tiny_moe import train
    models.quiet_transformers()
    record = train(args.model, steps=args.steps, batch=args.batch, seq=args.seq_len, lr=args.lr,
                   seed=args.seed, out=out, benchmarks_root=args.benchmarks)
    print(models.format_quality_record(record))
    print(f"wrote {out}")
    return 0


@console.pipes.quiet_broken_pipe
def train_draft(argv: list[str] | None = None) -> int:
    p = console.ArgumentParser(
        prog="train-draft", examples=DRAFT_EXAMPLES,
        description="Train an EAGLE-3 draft head for a target model with training-time test, "
                    "offline, and write it in EAGLE's checkpoint layout (config.json + "
                    "model.safetensors).")
    p.add_argument("--model", default=models.DEFAULT_MODEL, help="target: alias, hub id or folder")
    p.add_argument("--steps", type=int, default=1200, help="optimizer steps")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and data order")
    p.add_argument("--ttt", type=int, default=7, help="unrolled TTT steps (EAGLE-3: 7)")
    p.add_argument("--draft-vocab", type=int, default=2048, help="draft vocabulary size")
    p.add_argument("--intermediate", type=int, default=512, help="draft MLP width")
    p.add_argument("--new-tokens", type=int, default=128, help="target response length")
    p.add_argument("--out", type=Path, default=None, help="default: data/drafts/<model>")
    p.add_argument("--benchmarks", default=None, help="benchmarks folder (train splits)")
    console.threads.add_argument(p)
    p.add_argument("--force", action="store_true",
                   help="replace an existing, non-empty --out folder (never done otherwise)")
    args = p.parse_args(argv)
    _at_least_one(p, args, ("steps", "batch", "seq_len", "ttt", "draft_vocab", "intermediate",
                            "new_tokens"))
    if args.lr <= 0:
        p.error(f"--lr {args.lr} must be positive")
    try:  # before torch and transformers load: the target, the output folder, the corpus
        source = models.check_available(args.model)
        out = args.out or models.DRAFTS_DIR / source.name
        refuse_overwrite(p, out, args.force)
        benchmarks.benchmarks_dir(args.benchmarks)
    except UserError as exc:
        return fail("train-draft", exc)
    console.threads.apply(args.threads)  # before torch and transformers start their pools
    from training.draft import train
    models.quiet_transformers()
    try:
        record = train(args.model, steps=args.steps, batch=args.batch, seq=args.seq_len,
                       lr=args.lr, seed=args.seed, ttt=args.ttt, draft_vocab=args.draft_vocab,
                       intermediate=args.intermediate, new_tokens=args.new_tokens, out=out,
                       benchmarks_root=args.benchmarks)
    except UserError as exc:
        return fail("train-draft", exc)
    print(json.dumps(record, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(train_tiny())
