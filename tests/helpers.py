"""Plain helpers several test files share (fixtures live in conftest.py): running a command and
checking its one-line error, and synthetic routing and calibration data."""

import os
import subprocess
import sys
from pathlib import Path

import torch

CAP = ["--model", "tiny-olmoe", "--bench", "mbpp", "--max-new-tokens", "8", "--no-progress"]
CAP_ONE = ["--model", "tiny-olmoe", "--bench", "mbpp", "--limit", "1", "--max-new-tokens", "8",
           "--no-progress", "--threads", "1"]  # one prompt, one thread: for refusals
QUERY = "SELECT count(*) AS trees, round(avg(accepted_length), 6) AS tau FROM trees"


# --- commands ------------------------------------------------------------------------------------
def run(module, *args, timeout=300):
    """``python -m module args`` or, for ``module:function`` (a console script), that function
    called with the args."""
    if ":" in module:
        mod, func = module.split(":")
        cmd = ["-c", f"import sys; from {mod} import {func}; sys.exit({func}(sys.argv[1:]))"]
    else:
        cmd = ["-m", module]
    return subprocess.run([sys.executable, *cmd, *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


def call(module, *args, timeout=None):
    """What :func:`run` answers (a finished ``CompletedProcess``: returncode, stdout, stderr), from
    the command's entry point called in this process: no interpreter start, no torch import
    (seconds each). ``module`` as for :func:`run`: ``python -m module``'s ``main``, or
    ``module:function``. As in a fresh process, an exception the command lets through is exit
    1 with its traceback on stderr, warnings are written to stderr (the view warnings said once
    per process included), and what the command sets for itself (environment variables,
    torch's threads, storage options) is undone after.
    Keep :func:`run` for what needs a fresh process: a closed pipe, start-up time, what a
    command imports. ``timeout``: :func:`run`'s, accepted and unused (nothing to kill)."""
    import contextlib
    import importlib
    import io
    import traceback
    import warnings

    from moe_spec.catalog import location
    from moe_spec.console import threads
    mod, _, func = module.partition(":")
    main = getattr(importlib.import_module(mod), func or "main")
    argv = list(map(str, args))
    out, err = (io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True)
                for _ in range(2))
    saved = (dict(os.environ), torch.get_num_threads(), threads._applied, dict(location._options))
    warned = _once_warned()  # said once per process: a fresh process says it again
    said_before = set(warned)
    warned.clear()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                warnings.catch_warnings():
            warnings.resetwarnings()  # Python's defaults, shown on stderr (not pytest's record)
            for action, category in (("ignore", DeprecationWarning),
                                     ("ignore", PendingDeprecationWarning),
                                     ("ignore", ImportWarning), ("ignore", ResourceWarning)):
                warnings.simplefilter(action, category)
            warnings.showwarning = lambda message, category, filename, lineno, file=None, \
                line=None: sys.stderr.write(warnings.formatwarning(message, category, filename,
                                                                   lineno, line))
            try:
                code = main(argv)
            except SystemExit as stop:
                code = stop.code
            except BaseException:  # what the interpreter prints for an uncaught exception
                if sys.exc_info()[0] is KeyboardInterrupt:
                    raise
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
    finally:
        os.environ.clear()
        os.environ.update(saved[0])
        torch.set_num_threads(saved[1])
        threads._applied = saved[2]
        location._options.clear()
        location._options.update(saved[3])
        warned = _once_warned()
        warned.clear()
        warned.update(said_before)
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("text"): the text on stderr, exit 1
        err.write(f"{code}\n")
        code = 1
    text = [s.buffer.getvalue().decode("utf-8", "replace") for s in (out, err)]
    return subprocess.CompletedProcess([module, *argv], code, *text)


def _once_warned() -> set:
    """The warnings analysis.sql has said in this process (it says each once per process)."""
    from moe_spec.analysis import sql
    return sql._WARNED


def overlay_env(copy: Path) -> dict:
    """An environment whose ``moe_spec`` takes its packages from ``copy`` first and the working
    tree after (the mapping pyproject's package-dir makes on install): a recipe test's modified
    copy of one package, everything else unchanged."""
    (copy / "moe_spec").mkdir(exist_ok=True)
    root = Path(__file__).resolve().parents[1]
    (copy / "moe_spec" / "__init__.py").write_text(f"__path__ = [{str(copy)!r}, {str(root)!r}]\n")
    return dict(os.environ, PYTHONPATH=str(copy))


def one_line_error(r, *words):
    """``r`` (a finished subprocess) failed with exit code 2 and one stderr line holding
    ``words``, no traceback."""
    assert r.returncode == 2, (r.returncode, r.stdout[-500:], r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


def one_line(capsys, code, *words):
    """An in-process ``main`` returned ``code`` 2 and wrote one stderr line holding ``words``;
    the line."""
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


def exit_code(main, argv):
    """``main(argv)``'s exit status, whether returned or raised (argparse's ``error``)."""
    try:
        return main(argv)
    except SystemExit as stop:
        return stop.code


def copy_of(traces, tmp_path: Path, name="t") -> Path:
    """A copy of ``traces`` (a session fixture's) under ``tmp_path``, to change."""
    import shutil
    copy = tmp_path / name
    shutil.copytree(traces, copy)
    return copy


def run_env(tmp_path: Path) -> dict:
    """A subprocess environment: offline, one thread, its own cache folder."""
    return dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
                XDG_CACHE_HOME=str(tmp_path / "cache"), TOKENIZERS_PARALLELISM="false")


# --- synthetic routing and calibration -----------------------------------------------------------
def synthetic(seed: int, m=12, n=8, k=2, h=6, renormalize=True, sharpness=3.0, layer=3):
    """One tree-layer as a RoutingBatch of size 1 with expert terms, plus its raw tensors."""
    from moe_spec.policy.batch import ExpertTerms, RoutingBatch
    from moe_spec.policy.routing import RoutingRule
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(m, n, generator=g) * sharpness, -1)
    w, idx = probs.topk(k, -1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    experts = torch.randn(m, n, h, generator=g, dtype=torch.float64).float()
    batch = RoutingBatch.single(probs, idx, w, layer, RoutingRule(k, renormalize=renormalize))
    batch.terms = ExpertTerms.from_outputs(experts[None], idx[None], w[None])
    return batch, experts


def calibration_of(batch, experts, layer=3):
    """Calibration statistics of one synthetic tree-layer (:func:`synthetic`)."""
    from moe_spec.policy.calibration import CalibrationStats
    stats = CalibrationStats.empty([layer], batch.n)
    idx = batch.idx[0]
    stats.add(layer, idx, experts.gather(1, idx[..., None].expand(-1, -1, experts.shape[-1])))
    return stats


def synthetic_calibration(seed: int, count: int, n=8, k=2, m=12, h=6, examples=0):
    """Tree-layers whose experts differ in output size (which router mass cannot see), and the
    calibration statistics collected from them through the real ``collect``."""
    from types import SimpleNamespace

    from moe_spec.policy.calibration import CalibrationStats
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.2, 3.0, n)[torch.randperm(n, generator=torch.Generator()
                                                       .manual_seed(99))]
    weights = torch.randn(n, h, h, generator=torch.Generator().manual_seed(98)) * scale[:, None,
                                                                                         None]
    model = SimpleNamespace(moe_layers=[3], num_experts=n, expert_outputs=lambda layer, x:
                            torch.einsum("mh,nhd->mnd", x, weights))
    tls = []
    for _ in range(count):
        probs = torch.softmax(torch.randn(m, n, generator=g) * 2.0, -1)
        w, idx = probs.topk(k, -1)
        tls.append(SimpleNamespace(layer=3, probs=probs, idx=idx, weights=w,
                                   hidden=torch.randn(m, h, generator=g)))
    return CalibrationStats.collect(tls, model, max_examples=examples), tls, model


def linear_experts(seed: int, n: int, h: int, layer: int):
    """A model whose experts are ``E_i(h) = W_i h + c_i`` of different sizes (what router mass
    cannot see), with the ``expert_outputs`` and ``moe_layers`` the calibration reads."""
    from types import SimpleNamespace
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.2, 3.0, n)[torch.randperm(n, generator=g)]
    w = torch.randn(n, h, h, generator=g) * scale[:, None, None]
    c = torch.randn(n, h, generator=g) * 0.3
    return SimpleNamespace(moe_layers=[layer], num_experts=n, expert_outputs=lambda _, x:
                           torch.einsum("mh,nhd->mnd", x, w) + c)


# --- real MoE blocks -----------------------------------------------------------------------------
def block_io(model, input_ids):
    """(MoE input, MoE output) of every sparse block, captured by hooks during a forward."""
    from moe_spec.moe.adapter import MoEAdapter
    adapter = MoEAdapter(model)
    seen = {}
    hooks = [layer.block.register_forward_hook(  # gpt-oss's block returns (output, scores)
        lambda mod, args, out, i=layer.index: seen.__setitem__(
            i, (args[0], out[0] if isinstance(out, tuple) else out)))
        for layer in adapter]
    with torch.no_grad():
        model(input_ids=input_ids)
    for hook in hooks:
        hook.remove()
    return adapter, seen


def real_ids(tokenizer, n=40):
    """The first ``n`` token ids of mbpp's first prompt, as a batch of one."""
    from moe_spec.tasks import benchmarks
    text = benchmarks.load("mbpp", limit=1)[0].text
    return tokenizer(text, return_tensors="pt")["input_ids"][:, :n]


def capture_model_folder(tmp_path: Path, name: str) -> None:
    """A one-prompt capture into ``tmp_path/traces`` of a copy of tiny-olmoe in the local model
    folder ``tmp_path/name`` (a hostile folder name, say); the working directory is
    ``tmp_path``."""
    import shutil

    from moe_spec.capture import cli as capture_cli
    from moe_spec.moe import models
    os.chdir(tmp_path)
    shutil.copytree(models.EMBEDDED_DIR / "tiny-olmoe", tmp_path / name)
    assert capture_cli.main(["--model", name, "--draft", str(models.DRAFTS_DIR / "tiny-olmoe"),
                             "--limit", "1", "--max-new-tokens", "8", "--out", "traces",
                             "--no-progress", "--threads", "1"]) == 0


# The main column of the dashboard at its default layout (wide, sidebar open) in a 1280 px
# window, a laptop's: 808 px (headless Chromium: 928 px at 1400, 628 px at 1100)
PAGE_WIDTH = 808


def dataframe_width(frame) -> int:
    """About how wide ``st.dataframe`` draws ``frame`` (pandas, as AppTest gives it): each
    column sized to its longest text, header or cell (floats as Streamlit shows them, up to 4
    decimals), at about 6 px a character plus 20 px of padding. Checked against headless
    Chromium on the pages' tables: 7 columns of words 1208 estimated, 1204 drawn; 10 columns
    1490, 1453; 15 columns of numbers 1068, 1084; 8 columns 730, 736."""
    def shown(v) -> str:
        return f"{v:.4f}".rstrip("0").rstrip(".") if isinstance(v, float) else str(v)
    return sum(6 * max([len(str(c))] + [len(shown(v)) for v in frame[c]]) + 20
               for c in frame.columns)


def dataframes_cut(at) -> list[tuple[list, int]]:
    """The ``st.dataframe`` tables of an AppTest page wider than the page (their columns and
    estimated width, :func:`dataframe_width`): a column past the right edge is hidden."""
    return [(list(d.value.columns), w) for d in at.dataframe
            if (w := dataframe_width(d.value)) > PAGE_WIDTH]
