"""Adaptive budgets on the analysis side (issue 63): the cost model charges each MoE layer its own
load, and the frames, pages and report draw error and throughput against the mean experts
loaded per layer, one curve per budget mode, never fixed and adaptive averaged together."""

import numpy as np
import pytest

from moe_spec.analysis import cost

# A shape small enough to price by hand, on a device with 1 byte/s and 1 flop/s (time = max of
# bytes and flops): per MoE layer bytes = 14 + 3·n (attention 4, router 8, norms 2; an expert
# 3·1·1), flops at one token and no prefix = 2·4 + 4·1·1 + 2·3·2 = 24; the head: 2 bytes, 2 flops.
TINY = cost.ModelShape(layers=2, hidden=1, expert_inter=1, num_experts=8, top_k=2, heads=1,
                       kv_heads=1, head_dim=1, vocab=1, bytes_per_param=1.0)
UNIT = cost.Hardware("unit", 1.0, 1.0)
REAL = cost.ModelShape(layers=16, hidden=2048, expert_inter=768, num_experts=128, top_k=8,
                       heads=32, kv_heads=4, head_dim=128, vocab=151936, dense_layers=2,
                       dense_inter=6144)


def test_a_constant_allocation_costs_exactly_what_one_budget_does():
    hw = cost.PROFILES["H100-SXM"]
    for tokens, b in ((63, 40.0), (1, 8), (63, 12.5)):
        one = cost.pass_time(REAL, hw, tokens, 512, b)
        assert cost.pass_time(REAL, hw, tokens, 512, [b] * 14) == one  # one load per MoE layer
        assert cost.pass_time(REAL, hw, tokens, 512, np.full(70, b)) == one  # a pooled sample
    extra = REAL.overhead("sketch")
    assert cost.projected_speedup(REAL, hw, 3.0, [40] * 14, 63, 512, 1e-4, overhead=extra) == \
        cost.projected_speedup(REAL, hw, 3.0, 40, 63, 512, 1e-4, overhead=extra)


def test_each_layer_is_charged_its_own_load():
    # loads 1 and 7: layer 1 compute-bound max(17, 24) = 24, layer 2 memory-bound max(35, 24)
    # = 35, head 2: 61 s; memory only 17 + 35 + 2 = 54, compute only 24 + 24 + 2 = 50
    assert cost.pass_time(TINY, UNIT, 1, 0, [1, 7]) == (61.0, 54.0, 50.0)
    # the same mean load everywhere, 4: max(26, 24) twice + 2 = 54 (same bytes, less time:
    # a spread costs more than its mean where a layer falls under the compute floor)
    assert cost.pass_time(TINY, UNIT, 1, 0, 4) == (54.0, 54.0, 50.0)
    assert cost.pass_time(TINY, UNIT, 1, 0, [4, 4]) == (54.0, 54.0, 50.0)
    # a sample of per-layer loads (tree-layers of many passes) stands for the expected pass
    assert cost.pass_time(TINY, UNIT, 1, 0, [1, 7, 7, 1]) == (61.0, 54.0, 50.0)
    assert cost.pass_time(TINY, UNIT, 1, 0, [7, 7, 7, 1]) == (2 * (0.25 * 24 + 0.75 * 35) + 2,
                                                               2 * (0.25 * 17 + 0.75 * 35) + 2,
                                                               50.0)
    # the speedup charges the same: T_AR at top-2 (max(20, 24) · 2 + 2 = 50), no draft time
    assert cost.projected_speedup(TINY, UNIT, 3.0, [1, 7], 1, 0, 0.0) == pytest.approx(
        3.0 * 50 / 61)


def test_loads_must_be_numbers():
    for bad in ([], [float("nan")], [1, float("inf")]):
        with pytest.raises(ValueError, match="experts loaded per layer"):
            cost.pass_time(TINY, UNIT, 1, 0, bad)
