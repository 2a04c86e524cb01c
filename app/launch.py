"""``workbench-app``: start the dashboard on a traces folder."""

from __future__ import annotations

import sys
from pathlib import Path

import console


def main(argv: list[str] | None = None) -> int:
    p = console.ArgumentParser(prog="workbench-app", description="Start the Streamlit dashboard "
                                "over a traces folder (captures and replay results).")
    p.add_argument("--traces", default="traces", help="traces root (default traces/)")
    p.add_argument("--port", type=int, default=8501)
    p.add_argument("--headless", action="store_true", help="do not open a browser")
    args = p.parse_args(argv)
    from streamlit.web import cli as stcli
    script = Path(__file__).with_name("main.py")
    sys.argv = ["streamlit", "run", str(script), "--server.port", str(args.port),
                "--server.headless", str(args.headless).lower(),
                "--browser.gatherUsageStats", "false", "--", "--traces", args.traces]
    return stcli.main()


if __name__ == "__main__":
    sys.exit(main())
