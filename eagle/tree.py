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

from moe_spec.eagle.draft_head import DraftHead
from moe_spec.eagle.settings import TreeSettings  # noqa: F401 - re-exported


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


@dataclass
class DraftInput:
    """What one sequence brings to a drafting round: its draft cache, the target features at
    its newly committed positions ``[n, F]``, the token that follows each ``[n]`` (the last one
    is ``root``)."""

    cache: DraftCache
    features: torch.Tensor
    next_tokens: torch.Tensor
    root: int


def _padded_past(caches: list[DraftCache], length: int, like: list) -> list | None:
    """The sequences' draft KV as one batch, each padded on the right to ``length`` columns."""
    if length == 0:
        return None
    layers = []
    for li, (k0, v0) in enumerate(like):
        ks, vs = [], []
        for c in caches:
            if c.past is None:
                k = k0.new_zeros(1, k0.shape[1], 0, k0.shape[3])
                v = v0.new_zeros(1, v0.shape[1], 0, v0.shape[3])
            else:
                k, v = c.past[li]
            pad = length - k.shape[2]
            ks.append(torch.nn.functional.pad(k, (0, 0, 0, pad)))
            vs.append(torch.nn.functional.pad(v, (0, 0, 0, pad)))
        layers.append((torch.cat(ks), torch.cat(vs)))
    return layers


@torch.no_grad()
def build_trees(head: DraftHead, inputs: list[DraftInput], settings: TreeSettings
                ) -> list[DraftTree]:
    """Draft one tree per sequence, all ``b`` sequences in each draft forward.

    Sequence i's draft cache holds ``P_i`` positions and it brings ``n_i`` new ones; the batch
    pads both on the right (to ``P = max P_i`` and ``n = max n_i``) and masks the padding, with
    explicit per-sequence positions, so each sequence attends to exactly what it would alone:
    the prefix step's row j sees cache columns ``< P_i`` and new columns ``≤ j``; an expansion
    step's beam sees its sequence's committed columns and its own ancestors. Each cache keeps
    only its own ``P_i + n_i`` columns afterwards. At b = 1 nothing is padded and this is the
    one-sequence round of the module docstring, operation for operation.
    """
    k, b = settings.top_k, len(inputs)
    device = inputs[0].features.device
    prior = torch.tensor([x.cache.length for x in inputs], device=device)  # P_i
    fresh = torch.tensor([len(x.next_tokens) for x in inputs], device=device)  # n_i
    width, n = int(prior.max()), int(fresh.max())
    features = torch.stack([torch.nn.functional.pad(x.features, (0, 0, 0, n - len(x.features)))
                            for x in inputs])  # [b, n, F]
    tokens = torch.stack([torch.nn.functional.pad(x.next_tokens, (0, n - len(x.next_tokens)))
                          for x in inputs])  # [b, n]
    rows = torch.arange(n, device=device)
    positions = prior[:, None] + rows  # [b, n]
    cols = torch.arange(width, device=device)
    sees_cache = cols[None, None, :] < prior[:, None, None]  # [b, 1, P]
    sees_new = rows[None, :] <= rows[:, None]  # [n, n] causal among the new positions
    mask = torch.cat([sees_cache.expand(b, n, width), sees_new.expand(b, n, n)], 2)
    like = next((x.cache.past for x in inputs if x.cache.past is not None), None)
    past = _padded_past([x.cache for x in inputs], width, like) if like is not None else None
    hidden, past = head(features, tokens, positions if b > 1 else positions[0], past,
                        mask[:, None])
    last = hidden[torch.arange(b, device=device), fresh - 1]  # [b, H]
    for i, x in enumerate(inputs):  # each cache keeps its own P_i + n_i columns
        keep = torch.cat([torch.arange(int(prior[i]), device=device),
                          width + torch.arange(int(fresh[i]), device=device)])
        x.cache.past = [(kk[i:i + 1, :, keep], vv[i:i + 1, :, keep]) for kk, vv in past]
        x.cache.length = int(prior[i] + fresh[i])
    committed = prior + fresh  # [b] valid columns of the step cache: [0, P_i) and [P, P + n_i)
    step_cols = torch.arange(width + n, device=device)
    sees_committed = (step_cols[None] < prior[:, None]) | (
        (step_cols[None] >= width) & (step_cols[None] < width + fresh[:, None]))  # [b, P + n]

    logp = torch.log_softmax(head.logits(last).float(), -1)  # [b, Vd]
    beam_scores, draft_ids = logp.topk(k, dim=-1)  # [b, k]
    beam_tokens = head.to_target_ids(draft_ids)
    scores, cand_tokens = [beam_scores], [beam_tokens]
    parents = [torch.full((b, k), -1, dtype=torch.long, device=device)]  # flat candidate ids
    beam_flat = torch.arange(k, device=device).expand(b, k)
    beam_hidden = last[:, None].expand(b, k, -1)
    eye = torch.eye(k, dtype=torch.bool, device=device)
    anc = eye.expand(b, k, k)  # [b, beams, tree columns so far]
    step_past = past
    batch = torch.arange(b, device=device)[:, None]
    for i in range(settings.depth):
        pos = (committed + i)[:, None].expand(b, k)
        mask = torch.cat([sees_committed[:, None].expand(b, k, width + n), anc], 2)
        hidden, step_past = head(beam_hidden, beam_tokens, pos if b > 1 else pos[0], step_past,
                                 mask[:, None])
        logp = torch.log_softmax(head.logits(hidden).float(), -1)  # [b, k, Vd]
        child_lp, child_ids = logp.topk(k, dim=-1)
        cumulative = beam_scores[:, :, None] + child_lp  # [b, k, k]
        base = k + i * k * k
        scores.append(cumulative.flatten(1))
        cand_tokens.append(head.to_target_ids(child_ids).flatten(1))
        parents.append(beam_flat.repeat_interleave(k, dim=1))
        beam_scores, best = cumulative.flatten(1).topk(k, dim=-1)
        parent_beam = best // k
        beam_flat = base + best
        beam_tokens = cand_tokens[-1].gather(1, best)
        beam_hidden = hidden[batch, parent_beam]
        anc = torch.cat([anc[batch, parent_beam], eye.expand(b, k, k)], 2)

    all_scores, all_tokens, all_parents = (torch.cat(scores, 1), torch.cat(cand_tokens, 1),
                                           torch.cat(parents, 1))
    return [_rerank(all_scores[i], all_tokens[i], all_parents[i], x.root, settings)
            for i, x in enumerate(inputs)]


def _rerank(all_scores: torch.Tensor, all_tokens: torch.Tensor, all_parents: torch.Tensor,
            root: int, settings: TreeSettings) -> DraftTree:
    """Keep the ``total_tokens − 1`` best candidates in candidate order, plus the root."""
    device = all_scores.device
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


@torch.no_grad()
def build_tree(head: DraftHead, cache: DraftCache, features: torch.Tensor, next_tokens: torch.Tensor,
               root: int, settings: TreeSettings) -> DraftTree:
    """Draft one tree. ``features [n, F]`` are target features at the newly committed positions
    and ``next_tokens [n]`` the token that follows each (the last one is ``root``)."""
    return build_trees(head, [DraftInput(cache, features, next_tokens, root)], settings)[0]
