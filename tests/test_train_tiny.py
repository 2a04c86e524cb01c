"""``train-tiny`` is reproducible from its seed and writes a loadable, atomic HF folder."""

import hashlib

from moe import models
from training import cli


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
