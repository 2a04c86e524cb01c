"""gpt-oss (``gpt_oss``): the router has a bias and takes the softmax of the top-k logits (the
softmax over all N renormalised over the top-k); experts with biases and a clamped SwiGLU;
attention sinks, sliding-window and full attention layers alternating. transformers has no sdpa
path for its attention sinks: it runs, and its tiny model trains, with eager attention."""

from moe_spec.moe.families import Family, FamilySpec, TinyModel


def shallow_config(layers: int) -> dict:
    """Sliding and full attention alternate, over the few layers kept."""
    return dict(layer_types=(["sliding_attention", "full_attention"] * layers)[:layers])


FAMILY = Family(
    FamilySpec("gpt_oss", scoring_func="softmax", renormalize=True, router="router",
               attention="eager"),
    # No EAGLE-3 head for it is known to load in EAGLE's native layout here: pass --draft.
    alias="gpt-oss", hub_id="openai/gpt-oss-20b",
    real_config=dict(
        hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128,
        num_hidden_layers=24, vocab_size=201088, max_position_embeddings=131072),
    # softmax over the top-4 of 32 experts, sliding-window (32 tokens) and full layers
    # alternating, the real config's aux coefficient 0.9
    tiny=TinyModel("tiny-gpt-oss", dict(
        num_key_value_heads=2, head_dim=32, num_local_experts=32, num_experts_per_tok=4,
        intermediate_size=32, sliding_window=32,
        layer_types=["sliding_attention", "full_attention"] * 4, router_aux_loss_coef=0.9)),
    experts_key="num_local_experts", shallow_config=shallow_config, order=50,
)
