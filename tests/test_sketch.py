"""``sketch``: the oracle's search on expert outputs predicted from the tree tokens' MoE inputs.

* The surrogate is exact for linear experts at full rank (and its residual energy is 0), lossy
  below; sums from several runs add.
* With an exact surrogate sketch's shortlists score what the oracle's do (same search).
* Runtime-legal: the evaluation pass's expert outputs never reach it (perturbed or absent, the
  shortlist is unchanged), while its MoE inputs do (perturbed, it changes).
* Without its surrogate or the MoE inputs it says so and returns coact-prior's shortlists.
* Truncation: selected experts first (B ≥ |U| gives the floor).
* The artifact round-trips and refuses another model's weights; the cost grows with r.
* The surrogate refit during a prompt (``OnlineSurrogate``) is the least-squares fit of the
  calibration, counted as κ tokens, plus exactly the pairs the passes executed; its state is
  charged.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from helpers import linear_experts

from moe_spec.policy import coverage, rankings
from moe_spec.policy.batch import ExpertTerms, RoutingBatch
from moe_spec.policy.calibration import CalibrationStats
from moe_spec.policy.overhead import surrogate_cost
from moe_spec.policy.rankings.sketch import Sketch, attach_moments, with_inputs
from moe_spec.policy.routing import RoutingRule
from moe_spec.policy.surrogate import InputMoments, Surrogate, predicted_outputs

H, N, K, LAYER = 6, 8, 2, 3


def linear_model(seed: int = 98, n: int = N, h: int = H):
    """Experts ``E_i(h) = W_i h + c_i`` of different sizes (what router mass cannot see)."""
    return linear_experts(seed, n, h, LAYER)


def tree_layers(seed: int, count: int, m: int = 12, n: int = N, h: int = H):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        probs = torch.softmax(torch.randn(m, n, generator=g) * 2.0, -1)
        w, idx = probs.topk(K, -1)
        out.append(SimpleNamespace(layer=LAYER, probs=probs, idx=idx, weights=w / w.sum(-1, True),
                                   hidden=torch.randn(m, h, generator=g), prompt_index=None))
    return out


def calibration(model, seed: int = 1, count: int = 8):
    tls = tree_layers(seed, count)
    stats = CalibrationStats.collect(tls, model)
    return attach_moments(stats, InputMoments.collect(tls, model))


def evaluation_batch(model, seed: int = 7, m: int = 16, renormalize: bool = True):
    """One tree-layer routed on random scores, its terms from ``model`` on its inputs."""
    tl = tree_layers(seed, 1, m=m)[0]
    w, idx = tl.probs.topk(K, -1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    batch = RoutingBatch.single(tl.probs, idx, w, LAYER, RoutingRule(K, renormalize=renormalize))
    batch.terms = ExpertTerms.from_outputs(model.expert_outputs(LAYER, tl.hidden)[None], idx[None],
                                           w[None])
    return with_inputs(batch, tl.hidden[None])


def cell_errors(batch, cov, keep):
    idx, w = cov.apply(batch, keep)
    return cov.sq_errors(batch, keep, idx, w).sum(-1)


def test_full_rank_surrogate_is_exact_for_linear_experts_and_lower_rank_is_not():
    model = linear_model()
    tls = tree_layers(2, 6)
    half = InputMoments.collect(tls[:3], model)
    moments = InputMoments.merge([half, InputMoments.collect(tls[3:], model)])
    whole = InputMoments.collect(tls, model)
    assert torch.allclose(moments.yx, whole.yx) and torch.allclose(moments.xx, whole.xx)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(3))
    truth = model.expert_outputs(LAYER, x)  # [5, N, H]
    full = Surrogate.fit(moments, rank=H)
    pred = predicted_outputs(full, torch.tensor([LAYER]), x[None], torch.ones(1, 5, dtype=bool))
    assert torch.allclose(pred[0, ..., :H], truth, atol=1e-3)
    assert float(full.rho.max()) < 1e-6
    low = Surrogate.fit(moments, rank=2)
    pred = predicted_outputs(low, torch.tensor([LAYER]), x[None], torch.ones(1, 5, dtype=bool))
    assert not torch.allclose(pred[0, ..., :H], truth, atol=1e-2)
    assert float(low.rho.min()) > 0  # what rank 2 misses is kept as residual energy
    # residual energy + fitted energy = total energy, per expert
    fitted = predicted_outputs(low, torch.tensor([LAYER]),
                               torch.stack([torch.as_tensor(t.hidden) for t in tls])
                               .reshape(1, -1, H), torch.ones(1, 72, dtype=bool))
    total = whole.yy[0] / whole.count[0]
    assert torch.allclose(fitted[0, :, :, :H].pow(2).sum(-1).mean(0) + low.rho[0], total.float(),
                          rtol=1e-3)


@pytest.mark.parametrize("renormalize", [True, False])
def test_with_an_exact_surrogate_sketch_scores_what_the_oracle_does(renormalize):
    model = linear_model()
    stats = calibration(model)
    batch = evaluation_batch(model, renormalize=renormalize)
    sketch = Sketch(rank=H).fit(stats)
    oracle = rankings.get("oracle")()
    for name in ("truncation", "substitution"):
        cov = coverage.get(name)
        budgets = [b for b in (2, 3, 4, 5) if b >= cov.min_budget(K)]
        mine = cell_errors(batch, cov, sketch.shortlists(batch, cov, budgets)[0])
        best = cell_errors(batch, cov, oracle.shortlists(batch, cov, budgets)[0])
        router = cell_errors(batch, cov, rankings.get("router")().shortlists(batch, cov,
                                                                                budgets)[0])
        assert torch.allclose(mine, best, rtol=1e-4, atol=1e-9), (name, mine, best)
        assert bool((mine <= router * (1 + 1e-6)).all()), name


def test_the_evaluation_pass_expert_outputs_never_reach_sketch():
    """Perturb (or drop) the true expert outputs of the evaluated pass: the shortlist is the
    same; perturb its MoE inputs: it changes (so the test can fail)."""
    model = linear_model()
    stats = calibration(model)
    batch = evaluation_batch(model, m=20)
    sketch = Sketch(rank=3).fit(stats)
    g = torch.Generator().manual_seed(11)
    for name in ("truncation", "substitution"):
        cov = coverage.get(name)
        budgets = [b for b in (2, 3, 4, 6) if b >= cov.min_budget(K)]
        base = sketch.shortlists(batch, cov, budgets)[0]
        noisy = RoutingBatch(batch.probs, batch.idx, batch.weights, batch.mask, batch.layers,
                             batch.rule)
        wrong = torch.randn(batch.terms.experts.shape, generator=g) * 10
        noisy.terms = ExpertTerms.from_outputs(wrong, batch.idx, batch.weights)
        with_inputs(noisy, batch.hidden)
        assert torch.equal(sketch.shortlists(noisy, cov, budgets)[0], base), name
        bare = with_inputs(RoutingBatch(batch.probs, batch.idx, batch.weights, batch.mask,
                                        batch.layers, batch.rule), batch.hidden)
        assert torch.equal(sketch.shortlists(bare, cov, budgets)[0], base), name
    cov = coverage.get("substitution")
    changed = 0
    for seed in range(6):
        h = torch.randn(batch.hidden.shape, generator=torch.Generator().manual_seed(seed)) * 3
        other = with_inputs(RoutingBatch(batch.probs, batch.idx, batch.weights, batch.mask,
                                         batch.layers, batch.rule), h)
        changed += not torch.equal(sketch.shortlists(other, cov, [2, 3, 4])[0],
                                   sketch.shortlists(batch, cov, [2, 3, 4])[0])
    assert changed > 0  # the inputs do reach it


def test_without_a_surrogate_or_inputs_sketch_says_so_and_returns_coact_priors_shortlists():
    model = linear_model()
    plain = CalibrationStats.collect(tree_layers(1, 4), model)
    batch = evaluation_batch(model)
    cov = coverage.get("substitution")
    prior = rankings.get("coact-prior")().fit(plain).shortlists(batch, cov, [2, 3])[0]
    with pytest.warns(UserWarning, match="no expert surrogates"):
        blind = Sketch().fit(plain)
    assert not blind.token_aware
    assert torch.equal(blind.shortlists(batch, cov, [2, 3])[0], prior)
    stats = calibration(model)
    sketch = Sketch(rank=3).fit(stats)
    assert sketch.token_aware
    aware = sketch.shortlists(batch, cov, [2, 3])[0]
    del batch.hidden
    with pytest.warns(UserWarning, match="no MoE inputs"):
        keep = sketch.shortlists(batch, cov, [2, 3])[0]
    assert not sketch.token_aware
    prior = rankings.get("coact-prior")().fit(stats).shortlists(batch, cov, [2, 3])[0]
    assert torch.equal(keep, prior) and not torch.equal(keep, aware)


def test_truncation_puts_the_selected_experts_first():
    model = linear_model()
    stats = calibration(model)
    batch = evaluation_batch(model, m=3)
    cov = coverage.get("truncation")
    u = int(batch.union().sum())
    keep, _ = Sketch(rank=2).fit(stats).shortlists(batch, cov, [u, min(u + 1, N), N])
    assert (keep.sum(-1) == torch.tensor([[u, min(u + 1, N), N]])).all()
    floor = float(batch.terms.floor.sum())
    assert torch.allclose(cell_errors(batch, cov, keep)[0], torch.full((3,), floor, dtype=torch.float64),
                          rtol=1e-9, atol=1e-15)


def test_the_artifact_round_trips_and_refuses_another_model(tmp_path):
    model = linear_model()
    moments = InputMoments.collect(tree_layers(1, 4), model)
    fitted = Surrogate.fit(moments, rank=3, weights_hash="abc")
    path = tmp_path / "sketch.npz"
    fitted.save(path)
    back = Surrogate.load(path, weights_hash="abc")
    assert torch.equal(back.u, fitted.u) and torch.equal(back.rho, fitted.rho)
    assert back.rank == 3 and back.layers == [LAYER]
    with pytest.raises(ValueError, match="another model"):
        Surrogate.load(path, weights_hash="xyz")


def test_cost_counts_the_surrogate_bytes_and_flops():
    """The bytes a layer's surrogate holds are those of a fitted one's own tensors; the FLOPs
    those of predicting every expert's output on one token and their Gram, counted op by op."""
    from moe_spec.policy import index, overhead
    model = linear_model()
    for rank in (2, 3, H + 4):  # a rank above H is capped at H
        fitted = Surrogate.fit(InputMoments.collect(tree_layers(1, 4), model), rank=rank)
        held = fitted.u[0].numel() + fitted.v[0].numel() + fitted.rho[0].numel()
        assert fitted.u.dtype == torch.float32  # what SURROGATE_BYTES charges
        assert overhead.surrogate(N, H, rank).bytes_per_layer == held * 4
        # FLOPs from the tensors predicted_outputs multiplies: x [D] · V [N, D, r], z · U
        # [N, H, r], then the N predictions' Gram over H (+ the diagonal private block) and
        # their products with the predicted natural output R̂ [H]
        n, d, r = fitted.v.shape[1:]
        h = fitted.u.shape[2]
        flops = 2 * n * d * r + 2 * n * r * h + 2 * n * n * h + n + 2 * n * h
        assert overhead.surrogate(N, H, rank).flops_per_token == flops
    # the index names sketch's overhead at the rank replay fits; other rankings add nothing
    assert index.overhead("sketch", 64, 2048) == overhead.surrogate(64, 2048, Sketch.rank)
    assert index.overhead("coact-prior", 64, 2048) == overhead.NONE
    assert index.overhead("an-imported-name", 64, 2048) == overhead.NONE
    c4, c32 = surrogate_cost(64, 2048, 4, 1024), surrogate_cost(64, 2048, 32, 1024)
    assert c4["bytes_per_layer"] == 64 * (4 * 2048 + 4 * 2049 + 1) * 4  # float32 numbers
    assert c32["bytes_per_layer"] > c4["bytes_per_layer"] and c32["flops_per_token"] > \
        c4["flops_per_token"]
    assert c4["expert_bytes"] == 3 * 2048 * 1024 * 2
    assert abs(c4["expert_equivalents"] - c4["bytes_per_layer"] / c4["expert_bytes"]) < 1e-12
    assert Sketch.cost(64, 2048, 1024, rank=4) == c4


def test_the_online_budget_hands_sketch_the_tokens_moe_inputs():
    """policy.budget.Budget.route passes h_t (what the router hook of a verification pass
    sees) to the ranking: sketch is token-aware there, and blind (warned) without it."""
    from moe_spec.policy.budget import Budget
    model = linear_model()
    stats = calibration(model)
    batch = evaluation_batch(model)
    cov = coverage.get("substitution")
    budget = Budget(3, Sketch(rank=3).fit(stats), cov)
    routed = budget.route(LAYER, batch.probs[0], batch.idx[0], batch.weights[0], batch.rule,
                          batch.hidden[0])
    assert budget.ranking.token_aware
    want = Sketch(rank=3).fit(stats).shortlists(batch, cov, [3])[0][0, 0]
    assert torch.equal(routed.keep, want)
    with pytest.warns(UserWarning, match="no MoE inputs"):
        budget.route(LAYER, batch.probs[0], batch.idx[0], batch.weights[0], batch.rule)


@pytest.mark.slow
def test_replay_open_and_closed_loop_run_sketch_token_aware(tmp_path):
    """End to end on tiny-olmoe: with sketch asked for, replay collects the surrogate's sums on
    the calibration run and hands every batch its MoE inputs, open and closed loop: no
    fallback warning (sketch-gated's sketch included), and the saved artifact is a surrogate
    (not coact-prior's record)."""
    from helpers import call
    cap = ["--model", "tiny-olmoe", "--limit", "1", "--max-new-tokens", "8", "--no-progress",
           "--threads", "1", "--out", tmp_path]
    assert call("moe_spec.capture.cli", *cap, "--bench", "mbpp", "--run", "ev").returncode == 0
    assert call("moe_spec.capture.cli", *cap, "--bench", "gsm8k", "--run", "cal", "--role",
                "calibration").returncode == 0
    for mode, budgets, extra in (("open", "8,16,24,32", ["oracle"]), ("closed", "8", [])):
        r = call("moe_spec.replay.cli", "--traces", tmp_path, "--run", "ev", "--calibration", "cal",
                 "--ranking", "sketch", "sketch-post", "sketch-gated", "router", *extra,
                 "--coverage", "substitution", "--budget",
                 budgets, "--mode", mode, "--no-progress", "--threads", "1")
        assert r.returncode == 0, r.stderr
        assert "coact-prior's shortlists" not in r.stderr, r.stderr
        assert "sketch-post" in r.stdout and "sketch-gated" in r.stdout, r.stdout  # replayed
        # beside sketch, both loops
        if mode == "open":  # the summary says how much of it the surrogate ranked
            assert "sketch: its surrogate ranked every tree-layer" in r.stdout, r.stdout
            assert "sketch-gated: its surrogate ranked" in r.stdout, r.stdout
    q = call("moe_spec.analysis.query_cli", "--traces", tmp_path, "--format", "csv",
             "SELECT ranking, avg(surrogate_ranked::INT) AS share, count(*) AS n FROM replay_open "
             "GROUP BY ALL ORDER BY ALL")
    share = {line.split(",")[0]: float(line.split(",")[1])
             for line in q.stdout.strip().splitlines()[1:]}
    assert share["sketch"] == share["sketch-post"] == 1 and share["router"] == 0, q.stdout
    assert share["oracle"] == 0 and "sketch-gated" in share, q.stdout
    # the surrogate's own error curve: stored exactly where it ranked, null elsewhere
    q = call("moe_spec.analysis.query_cli", "--traces", tmp_path, "--format", "csv",
             "SELECT ranking, bool_and((predicted_rse IS NULL) = NOT surrogate_ranked) AS ok, "
             "count(predicted_rse) AS n FROM replay_open GROUP BY ALL ORDER BY ALL")
    found = {line.split(",")[0]: line.split(",")[1:] for line in q.stdout.strip().splitlines()[1:]}
    assert all(ok == "true" for ok, _ in found.values()), q.stdout + q.stderr
    assert int(found["sketch"][1]) > 0 and found["router"][1] == "0", q.stdout
    # the oracle replayed without a token-aware ranking starts without them: another variant
    # (computed, not answered by the stronger one), named so; the default view and an
    # uncalibrated request take the token-aware one
    r = call("moe_spec.replay.cli", "--traces", tmp_path, "--run", "ev", "--calibration", "cal",
             "--ranking", "oracle", "--coverage", "substitution", "--budget", "8", "--no-progress",
             "--threads", "1")
    assert r.returncode == 0 and "reused" not in r.stdout.lower(), r.stdout + r.stderr
    r = call("moe_spec.replay.cli", "--traces", tmp_path, "--run", "ev", "--ranking", "oracle",
             "--coverage", "substitution", "--budget", "8", "--no-progress", "--threads", "1")
    assert r.returncode == 0 and "with the token-aware starts" in r.stderr + r.stdout, r.stderr
    q = call("moe_spec.analysis.query_cli", "--traces", tmp_path, "--format", "csv",
             "SELECT token_aware_starts, count(DISTINCT config) AS n, sum(rse) AS s FROM "
             "replay_open_all WHERE ranking = 'oracle' AND budget = 8 GROUP BY ALL ORDER BY 1")
    assert q.returncode == 0, q.stderr
    rows = [line.split(",") for line in q.stdout.strip().splitlines()[1:]]
    assert [(a, n) for a, n, _ in rows] == [("false", "1"), ("true", "1")], q.stdout
    assert float(rows[1][2]) <= float(rows[0][2]) + 1e-9, rows  # more starts: never worse
    q = call("moe_spec.analysis.query_cli", "--traces", tmp_path, "--format", "csv",
             "SELECT DISTINCT token_aware_starts FROM replay_open WHERE ranking = 'oracle'")
    assert q.stdout.split() == ["token_aware_starts", "true"], q.stdout + q.stderr
    saved = list((tmp_path / "replay_open").rglob("sketch*"))
    assert saved and all(b"fallback" not in p.read_bytes()[:4096] for p in saved), saved
    # the report charges sketch its surrogate's bytes: net of them at the tiny model's shape
    # (10.7 experts a layer at r = 4: over a third of any budget up to 32) and at OLMoE's real
    # shape (a tenth of one)
    from moe_spec.analysis import report
    out = tmp_path.parent / f"{tmp_path.name}-report"  # beside the traces, never inside them
    assert report.main(["--traces", str(tmp_path), "--out", str(out)]) == 0
    html = (out / "tiny-olmoe_mbpp.html").read_text()
    table = html.split("Experts saved at matched quality vs router</h2>")[1].split("</table>")[0]
    assert "net, captured shape" in table and "net, allenai/OLMoE-1B-7B-0924 shape" in table
    row = next(r for r in table.split("<tr>") if "<td>open</td>" in r and "<td>sketch</td>" in r)
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
    saved_share, captured, real = (int(cells[i].rstrip("%")) for i in (4, 6, 7))
    assert captured <= saved_share - 30, cells
    assert saved_share - 2 <= real <= saved_share, cells  # OLMoE: 0.17 experts a layer


def _nonlinear_pairs(seed: int, m: int, shift: float = 0.0):
    """MoE inputs and every expert's output under nonlinear experts (a linear fit is local)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, H, H, generator=torch.Generator().manual_seed(7))
    x = torch.randn(m, H, generator=g) + shift
    return x, torch.tanh(torch.einsum("mh,nhd->mnd", x, w))


def _reference_fit(rows_x, rows_y, weights, rank):
    """Weighted reduced-rank least squares from the data themselves (numpy lstsq on rows scaled
    by √weight): the map M = U Uᵀ W and the weighted mean residual energy."""
    import numpy as np
    sw = np.sqrt(weights)[:, None]
    x = np.concatenate([rows_x, np.ones((len(rows_x), 1))], 1)
    w = np.linalg.lstsq(x * sw, rows_y * sw, rcond=None)[0].T  # [H, D]
    fitted = w @ (x * sw).T @ (x * sw) @ w.T
    u = np.linalg.eigh(fitted)[1][:, ::-1][:, :rank]
    m = u @ u.T @ w
    resid = ((rows_y - x @ m.T) ** 2).sum(1)
    return m, float((weights * resid).sum() / weights.sum())


def test_online_surrogate_refits_on_calibration_as_kappa_tokens_plus_executed_pairs():
    """Before any pass it is the calibration fit; after passes, each expert's map is the
    least-squares fit of the calibration (each token weighing κ / n_cal) plus exactly the
    (h, E_i(h)) pairs its passes executed, against a fit from the data themselves; outputs of
    experts a pass did not run (weight 0) and padding change nothing."""
    import numpy as np

    from moe_spec.policy.surrogate import OnlineSurrogate
    cal_x, cal_y = _nonlinear_pairs(1, 60)
    moments = InputMoments.empty([LAYER], N, H)
    moments.add(LAYER, cal_x, cal_y)
    kappa, rank = 12.0, 2
    online = OnlineSurrogate(moments, rank, kappa)
    before, fresh = online.refresh(), Surrogate.fit(moments, rank)
    for a, b in ((before.u, fresh.u), (before.v, fresh.v), (before.rho, fresh.rho)):
        assert torch.equal(a, b)
    passes = [_nonlinear_pairs(s, 5, shift=1.5) for s in (2, 3)]  # another domain
    g = torch.Generator().manual_seed(4)
    executed = []
    for x, y in passes:
        idx = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(5)])[None]  # [1,5,K]
        w = torch.rand(1, 5, K, generator=g) + 0.1
        w[0, 4] = 0  # a padded token
        w[0, 0, 1] = 0  # a slot the pass did not run
        outs = y[None].gather(2, idx[..., None].expand(1, 5, K, H)).clone()
        noisy = outs.clone()
        noisy[0, 4] += 100.0
        noisy[0, 0, 1] += 100.0  # what was not run must not matter
        online.observe(torch.tensor([LAYER]), x[None], idx, w, noisy)
        executed += [(x[t], y[t], int(idx[0, t, s])) for t in range(5) for s in range(K)
                     if w[0, t, s] != 0]
    after = online.refresh()
    probe = torch.randn(1, 3, H, generator=g)
    got = predicted_outputs(after, torch.tensor([LAYER]), probe, torch.ones(1, 3, dtype=torch.bool))
    changed = 0
    for i in range(N):
        mine = [(x, y) for x, y, e in executed if e == i]
        rows_x = np.concatenate([cal_x.numpy()] + [x[None].numpy() for x, _ in mine]).astype(float)
        rows_y = np.concatenate([cal_y[:, i].numpy()] + [y[i][None].numpy() for _, y in mine])
        weights = np.array([kappa / 60] * 60 + [1.0] * len(mine))
        m, rho = _reference_fit(rows_x, rows_y.astype(float), weights, rank)
        want = np.concatenate([probe[0].numpy(), np.ones((3, 1))], 1) @ m.T
        assert np.allclose(got[0, :, i, :H].numpy(), want, atol=2e-4), i
        assert float(after.rho[0, i]) == pytest.approx(rho, rel=1e-3, abs=1e-6)
        changed += bool(mine)
    assert changed >= 4  # the passes reached several experts


def test_the_online_refit_is_charged_the_state_it_touches():
    """The state a refit touches is charged: at a real shape it outweighs the experts."""
    c = surrogate_cost(64, 2048, 4, 1024)
    online = surrogate_cost(64, 2048, 4, 1024, online="refit", top_k=8)
    d = 2049
    assert online["bytes_per_layer"] == 2 * c["bytes_per_layer"] + 2 * 64 * (d * d + 2048 * d + 2) * 8
    assert online["expert_equivalents"] > 64 > c["expert_equivalents"]
    step = surrogate_cost(64, 2048, 4, 1024, online="gradient", top_k=8)
    assert step["bytes_per_layer"] == 2 * c["bytes_per_layer"]  # read and written back
    assert step["flops_per_token"] > c["flops_per_token"]


def test_gradient_surrogate_steps_toward_the_executed_pairs_only():
    """A normalized gradient step lowers the squared error on the pairs a pass executed and
    reads nothing else (outputs of slots not run, padding); step 0 moves only ρ."""
    from moe_spec.policy.surrogate import GradientSurrogate
    cal_x, cal_y = _nonlinear_pairs(1, 60)
    moments = InputMoments.empty([LAYER], N, H)
    moments.add(LAYER, cal_x, cal_y)
    x, y = _nonlinear_pairs(2, 6, shift=1.5)
    idx = torch.arange(N).repeat(6, 1)[None, :, :K].clone()  # [1, 6, K]: experts 0, 1
    w = torch.ones(1, 6, K)
    w[0, 5] = 0
    outs = y[None].gather(2, idx[..., None].expand(1, 6, K, H)).clone()
    noisy = outs.clone()
    noisy[0, 5] += 100.0
    layers, mask = torch.tensor([LAYER]), torch.ones(1, 6, dtype=torch.bool)

    def err(s):
        pred = predicted_outputs(s, layers, x[None], mask)[0, :5, :K, :H]
        return float((pred - y[:5, :K]).pow(2).sum())

    still = GradientSurrogate(moments, 2, step=0.0)
    before = err(still.surrogate)
    u0 = still.surrogate.u.clone()
    still.observe(layers, x[None], idx, w, outs)
    assert torch.equal(still.surrogate.u, u0) and err(still.surrogate) == pytest.approx(before)
    a, b = GradientSurrogate(moments, 2, step=0.3), GradientSurrogate(moments, 2, step=0.3)
    a.observe(layers, x[None], idx, w, outs)
    b.observe(layers, x[None], idx, w, noisy)
    assert err(a.surrogate) < 0.9 * before
    for p, q in ((a.surrogate.u, b.surrogate.u), (a.surrogate.v, b.surrogate.v),
                 (a.surrogate.rho, b.surrogate.rho)):
        assert torch.equal(p, q)
    assert torch.equal(a.surrogate.u[0, K:], u0[0, K:])  # experts nobody ran: unchanged


def test_posterior_surrogate_is_the_prior_weighted_fit_of_each_experts_last_w_pairs():
    """After passes, each expert's map equals (a M_i (Sxx + λI) + YᵀX)(a (Sxx + λI) + XᵀX)⁻¹
    solved directly (numpy) over exactly its last w executed pairs (X, Y), with M_i the
    calibration's rank-r map and a = κ / n_cal; before any pass (and for experts nobody ran) it
    predicts what the calibration fit does; outputs not run and padding change nothing."""
    import numpy as np

    from moe_spec.policy.surrogate import RIDGE, PosteriorSurrogate
    cal_x, cal_y = _nonlinear_pairs(1, 60)
    moments = InputMoments.empty([LAYER], N, H)
    moments.add(LAYER, cal_x, cal_y)
    kappa, rank, window = 12.0, 2, 2
    post = PosteriorSurrogate(moments, rank, kappa, window)
    base = Surrogate.fit(moments, rank)
    layers, g = torch.tensor([LAYER]), torch.Generator().manual_seed(4)
    probe = torch.randn(1, 3, H, generator=g)
    mask = torch.ones(1, 3, dtype=torch.bool)
    fresh = predicted_outputs(base, layers, probe, mask)
    assert torch.allclose(predicted_outputs(post.refresh(), layers, probe, mask), fresh)
    executed = []
    for seed in (2, 3):  # another domain, two passes: some experts see more than w pairs
        x, y = _nonlinear_pairs(seed, 5, shift=1.5)
        idx = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(5)])[None]
        w = torch.rand(1, 5, K, generator=g) + 0.1
        w[0, 4] = 0
        w[0, 0, 1] = 0
        outs = y[None].gather(2, idx[..., None].expand(1, 5, K, H)).clone()
        outs[0, 4] += 100.0
        outs[0, 0, 1] += 100.0  # what was not run must not matter
        post.observe(layers, x[None], idx, w, outs)
        executed += [(x[t], y[t], int(idx[0, t, s])) for t in range(5) for s in range(K)
                     if w[0, t, s] != 0]
    got = predicted_outputs(post.refresh(), layers, probe, mask)
    xx = moments.xx[0].numpy()
    d = xx.shape[0]
    reg = xx + RIDGE * np.trace(xx) / d * np.eye(d)
    a = kappa / 60
    probe_x = np.concatenate([probe[0].numpy(), np.ones((3, 1))], 1)
    dropped = 0
    for i in range(N):
        every = [(x, y) for x, y, e in executed if e == i]
        mine = every[-window:]
        m = (base.u[0, i].double() @ base.v[0, i].double().T).numpy()  # [H, D]
        if mine:
            xs = np.stack([np.append(x.numpy(), 1.0) for x, _ in mine]).astype(float)
            ys = np.stack([y[i].numpy() for _, y in mine]).astype(float)
            m = np.linalg.solve((a * reg + xs.T @ xs).T, (a * m @ reg + ys.T @ xs).T).T
        assert np.allclose(got[0, :, i, :H].numpy(), probe_x @ m.T, atol=2e-4), i
        dropped += len(every) > window
    assert dropped >= 2  # the window dropped older pairs for several experts


def test_the_posterior_is_charged_what_it_stores():
    """The charge per layer is the float32 state a full posterior holds, counted: its
    rank-(r + w) surrogate read, every expert's window of pairs read and written back and its
    factors written (3× the pairs' numbers), the prior inverse read."""
    from moe_spec.policy.surrogate import PosteriorSurrogate
    cal_x, cal_y = _nonlinear_pairs(1, 60)
    moments = InputMoments.empty([LAYER], N, H)
    moments.add(LAYER, cal_x, cal_y)
    rank, window = 2, 3
    post = PosteriorSurrogate(moments, rank, 4.0, window)
    x, y = _nonlinear_pairs(2, window, shift=1.0)
    every = torch.arange(N).repeat(window, 1)[None]  # every expert runs every token
    post.observe(torch.tensor([LAYER]), x[None], every, torch.ones(1, window, N), y[None])
    s = post.refresh()
    stored = s.u.numel() + s.v.numel() + s.rho.numel()
    pairs = sum(p.numel() for pair in post.pairs[0] for p in pair)
    assert pairs == N * window * (2 * H + 1) and all(p.dtype == torch.float32
                                                     for pair in post.pairs[0] for p in pair)
    inverse = post.inverse[0]
    assert inverse.dtype == torch.float32
    cost = surrogate_cost(N, H, rank, 4, online="posterior", window=window)
    assert cost["bytes_per_layer"] == (stored + 3 * pairs + inverse.numel()) * 4
    wider = surrogate_cost(N, H, rank, 4, online="posterior", window=window + 1)
    assert surrogate_cost(N, H, rank, 4)["bytes_per_layer"] < cost["bytes_per_layer"] \
        < wider["bytes_per_layer"]
    big = surrogate_cost(64, 2048, 4, 1024, online="posterior", window=16)
    assert big["expert_equivalents"] < 64  # bounded, unlike the exact refit


def _prompt_passes(model, passes: int = 5, m: int = 10, shift: float = 1.5):
    """One prompt's verification passes at one layer, off the calibration's domain (inputs
    shifted), as one batch with its prompt and step of every tree-layer."""
    tls = tree_layers(11, passes, m=m)
    hidden = torch.stack([tl.hidden for tl in tls]) + shift
    probs = torch.stack([tl.probs for tl in tls])
    w, idx = probs.topk(K, -1)
    w = w / w.sum(-1, keepdim=True)
    batch = RoutingBatch(probs, idx, w, torch.ones(passes, m, dtype=torch.bool),
                         torch.full((passes,), LAYER), RoutingRule(K, renormalize=True),
                         hidden=hidden)
    outputs = torch.stack([model.expert_outputs(LAYER, x) for x in hidden])
    batch.terms = ExpertTerms.from_outputs(outputs, idx, w)
    return batch, outputs, torch.zeros(passes, dtype=torch.long), torch.arange(passes)


def _pass_outputs_perturbed(batch, outputs, t):
    """``batch`` with every expert output of pass ``t`` changed (routing and inputs kept)."""
    noisy = outputs.clone()
    noisy[t] = noisy[t] * -3.0 + 5.0
    out = RoutingBatch(batch.probs, batch.idx, batch.weights, batch.mask, batch.layers,
                       batch.rule, hidden=batch.hidden)
    out.terms = ExpertTerms.from_outputs(noisy, batch.idx, batch.weights)
    return out


def _tanh_model():
    base = linear_model()
    return SimpleNamespace(moe_layers=[LAYER], num_experts=N, expert_outputs=lambda layer, x:
                           torch.tanh(base.expert_outputs(layer, x)) * 2)


def _replayed(batch, stats, budgets, cov, prompts=None):
    from moe_spec.replay import open_loop
    ranking = rankings.get("sketch-post")().fit(stats)
    if prompts is None:
        prompts = torch.zeros(batch.size, dtype=torch.long)
    steps = torch.tensor([int((prompts[:t] == prompts[t]).sum()) for t in range(batch.size)])
    return open_loop.shortlists(ranking, batch, cov, budgets, prompts, steps,
                                open_loop.Stream())[0]


@pytest.fixture
def weak_prior(monkeypatch):
    """sketch-post with the calibration worth 2 pseudo-tokens (its default 512 outweighs the
    few pairs of these small passes)."""
    from moe_spec.policy.rankings.sketch_post import SketchPosterior
    monkeypatch.setattr(SketchPosterior, "kappa", 2.0)
    return 2.0


def test_sketch_post_in_open_loop_is_the_posterior_stream_pass_by_pass(weak_prior):
    """Open-loop replay of the registered ranking equals the hand-written stream the bench
    scores (bench/sketch_gap.py online_rse): per budget, a fresh PosteriorSurrogate, each pass
    searched by Sketch.from_surrogate on the current posterior, then the outputs of exactly the
    experts that budget's pass ran observed; a new prompt starts from the calibration fit."""
    from moe_spec.policy.overhead import POSTERIOR_WINDOW, SKETCH_RANK
    from moe_spec.policy.rankings.sketch import routing_only
    from moe_spec.policy.surrogate import MOMENTS, PosteriorSurrogate
    model = _tanh_model()
    stats = calibration(model)
    batch, outputs, _, _ = _prompt_passes(model, passes=7)
    cov, budgets = coverage.get("substitution"), [2, 3]
    prompts = torch.tensor([0, 0, 0, 0, 1, 1, 1])  # the second prompt starts afresh
    keep = _replayed(batch, stats, budgets, cov, prompts)
    differs = False
    for j, b in enumerate(budgets):
        for t in range(batch.size):
            if t == 0 or prompts[t] != prompts[t - 1]:
                post = PosteriorSurrogate(stats.fitted[MOMENTS], SKETCH_RANK, weak_prior,
                                          POSTERIOR_WINDOW)
            part = batch.take(torch.tensor([t]))
            want = Sketch.from_surrogate(post.refresh()).shortlists(
                routing_only(part, torch.tensor([0])), cov, [b])[0]
            assert torch.equal(keep[t, j], want[0, 0]), (b, t)
            plain = Sketch.from_surrogate(Surrogate.fit(stats.fitted[MOMENTS], SKETCH_RANK))
            differs |= not torch.equal(plain.shortlists(routing_only(part, torch.tensor([0])),
                                                        cov, [b])[0], want)
            idx, w = cov.apply(part, want)
            idx, w = idx[:, 0], w[:, 0] * part.mask[..., None]
            ran = outputs[t:t + 1].gather(2, idx[..., None].expand(*idx.shape, H))
            post.observe(part.layers, part.hidden, idx, w, ran)
    assert differs  # the posterior moved some shortlist away from plain sketch's


def test_sketch_post_never_reads_the_current_pass_outputs(weak_prior):
    """Perturbing every expert output of the last pass changes no shortlist (no pass reads its
    own outputs); perturbing the first pass's changes a later one (it does learn from them)."""
    model = _tanh_model()
    stats = calibration(model)
    batch, outputs, _, _ = _prompt_passes(model)
    cov, budgets = coverage.get("substitution"), [2, 3]
    keep = _replayed(batch, stats, budgets, cov)

    def perturbed(t):
        return _replayed(_pass_outputs_perturbed(batch, outputs, t), stats, budgets, cov)

    assert torch.equal(perturbed(batch.size - 1), keep)
    assert not torch.equal(perturbed(0), keep)


def test_the_input_gate_is_ppca_mahalanobis_and_one_on_its_own_calibration():
    """Novelty against a direct float64 computation (eigendecomposition of C = Sxx/n, top-p
    directions, σ² the mean of the rest); over the calibration's own tokens its mean is 1 for
    every p, and inputs far from them score far above."""
    from moe_spec.policy.surrogate import InputGate
    model = linear_model()
    tls = tree_layers(1, 8)
    moments = InputMoments.collect(tls, model)
    hidden = torch.stack([tl.hidden for tl in tls])  # [T, M, H]
    mask = torch.ones(hidden.shape[:2], dtype=torch.bool)
    layers = torch.full((len(tls),), LAYER)
    x = torch.cat([hidden.double(), torch.ones(*hidden.shape[:2], 1, dtype=torch.float64)], -1)
    c = (x.reshape(-1, H + 1).T @ x.reshape(-1, H + 1)) / x.shape[0] / x.shape[1]
    vals, vecs = torch.linalg.eigh(c)
    for p in (1, 3, H, H + 1):
        gate = InputGate.fit(moments, p)
        got = gate.novelty(layers, hidden, mask)
        top, lam = vecs[:, -p:], vals[-p:]
        sigma2 = vals[:-p].mean() if p <= H else None
        z = x @ top
        want = (z.pow(2) / lam).sum(-1)
        if sigma2 is not None:
            want = want + (x.pow(2).sum(-1) - z.pow(2).sum(-1)) / sigma2
        want = want / (H + 1)  # [T, M] per token
        assert torch.allclose(gate.per_token(layers, hidden, mask), want, rtol=1e-4), p
        want = want.mean(-1)
        assert torch.allclose(got.double(), want, rtol=1e-4), p
        assert abs(float(got.mean()) - 1.0) < 1e-4, p  # the calibration's own mean
        far = gate.novelty(layers, hidden * 4 + 3, mask)
        assert bool((far > 3).all()), p
    half = mask.clone()
    half[:, 6:] = False  # padding does not count
    gate = InputGate.fit(moments, 3)
    assert bool((gate.per_token(layers, hidden, half)[:, 6:] == 0).all())
    assert torch.allclose(gate.novelty(layers, hidden, half),
                          gate.novelty(layers[:, None].expand(-1, 1).flatten(),
                                       hidden[:, :6], mask[:, :6]))


def _gated(stats, threshold, monkeypatch):
    from moe_spec.policy.rankings.sketch_gated import SketchGated
    monkeypatch.setattr(SketchGated, "threshold", threshold)
    return rankings.get("sketch-gated")().fit(stats)


def _streamed(ranking, batch, budgets, cov):
    from moe_spec.replay import open_loop
    prompts = torch.zeros(batch.size, dtype=torch.long)
    return open_loop.shortlists(ranking, batch, cov, budgets, prompts, torch.arange(batch.size),
                                open_loop.Stream())[0]


@pytest.fixture
def weak_gram_prior(monkeypatch):
    """coact-prior's calibration Gram worth 1e-3 pseudo-observations a pair (its default 8
    outweighs what these few passes execute): its state then decides its shortlists."""
    from moe_spec.policy.rankings.coact_online import CoactOnline
    monkeypatch.setattr(CoactOnline, "prior", 1e-3)


def _gated_reference(stats, batch, outputs, budgets, cov, near):
    """Hand-written: per budget one coact-prior state; each pass takes sketch's shortlist where
    ``near`` and the state's elsewhere, then the state observes what that pass ran."""
    from moe_spec.policy.coverage import experts_used
    from moe_spec.policy.rankings.sketch import routing_only
    sketch = Sketch().fit(stats)
    keep = torch.zeros(batch.size, len(budgets), batch.n, dtype=torch.bool)
    for j, b in enumerate(budgets):
        own = rankings.get("coact-prior")().fit(stats)
        for t in range(batch.size):
            routing = routing_only(batch, torch.tensor([t]))
            chosen = (sketch if near[t] else own).shortlists(routing, cov, [b])[0]
            keep[t, j] = chosen[0, 0]
            idx, w = cov.apply(batch.take(torch.tensor([t])), chosen)
            idx, w = idx[:, 0], w[:, 0] * routing.mask[..., None]
            ran = outputs[t:t + 1].gather(2, idx[..., None].expand(*idx.shape, H))
            own.observe(routing.layers, experts_used(idx, w, batch.n))
            own.observe_outputs(routing.layers, idx, w, ran)
    return keep


def _far_from_pass(batch, first):
    """``batch`` with the MoE inputs of passes ``first..`` moved far from the calibration's."""
    far = batch.hidden.clone()
    far[first:] = far[first:] * 4 + 3
    out = RoutingBatch(batch.probs, batch.idx, batch.weights, batch.mask, batch.layers,
                       batch.rule, hidden=far)
    out.terms = batch.terms
    return out


def test_sketch_gated_is_sketch_near_its_calibration_and_streamed_coact_prior_far(
        monkeypatch, weak_gram_prior):
    """Replayed pass by pass (open_loop.shortlists, one state per budget): with every
    tree-layer gated in it is sketch; with none, coact-prior streamed as replay streams it; at
    the default threshold, inputs like the calibration's get sketch's rows and shifted ones a
    coact-prior state that observed what the *gated* passes ran (the hand-written reference),
    which here differs from coact-prior's own stream (so the test can tell them apart)."""
    model = _tanh_model()
    stats = calibration(model)
    batch, outputs, _, _ = _prompt_passes(model, passes=7, shift=0.0)
    cov, budgets = coverage.get("substitution"), [2, 3, 4]
    sketch = Sketch().fit(stats).shortlists(batch, cov, budgets)[0]
    prior = _streamed(rankings.get("coact-prior")().fit(stats), batch, budgets, cov)
    fresh = torch.cat([rankings.get("coact-prior")().fit(stats).shortlists(
        batch.take(torch.tensor([t])), cov, budgets)[0] for t in range(batch.size)])
    assert not torch.equal(prior, fresh)  # the state matters here
    assert not torch.equal(sketch, prior)
    assert torch.equal(_streamed(_gated(stats, float("inf"), monkeypatch), batch, budgets, cov),
                       sketch)
    assert torch.equal(_streamed(_gated(stats, -1.0, monkeypatch), batch, budgets, cov), prior)
    gated = _gated(stats, 3.0, monkeypatch)
    assert (gated.gate.novelty(batch.layers, batch.hidden, batch.mask) <= 3).all()
    shifted = _far_from_pass(batch, 3)
    near = gated.near(shifted)
    assert near[:3].all() and not near[3:].any()
    # what replay stores per tree-layer (surrogate_ranked): the gate's rows; sketch's every one
    # with its MoE inputs, none without; a routing-only ranking none
    assert torch.equal(gated.surrogate_ranked(shifted), near)
    assert Sketch().fit(stats).surrogate_ranked(shifted).all()
    bare = RoutingBatch(batch.probs, batch.idx, batch.weights, batch.mask, batch.layers,
                        batch.rule)
    assert not Sketch().fit(stats).surrogate_ranked(bare).any()
    assert not rankings.get("coact-prior")().fit(stats).surrogate_ranked(shifted).any()
    used = []  # per streamed pass, the rows the overlay gave sketch
    overlay = type(gated).overlay

    def spied(self, part, *args):
        used.append(self.surrogate_ranked(part))
        return overlay(self, part, *args)

    monkeypatch.setattr(type(gated), "overlay", spied)
    keep = _streamed(gated, shifted, budgets, cov)
    assert torch.equal(torch.cat(used), near)  # what replay stores for the template
    assert torch.equal(keep[:3], sketch[:3])
    assert torch.equal(keep, _gated_reference(stats, shifted, outputs, budgets, cov, near))
    own_stream = _streamed(rankings.get("coact-prior")().fit(stats), shifted, budgets, cov)
    assert not torch.equal(keep[3:], own_stream[3:])


def test_sketch_gated_never_reads_the_current_pass_outputs(monkeypatch, weak_gram_prior):
    """Perturbing the last pass's expert outputs changes no shortlist; perturbing an earlier
    gated-in pass's changes a later gated-out one (coact-prior's state learns from them), so
    outputs do reach it, one pass late. Called directly too, on a batch that carries terms."""
    model = _tanh_model()
    stats = calibration(model)
    batch, outputs, _, _ = _prompt_passes(model, passes=7, shift=0.0)
    batch = _far_from_pass(batch, 3)
    cov, budgets = coverage.get("substitution"), [2, 3]
    keep = _streamed(_gated(stats, 3.0, monkeypatch), batch, budgets, cov)

    def perturbed(t):
        return _pass_outputs_perturbed(batch, outputs, t)

    assert torch.equal(_streamed(_gated(stats, 3.0, monkeypatch), perturbed(batch.size - 1),
                                 budgets, cov), keep)
    assert not torch.equal(_streamed(_gated(stats, 3.0, monkeypatch), perturbed(2), budgets,
                                     cov), keep)
    direct = _gated(stats, 3.0, monkeypatch).shortlists(batch, cov, budgets)[0]
    noisy = _gated(stats, 3.0, monkeypatch).shortlists(perturbed(0), cov, budgets)[0]
    assert torch.equal(direct, noisy)


def test_sketch_gated_is_charged_its_surrogate_and_gate():
    from moe_spec.policy import index, overhead
    from moe_spec.policy.surrogate import InputGate
    gate = InputGate.fit(InputMoments.collect(tree_layers(1, 4), linear_model()), 3)
    held = gate.directions[0].numel() + gate.variances[0].numel() + 1
    assert gate.directions.dtype == torch.float32
    assert overhead.input_gate(H, 3).bytes_per_layer == held * 4
    assert overhead.input_gate(H, 3).flops_per_token == 2 * (H + 1) * 3 + 3 * 3 + 2 * (H + 1)
    both = index.overhead("sketch-gated", 64, 2048)
    assert both == overhead.surrogate(64, 2048) + overhead.input_gate(2048)
    assert both.bytes_per_layer > index.overhead("sketch", 64, 2048).bytes_per_layer
    assert surrogate_cost(64, 2048, 4, 1024, gated=True)["bytes_per_layer"] == \
        both.bytes_per_layer


def test_sketch_gated_without_inputs_or_sums_says_so_and_runs_coact_prior(monkeypatch):
    model = _tanh_model()
    stats = calibration(model)
    batch, _, _, _ = _prompt_passes(model, passes=3, shift=0.0)
    cov, budgets = coverage.get("substitution"), [2, 3]
    prior = _streamed(rankings.get("coact-prior")().fit(stats), batch, budgets, cov)
    bare = RoutingBatch(batch.probs, batch.idx, batch.weights, batch.mask, batch.layers,
                        batch.rule)
    bare.terms = batch.terms
    with pytest.warns(UserWarning, match="no MoE inputs"):
        assert torch.equal(_streamed(_gated(stats, float("inf"), monkeypatch), bare, budgets,
                                     cov), prior)
    fitted = Surrogate.fit(stats.fitted.pop("sketch-moments"), Sketch.rank)
    stats.fitted.clear()  # nor the gate fitted from them above
    from moe_spec.policy.rankings.sketch import attach_surrogate
    attach_surrogate(stats, fitted)  # a loaded surrogate, but no sums to fit the gate from
    with pytest.warns(UserWarning, match="no input sums to gate by"):
        assert torch.equal(_streamed(_gated(stats, float("inf"), monkeypatch), batch, budgets,
                                     cov), prior)


def test_the_input_gate_survives_degenerate_calibrations():
    """A layer with fewer calibration tokens than dimensions warns and caps p at what they span
    (its own tokens still average 1, not the 1e4 a collapsed σ² gives); a layer it never saw
    gates every input out (∞), and padding never turns that into NaN."""
    from moe_spec.policy.surrogate import InputGate
    model = linear_model()
    few = tree_layers(1, 1, m=4)  # 4 tokens for H + 1 = 7 dimensions
    moments = InputMoments.collect(few, model)
    with pytest.warns(UserWarning, match="4 calibration tokens for 7 input dimensions"):
        gate = InputGate.fit(moments, 32)
    own = gate.novelty(torch.tensor([LAYER]), few[0].hidden[None], torch.ones(1, 4, dtype=torch.bool))
    assert 0.5 < float(own) <= 1.0 + 1e-4
    empty = InputMoments.empty([LAYER], N, H)
    with pytest.warns(UserWarning, match="0 calibration tokens"):
        blind = InputGate.fit(empty, 3)
    mask = torch.tensor([[True, True, False]])
    got = blind.novelty(torch.tensor([LAYER]), torch.randn(1, 3, H), mask)
    assert torch.isinf(got).all() and not torch.isnan(got).any()


def test_the_oracle_key_must_say_what_its_calibration_carries():
    """replay refuses to store an oracle cell whose key disagrees with its calibration: with the
    surrogate's sums it starts from the token-aware rankings (key token_aware_starts), without
    them it does not; a ranking without token-aware starts is never checked."""
    from moe_spec.policy.surrogate import MOMENTS
    from moe_spec.replay import plan
    from moe_spec.replay.run import ReplayError, check_starts
    cal = [SimpleNamespace(name="cal", run_id="r1")]
    oracle = rankings.get("oracle")
    with_sums, without = SimpleNamespace(fitted={MOMENTS: object()}), SimpleNamespace(fitted={})
    for sums, stats in ((True, with_sums), (False, without), (False, None)):
        key = plan.unit_key("open", "oracle", "substitution", cal if stats else [],
                            surrogate_sums=sums)
        assert key.get("token_aware_starts", False) is sums
        check_starts(SimpleNamespace(unit=key), oracle, stats)  # agrees: nothing raised
        other = SimpleNamespace(unit={**key, "token_aware_starts": not sums})
        if stats is not None:
            with pytest.raises(ReplayError, match="surrogate's sums"):
                check_starts(other, oracle, stats)
    assert "token_aware_starts" not in plan.unit_key("open", "sketch", "substitution", cal,
                                                     surrogate_sums=True)
    check_starts(SimpleNamespace(unit={}), rankings.get("sketch"), with_sums)


def test_replays_sharing_a_calibration_in_one_process_start_the_oracle_from_what_they_asked():
    """Calibration statistics are collected once per process and shared: a replay asking for a
    token-aware ranking gets the surrogate's sums on a copy, so a later replay asking for none
    neither finds them (its oracle key says no token-aware starts, and the check agrees) nor
    reuses starts cached without them for one that has them (the oracle's start cache is keyed
    by whether the sums were there)."""
    from moe_spec.policy.calibration import collect_runs
    from moe_spec.policy.rankings.sketch import with_surrogate_sums
    from moe_spec.policy.surrogate import MOMENTS
    from moe_spec.replay import plan
    from moe_spec.replay.run import check_starts
    model, tls = linear_model(), tree_layers(1, 8)
    run = SimpleNamespace(run_id="share-c1", name="cal", ref="cal")
    read = lambda r: iter(tls)  # noqa: E731
    oracle = rankings.get("oracle")
    plain = collect_runs([run], read, model, 0)
    first = oracle().fit(plain)  # replay --ranking oracle: no sums, no token-aware starts
    assert "sketch" not in [r.name for r in first.starts]
    with_sums = with_surrogate_sums(plain, [run], model, read)  # --ranking oracle sketch
    assert MOMENTS in with_sums.fitted and MOMENTS not in plain.fitted
    again = collect_runs([run], read, model, 0)
    assert again is plain and MOMENTS not in again.fitted  # --ranking router oracle after it
    for stats, sums in ((with_sums, True), (again, False)):
        key = plan.unit_key("open", "oracle", "substitution", [run], surrogate_sums=sums)
        check_starts(SimpleNamespace(unit=key), oracle, stats)  # agrees: nothing raised
        names = [r.name for r in oracle().fit(stats).starts]
        assert ("sketch" in names) is sums, names
