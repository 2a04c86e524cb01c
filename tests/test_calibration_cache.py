"""Calibration statistics saved per run and reused (policy.calibration.save_stats / load_stats,
collect_runs(saved=...)), and the learned ranking's fit kept beside them: what a second replay
reads instead of recomputing every expert output and refitting."""

from types import SimpleNamespace

import torch
from helpers import synthetic_calibration

from moe_spec.policy import calibration
from moe_spec.policy.calibration import collect_runs, load_stats, save_stats


def test_saved_statistics_round_trip_with_their_examples(tmp_path):
    stats, _, _ = synthetic_calibration(0, 6, examples=4)
    assert stats.examples
    save_stats(stats, tmp_path / "s.safetensors")
    back = load_stats(tmp_path / "s.safetensors")
    assert back.layers == stats.layers and back.sources == stats.sources
    for name in ("gram", "pairs", "moments"):
        assert torch.equal(getattr(back, name), getattr(stats, name)), name
    assert len(back.examples) == len(stats.examples)
    for a, b in zip(back.examples, stats.examples):
        assert a.layer == b.layer
        for f in ("probs", "idx", "weights", "order"):
            assert torch.equal(getattr(a, f), getattr(b, f)), f
    (tmp_path / "bad.safetensors").write_bytes(b"not a file of statistics")
    assert load_stats(tmp_path / "bad.safetensors") is None  # recomputed, never trusted


def test_a_second_collection_reads_the_saved_statistics_without_the_model(tmp_path, monkeypatch):
    _, tls, model = synthetic_calibration(1, 5)
    run = SimpleNamespace(run_id="r1", name="cal", ref={"run": "cal", "run_id": "r1"})
    saved = lambda r: tmp_path / f"{r.run_id}.safetensors"  # noqa: E731
    monkeypatch.setattr(calibration, "_COLLECTED", {})
    first = collect_runs([run], lambda r: iter(tls), model, 0, saved)
    assert first.saved is not None and first.saved.exists()
    assert "examples0" in first.saved.name  # examples asked for are part of what is saved
    monkeypatch.setattr(calibration, "_COLLECTED", {})  # a new process

    def no_model(layer, x):
        raise AssertionError("expert outputs recomputed")
    blind = SimpleNamespace(moe_layers=model.moe_layers, num_experts=model.num_experts,
                            expert_outputs=no_model)
    second = collect_runs([run], lambda r: iter(tls), blind, 0, saved)
    assert torch.equal(second.gram, first.gram) and torch.equal(second.pairs, first.pairs)
    monkeypatch.setattr(calibration, "_COLLECTED", {})
    with_examples = collect_runs([run], lambda r: iter(tls), model, 3, saved)  # not the same file
    assert with_examples.saved != first.saved and len(with_examples.examples) == 3
