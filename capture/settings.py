"""What a capture is asked to do: the settings of one run, checked when made.

Plain data, importable without torch. Each field that is a ``capture`` option declares it here,
once, in its metadata (:func:`option`: flag, help group, help text, choices, parsing); the
command-line parser and the settings built from parsed options derive from these declarations
(capture/cli.py), and `capture --help` must appear at once (help and choices that need other
modules are callables, resolved when the parser is built).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from moe_spec.capture.storage import DTYPES, OUTPUTS, StoragePolicy
from moe_spec.eagle.settings import TreeSettings
from moe_spec.errors import UserError
from moe_spec.moe.models import DEFAULT_MODEL


class CaptureError(UserError, RuntimeError):
    """A run that cannot be written or resumed; the message is one line for the user."""


MAX_COUNT = 1_000_000  # the most tokens, prompts, steps any sane option asks for


@dataclass(frozen=True)
class Bounds:
    """A setting's valid values: low ≤ value ≤ high (low < value where ``low_open``; either
    bound None: none; a value of None, "unset", passes); ``rule`` says so in words."""
    low: float | None
    high: float | None
    rule: str
    low_open: bool = False

    def admits(self, value) -> bool:
        if value is None:
            return True
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        return above and (self.high is None or value <= self.high)


def option(group: str, help: str | Callable[[], str] = "", *, flag: str | None = None,
           choices: Callable[[], list[str]] | None = None, store_true: bool = False,
           many: bool = False, parse: Callable | None = None,
           bounds: Bounds | None = None) -> dict:
    """A settings field's command-line option, declared once beside the field: its help group,
    help text, choices, and how the parsed value becomes the field's (``parse``). Help and
    choices may be callables, resolved when the parser is built (no import at module load);
    ``flag`` defaults to ``--`` + the field name with dashes; ``many`` is ``nargs="+"`` (a
    tuple); ``store_true`` a switch; ``bounds`` the values the settings accept (checked when
    settings are made, however: options, a config file or the Python API)."""
    found = {"option": {"group": group, "help": help, "flag": flag, "choices": choices,
                        "store_true": store_true, "many": many, "parse": parse}}
    return found if bounds is None else {**found, "bounds": bounds}


def option_flag(field: dataclasses.Field) -> str:
    return field.metadata["option"]["flag"] or "--" + field.name.replace("_", "-")


def limit_from_option(value: int) -> int | None:
    """``--limit``: 0 means every prompt (None); a negative count is refused."""
    if value is None:
        return None
    if value < 0:
        raise CaptureError(f"--limit {value} is out of range: it must be 0 (all) or more")
    return value or None


def benchmark_names() -> list[str]:
    from moe_spec.tasks import benchmarks
    return list(benchmarks.BENCHMARKS)


def model_help() -> str:
    from moe_spec.moe import models
    return f"alias ({', '.join(models.ALIASES)}), hub id or local folder"


def budget_modes() -> list[str]:
    from moe_spec.policy import index
    return [index.FIXED, index.ADAPTIVE]


def gain_predictors() -> dict[str, str]:
    from moe_spec.policy import index
    return index.GAIN_PREDICTORS


def gain_predictor_help() -> str:
    return "; ".join(f"{n}: {d}" for n, d in gain_predictors().items())


def runtime_rankings() -> list[str]:
    from moe_spec.policy import index
    return index.ranking_names(runtime=True)


def runtime_ranking_help() -> str:
    from moe_spec.policy import index
    return index.ranking_help(runtime=True)


def coverage_names() -> list[str]:
    from moe_spec.policy import index
    return list(index.COVERAGES)


def coverage_help() -> str:
    from moe_spec.policy import index
    return index.coverage_help()


RUN, TREE, SAMPLING, DEVICE = "what to run", "draft tree (EAGLE-2)", "sampling", "device"
STORAGE = "storage policy (routing, trees and nodes are always complete)"
ONLINE = "MoE-Spec online mode (budget inside verification passes only)"


@dataclass(frozen=True)
class CaptureSettings:
    """One capture's settings. Each field with ``option`` metadata is a ``capture`` option
    (capture/cli.py builds the parser and this object from the same declarations)."""
    model: str = field(default=DEFAULT_MODEL, metadata=option(RUN, model_help))
    bench: str = field(default="mbpp", metadata=option(RUN, lambda: (
        f"benchmark: {', '.join(benchmark_names())}; several comma-separated (mbpp,gsm8k) "
        "capture one run each, the model loaded once")))
    draft: str | None = field(default=None, metadata=option(
        RUN, "EAGLE-3 or EAGLE-1 head folder or hub id (default: the model's own)"))
    offset: int = field(default=0, metadata=option(
        RUN, "first prompt", bounds=Bounds(0, MAX_COUNT, f"0 to {MAX_COUNT}")))
    limit: int | None = field(default=8, metadata=option(
        RUN, "number of prompts (0: all)", parse=limit_from_option,
        bounds=Bounds(0, MAX_COUNT, f"0 (all) to {MAX_COUNT}")))
    max_new_tokens: int = field(default=64, metadata=option(
        RUN, "tokens generated per prompt",
        bounds=Bounds(1, MAX_COUNT, f"at least 1 and at most {MAX_COUNT}")))
    total_tokens: int = field(default=63, metadata=option(
        TREE, "tokens per verification tree, root included",
        bounds=Bounds(None, 4096, "at most 4096")))
    depth: int = field(default=7, metadata=option(
        TREE, "expansion steps", bounds=Bounds(None, 1024, "at most 1024")))
    tree_top_k: int = field(default=10, metadata=option(
        TREE, "beams and children", bounds=Bounds(None, 1024, "at most 1024")))
    temperature: float = field(default=0.0, metadata=option(
        SAMPLING, "0 = greedy", bounds=Bounds(0, 100, "0 (greedy) to 100")))
    top_p: float = field(default=1.0, metadata=option(
        SAMPLING, "nucleus sampling mass", bounds=Bounds(0, 1, "in (0, 1]", low_open=True)))
    top_k: int = field(default=0, metadata=option(
        SAMPLING, "0 = off", bounds=Bounds(0, MAX_COUNT, f"0 (off) to {MAX_COUNT}")))
    # a seed overflow is refused at once, not hours later: prompt i uses seed + i
    seed: int = field(default=0, metadata=option(
        SAMPLING, "prompt i uses seed + i",
        bounds=Bounds(0, 2**31 - MAX_COUNT - 1, f"0 to {2**31 - MAX_COUNT - 1}")))
    # storage policy (capture/storage.py)
    store_layers: str = field(default="auto", metadata=option(
        STORAGE, "MoE layers whose inputs/outputs are kept: auto (the smallest layer stride "
                 "under ~1.5 MB per tree), all, every:N or a list 0,4,8"))
    store_passes: str = field(default="all", metadata=option(
        STORAGE, "verification passes that keep them: all, every:N or fraction:F (seeded by "
                 "--seed)"))
    hidden_dtype: str = field(default="bfloat16", metadata=option(
        STORAGE, "storage dtype of MoE inputs/outputs (bfloat16 is stored losslessly)",
        choices=lambda: list(DTYPES)))
    store_output: str = field(default="recompute", metadata=option(
        STORAGE, "store the MoE output, or recompute it at replay (per-token output norms are "
                 "kept to check the model)", choices=lambda: list(OUTPUTS)))
    store_expert_outputs: bool = field(default=False, metadata=option(
        STORAGE, "also store each used expert's own output E_i(h_t)", store_true=True))
    budget: int | None = field(default=None, metadata=option(
        ONLINE, "experts per layer per tree", bounds=Bounds(None, MAX_COUNT,
                                                            f"at most {MAX_COUNT}")))
    ranking: str = field(default="router", metadata=option(
        ONLINE, runtime_ranking_help, choices=runtime_rankings))
    coverage: str = field(default="substitution", metadata=option(
        ONLINE, coverage_help, choices=coverage_names))
    budget_mode: str = field(default="fixed", metadata=option(
        ONLINE, "fixed: --budget experts at every layer; adaptive: --budget is a mean B̄, each "
                "layer loading the ranking's next expert while its predicted gain exceeds a "
                "price λ calibrated on --calibration (needed) to a mean of B̄",
        choices=lambda: budget_modes()))
    gain_predictor: str | None = field(default=None, metadata=option(
        ONLINE, lambda: "adaptive: the next expert's predicted gain, from the router mass each "
                        f"shortlist excludes: {gain_predictor_help()} (default: mass)",
        choices=lambda: list(gain_predictors())))
    pass_cap: float | None = field(default=None, metadata=option(
        ONLINE, "adaptive: a hard cap on each pass's total, F·B̄·L experts (F > 1)",
        bounds=Bounds(1, 1000, "above 1 (and at most 1000)", low_open=True)))
    pace: float | None = field(default=None, metadata=option(
        ONLINE, "adaptive: pace the price by the prompt's running deficit, λ·exp(η·D/B̄) with "
                "D = Σ (B_l − B̄) over its tree-layers so far (η > 0, e.g. 0.5)",
        bounds=Bounds(0, 1000, "above 0 (and at most 1000)", low_open=True)))
    # runs under the same --out for static / coact
    calibration: tuple[str, ...] = field(default=(), metadata=option(
        ONLINE, "captured runs under --out that static counts / coact statistics are learned "
                "from (other prompts)", many=True))
    device: str = field(default="auto", metadata=option(DEVICE, "auto, cpu, cuda, cuda:N"))
    dtype: str = field(default="auto", metadata=option(
        DEVICE, "auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16"))
    # not an option: decode steps written per part
    chunk_steps: int = field(default=64, metadata={"bounds": Bounds(1, MAX_COUNT,
                                                                    f"1 to {MAX_COUNT}")})
    # wrap prompts in the tokenizer's chat template (one user turn)
    chat_template: bool = field(default=False, metadata=option(
        RUN, "wrap each prompt in the tokenizer's chat template as one user turn "
             "(instruction-tuned targets; their EAGLE heads were trained so)", store_true=True))
    # sequences decoded together, one batched verification pass each step
    batch_size: int = field(default=1, metadata=option(
        RUN, "decode this many prompts together: each keeps its own draft tree, one target "
             "forward verifies all trees (continuous batching; a --budget caps the union over "
             "the whole batch)", bounds=Bounds(1, 4096, "1 to 4096")))

    # the checkpoint's git revision on the hub (branch, tag or commit), as from_pretrained takes
    revision: str | None = field(default=None, metadata=option(
        RUN, "the model's hub revision: a branch, tag or commit hash (from_pretrained's "
             "revision; recorded in the run, used again by replay)"))
    trust_remote_code: bool = field(default=False, metadata=option(
        RUN, "run the checkpoint's own modelling code from the hub (from_pretrained's "
             "trust_remote_code): only for repositories you trust", store_true=True))

    def __post_init__(self):
        """Refuse settings that cannot describe a capture, in one line naming the option."""
        if self.bench not in benchmark_names():
            raise CaptureError(f"--bench {self.bench!r} is not a benchmark; use one of "
                               f"{', '.join(benchmark_names())} (several: comma-separated)")
        # upper bounds too: a typo (max_new_tokens = 99999999999999999999) is refused at once,
        # not hours later (or never) in a generation loop or a seed overflow
        for f in dataclasses.fields(self):
            bounds = f.metadata.get("bounds")
            value = getattr(self, f.name)
            if bounds is not None and not bounds.admits(value):
                name = option_flag(f) if "option" in f.metadata else f.name
                raise CaptureError(f"{name} {value} is out of range: it must be {bounds.rule}")
        try:
            TreeSettings(self.total_tokens, self.depth, self.tree_top_k)
        except ValueError as exc:
            raise CaptureError(f"{exc} (--total-tokens, --depth, --tree-top-k)") from None

    @classmethod
    def options(cls) -> list[dataclasses.Field]:
        """The fields that are ``capture`` options, in declaration order."""
        return [f for f in dataclasses.fields(cls) if "option" in f.metadata]

    @classmethod
    def from_options(cls, values: dict) -> CaptureSettings:
        """The settings parsed options describe (``values``: field name -> parsed value; each
        option's ``parse`` applied; a list becomes a tuple). Checked: one line for anything
        invalid."""
        found = {}
        for f in cls.options():
            value = values[f.name]
            parse = f.metadata["option"]["parse"]
            found[f.name] = parse(value) if parse else tuple(value) if isinstance(
                value, list) else value
        return cls(**found)

    def storage(self) -> StoragePolicy:
        return StoragePolicy(self.store_layers, self.store_passes, self.hidden_dtype,
                             self.store_output, self.seed)

    def identity(self) -> dict:
        """What makes two captures the same run (device/dtype and chunking included: traces
        from different numerics are different data). ``batch_size`` 1 is left out, so runs
        captured before batching existed keep their identity."""
        found = dataclasses.asdict(self)
        if found["batch_size"] == 1:
            del found["batch_size"]
        for name in ("budget_mode", "gain_predictor", "pass_cap", "pace"):  # as before if unused
            if found[name] in (None, "fixed"):
                del found[name]
        if found["revision"] is None:  # likewise: runs before --revision existed
            del found["revision"]
        del found["trust_remote_code"]  # whose code ran, not what data it is
        return found

    def digest(self) -> str:
        """A short digest of everything that makes the run (:meth:`identity`): the manifest's
        ``settings_digest`` (a column of the ``runs`` view)."""
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:8]

    def readable_run_name(self, model: str, day: str) -> str:
        """A new run's default name: model, benchmark, mode, temperature and the day it
        started, e.g. ``tiny-olmoe-mbpp-eagle-T0-20261201`` (``capture.naming.default_run``
        resumes a run of the same settings under its own name instead)."""
        kind = f"B{self.budget}-{self.ranking}-{self.coverage}" if self.budget else "eagle"
        if self.budget and self.budget_mode != "fixed":
            kind += f"-{self.budget_mode}"
        tail = re.sub(r"[^A-Za-z0-9._-]+", "-", model.rsplit("/", 1)[-1]).strip(".-_")[:48]
        return f"{tail or 'model'}-{self.bench}-{kind}-T{self.temperature:g}-{day}"
