"""The storage policy: which MoE hidden states a capture keeps, and how.

Routing, trees and nodes are always complete; MoE inputs and outputs (``moe_io``) are what make
traces large (OLMoE-1B-7B: 63 nodes × 16 layers × 2048 values per tree). The policy chooses

* ``layers``: ``all``, ``every:N`` (every N-th MoE layer), a list ``0,4,8``, or ``auto`` (the
  smallest layer stride that keeps hidden states under ``budget_kib`` per tree — every layer of a
  small model, every 4th of OLMoE-1B-7B in bf16);
* ``passes``: ``all``, ``every:N`` (every N-th verification pass of a prompt) or ``fraction:F``
  (a seeded, order-independent fraction of passes);
* ``dtype``: ``bfloat16`` (stored losslessly as its 16-bit pattern), ``float16`` or ``float32``;
* ``output``: ``store`` the MoE output, or ``recompute`` it at replay from the input and keep
  only per-token output norms, enough for replay to catch a wrong model or a corrupt trace.

The resolved policy (the actual layer list) goes into the manifest; replay, analysis and the app
read it to say what a run lacks.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass

from moe_spec.errors import UserError

DTYPES = ("bfloat16", "float16", "float32")
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
OUTPUTS = ("store", "recompute")


class StorageError(UserError, ValueError):
    """A storage policy that cannot be read; the message is one line for the user."""


@dataclass(frozen=True)
class StoragePolicy:
    layers: str = "auto"
    passes: str = "all"
    dtype: str = "bfloat16"
    output: str = "recompute"
    seed: int = 0
    budget_kib: int = 1500  # ``auto``: hidden-state bytes per tree at most this

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise StorageError(f"storage dtype {self.dtype!r}: use one of {', '.join(DTYPES)}")
        if self.output not in OUTPUTS:
            raise StorageError(f"--store-output {self.output!r}: use store or recompute")
        self._pass_rule()  # validates

    def resolve(self, moe_layers: list[int], hidden_size: int, nodes: int) -> dict:
        """The concrete policy for a model: MoE layers kept, pass rule, dtype, output."""
        return dict(layers=self._layers(moe_layers, hidden_size, nodes), passes=self.passes,
                    dtype=self.dtype, output=self.output, seed=self.seed)

    def _layers(self, moe_layers: list[int], hidden_size: int, nodes: int) -> list[int]:
        spec = self.layers
        if spec == "all":
            return list(moe_layers)
        if spec == "auto":
            per_layer = nodes * hidden_size * BYTES[self.dtype] * \
                (2 if self.output == "store" else 1)
            keep = max(1, self.budget_kib * 1024 // max(1, per_layer))
            stride = max(1, math.ceil(len(moe_layers) / keep))
            return list(moe_layers[::stride])
        if spec.startswith("every:"):
            stride = _positive(spec, spec[6:])
            return list(moe_layers[::stride])
        try:
            wanted = sorted({int(x) for x in spec.split(",")})
        except ValueError:
            raise StorageError(f"--store-layers {spec!r}: use all, auto, every:N or a list "
                               "like 0,4,8") from None
        missing = [x for x in wanted if x not in moe_layers]
        if missing:
            raise StorageError(f"--store-layers {spec!r}: layers {missing} have no MoE block "
                               f"(MoE layers: {moe_layers[0]}..{moe_layers[-1]})")
        return wanted

    def _pass_rule(self) -> tuple[str, float]:
        spec = self.passes
        if spec == "all":
            return "all", 1.0
        if spec.startswith("every:"):
            return "every", _positive(spec, spec[6:])
        if spec.startswith("fraction:"):
            try:
                f = float(spec[9:])
            except ValueError:
                f = -1.0
            if not 0 < f <= 1:
                raise StorageError(f"--store-passes {spec!r}: the fraction must be in (0, 1]")
            return "fraction", f
        raise StorageError(f"--store-passes {spec!r}: use all, every:N or fraction:F")

    def keeps_pass(self, prompt_index: int, step: int) -> bool:
        """Whether pass ``step`` of prompt ``prompt_index`` keeps hidden states (a seeded draw
        for ``fraction:F``, independent of the order prompts are captured in)."""
        kind, value = self._pass_rule()
        if kind == "all":
            return True
        if kind == "every":
            return step % int(value) == 0
        digest = hashlib.sha256(f"{self.seed}:{prompt_index}:{step}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < value

    def as_dict(self) -> dict:
        return asdict(self)


def _positive(spec: str, text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise StorageError(f"{spec!r}: N must be a whole number ≥ 1")
    return n
