"""Tree verification on a transformers target: one forward over the whole tree.

With ``P`` committed tokens in a ``DynamicCache`` and a tree of ``M`` nodes (node 0 the root, not
yet in the cache), the target runs once on the tree tokens with

* ``position_ids = P + depth`` (RoPE sees each node at its depth along its own branch),
* a 4-D additive mask ``[1, 1, M, P + M]``: 0 on every prefix column and on each node's ancestors
  (itself included), the dtype's minimum elsewhere (a float mask is right for both eager and sdpa
  attention; a boolean one is silently wrong in eager),

which reproduces the sequential logits of every root-to-node path. Afterwards only the accepted
path's cache rows are kept (``compact_cache``), gathered to contiguous slots.

Models that mix sliding-window and full-attention layers (gpt-oss) get one mask per layer type
(transformers takes a mapping from layer type to mask): a sliding layer's mask also hides keys
at positions ``≤ q − window`` for a query at position q. Their cache keeps every position in
every layer (:func:`new_cache`): a rolling sliding-window cache would let the tree's rejected
tokens evict prefix tokens the next pass still attends to; the mask does the windowing instead.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from transformers import DynamicCache

from moe_spec.eagle.tree import DraftTree


def new_cache(model: nn.Module) -> DynamicCache:
    """A cache that keeps every position in every layer (see the module docstring)."""
    if sliding_window(model) is None:
        return DynamicCache(config=model.config)
    return DynamicCache()


def sliding_window(model: nn.Module) -> int | None:
    """The window of a model whose layers mix sliding-window and full attention, else None."""
    cfg = model.config
    types = set(getattr(cfg, "layer_types", None) or [])
    return getattr(cfg, "sliding_window", None) if "sliding_attention" in types else None


def tree_attention_mask(tree: DraftTree, prefix_len: int, dtype: torch.dtype,
                        window: int | None = None):
    """Additive ``[1, 1, M, P + M]`` mask: prefix and ancestors visible. With ``window``, a
    mapping {layer type: mask} whose sliding-window mask also hides keys at positions
    ``≤ position(query) − window``."""
    m = tree.size
    device = tree.tokens.device
    allowed = torch.zeros(m, prefix_len + m, dtype=torch.bool, device=device)
    allowed[:, :prefix_len] = True
    allowed[:, prefix_len:] = tree.ancestors

    def additive(ok):
        return torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill_(
            ~ok, torch.finfo(dtype).min)[None, None]

    if window is None:
        return additive(allowed)
    query = prefix_len + tree.depth  # [M]
    key = torch.cat([torch.arange(prefix_len, device=device), prefix_len + tree.depth])
    recent = key[None, :] > query[:, None] - window
    return {"full_attention": additive(allowed), "sliding_attention": additive(allowed & recent)}


class FeatureTap:
    """Collects target hidden states during forwards: the *inputs* of the given decoder layers
    (HF ``hidden_states[i]``, EAGLE-3's features) or, for index ``"final"``, the final post-norm
    hidden (EAGLE-1's feature). Hooks live only inside ``with tap.active():``."""

    def __init__(self, model: nn.Module, layers: list[int] | str):
        self.model = model
        self.layers = layers
        self._seen: dict = {}

    @contextmanager
    def active(self):
        base = self.model.model
        hooks = []
        self._seen = {}
        if self.layers == "final":
            hooks.append(base.norm.register_forward_hook(
                lambda mod, args, out: self._seen.__setitem__("final", out)))
        else:
            for i in self.layers:
                hooks.append(base.layers[i].register_forward_pre_hook(
                    lambda mod, args, kwargs, i=i: self._seen.__setitem__(
                        i, args[0] if args else kwargs["hidden_states"]), with_kwargs=True))
        try:
            yield self
        finally:
            for hook in hooks:
                hook.remove()

    def features(self) -> torch.Tensor:
        """``[B, T, F]``: the tapped states concatenated low → high (F = 3H for EAGLE-3)."""
        if self.layers == "final":
            return self._seen["final"]
        return torch.cat([self._seen[i] for i in self.layers], dim=-1)


@torch.no_grad()
def prefill(target: nn.Module, tap: FeatureTap, input_ids: torch.Tensor):
    """Run the prompt ``[1, P]``; returns (last logits ``[V]``, features ``[P, F]``, cache).
    Only the last position's logits are computed (``logits_to_keep=1``, as ``generate`` does):
    the LM head over every prompt position would cost about a third of a small model's
    prefill."""
    cache = new_cache(target)
    with tap.active():
        out = target(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
        feats = tap.features()[0]
    return out.logits[0, -1], feats, out.cache


@torch.no_grad()
def verify_tree(target: nn.Module, tap: FeatureTap | None, cache, tree: DraftTree, prefix_len: int):
    """One target forward over the tree; returns (logits ``[M, V]``, features ``[M, F]`` or
    None without a tap)."""
    dtype = next(target.parameters()).dtype
    mask = tree_attention_mask(tree, prefix_len, dtype, sliding_window(target))
    positions = (prefix_len + tree.depth)[None]
    with tap.active() if tap else nullcontext():
        out = target(input_ids=tree.tokens[None], position_ids=positions, attention_mask=mask,
                     cache=cache, use_cache=True)
        feats = tap.features()[0] if tap else None
    return out.logits[0], feats


@torch.no_grad()
def forward_tokens(target: nn.Module, tap: FeatureTap | None, cache, tokens: torch.Tensor,
                   prefix_len: int):
    """Plain causal forward of ``tokens [T]`` after the cached prefix (the AR baseline's step)."""
    positions = torch.arange(prefix_len, prefix_len + len(tokens), device=tokens.device)[None]
    with tap.active() if tap else nullcontext():
        out = target(input_ids=tokens[None], position_ids=positions, cache=cache, use_cache=True)
        feats = tap.features()[0] if tap else None
    return out.logits[0], feats


def compact_cache(cache, prefix_len: int, path: torch.Tensor) -> None:
    """Keep cache rows ``[0, P)`` and ``P + path`` (node ids, root first), drop the rest."""
    keep = torch.cat([torch.arange(prefix_len, device=path.device), prefix_len + path])
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(-2, keep)
        layer.values = layer.values.index_select(-2, keep)
