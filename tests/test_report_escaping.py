"""``report`` on traces whose free-text fields are hostile: nothing from disk becomes markup."""

from html.parser import HTMLParser

import pytest
from helpers import capture_model_folder

from moe_spec.analysis import report

PAYLOAD = "</title><script>alert(document.domain)</script>"
MODEL = f"m/{PAYLOAD}"  # a local model folder: ``m/<`` / ``title><script>…<`` / ``script>``
TAGS = {"html", "head", "meta", "title", "body", "h1", "h2", "p", "b", "table", "tr", "th", "td",
        "ol", "li", "a", "div", "script"}  # what the report's template and plotly write


class _Page(HTMLParser):
    """Every start tag of a page, its text outside scripts and each script's body."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags, self.text, self.scripts = [], [], []
        self._script = False

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._script = tag == "script"

    def handle_endtag(self, tag):
        self._script = False

    def handle_data(self, data):
        (self.scripts if self._script else self.text).append(data)


@pytest.mark.slow  # captures
def test_a_hostile_model_name_and_labels_stay_text_in_the_report(tmp_path, monkeypatch):
    # a real capture of a model whose name (its folder, free text in the manifest) is a payload
    monkeypatch.chdir(tmp_path)  # (restored afterwards)
    capture_model_folder(tmp_path, MODEL)
    # other strings read from disk: a manifest's dtype (Runs table), a key-number label and
    # value, a figure's title, trace name and axis title
    monkeypatch.setattr(report, "_dtype", lambda value: PAYLOAD)
    key_numbers = report.key_numbers
    monkeypatch.setattr(report, "key_numbers",
                        lambda *a: [*key_numbers(*a), (PAYLOAD, PAYLOAD)])
    heavy_tails = report.figures.heavy_tails

    def hostile_figure(*args, **kwargs):
        fig = heavy_tails(*args, **kwargs)
        fig.update_layout(title=PAYLOAD)
        fig.update_xaxes(title=PAYLOAD)
        fig.data[0].name = PAYLOAD
        return fig

    monkeypatch.setattr(report.figures, "heavy_tails", hostile_figure)
    assert report.main(["--traces", "traces", "--out", "r", "--threads", "1"]) == 0
    pages = [p for p in (tmp_path / "r").iterdir() if p.suffix == ".html"]
    assert len(pages) == 1
    html = pages[0].read_text()

    assert "<script>alert" not in html and "</title><script>" not in html
    page = _Page()
    page.feed(html)
    page.close()
    assert {tag for tag, _ in page.tags} <= TAGS, {tag for tag, _ in page.tags} - TAGS
    assert [tag for tag, _ in page.tags].count("title") == 1
    # every script is the report's own (plotly.js once, its config, one per figure), and the
    # payload inside a figure's JSON has no '<' that could end it
    assert all(set(attrs) <= {"type", "charset"} for tag, attrs in page.tags if tag == "script")
    assert not any("alert(document.domain)" in s and "<" in s for s in page.scripts)
    assert "\\u003c\\u002fscript\\u003e" in html or "\\u003c/script\\u003e" in html
    # the payload reads as text wherever the report shows it
    title = html.split("<title>")[1].split("</title>")[0]
    assert title == "MoE-Spec workbench: m/&lt;/title&gt;&lt;script&gt;alert(document.domain)" \
                    "&lt;/script&gt; / mbpp"
    text = "".join(page.text)
    assert f"{MODEL} / mbpp" in text  # the heading
    assert f"{PAYLOAD}{PAYLOAD}" in text  # the Runs table's two dtype cells
    assert text.count(PAYLOAD) >= 7  # title, heading, Runs (2), key number (2), contents
    toc = html.split("<h2>Figures</h2>")[1].split("</ol>")[0]
    assert "&lt;/title&gt;&lt;script&gt;alert(document.domain)&lt;/script&gt;</a>" in toc
