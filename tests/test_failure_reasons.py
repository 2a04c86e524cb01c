"""Why a generated program failed: the quality table keeps the exception's class and message
(analysis.quality), and the most common reasons are counted by class."""

from moe_spec.tasks.scoring import Score


def test_failed_programs_keep_the_exception_class_and_message():
    from moe_spec.analysis import quality
    trace = ('Traceback (most recent call last):\n  File "program.py", line 3, in <module>\n'
             "NameError: name 'remove_Occ' is not defined\n")
    assert quality.answer_of(Score("pass@1", 0.0, "failed", trace)) == \
        "failed: NameError: name 'remove_Occ' is not defined"
    assert quality.answer_of(Score("pass@1", 0.0, "failed", "AssertionError\n")) == \
        "failed: AssertionError"
    long = "ValueError: " + "x" * 1000
    assert len(quality.answer_of(Score("pass@1", 0.0, "failed", long))) == \
        len("failed: ") + quality.REASON_CHARS
    assert quality.answer_of(Score("pass@1", 0.0, "failed", "some output\n")) == "failed"
    assert quality.answer_of(Score("pass@1", 0.0, "timeout", "")) == "timeout"
    assert quality.answer_of(Score("pass@1", 1.0, "passed", "ok\n")) == "passed"
    assert quality.answer_of(Score("accuracy", 0.0, "42", "")) == "42"
    import pyarrow as pa
    table = pa.table({"answer": ["failed: NameError: name 'x'", "failed: NameError: y",
                                 "timeout", "passed", "17", "failed"],
                      "score": [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]})
    assert quality.failures(table) == [("NameError", 2), ("failed", 1), ("timeout", 1)]
