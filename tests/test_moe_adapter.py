"""The MoE adapter against the models' own MoE blocks and a slow per-token reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe.adapter import MoEAdapter
from tasks import benchmarks
from training.tiny_moe import SPECS

TOL = dict(rtol=1e-5, atol=1e-6)


def reference_moe(layer, h: torch.Tensor) -> torch.Tensor:
    """Obviously-correct O*_t = Σ_{i∈T_k(t)} ḡ_i(t) E_i(h_t), one token and expert at a time,
    straight from the weight tensors (no adapter code)."""
    w_router = layer.block.gate.weight
    gate_up, down = layer.block.experts.gate_up_proj, layer.block.experts.down_proj
    inter = down.shape[-1]
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        g = torch.softmax((w_router @ h[t]).double(), dim=-1)
        top = torch.topk(g, layer.top_k).indices
        weights = g[top] / g[top].sum() if layer.renormalize else g[top]
        for w, i in zip(weights, top):
            gu = gate_up[i] @ h[t]
            act = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            out[t] += (w * (down[i] @ act).double()).to(h.dtype)
    return out


def block_io(model, input_ids):
    """(MoE input, MoE output) of every sparse block, captured by hooks during a forward."""
    adapter = MoEAdapter(model)
    seen = {}
    hooks = [layer.block.register_forward_hook(
        lambda mod, args, out, i=layer.index: seen.__setitem__(i, (args[0], out)))
        for layer in adapter]
    with torch.no_grad():
        model(input_ids=input_ids)
    for hook in hooks:
        hook.remove()
    return adapter, seen


def real_ids(tokenizer, n=40):
    text = benchmarks.load("mbpp", limit=1)[0].text
    return tokenizer(text, return_tensors="pt")["input_ids"][:, :n]


def test_family_settings_match_the_real_checkpoints(embedded):
    adapter = MoEAdapter(embedded.model)
    expected = {"tiny-olmoe": (64, 8, False), "tiny-qwen3-moe": (128, 8, True),
                "tiny-mixtral": (8, 2, True)}[embedded.name]
    assert (adapter.num_experts, adapter.top_k, adapter.renormalize) == expected
    assert adapter.num_decoder_layers >= 8 and len(adapter) == adapter.num_decoder_layers
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
            torch.testing.assert_close(layer.moe_output(h, index, layer.rule.mix(probs, index)),
                                       gold, **TOL)
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


def test_router_scores_match_the_models_router_logits(embedded):
    ids = real_ids(embedded.tokenizer, 20)
    adapter, seen = block_io(embedded.model, ids)
    with torch.no_grad():
        out = embedded.model(input_ids=ids, output_router_logits=True)
    for layer, logits in zip(adapter, out.router_logits):
        h = seen[layer.index][0].reshape(-1, embedded.model.config.hidden_size)
        torch.testing.assert_close(layer.router_scores(h), torch.softmax(logits.float(), -1), **TOL)


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

    from moe.families import UnsupportedModelError
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
    from moe.families import UnsupportedModelError
    model = _random_model("tiny-olmoe", num_hidden_layers=2)
    model.config.norm_topk_prob = True  # the spec now says renormalise; the routers do not
    with pytest.raises(UnsupportedModelError, match="does not compute what its routing spec"):
        MoEAdapter(model)
