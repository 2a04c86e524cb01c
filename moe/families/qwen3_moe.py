"""Qwen3-MoE (``qwen3_moe``): softmax scores, plain top-k, mixing weights per
``norm_topk_prob``; a layer is dense when listed in ``mlp_only_layers`` or off the sparse step."""

from moe_spec.moe.families import Family, FamilySpec, TinyModel


def dense_layers(config) -> set[int]:
    """Qwen3-MoE: a layer is dense when listed in ``mlp_only_layers`` or off the sparse step."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    listed = set(getattr(config, "mlp_only_layers", []) or [])
    return {i for i in range(config.num_hidden_layers) if i in listed or (i + 1) % step != 0}


FAMILY = Family(
    FamilySpec("qwen3_moe", scoring_func="softmax", renormalize="norm_topk_prob",
               dense_layers=dense_layers),
    alias="qwen3-moe", hub_id="Qwen/Qwen3-30B-A3B", draft="Tengyunw/qwen3_30b_moe_eagle3",
    real_config=dict(
        hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_hidden_layers=48, vocab_size=151936,
        max_position_embeddings=40960),
    # N, k and the mixing-weight rule of the real checkpoint; its aux-loss coefficient (0.001)
    tiny=TinyModel("tiny-qwen3-moe", dict(
        num_key_value_heads=2, head_dim=32, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=8, intermediate_size=256, norm_topk_prob=True,
        router_aux_loss_coef=0.001)),
    experts_key="num_experts", order=20,
)
