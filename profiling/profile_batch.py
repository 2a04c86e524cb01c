"""``profile-batch``: MoESD's question measured — speculative decoding's speedup over
autoregressive decoding as a function of the batch size b, with and without an expert budget.

For each b in ``--batch-sizes`` the same real prompts are decoded b at a time with continuous
batching (:class:`eagle.batched.BatchedDecoder`) three ways:

* **ar**: autoregressive decoding, one token per sequence per pass (γ = 1);
* **eagle**: EAGLE dynamic trees, one target forward verifying all b trees (γ = M tokens each);
* **eagle** with ``--budget B`` (each budget in turn): the union of experts per MoE layer over
  the whole batch's b·M tree tokens capped at B (``--ranking``, ``--coverage``), applied inside
  the verification forward (MoE-Spec's online mode, :class:`policy.budget.Budget`).

**Equal work** (:mod:`analysis.timing`, the one statement of the rule): every decoding decodes
the same prompts to exactly ``--max-new-tokens`` new tokens each, end-of-sequence ignored, so
AR, EAGLE and EAGLE under a budget produce the same tokens and are timed on the same work (a
budget changes the text and the passes it takes, not the amount decoded). Each decoding gives
seconds per token over the whole run (prefill and drafting included) and every verification
pass's device-synchronised seconds with its b and γ:

    speedup(b) = median over repeats r of  s/token(ar, b, r) / s/token(eagle, b, r)

Repeats are **paired and interleaved**: within repeat r at one b every configuration (ar,
eagle, eagle under each budget) is decoded back to back, starting at configuration r mod m
(rotated, :func:`analysis.timing.repeat_order`; each row stores its ``position``), so a slow
period of a shared machine falls on both sides of a ratio. The interval is the
distribution-free order-statistic 95% interval of that median (:func:`analysis.timing.
median_interval`, which needs 6 ratios; the ratios are not trimmed); the per-configuration
medians (tokens/s, ms per pass) leave out repeats slower than median + 5·MAD (counted).
Before timing, ``--warmup N`` (default 1) untimed rounds decode the first b₀ prompts (b₀ the
first batch size) for 2 new tokens each way (ar and eagle), so start-up (allocation, lazy
imports, kernel selection) is not charged to the first decoding; ``--repeats R`` (default 9:
the interval needs 6, and from 9 leaves out the most extreme ratio on each side) decodes every
(mode, b, budget) R times. Each decoding's per-pass latency (draft + verify seconds, its first
pass left out as warm-up by :mod:`analysis.warmup`'s rule) is summarised as p50/p90/p99
(numpy's linear percentiles, as ``vllm bench serve`` and SGLang's ``bench_serving`` report
them), in the table and the printout.
Every invocation is one *measurement* (an id from its UTC start time, stored in every row) in a
file of its own beside the earlier ones: nothing is overwritten, and readers pick one
measurement by a stated rule (:func:`analysis.timing.latest`: the most recent complete one of
the same settings), never pooling several. The measurement's file (and ``--output``) is
rewritten atomically after every decoding, so a run that is stopped leaves the decodings it
finished (``complete`` false).

The passes are the points MoESD's pass-time model ``T(b, γ) ≈ c₀ + c₁·E(bγ) + c₂·bγ`` is fitted
to (:func:`analysis.moesd.fit`, reported with its relative RMSE); ``analysis`` sets the measured
curve beside that fit and beside the roofline projection for real shapes.

Points are stored in the traces folder as the ``batch_profile`` and ``batch_profile_passes``
tables (:mod:`catalog.schema`), one run folder per (model, bench, settings), one file per
measurement, and shown on the
dashboard's *Batch regime* page and in the report.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from moe_spec import console
from moe_spec.analysis.timing import DEFAULT_REPEATS, repeat_order
from moe_spec.errors import UserError, fail

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16)  # the default --limit (16) fills the largest


@dataclass(frozen=True)
class ProfileBatchSettings:
    """What one ``profile-batch`` run measures (its identity, apart from device and threads)."""

    model: str
    bench: str = "mbpp"
    draft: str | None = None
    limit: int = 16
    offset: int = 0
    max_new_tokens: int = 32
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    budgets: tuple[int, ...] = ()
    ranking: str = "router"
    coverage: str = "substitution"
    device: str = "auto"
    dtype: str = "auto"
    chat_template: bool = False
    warmup: int = 1  # untimed warm-up rounds before the first timed decoding
    repeats: int = DEFAULT_REPEATS  # timed decodings per (mode, b, budget)

    def identity(self) -> dict:
        """The settings that decide the numbers (device and dtype included: timings are), and
        the timing method (measurements before equal work hash apart)."""
        return {**asdict(self), "work": "equal: eos ignored"}


@dataclass
class Decoding:
    """One way of decoding at one b: its speed, its passes."""

    mode: str  # ar | eagle
    batch_size: int
    budget: int | None
    tokens: int
    seconds: float
    passes: list[dict]  # pass_sequences, gamma (tokens each), verify_seconds, draft_seconds
    accepted: int  # tokens added over all (sequence, pass) pairs
    trees: int
    repeat: int = 0  # 0 … --repeats − 1
    position: int | None = None  # its place among its repeat's configurations (0: first)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    @property
    def tau(self) -> float:
        """Mean tokens a sequence gains per pass (1 for AR)."""
        return self.accepted / self.trees if self.trees else float("nan")

    @property
    def latency(self) -> dict[str, float]:
        """p50/p90/p99 seconds of a pass (draft + verify) over the decoding's passes, its first
        left out as warm-up (:data:`catalog.schema.WARMUP_PASSES`); NaN with none left."""
        import numpy as np

        from moe_spec.catalog.schema import WARMUP_PASSES
        times = [p["draft_seconds"] + p["verify_seconds"] for p in self.passes[WARMUP_PASSES:]]
        return {f"latency_p{q}": float(np.percentile(times, q)) if times else float("nan")
                for q in PERCENTILES}

    def row(self) -> dict:
        return dict(mode=self.mode, batch_size=self.batch_size, budget=self.budget,
                    tokens=self.tokens, seconds=self.seconds, tokens_per_s=self.tokens_per_s,
                    seconds_per_token=self.seconds / self.tokens if self.tokens
                    else float("nan"), passes=len(self.passes), tau=self.tau,
                    repeat=self.repeat, position=self.position, **self.latency)

    def label(self, repeats: bool = False) -> str:
        """"b=2 eagle B=16", with " #2" (the repeat) when ``repeats``."""
        return f"b={self.batch_size} {self.mode}" + (
            f" B={self.budget}" if self.budget is not None else "") + (
            f" #{self.repeat + 1}" if repeats else "")


PERCENTILES = (50, 90, 99)


def decode(decoder, prompts: list[list[int]], batch_size: int, max_new_tokens: int, *,
           eos: set[int] = frozenset(), autoregressive: bool = False, verify_context=None,
           budget: int | None = None, on_pass=None) -> Decoding:
    """Decode every prompt ``batch_size`` at a time; tokens/s counts every output token of every
    prompt over the wall time of the whole decoding. With no ``eos`` (profile-batch's equal
    work) every prompt decodes exactly ``max_new_tokens`` tokens. ``on_pass(n)`` is called
    after each verification pass with the passes so far (progress)."""
    from moe_spec.eagle.batched import BatchedDecoder, BatchPass

    start = time.perf_counter()
    tokens = accepted = trees = 0
    passes = []
    for event in BatchedDecoder(decoder, batch_size, verify_context=verify_context).run(
            enumerate(prompts), max_new_tokens=max_new_tokens, eos_token_ids=eos,
            autoregressive=autoregressive):
        finished = event.finished if isinstance(event, BatchPass) else [event]
        tokens += sum(len(g.output_ids) for _, g in finished)
        if isinstance(event, BatchPass) and event.slots:
            passes.append(dict(pass_sequences=len(event.slots),
                               gamma=event.tokens_verified // len(event.slots),
                               verify_seconds=event.verify_seconds,
                               draft_seconds=event.draft_seconds))
            accepted += sum(r.accepted_length for r in event.records)
            trees += len(event.records)
            if verify_context is not None:
                verify_context.take()  # the budget's records are not kept: memory stays flat
            if on_pass:
                on_pass(len(passes))
    return Decoding("ar" if autoregressive else "eagle", batch_size, budget, tokens,
                    time.perf_counter() - start, passes, accepted, trees)


def measure(settings: ProfileBatchSettings, loaded, head, prompts: list[list[int]], *,
            progress=None, done=None, on_pass=None):
    """Every (mode, b, budget, repeat) decoding of ``settings`` on ``prompts``, yielded in turn,
    after ``settings.warmup`` untimed rounds: at each b, repeat by repeat, every configuration
    (ar, eagle, eagle under each budget) back to back in :func:`analysis.timing.repeat_order`
    (rotated by the repeat), so the speedups are paired per repeat; ``progress(label)`` is
    called before each (and before the warm-up), ``done(decoding)`` after, ``on_pass(n)`` after
    each pass."""
    from moe_spec.eagle.decoding import EagleDecoder
    from moe_spec.moe.adapter import MoEAdapter
    from moe_spec.moe.recorder import VerifyRecorder
    from moe_spec.policy import coverage, rankings
    from moe_spec.policy.budget import Budget

    decoder = EagleDecoder(loaded.model, head)
    adapter = MoEAdapter(loaded.model)
    eos: set[int] = set()  # equal work: end-of-sequence ignored (analysis.timing.METHOD)
    ranking = rankings.get(settings.ranking)().fit(None) if settings.budgets else None
    cover = coverage.get(settings.coverage)
    warm = settings.batch_sizes[0]  # start-up (allocations, lazy imports) off the clock
    for i in range(settings.warmup):
        if progress:
            progress(f"warm-up {i + 1}/{settings.warmup}")
        for autoregressive in (True, False):
            decode(decoder, prompts[:warm], warm, WARMUP_TOKENS, eos=eos,
                   autoregressive=autoregressive)
    for b in settings.batch_sizes:
        configurations = [("ar", dict(autoregressive=True)), ("eagle", {})] + [
            (f"eagle B={budget}", dict(budget=budget, verify_context=VerifyRecorder(
                adapter, record_tensors=False, budget=Budget(budget, ranking, cover))))
            for budget in settings.budgets]
        for r in range(settings.repeats):  # paired: every configuration back to back
            for position, (label, kwargs) in enumerate(repeat_order(configurations, r)):
                if progress:
                    progress(f"b={b} {label}" + (f" #{r + 1}" if settings.repeats > 1 else ""))
                decoding = decode(decoder, prompts, b, settings.max_new_tokens, eos=eos,
                                  on_pass=on_pass, **kwargs)
                decoding.repeat, decoding.position = r, position
                if done:
                    done(decoding)
                yield decoding


WARMUP_TOKENS = 2  # new tokens of a warm-up decoding


# --- storage ------------------------------------------------------------------------------------
def run_name(settings: ProfileBatchSettings) -> str:
    """``batch-<hash>`` of the settings that decide the numbers: the folder every measurement of
    the same command is kept in (one file each), other settings beside it."""
    import hashlib
    import json

    digest = hashlib.sha256(json.dumps(settings.identity(), sort_keys=True).encode())
    return f"batch-{digest.hexdigest()[:8]}"


def new_measurement() -> tuple[str, str]:
    """(id, UTC start in ISO 8601) of a measurement: the id sorts by time and a random suffix
    keeps two started in the same second apart."""
    import datetime
    import secrets
    now = datetime.datetime.now(datetime.timezone.utc)
    return f"{now:%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}", now.isoformat(timespec="seconds")


def tables(settings: ProfileBatchSettings, decodings: list[Decoding], *, num_experts: int,
           top_k: int, device: str, threads: int, measurement: tuple[str, str] = ("", ""),
           complete: bool = True) -> dict:
    """The ``batch_profile`` (one row per decoding) and ``batch_profile_passes`` (one row per
    verification pass) tables of one measurement (:data:`catalog.schema.BATCH_PROFILE_TABLES`),
    every row naming it (``measurement`` = (id, UTC start))."""
    import pyarrow as pa

    from moe_spec.catalog import schema

    common = dict(num_experts=num_experts, top_k=top_k, device=device, threads=threads,
                  ranking=settings.ranking if settings.budgets else None,
                  coverage=settings.coverage if settings.budgets else None,
                  measurement=measurement[0] or None, measured_at=measurement[1] or None,
                  complete=complete)
    rows = [{**d.row(), **common} for d in decodings]
    passes = [dict(mode=d.mode, batch_size=d.batch_size, budget=d.budget, repeat=d.repeat,
                   pass_index=i, measurement=measurement[0] or None, **p)
              for d in decodings for i, p in enumerate(d.passes)]
    return {name: pa.Table.from_pylist(data, schema=schema.BATCH_PROFILE_TABLES[name])
            for name, data in (("batch_profile", rows), ("batch_profile_passes", passes))}


# --- command line -------------------------------------------------------------------------------
EXAMPLES = """
profile-batch --model tiny-olmoe --batch-sizes 1,4,16 --limit 16
profile-batch --model tiny-olmoe --budget 16,32 --threads 1      # with online budgets
profile-batch --model tiny-olmoe --batch-sizes 1,2 --warmup 2 --repeats 15  # narrower intervals
profile-batch --model olmoe --device cuda --batch-sizes 1,2,4,8,16,32 --budget 32 --limit 32
"""


def _numbers(text: str, flag: str, *, minimum: int = 1) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or min(values) < minimum or len(set(values)) != len(values):
        raise ValueError(f"{flag} {text!r}: give distinct whole numbers ≥ {minimum}, "
                         "comma-separated (e.g. 1,4,16)")
    return values


def parser():
    from moe_spec.moe import models
    from moe_spec.policy import index
    from moe_spec.tasks import benchmarks

    d = ProfileBatchSettings(model=models.DEFAULT_MODEL)
    p = console.ArgumentParser(
        prog="profile-batch", examples=EXAMPLES,
        description="Measure seconds per token of autoregressive and of EAGLE decoding at each "
                    "batch size b (real prompts, continuous batching), with and without an expert "
                    "budget over the batch's union, on equal work (every decoding decodes exactly "
                    "--max-new-tokens tokens per prompt, end-of-sequence ignored), in repeats that "
                    "decode every configuration back to back; the speedup is the median of the "
                    "per-repeat ratios with a distribution-free 95% interval; each invocation "
                    "is stored as a new measurement beside the earlier ones, with every "
                    "verification pass's time (MoESD's cost model is fitted to them by report "
                    "and the dashboard).")
    p.add_argument("--model", default=d.model,
                   help=f"alias ({', '.join(models.ALIASES)}), hub id or local folder")
    p.add_argument("--draft", default=None, help="EAGLE head folder or hub id (default: the "
                                                  "model's own)")
    p.add_argument("--bench", default=d.bench, choices=benchmarks.BENCHMARKS)
    p.add_argument("--benchmarks", default=None,
                   help=f"benchmarks folder (default ${benchmarks.ENV_VAR} or "
                        "../shared/data/benchmarks)")
    p.add_argument("--offset", type=int, default=d.offset, help="first prompt")
    p.add_argument("--limit", type=int, default=d.limit,
                   help="prompts decoded at every b (at least the largest b: a smaller --limit "
                        "is refused)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                   help="tokens every prompt decodes, in every configuration (end-of-sequence "
                        "ignored: equal work)")
    p.add_argument("--batch-sizes", default=",".join(map(str, d.batch_sizes)),
                   help="batch sizes b, comma-separated")
    p.add_argument("--warmup", type=int, default=d.warmup, metavar="N",
                   help=f"untimed warm-up rounds before timing (each decodes the first b prompts "
                        f"for {WARMUP_TOKENS} tokens, ar and eagle; 0: none)")
    p.add_argument("--repeats", type=int, default=d.repeats, metavar="R",
                   help="timed repeats; each decodes every (mode, budget) at a b back to back, "
                        "order rotated; speedup: the median of the per-repeat ratios with a "
                        "distribution-free 95%% interval (needs at least 6)")
    p.add_argument("--budget", default="", help="expert budgets B over the batch's union, "
                                                "comma-separated (none: no budgeted decoding)")
    p.add_argument("--ranking", default=d.ranking, choices=index.ranking_names(runtime=True),
                   help="ranking that picks the budget's experts (no calibration)")
    p.add_argument("--coverage", default=d.coverage, choices=list(index.COVERAGES))
    p.add_argument("--chat-template", action="store_true",
                   help="wrap each prompt in the tokenizer's chat template")
    p.add_argument("--device", default=d.device, help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default=d.dtype, help="auto (bf16 on CUDA, fp32 on CPU), float32, "
                                                    "bfloat16, float16")
    p.add_argument("--out", type=Path, default=Path("traces"), help="traces root")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--output", type=Path, default=None, metavar="FILE.json",
                   help="also write the summary as JSON (machine-readable)")
    console.threads.add_argument(p, what="torch (CPU timings depend on it)")
    return p


MAX_COUNT = 1_000_000  # the most prompts or tokens any sane option asks for (capture's bound)
MAX_BATCH = 4096  # sequences decoded together (capture's --batch-size bound)
MAX_BATCH_SIZES = 64  # batch sizes measured in one run (each decoded 2 + budgets times)
MAX_REPEATS = 1000  # --repeats and --warmup (profile-target's bound)


def settings_from(args) -> ProfileBatchSettings:
    """Validated settings (ValueError: one line): every size within a sane cap (the model's
    own limits are checked by :func:`check_model_limits`, before it loads)."""
    if args.limit < 1 or args.max_new_tokens < 1 or args.offset < 0:
        raise ValueError("--limit and --max-new-tokens must be ≥ 1 and --offset ≥ 0")
    for flag, value in (("--limit", args.limit), ("--max-new-tokens", args.max_new_tokens),
                        ("--offset", args.offset)):
        if value > MAX_COUNT:
            raise ValueError(f"{flag} {value} is out of range: it must be at most {MAX_COUNT}")
    for flag, value, low in (("--warmup", args.warmup, 0), ("--repeats", args.repeats, 1)):
        if not low <= value <= MAX_REPEATS:
            raise ValueError(f"{flag} {value} is out of range: it must be {low} to {MAX_REPEATS}")
    batch_sizes = _numbers(args.batch_sizes, "--batch-sizes")
    budgets = _numbers(args.budget, "--budget") if args.budget.strip() else ()
    if max(batch_sizes) > MAX_BATCH or len(batch_sizes) > MAX_BATCH_SIZES:
        raise ValueError(f"--batch-sizes {args.batch_sizes!r}: give at most {MAX_BATCH_SIZES} "
                         f"batch sizes, each 1 to {MAX_BATCH}")
    if args.limit < max(batch_sizes):  # a "b = 16" of 8 prompts would be b = 8
        raise ValueError(f"--limit {args.limit} is smaller than the largest batch size "
                         f"{max(batch_sizes)}: give --limit {max(batch_sizes)} or more, or "
                         f"smaller --batch-sizes")
    if budgets and (max(budgets) > MAX_COUNT or len(budgets) > MAX_BATCH_SIZES):
        raise ValueError(f"--budget {args.budget!r}: give at most {MAX_BATCH_SIZES} budgets, "
                         f"each 1 to {MAX_COUNT}")
    return ProfileBatchSettings(
        model=args.model, bench=args.bench, draft=args.draft, limit=args.limit,
        offset=args.offset, max_new_tokens=args.max_new_tokens, batch_sizes=batch_sizes,
        budgets=budgets, ranking=args.ranking, coverage=args.coverage, device=args.device,
        dtype=args.dtype, chat_template=args.chat_template, warmup=args.warmup,
        repeats=args.repeats)


def check_model_limits(settings: ProfileBatchSettings) -> None:
    """What the model's ``config.json`` bounds, read without loading it (ValueError: one
    line): the new tokens within its context, the budgets within its N routed experts (and at
    least its top-k for substitution)."""
    from moe_spec.moe import models

    config = models.read_config(settings.model)
    positions = models.max_positions(config)
    if positions and settings.max_new_tokens >= positions:
        raise ValueError(f"--max-new-tokens {settings.max_new_tokens} is beyond "
                         f"{settings.model}'s max_position_embeddings {positions} (prompt "
                         "included); give fewer")
    shape = models.expert_shape(config)
    if settings.budgets and shape:
        n, k = shape
        low = k if settings.coverage == "substitution" else 1
        bad = [b for b in settings.budgets if not low <= b <= n]
        if bad:
            raise ValueError(f"--budget {bad[0]} is out of range for {settings.model}: use "
                             f"{low}..{n} ({n} experts, top-{k}, {settings.coverage})")


def summary_lines(decodings: list[Decoding]) -> list[str]:
    """One line per (b, budget): AR and EAGLE tokens/s (medians over repeats), τ, EAGLE's ms per
    verification pass, and the speedup (the median of paired per-repeat ratios) with its 95%
    interval (:func:`analysis.timing.speedups`; equal work checked, not assumed)."""
    import polars as pl

    from moe_spec.analysis import timing
    speed = timing.speedups(pl.DataFrame([d.row() for d in decodings]))
    head = (f"{'b':>4} {'budget':>6} {'AR tok/s':>9} {'EAGLE tok/s':>11} {'tau':>5} "
            f"{'pass ms':>8}  speedup (95% CI)")
    lines = [head]
    for r in speed.sort("batch_size", "budget", nulls_last=False).iter_rows(named=True):
        budget = "none" if r["budget"] is None else str(r["budget"])
        lines.append(f"{r['batch_size']:>4} {budget:>6} {r['ar_tokens_per_s']:>9.1f} "
                     f"{r['eagle_tokens_per_s']:>11.1f} {r['tau']:>5.2f} "
                     f"{r['pass_seconds'] * 1e3:>8.2f}  " + timing.speedup_text(r)
                     + ("" if r["equal_work"] else "  (unequal work: tokens differ)")
                     + (f"  ({r['dropped']} slow repeat(s) left out of the tok/s medians)"
                        if r["dropped"] else ""))
    return lines


def latency_lines(decodings: list[Decoding]) -> list[str]:
    """One line per decoding: passes and p50/p90/p99 of its per-pass latency in ms (draft +
    verify, first pass left out as warm-up), as serving benchmarks report them."""
    head = f"{'decoding':<22} {'passes':>6} " + " ".join(f"{'p' + str(q) + ' ms':>9}"
                                                         for q in PERCENTILES)
    lines = [head]
    repeats = any(d.repeat for d in decodings)
    for d in decodings:
        lat = d.latency
        lines.append(f"{d.label(repeats):<22} {len(d.passes):>6} " + " ".join(
            f"{lat[f'latency_p{q}'] * 1e3:>9.2f}" for q in PERCENTILES))
    return lines


@console.pipes.quiet_broken_pipe
def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        settings, prompts_found = checked(args)
    except (ValueError, UserError) as exc:
        return fail("profile-batch", exc)
    threads = console.threads.apply(args.threads)
    try:
        loaded, head, adapter = load_target(settings)
    except (ValueError, UserError) as exc:
        return fail("profile-batch", exc)
    from moe_spec.capture.target import prompt_ids
    ids = [prompt_ids(loaded.tokenizer, p.text, settings.chat_template) for p in prompts_found]
    runs = len(settings.batch_sizes) * (2 + len(settings.budgets)) * settings.repeats
    decodings: list[Decoding] = []
    save = saver(args, settings, loaded, adapter, threads, decodings, runs)
    try:
        folders = measure_all(args, settings, loaded, head, ids, decodings, runs, save)
    except KeyboardInterrupt:
        kept = f"kept the {len(decodings)} finished decodings of {runs} under {args.out}" \
            if decodings else "no decoding had finished: nothing stored"
        print(f"profile-batch: interrupted; {kept}", file=sys.stderr)
        return 130
    except OSError as exc:
        return fail("profile-batch", f"cannot write under {args.out} or --output: "
                                     f"{exc.strerror or exc}", 1)
    print_summary(args, settings, loaded, ids, decodings, folders)
    return 0


def checked(args) -> tuple[ProfileBatchSettings, list]:
    """Settings and prompts from the command line, every check that needs no model done."""
    from moe_spec.moe import models
    from moe_spec.tasks import benchmarks

    settings = settings_from(args)
    models.check_available(settings.model)
    check_model_limits(settings)
    prompts_found = benchmarks.load(settings.bench, offset=settings.offset,
                                    limit=settings.limit, root=args.benchmarks)
    console.check_output_option(args.output, ValueError)
    return settings, prompts_found


def load_target(settings: ProfileBatchSettings):
    """The target and draft head, and the checks that need the model (budgets against k)."""
    from moe_spec.eagle import loading
    from moe_spec.moe import models
    from moe_spec.moe.adapter import MoEAdapter
    from moe_spec.policy import rankings

    models.quiet_transformers()
    if settings.budgets and rankings.get(settings.ranking).needs_calibration:
        raise ValueError(f"--ranking {settings.ranking} needs calibration statistics; "
                         "profile-batch budgets use a ranking without them (router, "
                         "sqmass, previous)")
    loaded, head = loading.load_with_draft(settings.model, settings.draft,
                                           device=settings.device, dtype=settings.dtype)
    adapter = MoEAdapter(loaded.model)
    if settings.budgets and settings.coverage == "substitution" \
            and min(settings.budgets) < adapter.top_k:
        raise ValueError(f"--budget {min(settings.budgets)} is below k = {adapter.top_k}; "
                         "substitution needs B ≥ k (or use --coverage truncation)")
    return loaded, head, adapter


def saver(args, settings, loaded, adapter, threads, decodings: list[Decoding], runs: int):
    """``save(complete)``: the tables (and ``--output`` file) of the decodings so far,
    rewritten atomically, so a stopped run leaves every decoding it finished."""
    from moe_spec.analysis import timing
    from moe_spec.catalog.writer import write_batch_profile
    name = run_name(settings)
    measurement = new_measurement()

    def save(complete: bool) -> list:
        found = tables(settings, decodings, num_experts=adapter.num_experts,
                       top_k=adapter.top_k, device=str(loaded.device), threads=threads,
                       measurement=measurement, complete=complete)
        folders = write_batch_profile(args.out, loaded.name, settings.bench, name,
                                      measurement[0], found)
        if args.output is not None and (complete or str(args.output) != "-"):
            import polars as pl
            speed = timing.speedups(pl.from_arrow(found["batch_profile"]))
            console.write_json(args.output, {
                "tool": "profile-batch", "run": name, "measurement": measurement[0],
                "measured_at": measurement[1], "model": loaded.name, "threads": threads,
                "settings": settings.identity(), "complete": complete,
                "work": timing.METHOD, "interval": timing.INTERVAL,
                "speedups": speed.to_dicts() if speed.height else [],
                "decodings": f"{len(decodings)} of {runs}", "warmup_rounds": settings.warmup,
                "percentiles_of": "per-pass latency, draft + verify seconds (first pass of each "
                                  "decoding left out as warm-up)",
                "rows": found["batch_profile"].to_pylist()})
        return folders
    return save


def measure_all(args, settings, loaded, head, ids, decodings: list[Decoding], runs: int,
                save) -> list:
    """Every decoding, with a progress bar, each saved as it finishes; the folders written."""
    from tqdm import tqdm
    folders = []
    with tqdm(total=runs, desc="profile-batch", unit="decoding",
              disable=True if args.no_progress else None) as bar:
        label = [""]

        def step(text):
            label[0] = text
            bar.set_postfix_str(text)
            bar.update(0)

        def on_pass(n):
            bar.set_postfix_str(f"{label[0]}: {n} passes", refresh=False)

        for d in measure(settings, loaded, head, ids, progress=step, on_pass=on_pass,
                         done=lambda d: bar.update(1)):
            decodings.append(d)
            folders = save(complete=len(decodings) == runs)
    return folders


def print_summary(args, settings, loaded, ids, decodings: list[Decoding], folders) -> None:
    """The compact summary: throughput and per-pass latency per decoding, where it is stored."""
    from moe_spec.analysis import timing
    print(f"profile-batch {loaded.name}/{settings.bench}: {len(ids)} prompts x "
          f"{settings.max_new_tokens} new tokens at each b, every way ({timing.METHOD}; "
          f"seconds per token over the whole decoding; {settings.warmup} warm-up round(s), "
          f"{settings.repeats} repeat(s); interval: {timing.INTERVAL})")
    for line in summary_lines(decodings):
        print(line)
    print("per-pass latency (draft + verify; first pass of each decoding left out as warm-up):")
    for line in latency_lines(decodings):
        print(line)
    print(f"stored as a new measurement: {', '.join(str(f) for f in folders)}")
    print("look at it:\n  " + console.commandline(
        f"query --traces {args.out} \"SELECT measurement, batch_size, mode, budget, repeat, "
        f"seconds_per_token, latency_p50 FROM batch_profile ORDER BY ALL\""))


if __name__ == "__main__":
    sys.exit(main())
