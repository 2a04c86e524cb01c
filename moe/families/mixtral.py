"""Mixtral (``mixtral``): softmax scores, plain top-k, mixing weights renormalised over the
top-k, every layer sparse."""

from moe_spec.moe.families import Family, FamilySpec, TinyModel

FAMILY = Family(
    FamilySpec("mixtral", scoring_func="softmax", renormalize=True),
    alias="mixtral", hub_id="mistralai/Mixtral-8x7B-Instruct-v0.1",
    draft="yuhuili/EAGLE-mixtral-instruct-8x7B",  # only an EAGLE-1 head exists for Mixtral
    real_config=dict(
        hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
        num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32, vocab_size=32000,
        max_position_embeddings=32768),
    # N, k and the mixing-weight rule of the real checkpoint; its aux-loss coefficient (0.02)
    tiny=TinyModel("tiny-mixtral", dict(
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, intermediate_size=128,
        router_aux_loss_coef=0.02, router_jitter_noise=0.0)),
    experts_key="num_local_experts", order=30,
)
