"""The offline training corpus of the embedded tiny models.

Three sources, all available without a network and none of them an evaluation prompt:

* ``stdlib``: the Python standard library's own source (tests, idlelib and site-packages left out);
* ``gsm8k``: GSM8K *train*, in the same ``Question: … Answer:`` template capture uses;
* ``mbpp``: MBPP's *train* split (task ids 601–974), in the MBPP capture template.

Each document goes to the held-out split when a stable hash of its name falls in the lowest
``HELDOUT_PERCENT`` of the hash range, so the split never depends on file order or machine.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from moe_spec.tasks import benchmarks

HELDOUT_PERCENT = 3
_STDLIB_SKIP = {"test", "tests", "idlelib", "site-packages", "turtledemo", "lib2to3", "__pycache__"}


@dataclass(frozen=True)
class Document:
    source: str
    name: str
    text: str

    @property
    def heldout(self) -> bool:
        digest = hashlib.sha256(f"{self.source}/{self.name}".encode()).digest()
        return int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT


def stdlib_documents() -> list[Document]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _STDLIB_SKIP & set(rel.parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        docs.append(Document("stdlib", rel.as_posix(), text))
    return docs


def benchmark_train_documents(name: str, root=None) -> list[Document]:
    return [Document(name, p.prompt_id, p.text + p.reference)
            for p in benchmarks.load_train(name, root=root)]


def load_corpus(benchmarks_root=None) -> dict[str, list[Document]]:
    """All documents, by source, in a deterministic order."""
    return {
        "stdlib": stdlib_documents(),
        "gsm8k": benchmark_train_documents("gsm8k", benchmarks_root),
        "mbpp": benchmark_train_documents("mbpp", benchmarks_root),
    }


def split(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    """(train, held-out) by the stable hash rule above."""
    return [d for d in docs if not d.heldout], [d for d in docs if d.heldout]
