"""``train-tiny`` and ``train-draft``: the parsers, kept apart from the training code so that
``--help`` appears without importing torch and transformers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from moe_spec import console
from moe_spec.errors import UserError, fail
from moe_spec.moe import families, models
from moe_spec.tasks import benchmarks

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


MAX_STEPS = 10_000_000  # optimizer steps: more is a typo, not a training run
MAX_BATCH = 4096  # sequences per step
MAX_LR = 10.0  # a peak learning rate above this diverges at once
MAX_SEED = 2**32 - 1  # what numpy's and torch's generators both take
MAX_TTT = 64  # unrolled TTT steps (EAGLE-3: 7)
MAX_INTERMEDIATE = 65_536  # draft MLP width
DEFAULT_POSITIONS = 4096  # the tiny models' context (training/tiny_moe.py)


def check_numbers(parser, args, limits: dict) -> None:
    """Every numeric option within ``limits`` (option name -> (low, high): inclusive; a float
    option's low bound 0 is exclusive), and every float finite: refused in one line before any
    work (torch would fail later, or train on NaN)."""
    import math
    for name, (low, high) in limits.items():
        value = getattr(args, name)
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, float):
            rule = f"greater than {low:g} and at most {high:g}" if low == 0 else \
                f"{low:g} to {high:g}"
            if not math.isfinite(value) or not (low < value if low == 0 else low <= value) \
                    or value > high:
                parser.error(f"{flag} {value} is out of range: it must be a finite number "
                             f"{rule}")
        elif not low <= value <= high:
            parser.error(f"{flag} {value} is out of range: it must be {low} to {high}")


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
    check_numbers(p, args, dict(steps=(1, MAX_STEPS), batch=(1, MAX_BATCH),
                                seq_len=(1, DEFAULT_POSITIONS), lr=(0, MAX_LR),
                                seed=(0, MAX_SEED)))
    out = args.out or models.EMBEDDED_DIR / args.model
    refuse_overwrite(p, out, args.force)
    try:
        benchmarks.benchmarks_dir(args.benchmarks)
    except UserError as exc:
        return fail("train-tiny", exc)
    console.threads.apply(args.threads)  # before torch and transformers start their pools
    from moe_spec.training.tiny_moe import train
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
    limits = dict(steps=(1, MAX_STEPS), batch=(1, MAX_BATCH), lr=(0, MAX_LR),
                  seed=(0, MAX_SEED), ttt=(1, MAX_TTT), intermediate=(1, MAX_INTERMEDIATE))
    check_numbers(p, args, limits)  # what needs no model first
    try:  # before torch and transformers load: the target, the output folder, the corpus
        source = models.check_available(args.model)
        config = models.read_config(args.model)
        positions = models.max_positions(config) or DEFAULT_POSITIONS
        vocab = families.facts(config).vocab
        vocab = vocab if isinstance(vocab, int) and vocab > 0 else 1_000_000
        check_numbers(p, args, dict(seq_len=(1, positions), new_tokens=(1, positions),
                                    draft_vocab=(1, vocab)))
        out = args.out or models.DRAFTS_DIR / source.name
        refuse_overwrite(p, out, args.force)
        benchmarks.benchmarks_dir(args.benchmarks)
    except UserError as exc:
        return fail("train-draft", exc)
    console.threads.apply(args.threads)  # before torch and transformers start their pools
    from moe_spec.training.draft import train
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
