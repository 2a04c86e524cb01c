"""Shared fixtures. Tests run offline: no hub access, benchmarks from the shared folder."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from moe import models  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session", params=models.EMBEDDED)
def embedded(request) -> models.LoadedModel:
    """Each embedded tiny model, loaded through the registry in fp32 on the CPU."""
    return models.load(request.param, device="cpu", dtype="float32")
