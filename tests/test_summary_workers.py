"""The routing-summary workers never run the caller's main script again: a Streamlit page is
``__main__`` and builds summaries on load, so a worker re-running it started pools of its own and
the page never finished (CI hung on the app's tests)."""

import sys
import types

from moe_spec.analysis import summaries


def _page_as_main(tmp_path, monkeypatch):
    marker = tmp_path / "page ran in a worker"
    script = tmp_path / "page.py"
    script.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    page = types.ModuleType("__main__")
    page.__file__ = str(script)
    monkeypatch.setitem(sys.modules, "__main__", page)
    return marker


def test_the_workers_do_not_rerun_a_page_that_is_main(tmp_path, monkeypatch):
    marker = _page_as_main(tmp_path, monkeypatch)
    with summaries.pool(2) as workers:
        with summaries.callers_main_not_rerun():
            started = workers.map(abs, [-1, -2, -3])
        assert sys.modules["__main__"].__file__.endswith("page.py")  # given back at once
        assert list(started) == [1, 2, 3]
    assert not marker.exists()


def test_without_the_guard_a_worker_does_rerun_it(tmp_path, monkeypatch):
    """The mechanism the guard is for (so the test above can fail)."""
    marker = _page_as_main(tmp_path, monkeypatch)
    with summaries.pool(1) as workers:
        assert list(workers.map(abs, [-1])) == [1]
    assert marker.exists()
