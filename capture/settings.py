"""What a capture is asked to do: the settings of one run, checked when made.

Plain data, importable without torch: the command-line parser takes its defaults from here, and
`capture --help` must appear at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from capture.storage import StoragePolicy
from eagle.settings import TreeSettings
from moe.models import DEFAULT_MODEL


class CaptureError(RuntimeError):
    """A run that cannot be written or resumed; the message is one line for the user."""


@dataclass(frozen=True)
class CaptureSettings:
    model: str = DEFAULT_MODEL
    bench: str = "mbpp"
    draft: str | None = None
    offset: int = 0
    limit: int | None = 8
    max_new_tokens: int = 64
    total_tokens: int = 63
    depth: int = 7
    tree_top_k: int = 10
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    store_layers: str = "auto"  # storage policy (capture/storage.py)
    store_passes: str = "all"
    hidden_dtype: str = "bfloat16"
    store_output: str = "recompute"
    store_expert_outputs: bool = False
    budget: int | None = None
    ranking: str = "router"
    coverage: str = "substitution"
    calibration: tuple[str, ...] = ()  # runs under the same --out for static / coact
    device: str = "auto"
    dtype: str = "auto"
    chunk_steps: int = 64
    chat_template: bool = False  # wrap prompts in the tokenizer's chat template (one user turn)

    def __post_init__(self):
        """Refuse settings that cannot describe a capture, in one line naming the option."""
        checks = [(self.max_new_tokens >= 1, "--max-new-tokens", "at least 1"),
                  (self.offset >= 0, "--offset", "0 or more"),
                  (self.limit is None or self.limit >= 0, "--limit", "0 (all) or more"),
                  (self.temperature >= 0, "--temperature", "0 (greedy) or more"),
                  (0 < self.top_p <= 1, "--top-p", "in (0, 1]"),
                  (self.top_k >= 0, "--top-k", "0 (off) or more"),
                  (self.chunk_steps >= 1, "chunk_steps", "at least 1"),
                  (self.seed >= 0, "--seed", "0 or more")]
        for ok, option, rule in checks:
            if not ok:
                value = getattr(self, option.lstrip("-").replace("-", "_"))
                raise CaptureError(f"{option} {value} is out of range: it must be {rule}")
        try:
            TreeSettings(self.total_tokens, self.depth, self.tree_top_k)
        except ValueError as exc:
            raise CaptureError(f"{exc} (--total-tokens, --depth, --tree-top-k)") from None

    def storage(self) -> StoragePolicy:
        return StoragePolicy(self.store_layers, self.store_passes, self.hidden_dtype,
                             self.store_output, self.seed)

    def identity(self) -> dict:
        """What makes two captures the same run (device/dtype and chunking included: traces
        from different numerics are different data)."""
        return dataclasses.asdict(self)

    def default_run_name(self) -> str:
        """Readable and unique per settings: a short digest of everything that matters."""
        digest = hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()
        kind = f"B{self.budget}-{self.ranking}-{self.coverage}" if self.budget else "eagle"
        return f"{kind}-T{self.temperature:g}-{digest[:8]}"
