"""The tiny models' corpus never contains an evaluation prompt, and its split is stable."""

from moe_spec.tasks import benchmarks
from moe_spec.training import corpus


def test_split_is_disjoint_and_stable():
    docs = corpus.load_corpus()
    for items in docs.values():
        train, held = corpus.split(items)
        assert train and held
        assert not {d.name for d in train} & {d.name for d in held}
        assert [d.name for d in corpus.split(items)[1]] == [d.name for d in held]


def test_no_evaluation_prompt_is_in_the_corpus():
    docs = corpus.load_corpus()
    text = "\n".join(d.text for items in docs.values() for d in items)
    for bench in ("mbpp", "gsm8k", "humaneval"):
        for prompt in benchmarks.load(bench, limit=200):
            core = prompt.text[:200]
            assert core not in text, f"{bench} prompt {prompt.prompt_id} leaked into the corpus"
    assert {int(d.name) for d in docs["mbpp"]} <= set(range(601, 975))
    assert all(d.name.startswith("train-") for d in docs["gsm8k"])
