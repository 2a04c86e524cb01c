"""EAGLE-2 dynamic draft trees.

One round (``build_tree``):

1. Prefix step: the draft runs on the new (target feature, next token) pairs — the prompt after
   prefill, or the accepted path after a verification — and keeps their KV as its stable prefix.
   The top ``top_k`` tokens of its last position are the root's children (level 1).
2. ``depth`` expansion steps: the current ``top_k`` beams (the highest *cumulative* draft
   log-probabilities) run as one draft forward, each attending to the prefix and to its own
   ancestors; every beam proposes ``top_k`` children scored ``score(parent) + log q(child)``, and
   the global top ``top_k`` children become the next beams.
3. Rerank: of all ``top_k + depth·top_k²`` candidates keep the ``total_tokens − 1`` best by
   cumulative log-probability, in candidate order (parents precede children), plus the root.

Log-probabilities are ≤ 0, so a child never outscores its parent and the kept set is closed under
ancestors; exact ties could break that, so it is asserted. Drafts never use temperature (EAGLE).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eagle.draft_head import DraftHead
from eagle.settings import TreeSettings  # noqa: F401 - re-exported


@dataclass
class DraftTree:
    """A verification tree in node order; node 0 is the root (the last target-sampled token)."""

    tokens: torch.Tensor  # [M] target token ids
    parents: torch.Tensor  # [M] node index of the parent, -1 for the root
    depth: torch.Tensor  # [M] root = 0
    scores: torch.Tensor  # [M] cumulative draft log-prob, root = 0
    ancestors: torch.Tensor = field(init=False)  # [M, M] bool: ancestors[j, i] = i is j or above j

    def __post_init__(self):
        parents = self.parents.tolist()
        anc = torch.eye(len(parents), dtype=torch.bool)
        for j, p in enumerate(parents[1:], start=1):
            assert 0 <= p < j, f"node {j}: parent {p} is not an earlier kept node"
            anc[j] |= anc[p]
        self.ancestors = anc.to(self.tokens.device)

    @property
    def size(self) -> int:
        return len(self.tokens)

    def children(self, node: int) -> list[int]:
        """Children of ``node`` in order of decreasing draft score."""
        kids = (self.parents == node).nonzero().flatten()
        return kids[torch.argsort(self.scores[kids], descending=True, stable=True)].tolist()


@dataclass
class DraftCache:
    """The draft head's KV over the committed prefix (tree tokens are never kept)."""

    past: list | None = None
    length: int = 0


def _causal_rows(n: int, prefix: int, device) -> torch.Tensor:
    """Mask ``[1, 1, n, prefix + n]``: new row j sees the prefix and new columns ≤ j."""
    cols = torch.arange(prefix + n, device=device)
    return (cols[None] <= prefix + torch.arange(n, device=device)[:, None])[None, None]


@torch.no_grad()
def build_tree(head: DraftHead, cache: DraftCache, features: torch.Tensor, next_tokens: torch.Tensor,
               root: int, settings: TreeSettings) -> DraftTree:
    """Draft one tree. ``features [n, F]`` are target features at the newly committed positions
    and ``next_tokens [n]`` the token that follows each (the last one is ``root``)."""
    k, device = settings.top_k, features.device
    n = features.shape[0]
    prefix = cache.length
    pos = torch.arange(prefix, prefix + n, device=device)
    hidden, past = head(features[None], next_tokens[None], pos, cache.past,
                        _causal_rows(n, prefix, device))
    cache.past, cache.length = past, prefix + n

    logp = torch.log_softmax(head.logits(hidden[0, -1]).float(), -1)
    beam_scores, draft_ids = logp.topk(k)
    beam_tokens = head.to_target_ids(draft_ids)
    scores, tokens = [beam_scores], [beam_tokens]
    parents = [torch.full((k,), -1, dtype=torch.long, device=device)]  # flat candidate ids
    beam_flat = torch.arange(k, device=device)
    beam_hidden = hidden[0, -1].expand(k, -1)
    anc = torch.eye(k, dtype=torch.bool, device=device)  # beams × tree columns so far
    step_past = past
    for i in range(settings.depth):
        pos = torch.full((k,), prefix + n + i, device=device)
        mask = torch.cat([torch.ones(k, prefix + n, dtype=torch.bool, device=device), anc], 1)
        hidden, step_past = head(beam_hidden[None], beam_tokens[None], pos, step_past,
                                 mask[None, None])
        logp = torch.log_softmax(head.logits(hidden[0]).float(), -1)  # [k, Vd]
        child_lp, child_ids = logp.topk(k, dim=-1)
        cumulative = beam_scores[:, None] + child_lp  # [k, k]
        base = k + i * k * k
        scores.append(cumulative.flatten())
        tokens.append(head.to_target_ids(child_ids).flatten())
        parents.append(beam_flat.repeat_interleave(k))
        beam_scores, best = cumulative.flatten().topk(k)
        parent_beam = best // k
        beam_flat = base + best
        beam_tokens = tokens[-1][best]
        beam_hidden = hidden[0, parent_beam]
        anc = torch.cat([anc[parent_beam], torch.eye(k, dtype=torch.bool, device=device)], 1)

    all_scores, all_tokens, all_parents = torch.cat(scores), torch.cat(tokens), torch.cat(parents)
    keep = torch.sort(all_scores.topk(settings.total_tokens - 1).indices).values
    node_of = torch.full_like(all_parents, -1)
    node_of[keep] = torch.arange(1, len(keep) + 1, device=device)
    parent_flat = all_parents[keep]
    parent_node = torch.where(parent_flat < 0, torch.zeros_like(parent_flat), node_of[parent_flat])
    if bool((parent_node < 0).any()):
        raise AssertionError("draft tree lost ancestor closure (a kept node's parent was cut)")
    parent_node = torch.cat([torch.tensor([-1], device=device), parent_node])
    depth = [0]
    for p in parent_node.tolist()[1:]:
        depth.append(depth[p] + 1)
    return DraftTree(
        tokens=torch.cat([torch.tensor([root], device=device), all_tokens[keep]]),
        parents=parent_node, depth=torch.tensor(depth, device=device),
        scores=torch.cat([torch.zeros(1, device=device), all_scores[keep]]))
