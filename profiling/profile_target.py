"""``profile-target``: time the target's forward for batch size b and γ tokens per sequence (after
a cached prefix) on the current device, store the points as the catalog's ``profile`` table
(:data:`catalog.schema.PROFILE`) and print MoESD's fit and regimes (:mod:`analysis.moesd`)."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import polars as pl

from moe_spec import console
from moe_spec.analysis.moesd import efficiency, fit, regime
from moe_spec.errors import UserError, fail


def time_forward(model, batch_size: int, gamma: int, prefix: int, repeats: int, vocab: int,
                 seed: int = 0) -> float:
    import torch
    with torch.no_grad():
        return _time_forward(model, batch_size, gamma, prefix, repeats, vocab, seed)


def _time_forward(model, batch_size, gamma, prefix, repeats, vocab, seed) -> float:
    import torch
    from transformers import DynamicCache
    dev = next(model.parameters()).device
    g = torch.Generator(device="cpu").manual_seed(seed)
    ctx = torch.randint(0, vocab, (batch_size, prefix), generator=g).to(dev)
    new = torch.randint(0, vocab, (batch_size, gamma), generator=g).to(dev)
    times = []
    for _ in range(repeats + 1):
        cache = DynamicCache(config=model.config)
        model(input_ids=ctx, cache=cache, use_cache=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        model(input_ids=new, cache=cache, use_cache=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # first run warms up


def profile(model, batch_sizes, gammas, prefix: int, repeats: int) -> pl.DataFrame:
    from moe_spec.moe import families
    vocab = families.facts(model.config).vocab  # the token ids a random prompt draws from
    rows = [dict(batch_size=b, gamma=g, seconds=time_forward(model, b, g, prefix, repeats, vocab))
            for b in batch_sizes for g in gammas]
    return pl.DataFrame(rows)


MAX_BATCH = 4096  # sequences in one forward (capture's --batch-size bound)
MAX_REPEATS = 1000
MAX_POINTS = 10_000  # (b, γ) points timed
MAX_TOKENS = 1 << 22  # b · (prefix + γ) tokens of one timed forward: the memory of a pass
DEFAULT_POSITIONS = 1 << 17  # where a model's config names no max_position_embeddings


class SizeError(UserError, ValueError):
    """A size option beyond what the model or the machine can take; one line."""


def check_sizes(model: str, batch_sizes, gammas, prefix: int, repeats: int) -> None:
    """Refuse, before torch loads, sizes the model cannot take (a prefix plus γ beyond its
    ``max_position_embeddings``) or that would build absurd tensors, in one line."""
    from moe_spec.moe import models
    positions = models.max_positions(models.read_config(model))
    where = f"{model}'s max_position_embeddings {positions}" if positions else \
        f"the cap {DEFAULT_POSITIONS}"
    positions = positions or DEFAULT_POSITIONS
    if prefix + max(gammas) > positions:
        raise SizeError(f"--prefix {prefix} plus the largest --gammas {max(gammas)} is beyond "
                        f"{where}; give a smaller --prefix or --gammas")
    if max(batch_sizes) > MAX_BATCH:
        raise SizeError(f"--batch-sizes {max(batch_sizes)} is out of range: batch sizes must "
                        f"be 1 to {MAX_BATCH}")
    if repeats > MAX_REPEATS:
        raise SizeError(f"--repeats {repeats} is out of range: it must be 1 to {MAX_REPEATS}")
    if len(batch_sizes) * len(gammas) > MAX_POINTS:
        raise SizeError(f"{len(batch_sizes)} --batch-sizes × {len(gammas)} --gammas is more "
                        f"than {MAX_POINTS} points; give fewer")
    tokens = max(batch_sizes) * (prefix + max(gammas))
    if tokens > MAX_TOKENS:
        raise SizeError(f"--batch-sizes {max(batch_sizes)} × (--prefix {prefix} + --gammas "
                        f"{max(gammas)}) is {tokens} tokens in one forward, more than "
                        f"{MAX_TOKENS}; give smaller sizes")


@console.pipes.quiet_broken_pipe
def main(argv: list[str] | None = None) -> int:
    from moe_spec.moe import models
    p = console.ArgumentParser(
        prog="profile-target", examples="""
            profile-target --model tiny-olmoe --batch-sizes 1,2 --gammas 1,4,16
            profile-target --model olmoe --device cuda --repeats 5      # on the GPU you study
            profile-target --model tiny-olmoe --threads 1               # CPU timings, one core""",
        description="Time the target's forward at batch sizes b and gamma tokens per sequence on "
                    "this device and store the points for MoESD's efficiency eta(b, gamma).")
    p.add_argument("--model", default=models.DEFAULT_MODEL, help="alias, hub id or folder")
    p.add_argument("--batch-sizes", "--batches", dest="batch_sizes", default="1,2,4,8",
                   help="batch sizes b, comma-separated (--batches: its older spelling)")
    p.add_argument("--gammas", default="1,2,4,8,16,32,64",
                   help="tokens per sequence gamma, comma-separated (1 is always added)")
    p.add_argument("--prefix", type=int, default=128, help="cached tokens before the pass")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per point (median)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, "
                                                   "bfloat16, float16")
    p.add_argument("--out", type=Path, default=Path("traces"), help="traces root")
    console.threads.add_argument(p, what="torch (CPU timings depend on it)")
    args = p.parse_args(argv)
    try:
        batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
        gammas = sorted({1, *(int(x) for x in args.gammas.split(","))})
        if min(batch_sizes) < 1 or min(gammas) < 1 or args.prefix < 1 or args.repeats < 1:
            raise ValueError("--batch-sizes, --gammas, --prefix and --repeats must all be ≥ 1")
    except ValueError as exc:
        msg = str(exc) if "must" in str(exc) else \
            f"cannot read --batch-sizes/--gammas ({exc}); use comma-separated whole numbers ≥ 1"
        return fail("profile-target", msg)
    try:  # before torch and transformers load
        models.check_available(args.model)
        check_sizes(args.model, batch_sizes, gammas, args.prefix, args.repeats)
    except UserError as exc:
        return fail("profile-target", exc)
    threads = console.threads.apply(args.threads)
    from moe_spec.catalog.writer import write_profile
    from moe_spec.moe.adapter import MoEAdapter
    models.quiet_transformers()
    try:
        loaded = models.load(args.model, device=args.device, dtype=args.dtype)
        adapter = MoEAdapter(loaded.model)
    except UserError as exc:
        return fail("profile-target", exc)
    points = profile(loaded.model, batch_sizes, gammas, args.prefix, args.repeats)
    table = points.with_columns(prefix=pl.lit(args.prefix),
                                num_experts=pl.lit(adapter.num_experts),
                                top_k=pl.lit(adapter.top_k)).to_arrow()
    try:
        folder = write_profile(args.out, loaded.name, loaded.device.type, table)
    except OSError as exc:
        return fail("profile-target", f"cannot write to {args.out}: {exc.strerror or exc}; "
                    "choose a writable --out")
    eff = efficiency(points)
    coef = fit(points, adapter.num_experts, adapter.top_k)
    with pl.Config(tbl_rows=100):
        print(eff.with_columns(regime=pl.Series(regime(
            eff["batch_size"] * eff["gamma"], adapter.num_experts, adapter.top_k, coef))))
    if coef.get("refused"):
        print(f"fit: {coef['refused']}; wrote {folder}")
    else:
        print(f"fit: T = {coef['c0']:.3g} + {coef['c1']:.3g}·E(bγ) + {coef['c2']:.3g}·bγ s "
              f"(relative RMSE {coef['relative_rmse']:.1%}; {loaded.device.type}, {threads} "
              f"CPU threads); wrote {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
