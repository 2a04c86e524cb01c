"""Analyses against slow, obviously-correct references on synthetic routing tables."""

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moe_spec.analysis import coactivation, cost, moesd, replay_views, routing, summaries
from moe_spec.analysis.sql import connect
from moe_spec.catalog import commit, schema
from moe_spec.catalog.runs import commit_digest, write_manifest

N, K, M, LAYERS, TREES = 16, 4, 10, 2, 6


def write_routing(root, rows):
    """``rows`` as one complete run's routing table (m / b / r), its routing summarised."""
    folder = root / "routing" / "model=m" / "bench=b" / "run=r"
    folder.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema.TABLES["routing"]),
                   folder / "part-000000-0000.parquet")
    for table in ("sequences", "trees", "nodes"):  # present (empty): the run lists prompt 0
        (root / table / "model=m" / "bench=b" / "run=r").mkdir(parents=True)
        pq.write_table(schema.TABLES[table].empty_table(),
                       root / table / "model=m" / "bench=b" / "run=r" / "part-000000-0000.parquet")
    manifest = dict(model="m", bench="b", run="r", status="complete", role="evaluation",
                    settings=dict(total_tokens=M), num_experts=N, top_k=K,
                    schema_version=schema.SCHEMA_VERSION, prompts_total=0, prompt_ids=[])
    manifest["files"] = {t: commit.table_record([root / t / "model=m" / "bench=b" / "run=r" /
                                                 "part-000000-0000.parquet"])
                         for t in ("routing", "sequences", "trees", "nodes")}
    manifest["commit_digest"] = commit_digest(manifest)  # committed, as a capture commits
    write_manifest(root, manifest)
    summaries.ensure(root, workers=1)
    return rows


def synthetic_traces(root, seed=0, sharp=2.0):
    """A routing table of TREES trees × LAYERS layers × M nodes with skewed softmax routing."""
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(TREES):
        for layer in range(LAYERS):
            logits = rng.normal(size=(M, N)) * sharp + np.linspace(2, 0, N)
            probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
            top = np.argsort(-probs, 1, kind="stable")[:, :K]
            for node in range(M):
                rows.append(dict(prompt_index=0, prompt_id="p0", step=step, layer=layer, node=node,
                                 router_probs=probs[node].astype(np.float32).tolist(),
                                 topk_ids=top[node].tolist(),
                                 topk_weights=probs[node, top[node]].astype(np.float32).tolist(),
                                 applied_ids=None, applied_weights=None))
    return write_routing(root, rows)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("syn")
    rows = synthetic_traces(root)
    return connect(root), rows


def _groups(rows):
    out = {}
    for r in rows:
        out.setdefault((r["step"], r["layer"]), []).append(r)
    return out


def test_heavy_tails_and_coverage_match_reference(data):
    con, rows = data
    tails = routing.heavy_tails(con).sort(["step", "layer"])
    cov = routing.coverage_curve(con).sort("budget")
    ref_cov = np.zeros(N)
    for i, ((step, layer), g) in enumerate(sorted(_groups(rows).items())):
        s = np.sum([r["router_probs"] for r in g], 0)
        share = np.sort(s / s.sum())[::-1]
        cum = np.cumsum(share)
        ref_cov += cum / (TREES * LAYERS)
        row = tails.row(i, named=True)
        for q, col in ((0.5, "experts_50"), (0.9, "experts_90"), (0.99, "experts_99")):
            assert row[col] == int(np.argmax(cum >= q - 1e-9)) + 1
        asc = share[::-1]
        gini = sum((2 * r - N - 1) * x for r, x in enumerate(asc, start=1)) / (N * asc.sum())
        assert row["gini"] == pytest.approx(gini, abs=1e-5)
        assert row["top_half_share"] == pytest.approx(cum[N // 2 - 1], abs=1e-5)
    np.testing.assert_allclose(cov["coverage"].to_numpy(), ref_cov, atol=1e-5)


def test_activation_growth_matches_reference_and_sits_below_uniform(data):
    con, rows = data
    growth = routing.activation_growth(con).sort("tokens")
    ref = np.zeros(M)
    for g in _groups(rows).values():
        g = sorted(g, key=lambda r: r["node"])
        for t in range(1, M + 1):
            ref[t - 1] += len({e for r in g[:t] for e in r["topk_ids"]}) / (TREES * LAYERS)
    np.testing.assert_allclose(growth["unique_experts"].to_numpy(), ref, atol=1e-9)
    assert (growth["unique_experts"].to_numpy() <= growth["uniform"].to_numpy() + 1e-9).all()
    np.testing.assert_allclose(growth["uniform"].to_numpy(),
                               [N * (1 - ((N - K) / N) ** t) for t in range(1, M + 1)])
    # the i.i.d. baseline uses each layer's own marginals (then averages the curves)
    ref_marg = np.zeros(M)
    for layer in range(LAYERS):
        sel = [e for r in rows if r["layer"] == layer for e in r["topk_ids"]]
        q = np.bincount(sel, minlength=N) / (TREES * M)
        ref_marg += np.array([(1 - (1 - q) ** t).sum() for t in range(1, M + 1)]) / LAYERS
    np.testing.assert_allclose(growth["marginal"].to_numpy(), ref_marg, rtol=1e-9)


def test_marginal_baseline_respects_experts_a_layer_never_selects(tmp_path):
    """Two layers that use disjoint halves of the experts: pooled marginals would predict all N
    experts; per-layer ones cap the curve at N/2."""
    rows = [dict(prompt_index=0, prompt_id="p0", step=s, layer=layer, node=n,
                 router_probs=[1 / N] * N,
                 topk_ids=[(layer * N // 2 + (s * M + n + j) % (N // 2)) for j in range(K)],
                 topk_weights=[1 / N] * K, applied_ids=None, applied_weights=None)
            for s in range(20) for layer in range(2) for n in range(M)]
    write_routing(tmp_path, rows)
    con = connect(tmp_path)
    growth = routing.activation_growth(con).sort("tokens")
    assert growth["marginal"].max() <= N / 2 + 1e-9


def test_moesd_uniform_is_exact_for_iid_uniform_routing():
    rng = np.random.default_rng(1)
    t, trials = 12, 4000
    sims = [len({e for _ in range(t) for e in rng.choice(N, K, replace=False)})
            for _ in range(trials)]
    assert np.mean(sims) == pytest.approx(routing.moesd_uniform(N, K, t), rel=0.01)
    q = np.full(N, K / N)
    assert routing.moesd_marginal(q, [t])[0] == pytest.approx(routing.moesd_uniform(N, K, t))


def test_load_balance_matches_reference(data):
    con, rows = data
    lb = routing.load_balance(con).sort("layer")
    for layer in range(LAYERS):
        counts = np.bincount([e for r in rows if r["layer"] == layer for e in r["topk_ids"]],
                             minlength=N)
        row = lb.row(layer, named=True)
        assert row["cv"] == pytest.approx(counts.std() / counts.mean())
        p = counts[counts > 0] / counts.sum()
        assert row["entropy_ratio"] == pytest.approx(-(p * np.log(p)).sum() / np.log(N))
        assert row["dead_experts"] == int((counts == 0).sum())


def test_coactivation_conventions_and_concentration(data):
    con, rows = data
    c = coactivation.coactivation(con, 1, N)
    ref = np.zeros((N, N))
    for r in rows:
        if r["layer"] == 1:
            for a in r["topk_ids"]:
                for b in r["topk_ids"]:
                    ref[a, b] += 1
    np.testing.assert_array_equal(c.matrix, ref)
    off = ref - np.diag(np.diag(ref))
    tokens = TREES * M
    assert c.concentration == pytest.approx(off.max() / (tokens * K * (K - 1) / (N * (N - 1))))
    adj = coactivation.coactivation(con, 1, N, "adjacent").matrix
    rows_with = adj.sum(1) > 0
    np.testing.assert_allclose(adj.sum(1)[rows_with], 1.0)
    order = coactivation.cluster_order(c.matrix)
    assert sorted(order.tolist()) == list(range(N))


def test_concentration_is_about_one_under_uniform_random_routing():
    rng = np.random.default_rng(2)
    topk = np.argsort(rng.random((200_000, 64)), 1)[:, :8]
    c = coactivation.Coactivation(0, coactivation.all_pairs(topk, 64), len(topk), 8, "all_pairs")
    assert 1.0 <= c.concentration < 1.15


def test_budget_at_interpolates_and_oracle_gap():
    assert replay_views.budget_at([8, 16, 24], [0.4, 0.2, 0.1], 0.3) == pytest.approx(12)
    assert replay_views.budget_at([8, 16], [0.4, 0.2], 0.5) == 8
    assert np.isnan(replay_views.budget_at([8, 16], [0.4, 0.2], 0.1))
    curves = pl.DataFrame(dict(coverage=["t"] * 6, ranking=["router"] * 3 + ["oracle"] * 3,
                               budget=[8, 16, 24] * 2, rse=[0.4, 0.2, 0.1, 0.2, 0.1, 0.05]))
    gap = replay_views.oracle_gap(curves).sort("reference_budget")
    # router at B=8/16/24 has RSE .4/.2/.1; the oracle reaches .4 and .2 by its smallest
    # measured budget (8) and .1 at 16
    assert gap["budget_needed"].to_list() == [8, 8, 16]
    assert gap["saved_share"].to_list() == [0, 0.5, pytest.approx(1 / 3)]


def test_cost_model_charges_a_ranking_s_own_bytes_and_flops_to_every_verification_pass():
    """sketch's surrogate (policy.overhead) read once per MoE layer and computed per tree token:
    the memory-only and compute-only times grow by exactly its bytes and FLOPs; a ranking without
    an overhead changes nothing; the autoregressive pass selects nothing."""
    from moe_spec.policy import overhead
    shape = cost.ModelShape(layers=16, hidden=2048, expert_inter=768, num_experts=128, top_k=8,
                            heads=32, kv_heads=4, head_dim=128, vocab=151936, dense_layers=2,
                            dense_inter=6144)
    hw = cost.PROFILES["H100-SXM"]
    extra = shape.overhead("sketch")
    assert extra == overhead.surrogate(128, 2048, overhead.SKETCH_RANK, overhead.SURROGATE_BYTES)
    assert shape.overhead("coact-prior") == shape.overhead(None) == overhead.NONE
    _, mem, comp = cost.pass_time(shape, hw, 63, 512, 40)
    _, mem_s, comp_s = cost.pass_time(shape, hw, 63, 512, 40, overhead=extra)
    assert mem_s - mem == pytest.approx(14 * extra.bytes_per_layer / hw.bandwidth)  # MoE layers
    assert comp_s - comp == pytest.approx(14 * 63 * extra.flops_per_token / hw.peak_flops)
    assert shape.overhead_experts("sketch") == pytest.approx(
        extra.bytes_per_layer / shape.expert_bytes)
    plain = cost.projected_speedup(shape, hw, 3.0, 40, 63, 512, 1e-4)
    charged = cost.projected_speedup(shape, hw, 3.0, 40, 63, 512, 1e-4, overhead=extra)
    assert charged < plain
    # paying e experts' bytes is (memory-bound) the same as loading e more experts
    same = cost.projected_speedup(shape, hw, 3.0, 40 + shape.overhead_experts("sketch"), 63, 512,
                                  1e-4)
    assert charged == pytest.approx(same, rel=1e-3)
    assert cost.projected_batch_speedup(shape, hw, 4, 3.0, 63, 512, 40, 20, extra) < \
        cost.projected_batch_speedup(shape, hw, 4, 3.0, 63, 512, 40, 20)


def test_cost_model_roofline_and_calibration_recover_parameters():
    shape = cost.ModelShape(layers=16, hidden=2048, expert_inter=1024, num_experts=64, top_k=8,
                            heads=16, kv_heads=16, head_dim=128, vocab=50304)
    hw = cost.PROFILES["A100-80G"]
    t8 = cost.pass_time(shape, hw, 63, 512, 8)[0]
    t64 = cost.pass_time(shape, hw, 63, 512, 64)[0]
    assert t64 > t8  # loading more experts costs more in the memory-bound regime
    ar = cost.pass_time(shape, hw, 1, 512, 8)[0]
    assert cost.projected_speedup(shape, hw, 1.0, 8, 1, 512, 0.0) == pytest.approx(1.0)
    assert cost.projected_speedup(shape, hw, 3.0, 32, 63, 512, 0.1 * ar) > \
        cost.projected_speedup(shape, hw, 3.0, 64, 63, 512, 0.1 * ar)
    rng = np.random.default_rng(0)
    loaded = rng.integers(8, 65, 50)
    tokens = rng.integers(1, 64, 50)
    parts = np.array([cost.pass_time(shape, hw, t, 256, e)[1:] for t, e in zip(tokens, loaded)])
    seconds = 1.7 * parts[:, 0] + 0.3 * parts[:, 1] + 2e-4
    cal = cost.calibrate(shape, hw, seconds, tokens, [256] * 50, loaded)
    assert cal.alpha == pytest.approx(1.7, rel=1e-3) and cal.gamma == pytest.approx(2e-4, rel=1e-2)
    assert cal.relative_rmse < 1e-6 and cal.r2 > 0.999999


def test_efficiency_fit_and_regimes():
    rows = []
    for b in (1, 2, 4):
        for g in (1, 2, 4, 8, 16):
            t = b * g
            rows.append(dict(batch_size=b, gamma=g,
                             seconds=1e-3 + 2e-5 * routing.moesd_uniform(N, K, t) + 1e-5 * t))
    points = pl.DataFrame(rows)
    eff = moesd.efficiency(points)
    assert eff.filter(pl.col("gamma") == 1)["eta"].to_list() == [1.0] * 3
    assert (eff["eta"] <= 1.0 + 1e-12).all()
    coef = moesd.fit(points, N, K)
    assert coef["c1"] == pytest.approx(2e-5, rel=1e-3) and coef["relative_rmse"] < 1e-6
    assert set(moesd.regime([1, 64, 10_000], N, K, coef)) == {"expert growth",
                                                              "activation saturation",
                                                              "compute-bound"}


def test_cost_shapes_from_plain_configs_equal_transformers_configs():
    """The speedup page reads real shapes without importing transformers: same numbers."""
    from types import SimpleNamespace

    from moe_spec.analysis.frames import model_shape
    from moe_spec.moe.models import EMBEDDED, EMBEDDED_DIR
    from moe_spec.moe.shapes import REAL_SHAPES
    for s in REAL_SHAPES.values():
        assert cost.ModelShape.from_config(SimpleNamespace(**s.config)) == \
            cost.ModelShape.from_config(s.build_config()), s.name
    from transformers import AutoConfig
    for name in EMBEDDED:
        assert model_shape(str(EMBEDDED_DIR / name)) == \
            cost.ModelShape.from_config(AutoConfig.from_pretrained(EMBEDDED_DIR / name)), name


def test_ablation_is_the_share_of_the_router_oracle_gap_each_step_closes():
    from moe_spec.analysis.replay_views import ablation
    rows = []
    for cov in ("truncation", "substitution"):
        for b, router, oracle, sq, coact in ((8, 1.0, 0.2, 0.8, 0.3), (16, 0.5, 0.5, 0.5, 0.5)):
            rows += [dict(ranking=r, coverage=cov, budget=b, rse=v) for r, v in
                     (("router", router), ("oracle", oracle), ("sqmass", sq), ("coact", coact))]
    got = ablation(pl.DataFrame(rows))
    assert got.columns == ["coverage", "budget", "sqmass", "coact"]
    row = got.filter((pl.col("coverage") == "truncation") & (pl.col("budget") == 8)).row(
        0, named=True)
    assert row["sqmass"] == pytest.approx(0.25) and row["coact"] == pytest.approx(0.875)
    no_gap = got.filter(pl.col("budget") == 16)
    assert no_gap["sqmass"].is_null().all()  # router already at the oracle: nothing to close
    assert ablation(pl.DataFrame(rows).filter(pl.col("ranking") != "oracle")).is_empty()


# --- figures that mislead (issue 25) -------------------------------------------------------------

def _stats(closed=True, open_loop=True):
    """Routing statistics of a 64-expert capture with a budget sweep 8…56: aggressive budgets
    keep few accepted paths (closed loop) and have a large RSE (open loop)."""
    path = {8: 0.2, 16: 0.5, 24: 0.8, 32: 0.92, 48: 0.97, 56: 1.0}
    quality = {b: dict(**({"path_unchanged": p, "kl": 0.3 * (1 - p)} if closed else {}),
                       **({"rse": 0.2 * (1 - p)} if open_loop else {}))
               for b, p in path.items()}
    return dict(tau=3.0, prefix=200, unique=40.0, nodes=63, trees=10, num_experts=64,
                taus={b: 3.0 * (0.5 + p / 2) for b, p in path.items()} if closed else {},
                tau_source="closed-loop replay" if closed else "unbudgeted capture",
                quality=quality if (closed or open_loop) else {},
                quality_source="closed-loop replay" if closed else None,
                missing=None if (closed or open_loop) else "no replay at all of this dataset")


def test_speedup_budgets_are_the_targets_own_and_never_below_its_top_k():
    """Mixtral has 8 experts, top-2: a 64-expert capture's B = 8 (1/8 of N) is 1 of Mixtral's
    8, below its top-2, and must not be drawn; the axis counts Mixtral's experts."""
    from moe_spec.analysis import figures, frames
    from moe_spec.moe.shapes import REAL_SHAPES
    mixtral = next(frames.real_targets()[s.checkpoint] for s in REAL_SHAPES.values()
                   if "Mixtral" in s.checkpoint)
    hw = cost.PROFILES["H100-SXM"]
    sp = frames.speedup_frame(_stats(), mixtral, [hw])
    assert sp["budget"].to_list() == [2, 3, 4, 6, 7, 8]  # 16/64·8 = 2 … 64/64·8 = 8
    assert sp["budget"].min() >= mixtral.top_k and sp["budget"].max() == mixtral.num_experts
    assert (sp["experts_loaded"] >= mixtral.top_k).all()
    row = sp.filter(pl.col("budget") == 4).row(0, named=True)
    assert row["captured_budget"] == 32
    # one owner of the formula: cost.projected_speedup
    t_draft = frames.draft_seconds(mixtral.hidden, 4 * mixtral.hidden, 32000, 7, hw)
    assert row["speedup"] == pytest.approx(cost.projected_speedup(
        mixtral, hw, row["tau"], row["experts_loaded"], 63, 200, t_draft))
    note = frames.speedup_note(sp)
    assert "mapped by share of N" in note and "below the target's top-2" in note
    fig = figures.speedup(sp, "t", note, frames.headline(sp)["row"]["budget"])
    assert "experts of 8" in fig.layout.xaxis.title.text
    assert any("mapped by share of N" in a.text for a in fig.layout.annotations)
    assert list(fig.data[0].x) == [2, 3, 4, 6, 7, 8]


def test_speedup_headline_is_the_best_within_the_stated_quality_bound():
    from moe_spec.analysis import figures, frames
    olmoe = cost.ModelShape(layers=16, hidden=2048, expert_inter=1024, num_experts=64, top_k=8,
                            heads=16, kv_heads=16, head_dim=128, vocab=50304)
    sp = frames.speedup_frame(_stats(), olmoe, [cost.PROFILES["H100-SXM"]])
    assert sp.sort("speedup")["budget"][-1] == 8  # the most aggressive budget projects most
    top = frames.headline(sp)
    assert top["kind"] == "closed" and "path unchanged ≥ 90%" in top["bound"]
    assert top["row"]["budget"] == 32  # the smallest budget keeping ≥ 90% of accepted paths
    assert top["row"]["within_bound"] and "path unchanged 92%" in top["row"]["quality"]
    assert sp.filter(pl.col("budget") == 8)["quality"][0].startswith("path unchanged 20%")
    labels = figures.speedup(sp).data[0].text
    assert "20%" in labels and "92%" in labels  # the quality beside every projected speedup
    # open-loop replay only: an RSE bound, said to assume the unbudgeted τ
    top = frames.headline(frames.speedup_frame(_stats(closed=False), olmoe,
                                               [cost.PROFILES["H100-SXM"]]))
    assert top["kind"] == "open" and "RSE ≤" in top["bound"] and "no closed-loop" in top["bound"]
    assert top["row"]["rse"] <= frames.RSE_BOUND
    # no replay at all: B = N, said so
    top = frames.headline(frames.speedup_frame(_stats(False, False), olmoe,
                                               [cost.PROFILES["H100-SXM"]]))
    assert top["row"]["budget"] == 64
    assert top["note"] == "no replay at all of this dataset, so only B = N (no budget) is measured"


def test_oracle_gap_below_the_sweep_is_unknown_not_zero():
    from moe_spec.analysis import figures
    # the oracle's smallest budget (8) already beats the router's RSE at 8 and at 16
    curves = pl.DataFrame(dict(coverage=["t"] * 6, ranking=["router"] * 3 + ["oracle"] * 3,
                               budget=[8, 16, 24] * 2, rse=[0.4, 0.2, 0.1, 0.15, 0.1, 0.05]))
    gap = replay_views.oracle_gap(curves).sort("reference_budget")
    assert gap["sweep"].to_list() == ["below", "below", "inside"]
    text = list(figures.oracle_gap(gap).data[0].text)
    assert text == ["below<br>the<br>sweep", "≥ 50%,<br>below<br>the<br>sweep", "33%"]
    curves = curves.with_columns(rse=pl.Series([0.4, 0.2, 0.01, 0.15, 0.1, 0.05]))
    gap = replay_views.oracle_gap(curves).sort("reference_budget")
    assert gap["sweep"][-1] == "beyond"
    assert list(figures.oracle_gap(gap).data[0].text)[-1] == "beyond<br>the<br>sweep"


def test_degenerate_calibration_is_flagged_unusable():
    shape = cost.ModelShape(layers=16, hidden=2048, expert_inter=1024, num_experts=64, top_k=8,
                            heads=16, kv_heads=16, head_dim=128, vocab=50304)
    hw = cost.PROFILES["A100-80G"]
    rng = np.random.default_rng(0)
    loaded, tokens = rng.integers(8, 65, 40), rng.integers(1, 64, 40)
    noise = rng.lognormal(0, 1.0, 40) * 1e-2  # CPU timings with no roofline shape in them
    cal = cost.calibrate(shape, hw, noise, tokens, [256] * 40, loaded)
    assert not cal.usable
    assert any("R²" in p for p in cal.problems) and "not usable" in cal.verdict
    flat = cost.Calibration(0.0, 0.0, 0.05, 1.59, 0.0, 80)
    assert not flat.usable and any("α and β both fitted to 0" in p for p in flat.problems)
    parts = np.array([cost.pass_time(shape, hw, t, 256, e)[1:] for t, e in zip(tokens, loaded)])
    good = cost.calibrate(shape, hw, 1.7 * parts[:, 0] + 2e-4, tokens, [256] * 40, loaded)
    assert good.usable and good.problems == []


def test_coactivation_lift_masks_the_diagonal_and_is_one_when_independent():
    from moe_spec.analysis import figures
    rng = np.random.default_rng(3)
    topk = np.argsort(rng.random((100_000, 16)), 1)[:, :4]
    rest = np.array([e for e in range(16) if e not in (3, 11)])
    planted = np.argsort(rng.random((20_000, 14)), 1)[:, :2]
    topk[:20_000] = np.c_[np.full((20_000, 2), [3, 11]), rest[planted]]  # one planted pair
    c = coactivation.Coactivation(0, coactivation.all_pairs(topk, 16), len(topk), 4, "all_pairs")
    lift = c.lift
    assert np.isnan(np.diag(lift)).all()
    assert lift[3, 11] > 1.5 and lift[3, 11] == pytest.approx(lift[11, 3])
    others = np.ones((16, 16), bool)
    np.fill_diagonal(others, False)
    others[[3, 11], :] = others[:, [3, 11]] = False
    assert np.nanmedian(lift[others]) == pytest.approx(1.0, abs=0.05)
    # with uniform marginals the expectation is the concentration's M·k(k−1)/(N(N−1))
    # (a circulant design: every expert selected equally often)
    uniform = np.array([[(i + d) % 16 for d in (0, 1, 3, 7)] for i in range(16)] * 10)
    u = coactivation.Coactivation(0, coactivation.all_pairs(uniform, 16), 160, 4, "all_pairs")
    off = ~np.eye(16, dtype=bool)
    np.testing.assert_allclose(u.lift[off], u.matrix[off] / u.expected, rtol=1e-12)
    fig = figures.coactivation(c.matrix, None, "t", lift=lift)
    z = np.array(fig.data[0].z, dtype=float)
    assert np.isnan(np.diag(z)).all() and fig.data[0].zmid == 0
    assert "observed / expected" in fig.data[0].colorbar.title.text
    counts = figures.coactivation(c.matrix, None, "t")
    assert np.isnan(np.diag(np.array(counts.data[0].z, dtype=float))).all()
    assert "diagonal masked" in counts.data[0].colorbar.title.text
