"""``workbench-app``: start the dashboard on a traces folder.

    workbench-app --traces traces                      # http://127.0.0.1:8501, this machine only
    workbench-app --traces traces --host 0.0.0.0       # reachable from the network
    workbench-app --traces traces -- --theme.base dark # anything after -- goes to Streamlit
    workbench-app --traces s3://bucket/traces          # an object store (AWS_* variables)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moe_spec import console
from moe_spec.catalog import location
from moe_spec.errors import UserError, fail


def parser() -> argparse.ArgumentParser:
    p = console.ArgumentParser(
        prog="workbench-app",
        description="Start the Streamlit dashboard over a traces folder (captures and replay "
                    "results). Binds to 127.0.0.1 unless --host says otherwise.",
        examples=__doc__.split("\n\n", 1)[1])
    p.add_argument("--traces", default="traces",
                   help="traces root: a folder (default traces/) or s3://bucket/prefix")
    location.add_storage_options_argument(p)
    p.add_argument("--port", type=int, default=8501, help="port (default 8501)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--headless", action="store_true", help="do not open a browser")
    p.add_argument("streamlit_args", nargs="*", help="options passed to `streamlit run` (after --)")
    return p


WILDCARDS = {"0.0.0.0", "::", "[::]", "*", "0", "::0", "0:0:0:0:0:0:0:0"}  # every interface


def listening_address(host: str) -> str:
    """``--host`` as given, refused (UserError) when empty, blank or a wildcard other than an
    explicit ``0.0.0.0``: Streamlit reads an empty address as "every interface", and a stray
    ``--host ""`` must not expose the dashboard. ``0.0.0.0`` is allowed with a warning."""
    text = host.strip()
    if not text:
        raise UserError("--host is empty, which listens on every interface; give 127.0.0.1 "
                        "(this machine), an address of this machine, or 0.0.0.0 on purpose")
    if text == "0.0.0.0":
        print("workbench-app: warning: --host 0.0.0.0 listens on every interface: anyone who "
              "can reach this machine can read the traces", file=sys.stderr)
        return text
    if text.lower() in WILDCARDS:
        raise UserError(f"--host {host!r} listens on every interface; give 127.0.0.1 (this "
                        "machine), an address of this machine, or exactly 0.0.0.0 on purpose")
    return text


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if not 1 <= args.port <= 65535:
        p.error(f"--port {args.port} is not a port; use 1..65535")
    try:
        args.host = listening_address(args.host)
        root = location.from_args(args.traces, args.storage_options)
        if not location.is_remote(root) and root.exists() and not root.is_dir():
            raise UserError(f"--traces {args.traces} is not a folder; give the traces folder "
                            "(captures and replay results), e.g. --traces traces")
    except UserError as exc:
        return fail("workbench-app", exc)
    if not root.is_dir():
        print(f"workbench-app: note: no traces folder at {args.traces} yet; the dashboard shows "
              "how to create one", file=sys.stderr)
    from streamlit.web import cli as stcli
    script = Path(__file__).with_name("main.py")
    # without a terminal Streamlit's first-run e-mail prompt would wait forever on stdin
    headless = args.headless or not sys.stdin.isatty()
    sys.argv = ["streamlit", "run", str(script), "--server.port", str(args.port),
                "--server.address", args.host, "--server.headless", str(headless).lower(),
                "--browser.gatherUsageStats", "false",
                # a local analysis tool: no "Deploy" button or developer menu in the toolbar
                "--client.toolbarMode", "viewer", *args.streamlit_args, "--",
                "--traces", args.traces,
                *(["--storage-options", args.storage_options] if args.storage_options else [])]
    return stcli.main()


if __name__ == "__main__":
    sys.exit(main())
