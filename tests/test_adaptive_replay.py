"""Adaptive budgets in the product (issue 63): the ``budget_mode`` key column, the price λ
calibrated in the one calibration step, open- and closed-loop replay and capture's online budget
through :class:`policy.budget.Budget`."""

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import polars as pl
import pyarrow.parquet as pq
import pytest
import torch
from helpers import QUERY, call, copy_of, exit_code, one_line

from moe_spec.analysis import sql
from moe_spec.catalog import Catalog
from moe_spec.catalog.results import UnitResults
from moe_spec.policy import adaptive, coverage, index
from moe_spec.policy.batch import ExpertTerms, RoutingBatch
from moe_spec.policy.budget import AdaptiveBudget
from moe_spec.policy.prices import (
    PriceRequest,
    Prices,
    calibrate_prices,
    excluded_mass,
    relative_errors,
    runtime_curves,
)
from moe_spec.policy.rankings import get as ranking_class
from moe_spec.policy.routing import RoutingRule
from moe_spec.replay import plan

Router = ranking_class("router")


# --- 1. the key column ---------------------------------------------------------------------------
def test_budget_mode_names_round_trip_and_unknown_ones_are_refused():
    assert index.budget_mode() == "fixed" and index.budget_mode_parts(None) == (None, False, None)
    assert index.budget_mode("mass") == "adaptive:mass"
    assert index.budget_mode_parts("adaptive:mass+cap") == ("mass", True, None)
    for cap in (False, True):
        for paced in (None, "prompt", "run"):
            name = index.budget_mode("surrogate", cap, paced)
            assert index.budget_mode_parts(name) == ("surrogate", cap, paced)
    assert index.budget_mode("mass", True, "prompt") == "adaptive:mass+cap+pace"
    assert index.budget_mode("mass", False, "run") == "adaptive:mass+pace-run"
    with pytest.raises(ValueError, match="unknown budget mode"):
        index.budget_mode_parts("adaptive:nothing")


def test_fixed_keys_stay_as_they_were_and_adaptive_ones_are_other_units():
    fixed = plan.unit_key("open", "router", "truncation", [])
    assert "budget_mode" not in fixed  # results stored before the column existed are reused
    cal = [type("R", (), dict(name="cal", run_id="x"))()]
    adaptive = plan.unit_key("open", "router", "truncation", cal, budget_mode="adaptive:mass")
    assert adaptive["budget_mode"] == "adaptive:mass" and adaptive["calibration"] == [["cal", "x"]]
    capped = plan.unit_key("open", "router", "truncation", cal, budget_mode="adaptive:mass+cap",
                           pass_cap=1.25)
    assert capped["pass_cap"] == 1.25
    paced = plan.unit_key("open", "router", "truncation", cal, budget_mode="adaptive:mass+pace",
                          pace=0.5)
    assert paced["pace"] == 0.5 and "pace" not in adaptive and "pace" in plan.SIDE_BY_SIDE
    assert "budget_mode" in plan.UNIT_IDENTITY  # an adaptive unit never supersedes a fixed one


def _block(config, mode=None, budgets=(4, 8)):
    unit = dict(mode="open", ranking="router", coverage="truncation")
    if mode:
        unit["budget_mode"] = mode
    return dict(table="replay_open", model="m", bench="b", run="r", config=config, block=config,
                unit=unit, layers=[0, 1], budgets=list(budgets), committed_at="2026")


def test_fixed_and_adaptive_are_separate_curves_in_the_default_views():
    blocks = [_block("f"), _block("a", "adaptive:mass", budgets=(4,))]
    cells = sql.default_cells(blocks, {})
    assert {c["config"] for c in cells} == {"f", "a"}  # both drawn, never one the other's points
    assert sql.curve_of(blocks[0])[-1] == "fixed" and sql.curve_of(blocks[1])[-1] == "adaptive:mass"


def _drop_budget_mode(traces):
    """Rewrite every stored result file without the ``budget_mode`` column and commit the blocks
    again: results as stored before the column existed."""
    catalog = Catalog(traces)
    for run in catalog.runs():
        for key, unit in plan.stored_variants(traces, "replay_open", run):
            assert "budget_mode" not in key
            for block in unit.complete_blocks():
                for part in unit.block_dir(block).glob("part-*.parquet"):
                    table = pq.read_table(part)
                    assert table.column("budget_mode").to_pylist()[0] == "fixed"
                    pq.write_table(table.drop(["budget_mode"]), part)
                unit.finish(block)
            assert isinstance(unit, UnitResults)


def test_results_stored_before_the_column_read_as_fixed(replayed, tmp_path, no_model):
    traces = copy_of(replayed[0], tmp_path)
    _drop_budget_mode(traces)
    q = call("moe_spec.analysis.query_cli", "SELECT DISTINCT budget_mode FROM replay_open",
             "--traces", traces, "--format", "json")
    assert q.returncode == 0, q.stderr
    assert [r["budget_mode"] for r in json.loads(q.stdout)] == ["fixed"]
    # and a fixed replay of the same cells reuses them (the key did not change): no model loaded
    r = call("moe_spec.replay.cli", "--traces", traces, "--run", "r", "--ranking", "router",
             "--budget", "16", "--no-progress")
    assert r.returncode == 0 and "reused stored results" in r.stderr, r.stderr
    assert call("moe_spec.analysis.query_cli", QUERY, "--traces", traces,
                "--format", "csv").stdout == replayed[1]


# --- 2-5. the price rule in the product, on synthetic tree-layers ------------------------------
N, K, H, LAYERS = 8, 2, 6, [0, 1, 2, 3]


class Model:
    """A synthetic MoE model: expert i of layer l is a fixed linear map ``W_li h``."""

    num_experts, top_k, moe_layers = N, K, LAYERS

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.w = torch.randn(len(LAYERS), N, H, H, generator=g) / H ** 0.5
        self.w *= torch.logspace(0, -1.5, N)[None, :, None, None]  # some experts matter more

    def batch_rule(self, layers):
        return RoutingRule(K)

    def expert_outputs(self, layer, hidden):
        return torch.einsum("nij,mj->mni", self.w[LAYERS.index(layer)], hidden.float())


def tree_layers(passes, seed=1, tokens=5, sharpness=6.0):
    """``passes`` verification passes of one prompt, every MoE layer each, in pass order:
    router scores of very different concentration per tree-layer (some need many experts; the
    lower ``sharpness``, the flatter the scores and the more experts they ask for)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(passes):
        for layer in LAYERS:
            sharp = float(torch.rand(1, generator=g)) * sharpness
            probs = torch.softmax(torch.randn(tokens, N, generator=g) * sharp, -1)
            idx, w = RoutingRule(K).route(probs)
            out.append(SimpleNamespace(prompt_index=0, prompt_id="p", step=step, layer=layer,
                                       probs=probs.numpy(), idx=idx.numpy(), weights=w.numpy(),
                                       hidden=torch.randn(tokens, H, generator=g).numpy()))
    return out


RUN = SimpleNamespace(name="cal", run_id="x")


def prices(predictor="mass", means=(2, 3, 4, N), cap=None, cover="truncation", passes=40):
    request = PriceRequest(predictor, tuple(means), (cover,), cap)
    return calibrate_prices(None, [RUN], lambda run: tree_layers(passes), Model(), "router",
                            cover, request)


def batch_of(tls, model=Model()):
    t = lambda a, d: torch.as_tensor(a, dtype=d)  # noqa: E731
    probs = torch.stack([t(x.probs, torch.float32) for x in tls])
    idx = torch.stack([t(x.idx, torch.long) for x in tls])
    w = torch.stack([t(x.weights, torch.float32) for x in tls])
    layers = torch.tensor([x.layer for x in tls])
    batch = RoutingBatch(probs, idx, w, torch.ones(probs.shape[:2], dtype=torch.bool), layers,
                         RoutingRule(K))
    experts = torch.stack([model.expert_outputs(x.layer, t(x.hidden, torch.float32)) for x in tls])
    batch.terms = ExpertTerms.from_outputs(experts, idx, w)
    return batch


def test_the_gain_predictors_the_clis_offer_are_the_ones_policy_adaptive_has():
    assert set(index.GAIN_PREDICTORS) == set(adaptive.PREDICTORS)


@pytest.mark.parametrize("predictor", ["mass", "calibrated"])
def test_the_mean_on_the_calibration_run_itself_is_within_2_percent_of_the_mean_asked(predictor):
    p = prices(predictor)
    assert p.b_min == 1 and p.b_max == N and p.layers == LAYERS
    for mean in (2, 3, 4):
        assert abs(p.achieved[mean] - mean) <= 0.02 * mean, (mean, p.achieved)
    # the run-time path (batched over tree-layers) gives that same mean on those tree-layers
    batch = batch_of(tree_layers(40))
    keep = Router().fit(None).shortlists(batch, coverage.get("truncation"), p.budgets)[0]
    chosen = p.choose(excluded_mass(batch, keep), batch.layers, [2, 3, 4])
    assert chosen.double().mean(0).tolist() == pytest.approx([p.achieved[m] for m in (2, 3, 4)])
    assert len(set(chosen[:, 0].tolist())) > 1  # the budgets do adapt


def test_a_mean_of_n_loads_every_expert_at_every_layer_and_leaves_no_error():
    p = prices(means=(N,))
    assert p.prices[N] == float("-inf")
    batch = batch_of(tree_layers(3))
    keep = Router().fit(None).shortlists(batch, coverage.get("truncation"), p.budgets)[0]
    chosen = p.choose(excluded_mass(batch, keep), batch.layers, [N])
    assert (chosen == N).all()
    picked = p.pick(keep, chosen)
    assert picked.all()
    assert float(relative_errors(batch, picked, coverage.get("truncation")).max()) < 1e-12


class Constant(adaptive.Predictor):
    """The same predicted gain curve for every tree-layer, whatever its routing."""

    name, summary = "constant", "test"

    def gains(self, mass, layers):
        curve = torch.linspace(1, 0.1, mass.shape[-1] - 1, dtype=torch.float64)
        return curve.expand(*mass.shape[:-1], -1)


def test_a_constant_predicted_gain_curve_is_fixed_budgets_at_the_mean():
    batch = batch_of(tree_layers(5))
    cover = coverage.get("substitution")
    ranking = Router().fit(None)
    budgets = list(range(K, N + 1))
    keep = ranking.shortlists(batch, cover, budgets)[0]
    gains = Constant().gains(excluded_mass(batch, keep)[None], batch.layers)
    p = Prices(Constant(), K, N, {m: adaptive.calibrate_price(gains, m, K) for m in (2, 3, 5)},
               LAYERS)
    chosen = p.choose(excluded_mass(batch, keep), batch.layers, [2, 3, 5])
    assert chosen.tolist() == [[2, 3, 5]] * batch.size
    fixed = ranking.shortlists(batch, cover, [2, 3, 5])[0]
    assert torch.equal(p.pick(keep, chosen), fixed)


def paced_by_hand(gains, price, b_min, mean, pace):
    """The paced rule on one stream's gains ``[T, S]`` (in order), a tree-layer at a time."""
    out, owed = [], 0.0
    for row in gains.tolist():
        lam = price * math.exp(pace * owed / mean) if price > 0 else price
        b = b_min
        for g in row:
            if not g > lam:
                break
            b += 1
        out.append(b)
        owed += b - mean
    return out


def mass_of(tls):
    batch = batch_of(tls)
    keep = Router().fit(None).shortlists(batch, coverage.get("truncation"), list(range(1, N + 1)))[0]
    return batch, excluded_mass(batch, keep)


def test_pacing_is_the_rule_by_hand_per_stream_across_batches_and_zero_pace_is_unpaced():
    base = prices(means=(2, 3))
    paced = replace(base, pace=0.7)
    a, b = tree_layers(3, seed=5), tree_layers(3, seed=6, sharpness=2.0)
    batch, mass = mass_of(a + b)
    streams = torch.tensor([0] * len(a) + [1] * len(b))
    passes = torch.tensor([tl.step for tl in a] + [10 + tl.step for tl in b])
    # two calls, each holding the next tree-layers of each stream (as batches arrive in prompt,
    # step order), in a shuffled order within the call
    early = torch.tensor([i < 5 for i in range(len(a))] + [i < 7 for i in range(len(b))])
    deficit, chosen = {}, torch.empty(len(streams), 2, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    for rows in (early.nonzero()[:, 0], (~early).nonzero()[:, 0]):
        part = rows[torch.randperm(len(rows), generator=g)]
        chosen[part] = paced.choose(mass[part], batch.layers[part], [2, 3], passes[part], {},
                                    streams[part], deficit)
    gains = paced.predictor.gains(mass[None], batch.layers)[0]
    for j, mean in enumerate((2, 3)):
        for s in (0, 1):
            rows = (streams == s).nonzero()[:, 0]  # already in (pass, layer) order
            assert chosen[rows, j].tolist() == paced_by_hand(gains[rows], base.prices[mean], 1,
                                                             mean, 0.7)
    assert set(deficit) == {0, 1}
    zero = replace(base, pace=0.0).choose(mass, batch.layers, [2, 3], passes, {}, streams, {})
    assert torch.equal(zero, base.choose(mass, batch.layers, [2, 3]))


def test_pacing_holds_the_mean_where_prompts_ask_for_other_budgets_than_the_calibration():
    """λ is calibrated on sharper routing; on flatter routing the same price loads another
    number of experts. Unpaced, the held-out mean misses B̄ by over 5%; paced, it is within 2%."""
    base = prices(means=(3,))
    _, mass = mass_of(tree_layers(50, seed=9, sharpness=1.5))
    layers = torch.tensor(LAYERS * 50)
    unpaced = base.choose(mass, layers, [3]).double().mean()
    paced = replace(base, pace=0.5).choose(mass, layers, [3], torch.arange(200) // 4).double()
    assert abs(unpaced - 3) > 0.05 * 3, unpaced  # the drift is real
    assert abs(paced.mean() - 3) <= 0.02 * 3, paced.mean()
    assert paced.std() > 0  # it still adapts


def test_pacing_over_the_run_meets_the_mean_where_each_short_prompt_cannot():
    """Prompts of one pass each (4 tree-layers) on routing unlike the calibration's, η = 0.1
    (unpaced the mean is 16% under B̄): paced per
    prompt, each restarts with no deficit and the mean keeps most of the unpaced miss
    (ln(λ*/λ)/(η·T) with T = 4); paced over the run, the deficit goes on from prompt to prompt,
    T is the run's 200 tree-layers and the mean is within 2%. The run's budgets are the rule by
    hand on the whole run in order."""
    base = prices(means=(3,))
    batch, mass = mass_of(tree_layers(50, seed=9, sharpness=1.5))
    layers = torch.tensor(LAYERS * 50)
    prompts = passes = torch.arange(200) // len(LAYERS)
    per_prompt = replace(base, pace=0.1)
    over_run = replace(base, pace=0.1, pace_over="run")
    assert torch.equal(per_prompt.paced_streams(prompts), prompts)
    assert over_run.paced_streams(prompts).unique().tolist() == [0]
    each = per_prompt.choose(mass, layers, [3], passes, {}, per_prompt.paced_streams(prompts),
                             {}).double()
    run = over_run.choose(mass, layers, [3], passes, {}, over_run.paced_streams(prompts),
                          {}).double()
    assert abs(each.mean() - 3) > 0.05 * 3, each.mean()
    assert abs(run.mean() - 3) <= 0.02 * 3, run.mean()
    gains = base.predictor.gains(mass[None], batch.layers)[0]
    assert run[:, 0].long().tolist() == paced_by_hand(gains, base.prices[3], 1, 3, 0.1)


def test_an_adaptive_budget_carries_its_pace_across_passes_until_reset():
    """Per prompt, a reset starts the next prompt with no deficit; paced over the run, the next
    prompt goes on from the deficit the last one left: the rule by hand on both in a row."""
    base = prices(means=(3,))
    t = lambda a, d: torch.as_tensor(a, dtype=d)  # noqa: E731

    def run(budget, tls):
        out = []
        for tl in tls:
            budget.route(tl.layer, t(tl.probs, torch.float32), t(tl.idx, torch.long),
                         t(tl.weights, torch.float32), RoutingRule(K))
            out.append(budget.chosen[tl.layer])
        return out

    def by_hand(tls):
        batch, mass = mass_of(tls)
        return paced_by_hand(base.predictor.gains(mass[None], batch.layers)[0], base.prices[3],
                             1, 3, 0.5)

    tls = tree_layers(4, seed=4, sharpness=1.5)
    budget = AdaptiveBudget(3, Router().fit(None), coverage.get("truncation"),
                            prices=replace(base, pace=0.5))
    first = run(budget, tls)
    assert first == by_hand(tls)
    assert sum(first) != 3 * len(first)  # it leaves a deficit
    budget.reset()
    assert run(budget, tls) == first  # a new prompt starts with no deficit
    over_run = AdaptiveBudget(3, Router().fit(None), coverage.get("truncation"),
                              prices=replace(base, pace=0.5, pace_over="run"))
    assert run(over_run, tls) == first
    over_run.reset()
    second = run(over_run, tls)  # the next prompt goes on from the deficit
    assert second == by_hand(tls + tls)[len(first):] and second != first


def capped(mean=2, cap=1.0):
    """Prices where every layer wants all N (λ = −∞) under a cap of ``cap``·B̄·L."""
    return Prices(adaptive.MassGain(), 1, N, {mean: float("-inf")}, LAYERS, cap)


def test_a_pass_cap_goes_layer_by_layer_and_leaves_later_layers_b_min():
    tls = tree_layers(2)
    budget = AdaptiveBudget(2, Router().fit(None), coverage.get("truncation"), prices=capped())
    seen = []
    for tl in tls:  # two passes, layers in order: the cap is 8 = 1·2·4 a pass
        t = lambda a, d: torch.as_tensor(a, dtype=d)  # noqa: E731
        routed = budget.route(tl.layer, t(tl.probs, torch.float32), t(tl.idx, torch.long),
                              t(tl.weights, torch.float32), RoutingRule(K))
        seen.append(int(routed.keep.sum()))
    assert seen == [5, 1, 1, 1] * 2  # 8 − 3·B_min first, then B_min: reset for the next pass
    # open loop, the passes split across two batches, gives the same
    batch = batch_of(tls)
    keep = Router().fit(None).shortlists(batch, coverage.get("truncation"), list(range(1, N + 1)))[0]
    mass, used, p = excluded_mass(batch, keep), {}, capped()
    passes = torch.tensor([tl.step for tl in tls])
    first = p.choose(mass[:3], batch.layers[:3], [2], passes[:3], used)
    rest = p.choose(mass[3:], batch.layers[3:], [2], passes[3:], used)
    assert torch.cat([first, rest])[:, 0].tolist() == [5, 1, 1, 1] * 2
    none = torch.zeros(0, dtype=torch.long)  # an empty call, capped, paced or not
    for rule in (p, replace(p, pace=0.5)):
        assert rule.choose(mass[:0], none, [2], none, used, none, {}).shape == (0, 1)


# --- the CLI end to end (in process) on the session's one-prompt capture ------------------------
@pytest.fixture(scope="module")
def with_cal(one_prompt, tmp_path_factory):
    """A copy of the session's one-prompt capture (``eval``) with a calibration run ``cal`` of
    two other prompts."""
    from moe_spec.capture import cli as capture_cli
    traces = copy_of(one_prompt, tmp_path_factory.mktemp("adaptive"))
    assert capture_cli.main(["--limit", "2", "--offset", "50", "--max-new-tokens", "8", "--out",
                             str(traces), "--run", "cal", "--role", "calibration",
                             "--no-progress", "--threads", "1"]) == 0
    return traces


def replay(traces, *args):
    from moe_spec.replay import cli as replay_cli
    return exit_code(replay_cli.main, ["--traces", str(traces), "--run", "eval", "--no-progress",
                                       "--threads", "1", *map(str, args)])


@pytest.mark.parametrize("args, words", [
    (["--budget-mode", "adaptive"], ["--calibration"]),
    (["--pass-cap", "1.5"], ["--pass-cap", "--budget-mode adaptive"]),
    (["--gain-predictor", "mass"], ["--gain-predictor", "--budget-mode adaptive"]),
    (["--pace", "0.5"], ["--pace", "--budget-mode adaptive"]),
    (["--budget-mode", "adaptive", "--calibration", "cal", "--pace", "0"], ["--pace", "positive"]),
    (["--budget-mode", "adaptive", "--calibration", "cal", "--pace", "nan"], ["--pace", "positive"]),
    (["--budget-mode", "adaptive", "--calibration", "cal", "--pass-cap", "1"], ["above 1"]),
    (["--budget-mode", "adaptive", "--calibration", "cal", "--ranking", "exact"], ["exact"]),
    # a ranking that learns from executed experts has no adaptive state where nothing executes
    (["--budget-mode", "adaptive", "--calibration", "cal", "--ranking", "coact-prior"],
     ["coact-prior", "--mode closed"]),
])
def test_replay_refuses_what_adaptive_budgets_cannot_do_before_loading(with_cal, tmp_path, args,
                                                                       words, capsys, no_model):
    code = replay(with_cal, "--budget", "4", "--out", tmp_path, *args)
    one_line(capsys, code, *words)


def _rows(root, table):
    found = sorted((root / table).rglob("part-*.parquet"))
    assert found, f"no {table} rows under {root}"
    return pl.concat([pl.read_parquet(f) for f in found]).sort(pl.all())


def test_open_loop_adaptive_rows_are_keyed_realized_and_deterministic(with_cal, tmp_path,
                                                                      capsys):
    args = ["--ranking", "router", "--coverage", "truncation", "--budget", "2,4",
            "--budget-mode", "adaptive", "--calibration", "cal"]
    assert replay(with_cal, *args, "--out", tmp_path / "a", "--output", tmp_path / "a.json") == 0
    said = capsys.readouterr()
    assert "B̄ 2: λ" in said.err and "router, truncation, B̄ 4: mean experts loaded" in said.out
    # query reads results beside their runs only: no query command is offered for --out elsewhere
    assert "replay without --out" in said.out and "SELECT * FROM" not in said.out
    assert replay(with_cal, *args, "--out", tmp_path / "b") == 0
    a, b = _rows(tmp_path / "a", "replay_open"), _rows(tmp_path / "b", "replay_open")
    assert a.equals(b)  # the same rows from two runs
    assert set(a["budget_mode"]) == {"adaptive:mass"} and set(a["budget"]) == {2, 4}
    assert a["price"].null_count() == 0 and a["price"].n_unique() == 2  # one λ per B̄
    loaded = a.group_by("budget").agg(pl.col("experts_loaded").mean(),
                                      pl.col("experts_loaded").n_unique().alias("kinds"))
    assert loaded["kinds"].max() > 1  # tree-layers got different budgets
    assert json.loads((tmp_path / "a.json").read_text())["budget_mode"] == "adaptive:mass"


def test_closed_loop_adaptive_keeps_each_pass_under_its_cap(with_cal, tmp_path):
    closed = ["--mode", "closed", "--ranking", "router", "--coverage", "truncation", "--budget",
              "3", "--out", tmp_path]
    assert replay(with_cal, *closed) == 0  # fixed first: the adaptive unit keeps it
    assert replay(with_cal, *closed, "--budget-mode", "adaptive", "--pass-cap", "1.25",
                  "--calibration", "cal") == 0
    both = _rows(tmp_path, "replay_closed")
    assert set(both["budget_mode"]) == {"fixed", "adaptive:mass+cap"}
    assert both.filter(pl.col("budget_mode") == "fixed")["price"].null_count() == len(both) // 2
    rows = both.filter(pl.col("budget_mode") != "fixed")
    layers = len(rows["experts_loaded"][0])
    assert rows["experts_loaded"].list.sum().max() <= round(1.25 * 3 * layers)


def test_capture_online_adaptive_budget_goes_through_the_same_budget(with_cal, tmp_path, capsys):
    from moe_spec.capture import cli as capture_cli
    traces = copy_of(with_cal, tmp_path)
    base = ["--limit", "1", "--offset", "60", "--max-new-tokens", "6", "--out", str(traces),
            "--no-progress", "--threads", "1", "--budget", "3", "--ranking", "router",
            "--coverage", "truncation", "--run", "online"]
    one_line(capsys, exit_code(capture_cli.main, [*base, "--budget-mode", "adaptive"]),
             "--calibration")
    one_line(capsys, exit_code(capture_cli.main, [*base, "--pass-cap", "2"]),
             "--budget-mode adaptive")
    assert capture_cli.main([*base, "--budget-mode", "adaptive", "--pass-cap", "1.25",
                             "--calibration", "cal"]) == 0
    run = Catalog(traces).runs(names=["online"])[0]
    assert run.settings["budget_mode"] == "adaptive" and run.settings["pass_cap"] == 1.25
    loaded = pl.concat([pl.read_parquet(f) for f in run.files("trees")])["experts_loaded"]
    assert loaded.list.sum().max() <= round(1.25 * 3 * len(loaded[0]))
    assert loaded.explode().n_unique() > 1  # layers got different budgets


def test_prices_follow_the_layers_a_pass_goes_through_and_refuse_what_they_cannot_predict():
    from moe_spec.policy.calibration import CalibrationError
    p = prices("calibrated", means=(2,), cap=1.0)
    assert p.for_layers(LAYERS[:2]).layers == LAYERS[:2] and p.for_layers(LAYERS[:2]).cap(2) == 4
    with pytest.raises(CalibrationError, match="--store-layers all"):  # one line, no traceback
        p.for_layers([*LAYERS, 9])
    assert capped().for_layers([*LAYERS, 9]).cap(2) == 10  # mass predicts anywhere


class ReadsOther(adaptive.Predictor):
    name, summary, reads = "other", "test", ("token_error",)  # (predicted_rse has its line)

    def gains(self, inputs, layers):
        raise AssertionError("never asked")


def test_a_predictor_reading_a_curve_the_product_cannot_compute_is_refused_in_one_line():
    from moe_spec.policy.calibration import CalibrationError
    batch = batch_of(tree_layers(1))
    keep = Router().fit(None).shortlists(batch, coverage.get("truncation"), [1, 2])[0]
    with pytest.raises(CalibrationError, match="reads token_error"):
        runtime_curves(ReadsOther(), batch, keep, coverage.get("truncation"), None)
    assert torch.equal(runtime_curves(adaptive.MassGain(), batch, keep, None, None),
                       excluded_mass(batch, keep).double())


def test_batches_take_the_same_rule_over_the_pass_union(with_cal, tmp_path):
    assert replay(with_cal, "--ranking", "router", "--coverage", "truncation", "--budget", "4",
                  "--budget-mode", "adaptive", "--calibration", "cal", "--batch-size", "2",
                  "--out", tmp_path) == 0
    rows = _rows(tmp_path, "replay_batch")
    assert set(rows["budget_mode"]) == {"adaptive:mass"} and set(rows["batch_size"]) == {2}
    assert rows["experts_loaded"].n_unique() > 1 and rows["price"].null_count() == 0


def test_which_rankings_adapt_where_passes_execute_and_where_they_do_not():
    learns = {n for n, e in index.RANKINGS.items()
              if {"executed_outputs", "executed_output_vectors"} & e.needs()}
    assert {"coact-prior", "sketch-gated"} <= learns
    for name, entry in index.RANKINGS.items():
        searches = entry.subset_limit is not None
        assert index.adapts(name, executes=True) == (not searches)
        assert index.adapts(name) == (not searches and name not in learns)


def test_closed_loop_adaptive_with_a_learning_ranking_keeps_one_state_fed_its_own_passes(
        with_cal, tmp_path, monkeypatch):
    """coact-prior learns from what earlier passes executed: under an adaptive budget its state
    observes, after each pass, exactly the experts that pass's layers loaded at their own B_l,
    and restarts with each prompt."""
    seen = []  # (chosen B per layer, experts loaded per layer) of every observed pass
    observe, reset = AdaptiveBudget.observe, AdaptiveBudget.reset

    def spy_observe(self, loaded, executed=None):
        seen.append((dict(self.chosen), {i: int(v.sum()) for i, v in loaded.items()},
                     executed is not None))
        return observe(self, loaded, executed)

    def spy_reset(self):
        seen.append("reset")
        return reset(self)

    monkeypatch.setattr(AdaptiveBudget, "observe", spy_observe)
    monkeypatch.setattr(AdaptiveBudget, "reset", spy_reset)
    args = ["--mode", "closed", "--ranking", "coact-prior", "--coverage", "truncation",
            "--budget", "3", "--budget-mode", "adaptive", "--calibration", "cal"]
    assert replay(with_cal, *args, "--out", tmp_path / "a") == 0
    passes = [s for s in seen if s != "reset"]
    rows = _rows(tmp_path / "a", "replay_closed")
    assert set(rows["budget_mode"]) == {"adaptive:mass"} and len(passes) == len(rows)
    assert "reset" in seen[:seen.index(passes[0])]  # the state starts fresh for the prompt
    for chosen, loaded, executed in passes:
        assert executed and set(loaded) == set(chosen)  # its outputs, every layer
        assert all(loaded[i] <= chosen[i] for i in chosen)  # what its own B_l let run
    assert len({tuple(c.values()) for c, _, _ in passes}) > 1 or \
        len(set(passes[0][0].values())) > 1  # budgets differ between layers or passes
    monkeypatch.undo()
    assert replay(with_cal, *args, "--out", tmp_path / "b") == 0
    assert rows.equals(_rows(tmp_path / "b", "replay_closed"))  # deterministic


def test_capture_online_adaptive_budget_takes_a_learning_ranking_and_a_pace(with_cal, tmp_path):
    from moe_spec.capture import cli as capture_cli
    traces = copy_of(with_cal, tmp_path)
    assert capture_cli.main(["--limit", "1", "--offset", "60", "--max-new-tokens", "6", "--out",
                             str(traces), "--no-progress", "--threads", "1", "--budget", "3",
                             "--ranking", "coact-prior", "--coverage", "truncation", "--run",
                             "online", "--budget-mode", "adaptive", "--calibration", "cal",
                             "--pace", "0.5"]) == 0
    run = Catalog(traces).runs(names=["online"])[0]
    assert run.settings["ranking"] == "coact-prior" and run.settings["budget_mode"] == "adaptive"
    assert run.settings["pace"] == 0.5
    loaded = pl.concat([pl.read_parquet(f) for f in run.files("trees")])["experts_loaded"]
    assert loaded.explode().n_unique() > 1


@pytest.mark.parametrize("mode, table", [("open", "replay_open"), ("closed", "replay_closed")])
def test_a_paced_rule_is_its_own_budget_mode_with_its_pace_in_the_key(with_cal, tmp_path, mode,
                                                                      table):
    args = ["--mode", mode, "--ranking", "router", "--coverage", "truncation", "--budget", "3",
            "--budget-mode", "adaptive", "--calibration", "cal"]
    out = tmp_path / "out"
    assert replay(with_cal, *args, "--out", out) == 0
    assert replay(with_cal, *args, "--pace", "0.5", "--out", out,
                  "--output", tmp_path / "p.json") == 0
    rows = _rows(out, table)
    assert set(rows["budget_mode"]) == {"adaptive:mass", "adaptive:mass+pace"}
    keys = [json.loads(p.read_text())["unit"]
            for p in (out / table).rglob("_config.json")]
    assert sorted(k.get("pace") or 0 for k in keys) == [0, 0.5]
    assert json.loads((tmp_path / "p.json").read_text())["pace"] == 0.5
    paced = rows.filter(pl.col("budget_mode") == "adaptive:mass+pace")
    assert paced["price"].null_count() == 0  # the base λ, the row's B̄'s
    assert replay(with_cal, *args, "--pace", "0.5", "--pace-over", "run", "--out", out) == 0
    run = _rows(out, table).filter(pl.col("budget_mode") == "adaptive:mass+pace-run")
    assert run.height == paced.height  # its own rows beside the per-prompt ones
    assert replay(with_cal, *args, "--pace-over", "run", "--out", out) == 2  # needs --pace


@pytest.mark.parametrize("mode, table", [("open", "replay_open"), ("closed", "replay_closed")])
def test_an_interrupted_replay_paced_over_the_run_computes_again_from_the_first_prompt(
        with_cal, tmp_path, mode, table):
    """Paced over the run, a prompt's budgets depend on the prompts before it: a block killed
    part way is computed again from its first prompt (resuming at the missing ones would start
    them with no deficit), so the rows equal an uninterrupted replay's. Per prompt, it resumes."""
    from moe_spec.capture import cli as capture_cli
    from moe_spec.replay import cli as replay_cli
    traces = copy_of(with_cal, tmp_path)
    assert capture_cli.main(["--limit", "3", "--offset", "20", "--max-new-tokens", "6", "--out",
                             str(traces), "--run", "ev3", "--no-progress", "--threads", "1"]) == 0
    args = ["--traces", str(traces), "--run", "ev3", "--no-progress", "--threads", "1", "--mode",
            mode, "--ranking", "router", "--coverage", "truncation", "--budget", "2",
            "--budget-mode", "adaptive", "--calibration", "cal", "--pace", "0.1"]
    written = {}
    for over in ("run", "prompt"):
        out = tmp_path / over
        assert exit_code(replay_cli.main, [*args, "--pace-over", over, "--out", str(out)]) == 0
        whole = _rows(out, table)
        config = next((out / table).rglob("_config.json"))
        state = json.loads(config.read_text())
        state["blocks"][0]["status"] = "running"  # as if killed after its first prompt
        config.write_text(json.dumps(state))
        parts = sorted(config.parent.rglob("part-*.parquet"))
        assert len(parts) == 3
        for part in parts[1:]:
            part.unlink()
        stamps = {p: p.stat().st_mtime_ns for p in parts[:1]}
        assert exit_code(replay_cli.main, [*args, "--pace-over", over, "--out", str(out)]) == 0
        assert _rows(out, table).equals(whole)
        written[over] = any(p.stat().st_mtime_ns != t for p, t in stamps.items())
    assert written == {"run": True, "prompt": False}  # computed again / resumed


@pytest.mark.parametrize("extra", [["--pace", "4"], ["--pace", "4", "--pace-over", "run"],
                                   ["--pass-cap", "1.5"]])
def test_a_paced_or_capped_unit_is_replayed_at_every_layer_never_a_subset(with_cal, tmp_path,
                                                                           capsys, extra):
    """A paced or capped rule runs over a pass's layers in order: replayed at layers 0,1 its
    stream would be a 2-layer pass, and completed later at every layer the unit would hold two
    streams' rows under one key (found by the review of issue 63). --layers is refused for
    them, in one line, before anything is written; so is --layers in closed loop, which
    budgets every MoE layer."""
    args = ["--ranking", "router", "--coverage", "truncation", "--budget", "3",
            "--budget-mode", "adaptive", "--calibration", "cal", *extra]
    capsys.readouterr()
    assert replay(with_cal, *args, "--layers", "0,1", "--out", tmp_path / "o") == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "drop --layers" in said[0] and "whole pass" in said[0], said
    assert not (tmp_path / "o").exists()
    assert replay(with_cal, "--mode", "closed", "--ranking", "router", "--budget", "3",
                  "--layers", "0,1", "--out", tmp_path / "c") == 2
    assert "closed loop" in capsys.readouterr().err and not (tmp_path / "c").exists()
    assert replay(with_cal, *args, "--out", tmp_path / "o") == 0  # every layer: fine
