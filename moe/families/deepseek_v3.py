"""DeepSeek-V3 (``deepseek_v3``): sigmoid scores, selection by ``scores +
e_score_correction_bias`` within the ``topk_group`` of ``n_group`` groups with the best
two-expert sums; weights from the unbiased scores, renormalised per ``norm_topk_prob``, times
``routed_scaling_factor``; one MLP of ``n_shared_experts`` always-on shared experts; the first
``first_k_dense_replace`` layers dense; MLA attention."""

from moe_spec.moe.families import Family, FamilySpec, TinyModel


def dense_layers(config) -> set[int]:
    """DeepSeek-V3: the first ``first_k_dense_replace`` layers have a dense MLP."""
    return set(range(min(config.first_k_dense_replace or 0, config.num_hidden_layers)))


def shallow_config(layers: int) -> dict:
    """Keep the MoE layers of a few-layer model (the real first 3 are dense)."""
    return dict(first_k_dense_replace=0)


FAMILY = Family(
    FamilySpec("deepseek_v3", scoring_func="sigmoid", renormalize="norm_topk_prob",
               renormalize_eps=1e-20, routed_scaling_factor="routed_scaling_factor",
               e_score_correction_bias="e_score_correction_bias",
               grouped_topk=("n_group", "topk_group"), shared_experts="shared_experts",
               dense_layers=dense_layers),
    # No EAGLE-3 head for it is known to load in EAGLE's native layout here: pass --draft.
    alias="deepseek-v3", hub_id="deepseek-ai/DeepSeek-V3",
    real_config=dict(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8,
        topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=3,
        num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, head_dim=64,
        num_hidden_layers=61, vocab_size=129280, max_position_embeddings=163840),
    # DeepSeek-V3's routing at small scale: 64 routed experts in 8 groups, top-6 within the best
    # 4 groups, sigmoid scores with a selection bias updated aux-loss-free (γ = 1e-3), weights
    # renormalised × 2.5, one shared expert, the first layer dense, MLA attention; its router
    # trained per training.tiny_moe.RouterRecipe (issue 28: 5× learning rate, sequence-wise
    # balance loss α = 1e-4)
    tiny=TinyModel("tiny-deepseek-v3", dict(
        num_key_value_heads=4, n_routed_experts=64, n_group=8, topk_group=4,
        num_experts_per_tok=6, n_shared_experts=1, moe_intermediate_size=16,
        intermediate_size=256, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=32, head_dim=16), balancing="bias",
        router=dict(lr_scale=5.0, weight_decay=0.1, seq_aux=1e-4)),
    experts_key="n_routed_experts", shallow_config=shallow_config, order=40,
)
