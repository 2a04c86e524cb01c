"""EAGLE tree settings: plain numbers, importable without torch (command-line parsers use
them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TreeSettings:
    total_tokens: int = 63  # root + drafted nodes verified in one pass
    depth: int = 7  # expansion steps; deepest level is depth + 1
    top_k: int = 10

    def __post_init__(self):
        if self.total_tokens < 2 or self.depth < 0 or self.top_k < 1:
            raise ValueError("tree settings need total_tokens ≥ 2, depth ≥ 0, top_k ≥ 1")
        pool = self.top_k + self.depth * self.top_k ** 2
        if self.total_tokens - 1 > pool:
            raise ValueError(f"total_tokens − 1 = {self.total_tokens - 1} exceeds the "
                             f"{pool} candidates of top_k={self.top_k}, depth={self.depth}")
