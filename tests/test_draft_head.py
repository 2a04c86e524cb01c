"""Draft heads load in EAGLE's native checkpoint layout and refuse anything else."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_spec.eagle.draft_head import DraftConfig, DraftHeadError, Eagle1Draft, Eagle3Draft, load_draft
from moe_spec.training.tiny_moe import SPECS

EAGLE3_KEYS = {"fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
               "midlayer.post_attention_layernorm.weight", "norm.weight", "lm_head.weight",
               "d2t", "t2d"} | {f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"} | \
              {f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return SPECS["tiny-mixtral"].model_cls(SPECS["tiny-mixtral"].build_config()).eval()


def _cfg(target, **kw):
    c = target.config
    return DraftConfig(hidden_size=c.hidden_size, intermediate_size=64, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=c.vocab_size, **kw)


def test_eagle3_native_keys_round_trip(target, tmp_path):
    head = Eagle3Draft(_cfg(target, draft_vocab_size=512), target.get_input_embeddings())
    head.d2t.copy_(torch.arange(512) * 3)
    head.save_pretrained(tmp_path)
    assert set(load_file(tmp_path / "model.safetensors")) == EAGLE3_KEYS
    loaded = load_draft(tmp_path, target)
    assert isinstance(loaded, Eagle3Draft)
    assert loaded.config.feature_layers == [2, 4, 5]
    assert torch.equal(loaded.to_target_ids(torch.tensor([0, 1, 5])), torch.tensor([0, 4, 20]))
    for k, v in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v)


def test_missing_or_unexpected_keys_are_refused(target, tmp_path):
    head = Eagle3Draft(_cfg(target), target.get_input_embeddings())
    head.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in state.items()}
    save_file(renamed, tmp_path / "model.safetensors")
    with pytest.raises(DraftHeadError, match="missing .*midlayer.*unexpected .*layers.0"):
        load_draft(tmp_path, target, eagle_version=3)


def test_head_for_another_target_is_refused(target, tmp_path):
    head = Eagle3Draft(_cfg(target), target.get_input_embeddings())
    head.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["vocab_size"] = 32000
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DraftHeadError, match="trained for another model"):
        load_draft(tmp_path, target)


def test_specforge_layer_ids_are_layer_outputs():
    cfg = DraftConfig.from_dict(dict(hidden_size=8, intermediate_size=8, num_attention_heads=2,
                                     num_key_value_heads=2, vocab_size=10,
                                     eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 23, 44]}))
    assert cfg.feature_layers == [2, 24, 45]


def test_eagle1_head_loads_from_bin_with_native_keys(target, tmp_path):
    cfg = _cfg(target, eagle_version=1)
    head = Eagle1Draft(cfg, target.get_input_embeddings(), target.get_output_embeddings())
    state = {k: v for k, v in head.state_dict().items()
             if not k.startswith(("embed_tokens", "target_lm_head"))}
    assert "fc.bias" in state and "layers.0.input_layernorm.weight" not in state
    torch.save(state, tmp_path / "pytorch_model.bin")
    raw = {k: v for k, v in json.loads(json.dumps(cfg.__dict__)).items() if k != "eagle_version"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    loaded = load_draft(tmp_path, target)
    assert isinstance(loaded, Eagle1Draft) and loaded.config.eagle_version == 1
    h, _ = loaded(torch.randn(1, 3, cfg.hidden_size), torch.tensor([[1, 2, 3]]),
                  torch.arange(3), None, torch.ones(3, 3, dtype=torch.bool).tril()[None, None])
    assert loaded.logits(h).shape == (1, 3, cfg.vocab_size)
