"""The MoE adapter against the models' own MoE blocks and a slow per-token reference."""

import json

import pytest
import torch
from helpers import block_io, real_ids
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_spec.moe import models
from moe_spec.moe.adapter import MoEAdapter
from moe_spec.training.tiny_moe import SPECS

TOL = dict(rtol=1e-5, atol=1e-6)


def _reference_routing(layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts, mixing weights) of one token ``x [H]`` in float64, from the family's published
    rule and the router's weight tensors (no adapter or policy code)."""
    family = layer.block.__class__.__name__
    if family == "DeepseekV3MoE":  # sigmoid, bias-corrected group-limited choice, × scale
        gate = layer.block.gate
        s = torch.sigmoid(gate.weight.double() @ x)
        choice = s + gate.e_score_correction_bias.double()
        groups = choice.view(gate.num_group, -1)
        best_groups = groups.topk(2, dim=-1).values.sum(-1).topk(gate.topk_group).indices
        allowed = torch.full_like(groups, float("-inf"))
        allowed[best_groups] = 0
        top = (choice + allowed.reshape(-1)).topk(gate.top_k).indices
        w = s[top] / (s[top].sum() + 1e-20) if gate.norm_topk_prob else s[top]
        return top, w * gate.routed_scaling_factor
    if family == "GptOssMLP":  # router bias, softmax over the top-k logits
        router = layer.block.router
        z = router.weight.double() @ x + router.bias.double()
        top = z.topk(router.top_k).indices
        return top, torch.softmax(z[top], -1)
    g = torch.softmax(layer.block.gate.weight.double() @ x, dim=-1)
    top = torch.topk(g, layer.top_k).indices
    return top, (g[top] / g[top].sum() if layer.renormalize else g[top])


def _reference_expert(layer, i: int, x: torch.Tensor) -> torch.Tensor:
    experts = layer.block.experts
    if layer.block.__class__.__name__ == "GptOssMLP":  # biases, clamped SwiGLU, interleaved
        gu = x @ experts.gate_up_proj[i].double() + experts.gate_up_proj_bias[i].double()
        gate, up = gu[::2].clamp(max=experts.limit), gu[1::2].clamp(-experts.limit, experts.limit)
        act = (up + 1) * gate * torch.sigmoid(gate * experts.alpha)
        return act @ experts.down_proj[i].double() + experts.down_proj_bias[i].double()
    gate_up, down = experts.gate_up_proj[i].double(), experts.down_proj[i].double()
    gu = gate_up @ x
    inter = down.shape[-1]
    return down @ (torch.nn.functional.silu(gu[:inter]) * gu[inter:])


def _reference_shared(layer, x: torch.Tensor) -> torch.Tensor:
    if layer.shared is None:
        return torch.zeros_like(x)
    mlp = layer.shared
    act = torch.nn.functional.silu(mlp.gate_proj.weight.double() @ x) * \
        (mlp.up_proj.weight.double() @ x)
    return mlp.down_proj.weight.double() @ act


def reference_moe(layer, h: torch.Tensor) -> torch.Tensor:
    """Obviously-correct O*_t = Σ_{i∈T_k(t)} ḡ_i(t) E_i(h_t) (+ shared experts), one token and
    expert at a time, in float64, straight from the weight tensors (no adapter code)."""
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        x = h[t].double()
        top, weights = _reference_routing(layer, x)
        o = _reference_shared(layer, x)
        for w, i in zip(weights, top.tolist()):
            o = o + w * _reference_expert(layer, i, x)
        out[t] = o.to(h.dtype)
    return out


def router_trace(model, adapter, input_ids) -> dict:
    """Every router's input and own output ``(hidden [T, H], logits, weights, index)`` per MoE
    layer, captured by hooks during one forward."""
    seen = {}
    hooks = [layer.router.register_forward_hook(  # every router returns (logits, weights, ids)
        lambda mod, args, out, i=layer.index: seen.__setitem__(i, (args[0], *out)))
        for layer in adapter]
    with torch.no_grad():
        model(input_ids=input_ids)
    for hook in hooks:
        hook.remove()
    return seen


def _same_sets(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a.long().sort(-1).values == b.long().sort(-1).values).all())


def _contract_num_experts(model, adapter, trace):
    """N: the router's logits, its weight rows and the experts module agree with the adapter."""
    for layer in adapter:
        _, logits, _, _ = trace[layer.index]
        assert layer.num_experts == logits.shape[-1] == layer.experts.gate_up_proj.shape[0]
    assert adapter.num_experts == adapter.layers[0].num_experts


def _contract_top_k(model, adapter, trace):
    """k: as many experts per token as the router picks, and as the config says."""
    for layer in adapter:
        _, _, weights, index = trace[layer.index]
        assert layer.top_k == index.shape[-1] == weights.shape[-1]
    assert adapter.top_k == model.config.num_experts_per_tok


def _contract_shared_experts(model, adapter, trace):
    """Shared experts: every submodule of a sparse block is its router, its experts or the
    shared experts the adapter computes (none is silently left out of the gold output)."""
    for layer in adapter:
        others = [m for m in layer.block.children() if m is not layer.router
                  and m is not layer.experts]
        assert others == ([] if layer.shared is None else [layer.shared])
    assert adapter.has_shared_experts == any(layer.shared is not None for layer in adapter)


def _contract_dense_layers(model, adapter, trace):
    """Dense layers: exactly the decoder layers whose MLP has no experts are left out."""
    layers = model.model.layers
    dense = {i for i, layer in enumerate(layers) if not hasattr(layer.mlp, "experts")}
    assert dense == set(range(len(layers))) - set(adapter.moe_layers)
    assert adapter.num_decoder_layers == len(layers)


def _contract_score_function(model, adapter, trace):
    """Score function: the router's weights are proportional to the rule's scores of its experts
    (whatever the mixing's normalisation and scale), and the rule's selection over those scores
    picks the router's own experts."""
    for layer in adapter:
        hidden, _, weights, index = trace[layer.index]
        scores = layer.router_scores(hidden.reshape(-1, hidden.shape[-1]))
        kept = scores.gather(-1, index.long()).double()
        weights = weights.double()
        torch.testing.assert_close(kept / kept.sum(-1, keepdim=True),
                                   weights / weights.sum(-1, keepdim=True), **TOL)
        idx, _ = layer.rule.select(scores)
        assert _same_sets(idx, index)


def _contract_mixing(model, adapter, trace):
    """Mixing: the rule's weights of the router's experts are the router's own weights, and
    they are the rule's closed form ``a(Z) g`` (what the substitution oracle scores with)."""
    for layer in adapter:
        hidden, _, weights, index = trace[layer.index]
        scores = layer.router_scores(hidden.reshape(-1, hidden.shape[-1]))
        index = index.long()
        mixed = layer.rule.mix(scores, index)
        torch.testing.assert_close(mixed, weights.float(), **TOL)
        kept = scores.gather(-1, index).double()
        closed = layer.rule.mixing.coefficient(kept.sum(-1, keepdim=True)) * kept
        torch.testing.assert_close(mixed.double(), closed, **TOL)


FAMILY_CONTRACT = {  # what every supported family must satisfy, read off its modules
    "N experts": _contract_num_experts, "k": _contract_top_k,
    "shared experts": _contract_shared_experts, "dense layers": _contract_dense_layers,
    "score function": _contract_score_function, "mixing": _contract_mixing,
}


@pytest.mark.parametrize("clause", FAMILY_CONTRACT)
def test_every_family_passes_the_contract(embedded, clause):
    with torch.no_grad():
        adapter = MoEAdapter(embedded.model)
        FAMILY_CONTRACT[clause](embedded.model, adapter,
                                router_trace(embedded.model, adapter, real_ids(embedded.tokenizer)))


def test_every_family_has_an_embedded_model():
    """The contract runs over every family of moe.families: each has an embedded model."""
    from moe_spec.moe.families import FAMILIES
    types = {json.loads((models.EMBEDDED_DIR / name / "config.json").read_text())["model_type"]
             for name in models.EMBEDDED}
    assert types == set(FAMILIES)


def test_embedded_models_have_distinct_eagle_feature_layers(embedded):
    adapter = MoEAdapter(embedded.model)
    assert adapter.num_decoder_layers >= 8
    L = adapter.num_decoder_layers
    assert len({2, L // 2, L - 3}) == 3  # EAGLE-3 feature layers stay distinct


@pytest.mark.parametrize("inputs", ["real", "random"])
def test_recomputed_moe_output_equals_model_block_output(embedded, inputs):
    torch.manual_seed(0)
    ids = real_ids(embedded.tokenizer) if inputs == "real" else \
        torch.randint(0, embedded.model.config.vocab_size, (2, 24))
    adapter, seen = block_io(embedded.model, ids)
    for layer in adapter:
        h, gold = seen[layer.index]
        h, gold = h.reshape(-1, h.shape[-1]), gold.reshape(-1, gold.shape[-1])
        with torch.no_grad():
            torch.testing.assert_close(layer.forward(h), gold, **TOL)
            probs = layer.router_scores(h)
            index, weights = layer.route(h)
            torch.testing.assert_close(layer.rule.mix(probs, index), weights.float(), **TOL)
            routed = layer.moe_output(h, index, layer.rule.mix(probs, index))
            shared = layer.shared_output(h)
            torch.testing.assert_close(routed if shared is None else routed + shared, gold, **TOL)
            torch.testing.assert_close(reference_moe(layer, h[:12]), gold[:12], rtol=1e-4, atol=1e-5)


def test_all_experts_output_equals_per_expert_output(embedded):
    torch.manual_seed(1)
    adapter = MoEAdapter(embedded.model)
    h = torch.randn(9, embedded.model.config.hidden_size)
    for layer in (adapter.layers[0], adapter.layers[-1]):
        with torch.no_grad():
            all_out = layer.all_expert_outputs(h)
            assert all_out.shape == (9, layer.num_experts, h.shape[-1])
            for i in range(layer.num_experts):
                torch.testing.assert_close(all_out[:, i], layer.expert_output(i, h), **TOL)


def _random_model(name, **overrides):
    torch.manual_seed(0)
    return SPECS[name].model_cls(SPECS[name].build_config(**overrides)).eval()


_MIXTRAL = _random_model("tiny-mixtral")


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 6), seed=st.integers(0, 10_000))
def test_moe_output_is_the_weighted_sum_of_expert_outputs(tokens, seed):
    """Property: for any indices and weights, moe_output = Σ_j w_j · all_expert_outputs[idx_j]."""
    layer = MoEAdapter(_MIXTRAL).layers[3]
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, _MIXTRAL.config.hidden_size, generator=g)
    idx = torch.stack([torch.randperm(layer.num_experts, generator=g)[:layer.top_k]
                       for _ in range(tokens)])
    w = torch.rand(tokens, layer.top_k, generator=g)
    with torch.no_grad():
        expected = (layer.all_expert_outputs(h).gather(
            1, idx[..., None].expand(-1, -1, h.shape[-1])) * w[..., None]).sum(1)
        torch.testing.assert_close(layer.moe_output(h, idx, w), expected, **TOL)


def test_dense_layers_of_qwen3_moe_are_skipped():
    model = _random_model("tiny-qwen3-moe", mlp_only_layers=[1, 5])
    adapter = MoEAdapter(model)
    assert [layer.index for layer in adapter] == [0, 2, 3, 4, 6, 7]
    with pytest.raises(KeyError, match="no MoE block"):
        adapter.layer(1)


@pytest.mark.parametrize("model_type", ["qwen2_moe", "granitemoe"])
def test_unsupported_families_are_refused_in_one_line(model_type):
    """A family without a routing spec is refused at load, naming the supported ones (a random
    Qwen2-MoE would otherwise pass with its gated shared expert ignored)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from moe_spec.moe.families import UnsupportedModelError
    cfg = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=64,
                               moe_intermediate_size=32, shared_expert_intermediate_size=32,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                               vocab_size=128, num_experts=8, num_local_experts=8,
                               num_experts_per_tok=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(UnsupportedModelError, match="supported MoE families: olmoe"):
        MoEAdapter(model)


def test_a_router_that_breaks_its_spec_is_refused():
    """The load-time probe catches a router that does not compute what its spec says."""
    from moe_spec.moe.families import UnsupportedModelError
    model = _random_model("tiny-olmoe", num_hidden_layers=2)
    model.config.norm_topk_prob = True  # the spec now says renormalise; the routers do not
    with pytest.raises(UnsupportedModelError, match="does not compute what its routing spec"):
        MoEAdapter(model)
