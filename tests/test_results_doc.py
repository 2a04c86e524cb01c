"""The results pages' generated blocks (analysis/results_doc.py, the one renderer every bench
uses): the block is replaced, the text around it kept byte for byte, and a page without its
markers refused in one line with nothing written."""

import argparse

import pytest

from moe_spec.analysis import results_doc
from moe_spec.analysis.results_doc import MissingBlock, block_markers, replace_block, write_block

BEGIN, END = block_markers("sketch matrix", "cross_domain.py")


def page(body: str = "| typed | by hand |") -> str:
    return f"intro\n\n{BEGIN}\n{body}\n{END}\n\noutro <!-- other: end -->\n"


def test_the_markers_name_the_block_and_the_bench_that_writes_it():
    assert BEGIN == "<!-- sketch matrix: begin (bench/cross_domain.py --readme; do not edit) -->"
    assert END == "<!-- sketch matrix: end -->"


def test_the_block_is_replaced_and_the_text_around_it_kept():
    assert replace_block(page(), "| new | table |", BEGIN, END) == page("| new | table |")
    twice = replace_block(replace_block(page(), "a\nb", BEGIN, END), "a\nb", BEGIN, END)
    assert twice == page("a\nb")  # rendering again changes nothing
    other = block_markers("frontier", "frontier.py")  # another block on the same page stays
    text = page() + f"{other[0]}\nkept\n{other[1]}\n"
    assert replace_block(text, "x", BEGIN, END) == page("x") + f"{other[0]}\nkept\n{other[1]}\n"


@pytest.mark.parametrize("text", [
    "intro\nno markers\n",
    f"intro\n{BEGIN}\nonly the begin\n",
    f"intro\nonly the end\n{END}\n",
    f"{END}\nend first\n{BEGIN}\n",
    page() + f"{BEGIN}\nsecond\n{END}\n",
])
def test_a_page_without_exactly_one_block_is_refused_in_one_line(text):
    with pytest.raises(MissingBlock) as refused:
        replace_block(text, "x", BEGIN, END, "README.md")
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"README.md has no '{BEGIN}'")
    assert "add both marker lines" in message


def test_a_refused_page_leaves_every_page_as_it_was(tmp_path):
    good, bad = tmp_path / "README.md", tmp_path / "results.md"
    good.write_text(page())
    bad.write_text("no markers\n")
    with pytest.raises(MissingBlock, match="results.md has no"):
        write_block([good, bad], "new", "sketch matrix", "cross_domain.py")
    assert good.read_text() == page() and bad.read_text() == "no markers\n"
    assert write_block([good], "new", "sketch matrix", "cross_domain.py") == [good]
    assert good.read_text() == page("new")


def test_a_bench_command_line_gets_one_error_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "results.md"
    bad.write_text("no markers\n")
    for missing in (bad, tmp_path / "absent.md"):
        with pytest.raises(SystemExit) as done:
            results_doc.write_block_or_exit([missing], "x", "sketch matrix", "cross_domain.py")
        assert done.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("cross_domain.py: error: ") and err.count("\n") == 1, err
        assert str(missing) in err
    assert bad.read_text() == "no markers\n"


def test_the_table_options_default_to_the_bench_s_block():
    p = argparse.ArgumentParser()
    results_doc.add_table_options(p, "frontier")
    args = p.parse_args(["--render", "a.json", "--readme", "README.md"])
    assert (args.block, [str(r) for r in args.readme], [str(r) for r in args.render]) == (
        "frontier", ["README.md"], ["a.json"])
    assert p.parse_args([]).render is None and p.parse_args([]).readme == []


def test_two_files_holding_one_result_are_refused_not_one_hidden(tmp_path, capsys):
    import json
    files = []
    for name, tau in (("a.json", 4.0), ("b.json", 5.0)):
        files.append(tmp_path / name)
        files[-1].write_text(json.dumps({"version": 1, "models": {"m@8": {"tau": tau}}}))
    assert results_doc.read_model_outputs(files[:1], "x.py", 1) == {"m@8": {"tau": 4.0}}
    with pytest.raises(SystemExit) as exit_:
        results_doc.read_model_outputs(files, "x.py", 1)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "a.json" in err and "b.json" in err and "m@8" in err
