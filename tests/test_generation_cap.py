"""--max-new-tokens is a hard cap: generation stops at it before looking for EOS, even when a
verification pass accepts tokens on both sides of it."""

import pytest

from moe_spec.capture.run import prompt_ids
from moe_spec.eagle import loading
from moe_spec.eagle.decoding import EagleDecoder
from moe_spec.tasks import benchmarks


@pytest.mark.parametrize("out,eos,cap,expected", [
    ([1, 2, 3, 4, 5], {5}, 3, ([1, 2, 3], "max_new_tokens")),  # EOS past the cap: the cap wins
    ([1, 2, 3, 4, 5], {3}, 3, ([1, 2, 3], "eos")),  # EOS is the last token allowed
    ([1, 2, 3, 4, 5], {2, 4}, 3, ([1, 2], "eos")),
    ([1, 2, 3, 4, 5], {4}, 10, ([1, 2, 3, 4], "eos")),
    ([1, 2, 3, 4], set(), 3, ([1, 2, 3], "max_new_tokens")),
    ([1, 2], {9}, 3, ([1, 2], "")),
])
def test_stop_cuts_at_the_cap_before_looking_for_eos(out, eos, cap, expected):
    assert EagleDecoder._stop(None, out, eos, cap) == expected


@pytest.fixture(scope="module")
def olmoe():
    return loading.load_with_draft("tiny-olmoe", device="cpu", dtype="float32")


def test_no_generation_exceeds_max_new_tokens_when_a_pass_crosses_the_cap(olmoe):
    loaded, head = olmoe
    dec = EagleDecoder(loaded.model, head)
    ids = prompt_ids(loaded.tokenizer, benchmarks.load("mbpp", limit=1)[0].text)
    ref = dec.generate(ids, max_new_tokens=24)
    ends, n = set(), 1  # output lengths at which a pass ends (the root comes from prefill)
    for s in ref.steps:
        n += s.accepted_length
        ends.add(n)
    crossing = 0
    for cap in range(2, 20):
        after = ref.output_ids[cap]  # the first token past the cap
        if after in ref.output_ids[:cap]:
            continue
        crossing += cap not in ends  # a pass accepts tokens on both sides of the cap
        out = dec.generate(ids, max_new_tokens=cap, eos_token_ids={after})
        assert out.output_ids == ref.output_ids[:cap], cap
        assert out.stop_reason == "max_new_tokens", cap
        last = ref.output_ids[cap - 1]
        if last not in ref.output_ids[:cap - 1]:
            out = dec.generate(ids, max_new_tokens=cap, eos_token_ids={last})
            assert out.output_ids == ref.output_ids[:cap] and out.stop_reason == "eos", cap
    assert crossing >= 3  # the case that used to run past the cap was exercised
