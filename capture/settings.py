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


MAX_COUNT = 1_000_000  # the most tokens, prompts, steps any sane option asks for


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
    batch_size: int = 1  # sequences decoded together, one batched verification pass each step

    def __post_init__(self):
        """Refuse settings that cannot describe a capture, in one line naming the option."""
        # upper bounds too: a typo (max_new_tokens = 99999999999999999999) is refused at once,
        # not hours later (or never) in a generation loop or a seed overflow
        checks = [(1 <= self.max_new_tokens <= MAX_COUNT, "--max-new-tokens",
                   f"at least 1 and at most {MAX_COUNT}"),
                  (0 <= self.offset <= MAX_COUNT, "--offset", f"0 to {MAX_COUNT}"),
                  (self.limit is None or 0 <= self.limit <= MAX_COUNT, "--limit",
                   f"0 (all) to {MAX_COUNT}"),
                  (0 <= self.temperature <= 100, "--temperature", "0 (greedy) to 100"),
                  (0 < self.top_p <= 1, "--top-p", "in (0, 1]"),
                  (0 <= self.top_k <= MAX_COUNT, "--top-k", f"0 (off) to {MAX_COUNT}"),
                  (1 <= self.chunk_steps <= MAX_COUNT, "chunk_steps", f"1 to {MAX_COUNT}"),
                  (1 <= self.batch_size <= 4096, "--batch-size", "1 to 4096"),
                  (self.total_tokens <= 4096, "--total-tokens", "at most 4096"),
                  (self.depth <= 1024, "--depth", "at most 1024"),
                  (self.tree_top_k <= 1024, "--tree-top-k", "at most 1024"),
                  (self.budget is None or self.budget <= MAX_COUNT, "--budget",
                   f"at most {MAX_COUNT}"),
                  (0 <= self.seed < 2**31 - MAX_COUNT, "--seed", f"0 to {2**31 - MAX_COUNT - 1}")]
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
        from different numerics are different data). ``batch_size`` 1 is left out, so runs
        captured before batching existed keep their identity."""
        found = dataclasses.asdict(self)
        if found["batch_size"] == 1:
            del found["batch_size"]
        return found

    def default_run_name(self) -> str:
        """Readable and unique per settings: a short digest of everything that matters."""
        digest = hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()
        kind = f"B{self.budget}-{self.ranking}-{self.coverage}" if self.budget else "eagle"
        return f"{kind}-T{self.temperature:g}-{digest[:8]}"
