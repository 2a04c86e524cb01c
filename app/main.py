"""The MoE-Spec workbench dashboard (Streamlit).

    workbench-app --traces traces          # or: streamlit run app/main.py -- --traces traces
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import streamlit as st

if __package__ in (None, ""):  # run as a script by `streamlit run`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app import data, pages  # noqa: E402


def traces_root() -> Path:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--traces", default=os.environ.get("MOESPEC_TRACES", "traces"))
    args, _ = p.parse_known_args(sys.argv[1:])
    return Path(args.traces)


st.set_page_config(page_title="MoE-Spec workbench", layout="wide")
root = traces_root()
dataset, problem = data.load(root)
if dataset is None:
    pages.no_data(root, problem)
    st.stop()
st.sidebar.title("MoE-Spec workbench")
page = st.sidebar.radio("Page", list(pages.PAGES), key="page")
st.sidebar.caption(f"{dataset.runs.height} runs under `{root}`")
pages.PAGES[page](dataset)
