"""The routing-summary workers never run the caller's main script again: a Streamlit page is
``__main__`` and builds summaries on load, so a worker re-running it started pools of its own and
the page never finished (CI hung on the app's tests)."""

import os
import sys
import types

from moe_spec.analysis import summaries
from moe_spec.catalog import location


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
        started = workers.map(abs, [-1, -2, -3])
        assert sys.modules["__main__"].__file__.endswith("page.py")  # given back at once
        assert list(started) == [1, 2, 3]
    assert not marker.exists()


def test_without_the_guard_a_worker_does_rerun_it(tmp_path, monkeypatch):
    """The mechanism the guard is for (so the test above can fail): a plain fork-server pool."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    marker = _page_as_main(tmp_path, monkeypatch)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver")) as workers:
        assert list(workers.map(abs, [-1])) == [1]
    assert marker.exists()


def test_the_workers_have_the_callers_environment_and_storage_options_as_they_are_now(
        monkeypatch):
    """The fork server is started once, by the first pool; a worker it starts later must still
    see what the caller set since (s3:// parts failed to open as 'corrupt' in the workers when
    the AWS_* variables came after the server)."""
    with summaries.pool(1) as first:  # the fork server runs from here on
        assert list(first.map(abs, [-1])) == [1]
    monkeypatch.setenv("MOESPEC_WORKER_PROBE", "set after the server started")
    location.use_storage_options({"endpoint_url": "http://127.0.0.1:9"})
    try:
        with summaries.pool(1) as workers:
            assert list(workers.map(os.getenv, ["MOESPEC_WORKER_PROBE"])) == [
                "set after the server started"]
            assert workers.submit(location.storage_options).result() == {
                "endpoint_url": "http://127.0.0.1:9"}
    finally:
        location.use_storage_options(None)
