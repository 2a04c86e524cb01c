"""Does a token-aware selector close the router→oracle gap where calibrated rankings cannot, and
does it pay for its own bytes? ``sketch`` (the oracle's search on expert outputs predicted from
the tree tokens' MoE inputs by rank-r calibration surrogates) against router, coact-prior and
the oracle, per evaluation × calibration benchmark, both policies, a budget sweep and r sweep.

    python bench/sketch_gap.py --traces /tmp/xsel40 --model tiny-qwen3-moe \\
        --benches mbpp gsm8k cnndm --ranks 4 8 16 32 --threads 1 --output sketch.json

Runs are ``bench/cross_domain.py``'s (``eval-<bench>``: prompts 0..E−1, ``cal-<bench>``: the
next C, role calibration), captured here when missing with the same settings. Open-loop replay
scores the batches itself here (every rank and calibration source on the same batches) with the
replay's own batch loader (every expert output recomputed and checked against the capture, the
same metrics) and attaches h_t for sketch; router, oracle (with its streamed start, the
matrix's reference) and coact-prior are scored on the very same batches, each built and run as
replay builds and runs it (``fit`` on the calibration, None for the two references; replay's own
:func:`replay.open_loop.shortlists`: coact-prior streamed pass by pass and refined from what
each budgeted pass executed; outputs written before this was so are marked in the tables,
:data:`PRIOR_ONLY`). It prints

    gap closed = (RSE_router − RSE_X) / (RSE_router − RSE_oracle)     (mean RSE over tree-layers)

per cell and budget, the median over the diagonal and the off-diagonal cells at each budget,
and per ranking the experts saved at matched error (router's mean RSE at B, the budget X needs
on its own sweep, linear interpolation; mean over the router budgets inside the sweep) minus the
surrogate's bytes in expert-equivalents, at the tiny model's shape and at the family's real
shape (:func:`real_shape`; the saving measured on the tiny model, the charge at real size: a
projection). The cost figures (bytes per layer, FLOPs per token) are in the output.

Off its calibration's domain the surrogate extrapolates badly (``--surrogate-error`` measures
it per cell). ``--online KAPPA`` and ``--online-step ETA`` also score sketch with its surrogate
updated during each prompt from the outputs of the experts its earlier passes executed (exact
refit, :class:`policy.surrogate.OnlineSurrogate`; one gradient step, :class:`~policy.surrogate.
GradientSurrogate`; the calibration fit as a prior and each expert's last W executed pairs as
evidence, ``--posterior W``, :class:`~policy.surrogate.PosteriorSurrogate`), pass by pass, each
charged what its update touches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from itertools import product
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr

from moe_spec.analysis.results_doc import add_table_options, write_block_or_exit
from moe_spec.bench.pipeline import capture, loaded_model
from moe_spec.catalog import Catalog, reader
from moe_spec.policy import coverage as coverages
from moe_spec.policy import rankings
from moe_spec.policy.overhead import surrogate_cost
from moe_spec.policy.rankings.sketch import Sketch, attach_moments, with_inputs
from moe_spec.policy.surrogate import (
    MOMENTS,
    GradientSurrogate,
    InputGate,
    InputMoments,
    OnlineSurrogate,
    PosteriorSurrogate,
    Surrogate,
    predicted_outputs,
)
from moe_spec.replay import open_loop
from moe_spec.replay.run import calibration_stats
from moe_spec.replay.virtual_batch import PromptSource


def real_shape(model: str) -> tuple[str, int, int, int] | None:
    """(checkpoint, N, H, I) of the real checkpoint the tiny model ``model`` stands for, from
    its family's record (``moe.families``: N, hidden size, the experts' intermediate size)."""
    from moe_spec.moe import families
    family = families.lookup(name=model)
    if family is None:
        return None
    found = family.facts(family.real_config)
    return family.hub_id.split("/")[-1], found.num_experts, found.hidden_size, found.expert_inter


def capture_runs(root: Path, model: str, args) -> None:
    common = dict(model=model, max_new_tokens=args.max_new_tokens, seed=args.seed)
    for bench in args.benches:
        capture(root, f"eval-{bench}", **common, bench=bench, limit=args.eval_prompts)
        capture(root, f"cal-{bench}", role="calibration", **common, bench=bench,
                offset=args.eval_prompts, limit=args.cal_prompts)


def loader(run, adapter):
    """``load(slices)``: the slices' tree-layers as one batch (every expert output recomputed and
    checked against the capture) with their tokens' MoE inputs h_t attached."""
    tolerance = open_loop.gold_tolerance(run.manifest)
    dtype = open_loop.captured_weight_dtype(run.manifest)

    def load(slices):
        batch = open_loop.load_batch(slices, adapter, torch.device("cpu"), tolerance, run.name,
                                     dtype)
        hidden = torch.from_numpy(open_loop.pad(slices, "hidden",
                                                slices[0].data.hidden.shape[1], np.float32))
        return with_inputs(batch, hidden)
    return load


def batches(run, adapter, max_batch: int, prompts: int | None = None):
    """``(batch, prompts, steps)``: the run's tree-layers (of its first ``prompts`` prompts) in
    batches of up to ``max_batch`` in prompt, step order, each with its tokens' MoE inputs h_t
    attached, and each tree-layer's prompt index and step (what :func:`replay.open_loop.
    shortlists` streams a stateful ranking by, as the replay engine does)."""
    source = PromptSource(run)
    pending = []
    layers = [layer.index for layer in adapter]
    read = loader(run, adapter)

    def load(slices):
        return (read(slices),
                torch.tensor([s.data.prompt_index for s in slices for _ in s.rows]),
                torch.tensor([int(s.data.step[r]) for s in slices for r in s.rows]))

    for prompt in source.keys()[:prompts]:
        for data in source.chunks(prompt):
            rows = data.select(layers)
            while rows:
                room = max_batch - sum(len(s.rows) for s in pending)
                pending.append(open_loop.Slice(data, rows[:room]))
                rows = rows[room:]
                if sum(len(s.rows) for s in pending) >= max_batch:
                    yield load(pending)
                    pending = []
    if pending:
        yield load(pending)


def passes(run, adapter, prompts: int | None = None):
    """``(prompt, batch)`` per verification pass (the tree-layers of one step of one prompt), in
    the order they ran, with h_t attached: what a ranking that learns during the prompt sees."""
    source = PromptSource(run)
    layers = [layer.index for layer in adapter]
    load = loader(run, adapter)
    for prompt in source.keys()[:prompts]:
        steps: dict[int, list] = {}
        for data in source.chunks(prompt):
            for row in data.select(layers):
                steps.setdefault(int(data.step[row]), []).append(open_loop.Slice(data, [row]))
        for step in sorted(steps):
            yield prompt, load(steps[step])


ONLINE = {"sketch-online": "refit", "sketch-nlms": "gradient", "sketch-post": "posterior"}
# name prefix -> policy.overhead kind (sketch-postW: a window of W pairs)


def online_kind(name: str) -> str | None:
    """``"refit"`` / ``"gradient"`` / ``"posterior"`` for a surrogate updated during the
    prompt, else None."""
    return ONLINE.get(name.rsplit("-r", 1)[0].rstrip("0123456789"))


def cost_of(name: str, n: int, h: int, inter: int, k: int) -> dict:
    """:func:`policy.overhead.surrogate_cost` of a sketch variant named ``sketch…-rR`` (the
    posterior's window is the number after ``sketch-post``)."""
    prefix, rank = name.rsplit("-r", 1)
    window = int(prefix[len("sketch-post"):]) if prefix.startswith("sketch-post") else 0
    return surrogate_cost(n, h, int(rank), inter, online=online_kind(name), top_k=k, window=window,
                          gated=prefix == "sketch-gated")


def posterior_maker(kappa: float, window: int):
    """``make(moments, rank)`` → a fresh :class:`policy.surrogate.PosteriorSurrogate`; the
    instances of one calibration and rank share its base fit and prior inverses (fitted and
    inverted once, not once per prompt and budget: read-only, as sketch-post shares them)."""
    shared: dict = {}

    def make(moments, rank):
        if (id(moments), rank) not in shared:
            shared[(id(moments), rank)] = (moments, Surrogate.fit(moments, rank), {})
        _, base, inverses = shared[(id(moments), rank)]
        return PosteriorSurrogate(moments, rank, kappa, window, base=base, inverses=inverses)
    return make


def online_rse(stream, make, cov, budgets: list[int]) -> np.ndarray:
    """Summed RSE per budget of sketch with its surrogate updated during each prompt (``make()``
    a fresh :class:`policy.surrogate.OnlineSurrogate` or :class:`~policy.surrogate.
    GradientSurrogate`): one surrogate per budget and prompt, each pass searched on the current
    fit, then the outputs of exactly the experts that budget's pass ran observed (as open-loop
    replay feeds coact-online)."""
    out = np.zeros(len(budgets))
    for j, b in enumerate(budgets):
        online, current = None, None
        for prompt, batch in stream:
            if prompt != current:
                online, current = make(), prompt
            sketch = Sketch.from_surrogate(online.refresh())
            keep, _ = sketch.shortlists(batch, cov, [b])
            out[j] += float(open_loop.metrics(batch, keep, cov)["rse"].double().sum())
            idx, w = cov.apply(batch, keep)  # what the budgeted pass ran: [T, 1, M, k]
            idx, w = idx[:, 0], w[:, 0] * batch.mask[..., None]
            ran = open_loop.executed_outputs(batch, torch.arange(batch.size), idx[:, None])[:, 0]
            online.observe(batch.layers, batch.hidden, idx, w, ran)
    return out


GATE_SWEEP = (8, 16, 32)  # the input gate's p compared by --surrogate-error (and the full D)


def surrogate_errors(args, evaluated, cal, sources, adapter) -> list[dict]:
    """Per evaluation × calibration cell and rank: ``Σ ||E_i(h) − Ê_i(h)||² / Σ ||E_i(h)||²``
    over the scored tokens and every expert, and over each token's own top-k (the outputs the
    search leans on most); and how far the evaluation's inputs lie from the calibration's: the
    median tree-layer novelty of :class:`policy.surrogate.InputGate` with p = each of
    :data:`GATE_SWEEP` and the full covariance (p = D, the Mahalanobis distance per dimension),
    and per token the Spearman correlation between that full distance and the surrogate's
    relative error over every expert."""
    rows = []
    print(f"\n{args.model}: relative error of the predicted expert outputs, every expert | "
          "own top-k, evaluation ← calibration; the input gate's median novelty at p = "
          f"{', '.join(map(str, GATE_SWEEP))}, D; Spearman(per-token error, full novelty)")
    for bench, runs in evaluated.items():
        loaded = [b for run in runs
                  for b, *_ in batches(run, adapter, args.max_batch, args.prompts)]
        for src in sources:
            moments = cal[(src, bench)].fitted[MOMENTS]
            d = moments.xx.shape[-1]
            novelty = {}
            for p in (*GATE_SWEEP, d):
                gate = InputGate.fit(moments, p)
                novelty["D" if p == d else str(p)] = float(torch.cat(
                    [gate.novelty(b.layers, b.hidden, b.mask) for b in loaded]).median())
            full = [gate.per_token(b.layers, b.hidden, b.mask)[b.mask.bool()].numpy()
                    for b in loaded]  # the last gate's: p = D
            for r in args.ranks:
                rows.append(relative_errors(Surrogate.fit(moments, r), loaded, full) |
                            dict(bench=bench, calibration=src, rank=r, novelty=novelty,
                                 kind=kind_of(bench, src)))
                e = rows[-1]
                print(f"  r={r:<3} {bench + ' ← ' + src:<20} {100 * e['every']:6.0f}% | "
                      f"{100 * e['own_top_k']:4.0f}%   novelty " +
                      " ".join(f"{v:.2f}" for v in novelty.values()) +
                      f"   Spearman {e['spearman']:.2f}", flush=True)
    return rows


def relative_errors(surrogate, loaded: list, novelty: list) -> dict:
    """:func:`surrogate_errors`' error sums of one surrogate over the batches ``loaded``, and
    the Spearman correlation of its per-token error with ``novelty`` (per batch, its unpadded
    tokens in order)."""
    sums = np.zeros(4)  # error, energy: every expert; error, energy: own top-k
    per_token = []
    for batch in loaded:
        true = batch.terms.experts.double()  # [T, M, N, H]
        pred = predicted_outputs(surrogate, batch.layers, batch.hidden,
                                 batch.mask)[..., :true.shape[-1]].double()
        err, energy = (true - pred).pow(2).sum(-1), true.pow(2).sum(-1)  # [T, M, N]
        own = torch.zeros_like(err).scatter_(2, batch.idx, 1.0) * batch.mask[..., None]
        every = batch.mask[..., None].double().expand_as(err)
        sums += [float((err * every).sum()), float((energy * every).sum()),
                 float((err * own).sum()), float((energy * own).sum())]
        mine = batch.mask.bool()
        per_token.append((err.sum(-1)[mine] / energy.sum(-1)[mine].clamp_min(1e-300)).numpy())
    rho = spearmanr(np.concatenate(per_token), np.concatenate(novelty)).statistic
    return dict(every=sums[0] / sums[1], own_top_k=sums[2] / sums[3], spearman=float(rho))


PRIOR_ONLY = ("† coact-prior scored from its calibration prior alone (an output of this bench "
              "written before it streamed stateful rankings pass by pass): without the "
              "refinement from executed outputs that replay gives it, these rows are not the "
              "replayed ranking's (in the matrix's mixed-calibration cells replay closes more "
              "of the gap), and that output's oracle lacked its streamed start.")
STREAMED = "streamed"  # an output's ``stateful`` field: stateful rankings scored as replay does


def cal_names(source: str, bench: str, benches: list[str]) -> list[str]:
    """Calibration runs of a source: ``cal-<source>``, or for ``others`` every benchmark's but
    the evaluated one (mixed-domain and still out of domain, as bench/cross_domain.py)."""
    if source == "others":
        return [f"cal-{b}" for b in benches if b != bench]
    return [f"cal-{source}"]


def interpolate_saved(budgets: list[int], router: list[float], other: list[float]) -> dict:
    """Per router budget B: the budget X needs for router's mean RSE at B (linear interpolation
    on X's sweep; None below its smallest or beyond its largest budget) and B minus it."""
    out = {}
    for b, target in zip(budgets, router):
        need = None
        if target < other[0]:
            for i in range(1, len(budgets)):
                if other[i] <= target:
                    need = budgets[i - 1] + (budgets[i] - budgets[i - 1]) * \
                        (other[i - 1] - target) / (other[i - 1] - other[i])
                    break
        out[b] = None if need is None else b - need
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", type=Path, default=Path("traces-xdomain"))
    p.add_argument("--model", default="tiny-qwen3-moe")
    p.add_argument("--benches", nargs="+", default=["mbpp", "gsm8k", "cnndm"])
    p.add_argument("--sources", nargs="*", default=None,
                   help="calibration benchmarks, or 'others' (every one but the evaluated; "
                        "default: every one of --benches)")
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--budgets", default=None,
                   help="comma-separated (default: k, k+2, k+4, 16, 24, 32 within N)")
    p.add_argument("--coverages", nargs="+", default=["substitution", "truncation"])
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--cal-prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", type=int, default=None,
                   help="score only the first P evaluation prompts of each run (default: all)")
    p.add_argument("--max-batch", type=int, default=32, help="tree-layers per batch")
    p.add_argument("--online", type=float, default=None, metavar="KAPPA",
                   help="also score sketch-online-rR: the surrogate refit during each prompt "
                        "from the outputs of the experts its earlier passes executed, the "
                        "calibration counting as KAPPA tokens per expert "
                        "(policy.surrogate.OnlineSurrogate; slow: one pass at a time, one "
                        "stream per budget)")
    p.add_argument("--surrogate-error", action="store_true",
                   help="only measure how well the calibration surrogates predict the "
                        "evaluation's expert outputs: relative error per cell, over every "
                        "expert and over each token's own top-k")
    p.add_argument("--online-step", type=float, default=None, metavar="ETA",
                   help="also score sketch-nlms-rR: the surrogate moved by one normalized "
                        "gradient step of size ETA after each pass, on the pairs it executed "
                        "(policy.surrogate.GradientSurrogate: no state beyond the surrogate)")
    p.add_argument("--posterior", type=int, nargs="+", default=None, metavar="W",
                   help="also score sketch-postW-rR for each window W: the calibration fit as a prior, each "
                        "expert's last W executed pairs as evidence, the posterior mean in closed "
                        "form after each pass (policy.surrogate.PosteriorSurrogate)")
    p.add_argument("--posterior-kappa", type=float, default=512.0, metavar="KAPPA",
                   help="the prior's weight in pseudo-tokens for --posterior")
    p.add_argument("--gated", action="store_true",
                   help="also score sketch-gated-rR: sketch on tree-layers whose MoE inputs lie "
                        "near the calibration's, coact-prior streamed elsewhere "
                        "(policy.rankings.sketch_gated)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", type=Path, default=None, help="every cell and cost as JSON")
    add_table_options(p, "sketch")
    args = p.parse_args()
    if args.posterior is not None:
        if min(args.posterior) < 1 or not args.posterior_kappa > 0:
            p.error("--posterior takes windows of at least 1 pair and --posterior-kappa a "
                    "weight > 0")
        args.posterior = sorted(set(args.posterior))
    if args.render:
        found = [(path, json.loads(path.read_text())) for path in args.render]
        for path, rep in found:  # another bench's output, or one before the matched savings
            if not isinstance(rep, dict) or "medians" not in rep or not all(
                    isinstance(v, dict) for v in rep.get("experts_saved", {}).values()):
                sys.exit(f"sketch_gap.py: {path} is not an --output of this version of "
                         "bench/sketch_gap.py; rerun the bench for it")
        table = markdown([rep for _, rep in found])
        print(table)
        for readme in write_block_or_exit(args.readme, table, args.block, "sketch_gap.py"):
            print(f"wrote the tables into {readme}")
        return
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    root = args.traces / args.model
    capture_runs(root, args.model, args)
    loaded, adapter = loaded_model(args.model)
    n, k = adapter.num_experts, adapter.top_k
    h, inter = int(adapter.facts.hidden_size), int(adapter.facts.expert_inter)
    budgets = sorted({int(b) for b in args.budgets.split(",")} if args.budgets else
                     {b for b in (k, k + 2, k + 4, 16, 24, 32) if b <= n})
    sources = args.sources if args.sources is not None else args.benches
    catalog = Catalog(root)
    evaluated = {b: catalog.runs(model=args.model, bench=b, names=[f"eval-{b}"])
                 for b in args.benches}
    every = [r for runs in evaluated.values() for r in runs]
    started = time.perf_counter()
    moments_of: dict[str, InputMoments] = {}  # per calibration run name
    cal = {}  # (source, evaluated bench) -> calibration statistics with the surrogate sums
    for bench in args.benches:
        for src in sources:
            names = cal_names(src, bench, args.benches)
            if tuple(names) in cal:
                cal[(src, bench)] = cal[tuple(names)]
                continue
            stats, runs = calibration_stats(catalog, names, args.model, every, adapter,
                                            progress=False, rankings_used=("coact-prior",))
            for r in runs:
                if r.name not in moments_of:
                    moments_of[r.name] = InputMoments.collect(reader.tree_layers([r]), adapter,
                                                              sources=[r.ref])
            attach_moments(stats, InputMoments.merge([moments_of[r.name] for r in runs]))
            cal[(src, bench)] = cal[tuple(names)] = stats
    print(f"calibration and surrogate sums: {time.perf_counter() - started:.0f}s", flush=True)
    if args.surrogate_error:
        found = surrogate_errors(args, evaluated, cal, sources, adapter)
        if args.output:
            args.output.write_text(json.dumps(dict(model=args.model, surrogate_error=found),
                                              indent=1))
        return
    # as replay builds a ranking (replay.modes: fit on the calibration, None without one): the
    # oracle's fit adds its stateful start, which open_loop.shortlists streams
    base = {name: rankings.get(name)().fit(None) for name in ("router", "oracle")}
    sums: dict[tuple, np.ndarray] = {}  # (bench, source, ranking, coverage) -> [sum rse per B]
    counts: dict[tuple, int] = {}
    timing: dict[str, float] = {}
    novelty: dict[tuple, list] = {}  # (bench, source) -> the gate's novelty per tree-layer
    for bench, runs in evaluated.items():
        fitted = [(None, name, r) for name, r in base.items()]
        for src in sources:
            stats = cal[(src, bench)]
            fitted.append((src, "coact-prior", rankings.get("coact-prior")().fit(stats)))
            for r in args.ranks:
                sketch = Sketch(rank=r).fit(stats)
                assert sketch.token_aware, "sketch fitted without its surrogate"
                fitted.append((src, f"sketch-r{r}", sketch))
                if args.gated:
                    gated = rankings.get("sketch-gated")(rank=r).fit(stats)
                    assert gated.token_aware, "sketch-gated fitted without surrogate or gate"
                    fitted.append((src, f"sketch-gated-r{r}", gated))
        for run in runs:
            # one instance and stream per ranking and policy: open_loop.shortlists streams a
            # stateful ranking (coact-prior) pass by pass and feeds it what each budgeted pass
            # executed, exactly as replay does (its rows equal replay's: tests/test_benches.py)
            tasks = [(src, name, cov_name, coverages.get(cov_name),
                      ranking.clone() if ranking.stateful or ranking.stateful_starts else ranking,
                      open_loop.Stream()) for src, name, ranking in fitted
                     for cov_name in args.coverages]
            gates = {src: ranking.gate for src, name, ranking in fitted
                     if name.startswith("sketch-gated")}  # one gate per calibration (any r)
            for batch, prompts, steps in batches(run, adapter, args.max_batch, args.prompts):
                for src, gate in gates.items():
                    novelty.setdefault((bench, src), []).append(
                        gate.novelty(batch.layers, batch.hidden, batch.mask).cpu())
                for src, name, cov_name, cov, ranking, stream in tasks:
                    valid = [b for b in budgets if b >= cov.min_budget(k)]
                    t0 = time.perf_counter()
                    keep, _ = open_loop.shortlists(ranking, batch, cov, valid, prompts, steps,
                                                   stream)
                    assert getattr(ranking, "token_aware", True), name  # h_t reached it
                    timing[name] = timing.get(name, 0.0) + time.perf_counter() - t0
                    rse = open_loop.metrics(batch, keep, cov)["rse"].double().sum(0).numpy()
                    key = (bench, src, name, cov_name)
                    sums[key] = sums.get(key, 0) + rse
                    counts[key] = counts.get(key, 0) + batch.size
            print(f"{bench}: {counts[(bench, None, 'router', args.coverages[0])]} tree-layers, "
                  f"{time.perf_counter() - started:.0f}s", flush=True)
            variants = []  # (name prefix, a fresh surrogate updated during the prompt)
            if args.online is not None:
                variants.append(("sketch-online", lambda m, r: OnlineSurrogate(m, r, args.online)))
            if args.online_step is not None:
                variants.append(("sketch-nlms",
                                 lambda m, r: GradientSurrogate(m, r, args.online_step)))
            for window in args.posterior or []:
                variants.append((f"sketch-post{window}",
                                 posterior_maker(args.posterior_kappa, window)))
            if not variants:
                continue
            stream = list(passes(run, adapter, args.prompts))
            for cov_name in args.coverages:
                cov = coverages.get(cov_name)
                valid = [b for b in budgets if b >= cov.min_budget(k)]
                for src in sources:
                    for (prefix, factory), r in product(variants, args.ranks):
                        t0, name = time.perf_counter(), f"{prefix}-r{r}"
                        make = partial(factory, cal[(src, bench)].fitted[MOMENTS], r)
                        rse = online_rse(stream, make, cov, valid)
                        timing[name] = timing.get(name, 0.0) + time.perf_counter() - t0
                        key = (bench, src, name, cov_name)
                        sums[key] = sums.get(key, 0) + rse
                        counts[key] = counts.get(key, 0) + sum(b.size for _, b in stream)
                        assert counts[key] == counts[(bench, None, "router", cov_name)], \
                            "the online stream must score the batches' tree-layers"
            print(f"{bench}: online, {time.perf_counter() - started:.0f}s", flush=True)
    report = summarise(args, sums, counts, budgets, sources, k, n, h, inter, timing)
    if novelty:
        report["gate"] = gate_summary(novelty)
    if args.output:
        args.output.write_text(json.dumps(report, indent=1, default=str))


def gate_summary(novelty: dict[tuple, list]) -> dict:
    """Per evaluation ← calibration pair, what sketch-gated's input gate saw: the median
    novelty of the tree-layers (their tokens' mean Mahalanobis distance per dimension under the
    calibration's inputs, 1 on the calibration itself: policy.surrogate.InputGate) and the share
    it let sketch rank (novelty ≤ the threshold); printed and kept in the output."""
    from moe_spec.policy.rankings.sketch_gated import SketchGated
    found = {}
    print(f"\ninput gate (p = {SketchGated.components}, threshold {SketchGated.threshold:g}): "
          "median novelty of the tree-layers, share ranked by sketch")
    for (bench, src), parts in novelty.items():
        values = torch.cat(parts).double()
        found[f"{bench}|{src}"] = dict(
            median_novelty=float(values.median()), tree_layers=len(values),
            gated_in=float((values <= SketchGated.threshold).double().mean()))
        print(f"  {bench + ' ← ' + src:<28} {found[f'{bench}|{src}']['median_novelty']:8.2f} "
              f"{100 * found[f'{bench}|{src}']['gated_in']:6.0f}%")
    return dict(components=SketchGated.components, threshold=SketchGated.threshold,
                pairs=found)


def summarise(args, sums, counts, budgets, sources, k, n, h, inter, timing) -> dict:
    mean = {key: (sums[key] / counts[key]).tolist() for key in sums}
    names = ["coact-prior"] + [f"sketch-r{r}" for r in args.ranks] + (
        [f"sketch-gated-r{r}" for r in args.ranks if args.gated]) + (
        [] if args.online is None else [f"sketch-online-r{r}" for r in args.ranks]) + (
        [] if args.online_step is None else [f"sketch-nlms-r{r}" for r in args.ranks]) + (
        [f"sketch-post{w}-r{r}" for w in args.posterior or [] for r in args.ranks])
    cells, medians = [], {}
    for cov_name in args.coverages:
        valid = [b for b in budgets if b >= coverages.get(cov_name).min_budget(k)]
        print(f"\n{args.model} · {cov_name}: gap closed (%), evaluation ← calibration")
        print(f"  {'ranking':<16} {'cell':<22}" + "".join(f"{'B=' + str(b):>7}" for b in valid))
        for name in names:
            for bench in args.benches:
                router = np.array(mean[(bench, None, "router", cov_name)])
                oracle = np.array(mean[(bench, None, "oracle", cov_name)])
                for src in sources:
                    mine = np.array(mean[(bench, src, name, cov_name)])
                    gap = (router - mine) / np.where(router - oracle > 0, router - oracle, np.nan)
                    for b, g, r in zip(valid, gap, mine):
                        cells.append(dict(model=args.model, ranking=name, coverage=cov_name,
                                          bench=bench, calibration=src, budget=b,
                                          gap_closed=float(g), rse=float(r),
                                          diagonal=bench == src,
                                          kind=kind_of(bench, src)))
                    mark = "*" if bench == src else " "
                    print(f"  {name:<16} {bench + ' ← ' + src + mark:<22}" +
                          "".join(f"{100 * g:7.0f}" for g in gap))
        for name in names:
            for kind in ("diagonal", "off", "others"):
                for b in valid:
                    vals = [c["gap_closed"] for c in cells if c["ranking"] == name and
                            c["coverage"] == cov_name and c["budget"] == b and
                            c["kind"] == kind and np.isfinite(c["gap_closed"])]
                    if vals:
                        medians[f"{cov_name}|{name}|{kind}|{b}"] = dict(
                            median=statistics.median(vals), worst=min(vals), cells=len(vals))
    print("\nmedian (worst) gap closed, %: diagonal | off-diagonal | others")
    for cov_name in args.coverages:
        valid = [b for b in budgets if b >= coverages.get(cov_name).min_budget(k)]
        for name in names:
            parts = []
            for b in valid:
                d = medians.get(f"{cov_name}|{name}|diagonal|{b}")
                o = medians.get(f"{cov_name}|{name}|off|{b}")
                x = medians.get(f"{cov_name}|{name}|others|{b}")
                fmt = lambda m: "—" if m is None else \
                    f"{100 * m['median']:.0f} ({100 * m['worst']:.0f})"  # noqa: E731
                parts.append(f"B={b}: {fmt(d)} | {fmt(o)} | {fmt(x)}")
            print(f"  {cov_name:<12} {name:<16} " + "; ".join(parts))
    saved = experts_saved(args, mean, budgets, sources, names, k)
    label, rn, rh, ri = real_shape(args.model) or (args.model, n, h, inter)
    costs = {name: dict(tiny=cost_of(name, n, h, inter, k), real=cost_of(name, rn, rh, ri, k))
             for name in names if name.startswith("sketch")}
    print(f"\nexperts saved at matched error vs router (mean over the cells and router budgets "
          f"where both it and the oracle reach router's error inside their sweeps), minus the "
          f"surrogate's bytes in expert-equivalents "
          f"(tiny: N={n}, H={h}, I={inter}; real: {label} N={rn}, H={rh}, I={ri}; experts bf16, "
          "surrogate float32)")
    print(f"  {'coverage':<12} {'ranking':<16} {'saved':>7} {'tiny eq':>9} {'net tiny':>9} "
          f"{'real eq':>8} {'net real':>9} {'bytes/layer (real)':>19} {'FLOPs/token (real)':>19}")
    for cov_name in args.coverages:
        for name in ["oracle"] + names:
            s = saved[(cov_name, name)]["saved"]
            c = costs.get(name)
            te = c["tiny"]["expert_equivalents"] if c else 0.0
            re_ = c["real"]["expert_equivalents"] if c else 0.0
            fmt = lambda x: "—" if x is None else f"{x:.2f}"  # noqa: E731
            print(f"  {cov_name:<12} {name:<16} {fmt(s):>7} {te:9.2f} "
                  f"{fmt(None if s is None else s - te):>9} {re_:8.2f} "
                  f"{fmt(None if s is None else s - re_):>9} "
                  f"{(c['real']['bytes_per_layer'] if c else 0):>19,} "
                  f"{(c['real']['flops_per_token'] if c else 0):>19,}")
    print("\nseconds spent in each ranking (its shortlists, and a stateful one's observing): " +
          ", ".join(f"{k_}: {v:.0f}" for k_, v in sorted(timing.items())))
    return dict(model=args.model, budgets=budgets, ranks=args.ranks, benches=args.benches,
                online_kappa=args.online, online_step=args.online_step,
                posterior_window=args.posterior, posterior_kappa=args.posterior_kappa,
                sources=sources, cells=cells, medians=medians,
                experts_saved={f"{c}|{r}": v for (c, r), v in saved.items()},
                cost=costs, real_shape=dict(name=label, n=rn, h=rh, i=ri),
                tiny_shape=dict(n=n, h=h, i=inter), seconds=timing,
                tree_layers={f"{b}": counts[(b, None, "router", args.coverages[0])]
                             for b in args.benches},
                prompts=args.prompts or args.eval_prompts, cal_prompts=args.cal_prompts,
                stateful=STREAMED)


KINDS = (("diagonal", "in domain"), ("off", "one other benchmark"),
         ("others", "the other benchmarks together"))


def calibrated_on(rep: dict) -> str:
    """A report's calibration column: "each benchmark" for the full single-benchmark matrix."""
    full = rep["sources"] == rep["benches"] and len(rep["benches"]) > 1
    return "each benchmark" if full else ", ".join(rep["sources"])


def markdown(reports: list[dict]) -> str:
    """Two tables from one or more ``--output`` files: the median (worst) gap closed per model,
    policy, ranking and budget for each kind of calibration cell, and the experts saved at
    matched error net of the surrogate's bytes at the family's real shape, as a share of the
    oracle's saving."""
    fmt = lambda m: "—" if m is None else f"{100 * m['median']:.0f} ({100 * m['worst']:.0f})"  # noqa: E731
    lines = ["| model | calibrated on | policy | ranking | B | " + " | ".join(k[1] for k in KINDS)
             + " |", "|---|---|---|---|---|" + "---|" * len(KINDS)]
    shown = lambda rep, name: name + ("†" if name == "coact-prior" and  # noqa: E731
                                       rep.get("stateful") != STREAMED else "")
    for rep in reports:
        src = calibrated_on(rep)
        keys = [tuple(k.split("|")) for k in rep["medians"]]
        order = list(dict.fromkeys((c, r) for c, r, _, _ in keys))
        for cov, name in order:
            for b in rep["budgets"]:
                cells = [rep["medians"].get(f"{cov}|{name}|{kind}|{b}") for kind, _ in KINDS]
                row = (f"| {rep['model']} | {src} | {cov} | {shown(rep, name)} | {b} | "
                       + " | ".join(fmt(c) for c in cells) + " |")
                if any(cells) and row not in lines:  # a row two files share word for word
                    lines.append(row)  # (a ranking scored again beside new ones): once
    net = ["| model | calibrated on | budgets | policy | ranking | experts saved | its bytes at the "
           "real shape (experts) | net | oracle's saving | net / oracle's |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for rep in reports:
        real = rep["real_shape"]["name"]
        src = calibrated_on(rep)
        for key, found in rep["experts_saved"].items():
            cov, name = key.split("|")
            saved, oracle = found["saved"], found["oracle"]
            if name == "oracle" or saved is None:
                continue
            charge = rep["cost"].get(name, {}).get("real", {}).get("expert_equivalents", 0.0)
            share = "—" if not oracle else f"{100 * (saved - charge) / oracle:.0f}%"
            net.append(f"| {rep['model']} ({real}) | {src} | "
                       f"{', '.join(map(str, rep['budgets']))} | {cov} | {shown(rep, name)} | "
                       f"{saved:.2f} | "
                       f"{charge:.2f} | {saved - charge:.2f} | "
                       f"{'—' if oracle is None else f'{oracle:.2f}'} | {share} |")
    scored = "; ".join(dict.fromkeys(  # each distinct scoring once
        f"{rep['model']} ({', '.join(rep['benches'])}): {sum(rep['tree_layers'].values())} "
        "tree-layers" + (f" of {rep['prompts']} evaluation prompts a benchmark"
                         if "prompts" in rep else " (prompts a benchmark not recorded)")
        for rep in reports))
    gate = ["| model | evaluated on | calibrated on | median novelty | tree-layers ranked by "
            "sketch |", "|---|---|---|---|---|"]
    for rep in reports:
        for pair, found in rep.get("gate", {}).get("pairs", {}).items():
            bench, src = pair.split("|")
            gate.append(f"| {rep['model']} | {bench} | {src} | {found['median_novelty']:.2f} | "
                        f"{100 * found['gated_in']:.0f}% of {found['tree_layers']} |")
    gated = "" if len(gate) == 2 else (
        "\n\nsketch-gated's input gate (outputs that recorded it): the tree-layers' median "
        "novelty under the calibration's inputs (1 on the calibration itself) and the share "
        "whose novelty is at most the threshold, which sketch ranks (coact-prior the rest):\n\n"
        + "\n".join(gate))
    marked = any(rep.get("stateful") != STREAMED for rep in reports)  # an output from before
    return ("Gap closed, % (median over cells, worst in brackets); gap closed = (RSE_router − "
            f"RSE_X) / (RSE_router − RSE_oracle). Scored: {scored}."
            + (f" {PRIOR_ONLY}" if marked else "") + "\n\n"
            + "\n".join(lines) +
            "\n\nExperts saved at matched error vs router, X's and the oracle's each averaged over "
            "the same cells and router budgets (those where both reach router's error inside "
            "their sweeps); the saving is the tiny model's, the charge (float32 surrogate, bf16 "
            "experts) the real shape's: a projection:\n\n" + "\n".join(net) + gated)


def kind_of(bench: str, source: str) -> str:
    return "others" if source == "others" else "diagonal" if bench == source else "off"


def experts_saved(args, mean, budgets, sources, names, k) -> dict:
    """(coverage, ranking) -> ``dict(saved, oracle, pairs)``: the experts X saves at matched error
    and the oracle's saving, each averaged over the same (evaluation, calibration, router budget)
    triples, those where both reach router's error inside their sweeps (``pairs`` of them; saved
    and oracle None when there is none), so that X's share of the oracle's saving compares like
    with like. The oracle's own row: its saving over the budgets where it is inside."""
    out = {}
    for cov_name in args.coverages:
        valid = [b for b in budgets if b >= coverages.get(cov_name).min_budget(k)]
        for name in ["oracle"] + names:
            pairs = []
            for bench in args.benches:
                router = mean[(bench, None, "router", cov_name)]
                best = interpolate_saved(valid, router, mean[(bench, None, "oracle", cov_name)])
                for src in ([None] if name == "oracle" else sources):
                    mine = interpolate_saved(valid, router, mean[(bench, src, name, cov_name)])
                    pairs += [(mine[b], best[b]) for b in valid
                              if mine[b] is not None and best[b] is not None]
            out[(cov_name, name)] = dict(
                saved=float(np.mean([p[0] for p in pairs])) if pairs else None,
                oracle=float(np.mean([p[1] for p in pairs])) if pairs else None, pairs=len(pairs))
    return out


if __name__ == "__main__":
    main()
