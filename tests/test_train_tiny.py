"""``train-tiny`` is reproducible from its seed and writes a loadable, atomic HF folder."""

import hashlib

import pytest
import torch

from moe_spec.moe import models
from moe_spec.training import cli
from moe_spec.training.tiny_moe import (
    SPECS,
    BiasBalancer,
    RouterRecipe,
    bias_gates,
    param_groups,
    sequence_balance_loss,
)


def _digest(folder):
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def test_same_seed_same_weights_and_loadable_through_the_registry(tmp_path):
    args = ["--model", "tiny-mixtral", "--steps", "2", "--batch", "2", "--seq-len", "32",
            "--seed", "7"]
    assert cli.train_tiny([*args, "--out", str(tmp_path / "a")]) == 0
    assert cli.train_tiny([*args, "--out", str(tmp_path / "b")]) == 0
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert cli.train_tiny([*args[:-1], "8", "--out", str(tmp_path / "c")]) == 0
    assert _digest(tmp_path / "a") != _digest(tmp_path / "c")
    # only the finished folders are left: no temporary siblings
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]
    loaded = models.load(str(tmp_path / "a"), device="cpu")
    assert type(loaded.model).__name__ == "MixtralForCausalLM"


def test_sequence_balance_loss_is_one_when_balanced_and_penalises_concentration():
    chosen = torch.arange(8).remainder(4).reshape(1, 8, 1)  # every expert twice, k = 1
    assert sequence_balance_loss(torch.zeros(1, 8, 4), chosen, 1).item() == pytest.approx(1.0)
    logits = torch.tensor([3.0, 0, 0, 0]).repeat(1, 8, 1).requires_grad_()
    loss = sequence_balance_loss(logits, torch.zeros(1, 8, 1, dtype=torch.long), 1)
    assert loss.item() > 1.5  # f_0 = 4, P_0 > 1/4
    loss.backward()
    assert (logits.grad[..., 0] > 0).all() and (logits.grad[..., 1:] < 0).all()  # 0 down, rest up


def test_deepseek_router_recipe_groups_hooks_and_bias():
    spec = SPECS["tiny-deepseek-v3"]
    recipe = RouterRecipe(lr_scale=10.0, weight_decay=0.0, seq_aux=1e-4)
    torch.manual_seed(0)
    model = spec.model_cls(spec.build_config(num_hidden_layers=3))
    gates = bias_gates(model)
    assert len(gates) == 2  # layer 0 is dense
    groups = param_groups(model, recipe)
    assert [g["lr_scale"] for g in groups] == [1.0, 1.0, 10.0]
    assert {id(p) for p in groups[-1]["params"]} == {id(g.weight) for g in gates}
    assert groups[-1]["weight_decay"] == 0.0
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    assert len(param_groups(model)) == 2  # without a recipe: the common two groups
    balance = BiasBalancer(model, gamma=0.5, seq_aux=True)
    model(input_ids=torch.randint(0, 100, (2, 16)))
    assert torch.isfinite(balance.take_loss()) and balance.losses == []
    load = {g: balance.counts[g].clone() for g in gates}
    balance.step()
    for gate in gates:
        assert torch.equal(gate.e_score_correction_bias,
                           0.5 * torch.sign(load[gate].mean() - load[gate]))
