"""Model registry: aliases, hub ids, local folders, offline failures, device and dtype."""

import time

import pytest
import torch
from helpers import call

from moe_spec.moe import models


def test_embedded_aliases_resolve_to_hf_folders():
    for name in models.EMBEDDED:
        src = models.resolve(name)
        assert src.path == models.EMBEDDED_DIR / name
        assert (src.path / "config.json").is_file() and (src.path / "tokenizer.json").is_file()


def test_real_aliases_resolve_to_hub_ids():
    assert models.resolve("olmoe").hub_id == "allenai/OLMoE-1B-7B-0924"
    assert models.resolve("qwen3-moe").hub_id == "Qwen/Qwen3-30B-A3B"
    assert models.resolve("mixtral").hub_id == "mistralai/Mixtral-8x7B-Instruct-v0.1"
    assert models.resolve("someorg/some-moe").hub_id == "someorg/some-moe"


def test_local_folder_resolves(tmp_path):
    src = models.resolve(str(models.EMBEDDED_DIR / "tiny-mixtral"))
    assert src.path == (models.EMBEDDED_DIR / "tiny-mixtral").resolve() and src.hub_id is None
    with pytest.raises(models.ModelError, match="no config.json"):
        models.resolve(str(tmp_path))


def test_unknown_alias_lists_known_ones():
    with pytest.raises(models.ModelError) as exc:
        models.resolve("olmo")
    msg = str(exc.value)
    assert "\n" not in msg
    for name in models.ALIASES:
        assert name in msg


@pytest.mark.parametrize("alias,alternative", [("olmoe", "tiny-olmoe"),
                                               ("qwen3-moe", "tiny-qwen3-moe"),
                                               ("mixtral", "tiny-mixtral")])
def test_network_alias_fails_at_once_offline_naming_embedded_alternative(alias, alternative):
    start = time.perf_counter()
    with pytest.raises(models.ModelError) as exc:
        models.load(alias)
    assert time.perf_counter() - start < 5
    assert f"--model {alternative}" in str(exc.value) and "\n" not in str(exc.value)


def test_auto_device_and_dtype():
    dev = models.pick_device("auto")
    assert dev.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert models.pick_dtype("auto", torch.device("cpu")) == torch.float32
    assert models.pick_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert models.pick_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(models.ModelError, match="unknown dtype"):
        models.pick_dtype("int3", dev)


def test_dtype_override_loads_in_that_dtype():
    loaded = models.load("tiny-mixtral", device="cpu", dtype="bfloat16")
    assert next(loaded.model.parameters()).dtype == torch.bfloat16


def test_embedded_models_load_with_their_tokenizers(embedded):
    tok = embedded.tokenizer
    ids = tok("def add(a, b):\n    return a + b\n")["input_ids"]
    assert tok.decode(ids) == "def add(a, b):\n    return a + b\n"
    assert embedded.model.config.vocab_size == len(tok)
    assert not embedded.model.training


def _cli(*args):
    return call("moe_spec.profiling.inspect_model", *args)


def test_cli_bad_model_is_one_line_and_nonzero():
    for bad in ("nope", "olmoe"):
        r = _cli("--model", bad)
        assert r.returncode == 2
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("inspect-model: error:"), r.stderr


def test_cli_summarises_the_default_model():
    r = _cli("--json")
    assert r.returncode == 0, r.stderr
    import json
    info = json.loads(r.stdout)
    assert info["model"] == "tiny-olmoe" and info["num_experts"] == 64 and info["top_k"] == 8
    assert len(info["probe_unique_experts"]) == 8
    assert all(8 <= u <= 64 for u in info["probe_unique_experts"])
    assert info["quality"]["heldout"]["loss"] > 0
    # sketch's surrogate at this model's shape (N = 64, H = 128, I = 16): per expert U [H, r]
    # and V [H + 1, r] at r = 4 plus its residual energy, float32; the model is float32 on CPU
    numbers = 64 * (4 * 128 + 4 * 129 + 1)
    sketch = info["selection_overhead"]["sketch"]
    assert sketch["bytes_per_layer"] == numbers * 4 and sketch["expert_dtype_bytes"] == 4
    assert sketch["expert_equivalents"] == numbers * 4 / (3 * 128 * 16 * 4)
    # sketch-post: the rank-(4 + 16) surrogate read, each expert's window of pairs read and
    # written back and its new factors written, the layer's prior inverse read (all float32)
    post = info["selection_overhead"]["sketch-post"]
    d, w = 129, 16
    assert post["bytes_per_layer"] == (64 * (20 * (2 * 128 + 1) + 1) + 3 * 64 * w * (d + 128)
                                       + d * d) * 4
    # sketch-gated: sketch's surrogate and the gate's p = 32 directions, variances and σ²
    gated = info["selection_overhead"]["sketch-gated"]
    assert gated["bytes_per_layer"] == (numbers + d * 32 + 32 + 1) * 4
    assert set(info["selection_overhead"]) == {"sketch", "sketch-post", "sketch-gated"}
    # (the others read none)


def test_an_unsupported_family_is_refused_before_any_weight_is_read(tmp_path):
    """A dense model's folder (config only: reading weights would fail differently) is refused
    in one line naming the supported families, from its config alone."""
    import json
    folder = tmp_path / "dense"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=100)))
    with pytest.raises(models.ModelError) as exc:
        models.load(str(folder), device="cpu")
    message = str(exc.value)
    assert "'llama' is not supported" in message and "olmoe" in message and "\n" not in message
