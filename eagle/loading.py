"""Loading a target with its EAGLE draft head: the head a model uses by default, local or hub
folders, and the check that the head was trained for this target."""

from __future__ import annotations

from pathlib import Path

from moe_spec.moe.models import DEFAULT_MODEL, DRAFTS_DIR, ModelError, ModelSource, hub_reachable, load


def default_draft(source: ModelSource) -> str | None:
    """The draft head a model uses when ``--draft`` is not given."""
    if source.alias is None:
        return None
    if source.alias.hub_id is None:
        return str(DRAFTS_DIR / source.alias.name)
    return source.alias.draft


def resolve_draft(draft: str) -> Path:
    """A draft head folder from a local path or a hub id (downloaded, or from the cache)."""
    path = Path(draft).expanduser()
    if path.is_dir():
        return path
    if path.is_absolute() or draft.startswith((".", "~")) or draft.count("/") != 1:
        hint = (f"train it with `train-draft --model {path.name}`"
                if path.parent == DRAFTS_DIR else "pass --draft with an existing folder or a hub id")
        raise ModelError(f"draft head folder {draft} does not exist; {hint}")
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(draft, local_files_only=not hub_reachable()))
    except Exception as exc:  # noqa: BLE001 - the hub raises many types; one line for the user
        raise ModelError(f"draft head {draft!r} is not in the local Hugging Face cache and the hub "
                         f"cannot be reached ({type(exc).__name__}); pass --draft with a local "
                         "folder") from exc


def load_with_draft(model: str = DEFAULT_MODEL, draft: str | None = None, **kwargs):
    """(LoadedModel, draft head) for EAGLE decoding; the head is checked against the target."""
    from moe_spec.eagle.draft_head import DraftHeadError, load_draft

    loaded = load(model, **kwargs)
    draft = draft or default_draft(loaded.source)
    if draft is None:
        raise ModelError(f"model {loaded.name!r} has no default draft head; pass --draft PATH")
    try:
        head = load_draft(resolve_draft(draft), loaded.model)
    except DraftHeadError as exc:
        raise ModelError(str(exc)) from exc
    alias = loaded.source.alias
    if alias and alias.feature_layers and draft == alias.draft:
        head.config.feature_layers = list(alias.feature_layers)
    return loaded, head
