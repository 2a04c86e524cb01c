"""OLMoE (``olmoe``): softmax scores, plain top-k, mixing weights per ``norm_topk_prob`` (raw in
OLMoE-1B-7B), every layer sparse."""

from moe_spec.moe.families import Family, FamilySpec, TinyModel

FAMILY = Family(
    FamilySpec("olmoe", scoring_func="softmax", renormalize="norm_topk_prob"),
    alias="olmoe", hub_id="allenai/OLMoE-1B-7B-0924",
    # The public OLMoE EAGLE-3 head was trained on the inputs of layers {2, 8, 15}, not the
    # official {2, L//2, L-3} (shared/docs/eagle-notes.md §5.2).
    draft="wantsleep/OLMoE_1B_7B_Eagle3", feature_layers=(2, 8, 15),
    real_config=dict(
        hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8,
        norm_topk_prob=False, num_attention_heads=16, num_key_value_heads=16,
        num_hidden_layers=16, vocab_size=50304, max_position_embeddings=4096),
    # N, k and the mixing-weight rule of the real checkpoint; its aux-loss coefficient (0.01)
    tiny=TinyModel("tiny-olmoe", dict(
        num_key_value_heads=4, num_experts=64, num_experts_per_tok=8, intermediate_size=16,
        norm_topk_prob=False, router_aux_loss_coef=0.01)),
    experts_key="num_experts", order=10,
)
