"""The MoE-Spec workbench dashboard (Streamlit).

    workbench-app --traces traces          # or: streamlit run app/main.py -- --traces traces

Every page is one module, app/screens/<name>.py (found by :mod:`app.screens`), and has its own
URL, e.g. ``http://127.0.0.1:8501/coverage``. The folder is not called ``pages/``: Streamlit
would treat that name as its older multipage layout and run a deep-linked page without this
script.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import streamlit as st

from moe_spec.app import data, screens, views  # run as a script by `streamlit run`: the

# installed package (scripts/setup.sh), never this folder's neighbours


def traces_root():
    """The traces root the app was started on: a folder or s3://bucket/prefix
    (:func:`catalog.location.root`, with ``--storage-options`` installed)."""
    from moe_spec.catalog import location
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--traces", default=os.environ.get("MOESPEC_TRACES", "traces"))
    p.add_argument("--storage-options", default=None)
    args, _ = p.parse_known_args(sys.argv[1:])
    return location.from_args(args.traces, args.storage_options)


st.set_page_config(page_title="MoE-Spec workbench", layout="wide")
try:
    root = traces_root()
except ValueError as exc:  # catalog.location.LocationError: one line, no traceback
    st.error(str(exc))
    st.stop()
st.session_state["root"] = root
dataset, problem = data.current(root)
if dataset is None:
    views.no_data(root, problem)
    st.stop()
here = Path(__file__).resolve().parent
pages = [st.Page(str(here / "screens" / f"{name}.py"), title=title,
                 url_path=name.replace("_", "-"), default=name == "overview")
         for name, (title, _) in screens.PAGES.items()]
page = st.navigation(pages)
st.sidebar.caption(f"{dataset.runs.height} runs under `{root}`")
page.run()
