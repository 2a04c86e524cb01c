"""Answer extraction on tricky completions: each row is (completion, reference, correct?).

GSM8K references are written as upstream writes them (a worked solution ending ``#### N``) or as a
bare number; MATH500 references are LaTeX, as in the benchmark."""

import pytest

from moe_spec.tasks import scoring
from moe_spec.tasks.benchmarks import Prompt

GSM8K = [
    # a hyphen between two numbers is a range or a subtraction, never the second number's sign
    ("range-hyphen", " It takes between 5-10 minutes.", "#### 10", True),
    ("range-hyphen-not-negative", " It takes between 5-10 minutes.", "#### -10", False),
    ("range-hyphen-spaced", " It takes between 5 - 10 minutes.", "#### 10", True),
    ("range-en-dash", " It takes between 5\u201310 minutes.", "#### 10", True),
    ("range-en-dash-not-negative", " It takes between 5\u201310 minutes.", "#### -10", False),
    ("range-dollars", " It costs $5-$10.", "10", True),
    ("subtraction", " 12 - 5 = 7\n#### 7", "#### 7", True),
    ("hyphenated-word", " The answer is in COVID-19", "19", True),
    # U+2212 MINUS SIGN is a minus sign
    ("unicode-minus", " The answer is \u22125.", "#### -5", True),
    ("unicode-minus-not-positive", " The answer is \u22125.", "#### 5", False),
    ("unicode-minus-after-hashes", " #### \u22125", "-5", True),
    ("negative-after-hashes", " Let me think.\n#### -5", "#### -5", True),
    ("negative-after-hashes-not-positive", " #### -5", "#### 5", False),
    ("negative-after-equals", " The change is 3 - 8 = -5", "-5", True),
    ("negative-after-word", " The temperature fell to -5", "-5", True),
    ("negative-dollars", " The profit is -$5", "#### -5", True),
    # numbers compare by value, not by spelling
    ("leading-zeros", " #### 007", "#### 7", True),
    ("leading-zeros-reference", " #### 7", "#### 007", True),
    ("leading-dot", " The answer is .5", "#### 0.5", True),
    ("leading-dot-not-five", " The answer is .5", "#### 5", False),
    ("trailing-zero-decimal", " #### 3.0", "#### 3", True),
    ("decimals-by-value", " #### 0.50", "#### .5", True),
    ("decimal-not-rounded", " #### 3.01", "#### 3", False),
    ("thousands", " #### 1,000", "#### 1000", True),
    ("thousands-reference", " #### 1450000", "#### 1,450,000", True),
    ("thousands-in-text", " The total is 1,000 dollars.", "1000", True),
    ("comma-list-is-not-thousands", " The numbers are 1,2,3", "3", True),
    ("trailing-period", " The answer is 42.", "#### 42", True),
    ("money", " It costs $1,234.50", "#### 1234.5", True),
    ("money-with-cents", " #### $18.00", "She makes $<<9*2=18>>18.\n#### 18", True),
    ("percent", " The discount is 50%", "#### 50", True),
    ("percent-after-hashes", " #### 50%", "#### 50", True),
    # which number counts
    ("first-number-after-last-hashes", " #### 4\n#### 5 apples, 9 pears", "#### 5", True),
    ("last-number-without-hashes", " 3 + 4 = 7, so 7 apples and 2 left", "#### 2", True),
    ("wrong-number", " #### 123456789", "#### 7", False),
    ("no-number", " no number at all", "#### 7", False),
    ("empty", "", "#### 7", False),
]

MATH500 = [
    ("frac-vs-decimal", r" The answer is $\boxed{\frac{1}{2}}$.", "0.5", True),
    ("frac-vs-slash", r" $\boxed{\frac{1}{2}}$", "1/2", True),
    ("frac-vs-leading-dot", r" $\boxed{\frac{1}{2}}$", ".5", True),
    ("leading-dot-vs-frac", r" $\boxed{.5}$", r"\frac{1}{2}", True),
    ("unreduced-frac", r" $\boxed{\dfrac{2}{4}}$", r"\frac{1}{2}", True),
    ("wrong-frac", r" $\boxed{\frac{1}{3}}$", r"\frac{1}{2}", False),
    ("rounded-is-not-exact", r" $\boxed{0.333}$", r"\frac{1}{3}", False),
    ("leading-zeros", r" $\boxed{007}$", "7", True),
    ("leading-zeros-reference", r" $\boxed{7}$", "007", True),
    ("trailing-zero-decimal", r" $\boxed{3.0}$", "3", True),
    ("thousands", r" $\boxed{1,000}$", "1000", True),
    ("money", r" $\boxed{\$1,234.50}$", "1234.5", True),
    ("negative", r" $\boxed{-50}$", "-50", True),
    ("negative-not-positive", r" $\boxed{50}$", "-50", False),
    ("unicode-minus-boxed", " $\\boxed{\u22125}$", "-5", True),
    ("unicode-minus-plain-text", " The answer is \u22125.", "-5", True),
    ("unicode-minus-not-positive", " The answer is \u22125.", "5", False),
    # inside LaTeX a hyphen between numbers is subtraction
    ("latex-subtraction", r" $\boxed{5-10}$", "-5", True),
    ("latex-subtraction-not-ten", r" $\boxed{5-10}$", "10", False),
    ("percent-vs-fraction", r" $\boxed{50\%}$", "0.5", True),
    ("surd", r" $\boxed{\sqrt{52}}$", r"2\sqrt{13}", True),
    ("pi-is-not-3.14", r" $\boxed{\pi}$", "3.14", False),
    ("solution-set-order", r" $\boxed{-2,1}$", "1,-2", True),
    ("degrees", r" $\boxed{90}$", r"90^\circ", True),
    ("polar-pair", r" $\boxed{(3, \pi/2)}$", r"\left( 3, \frac{\pi}{2} \right)", True),
    ("empty", "", r"\frac{1}{2}", False),
]


@pytest.mark.parametrize("completion, reference, correct", [row[1:] for row in GSM8K],
                         ids=[row[0] for row in GSM8K])
def test_gsm8k_tricky_answers(completion, reference, correct):
    score = scoring.gsm8k(Prompt("gsm8k", "x", "Question: ...", reference), completion)
    assert score.value == float(correct), (score.answer, score.detail)


@pytest.mark.parametrize("completion, reference, correct", [row[1:] for row in MATH500],
                         ids=[row[0] for row in MATH500])
def test_math500_tricky_answers(completion, reference, correct):
    score = scoring.math500(Prompt("math500", "x", "Problem: ...", reference), completion)
    assert score.value == float(correct), (score.answer, score.detail)


@pytest.mark.parametrize("text, number", [
    ("$1,000.50", "1000.5"), ("7.0", "7"), ("007", "7"), (".5", "0.5"), ("\u22125", "-5"),
    ("-0", "0"), ("50%", "50"), ("1,450,000", "1450000"), ("-$5", "-5"), ("42.", "42"),
])
def test_normalise_number_gives_one_spelling_per_value(text, number):
    assert scoring.normalise_number(text) == number
