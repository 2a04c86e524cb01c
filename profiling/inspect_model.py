"""``inspect-model``: load a model through the registry and print what the workbench sees in it.

    inspect-model --model tiny-olmoe

Prints the architecture, the MoE layers the adapter found (N, k, mixing-weight rule), parameter
counts (total and active per token), the quality record of an embedded model, and a live probe:
the experts touched per layer by the first 63 tokens of a benchmark prompt, the token count of one
EAGLE verification tree.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from moe_spec import console
from moe_spec.errors import UserError, fail
from moe_spec.moe import families, models
from moe_spec.tasks import benchmarks

if TYPE_CHECKING:  # torch and the adapter load after the options are read: --help is instant
    from moe_spec.moe.adapter import MoEAdapter

PROBE_TOKENS = 63


def parameter_counts(model, adapter: MoEAdapter) -> tuple[int, int]:
    """(total parameters, parameters active for one token: all but the unrouted experts)."""
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    for layer in adapter:
        per_expert = (layer.experts.gate_up_proj[0].numel() + layer.experts.down_proj[0].numel())
        inactive += per_expert * (layer.num_experts - layer.top_k)
    return total, total - inactive


def probe(loaded: models.LoadedModel, adapter: MoEAdapter, bench: str, root) -> list[int]:
    """Unique experts per MoE layer touched by the first PROBE_TOKENS tokens of one prompt."""
    import torch
    prompt = benchmarks.load(bench, root=root, limit=1)[0]
    ids = loaded.tokenizer(prompt.text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    ids = ids[:, :PROBE_TOKENS].to(loaded.device)
    chosen = {}
    hooks = [layer.router.register_forward_hook(
        lambda mod, args, out, i=layer.index: chosen.__setitem__(i, out[2])) for layer in adapter]
    try:
        with torch.no_grad():
            loaded.model(input_ids=ids)
    finally:
        for hook in hooks:
            hook.remove()
    return [int(torch.unique(chosen[layer.index]).numel()) for layer in adapter]


def describe_rule(adapter: MoEAdapter) -> str:
    """The family's routing in words: the rule's own description
    (:meth:`policy.routing.RoutingRule.describe`), then the block's shared experts and dense
    layers, which are not routed."""
    parts = [adapter.rule.describe()]
    if adapter.has_shared_experts:
        parts.append("shared experts (always on, not in a budget)")
    dense = adapter.num_decoder_layers - len(adapter)
    if dense:
        parts.append(f"{dense} dense layer(s)")
    return ", ".join(parts)


def selection_overheads(loaded: models.LoadedModel) -> dict[str, dict]:
    """Per ranking that reads weights of its own at every verification pass (``sketch``'s
    surrogates; :func:`policy.index.overhead`), what it costs at this model's shape: bytes per
    MoE layer, FLOPs per tree token and those bytes in experts of this model at its parameter
    dtype (the numbers the cost model charges, :meth:`analysis.cost.ModelShape.overhead`)."""
    from moe_spec.analysis.cost import ModelShape
    from moe_spec.policy import index
    size = next(loaded.model.parameters()).element_size()
    shape = ModelShape.from_config(loaded.model.config, bytes_per_param=size)
    found = {}
    for name, entry in index.RANKINGS.items():
        if entry.overhead is not None:
            cost = shape.overhead(name)
            found[name] = dict(bytes_per_layer=cost.bytes_per_layer,
                               flops_per_token=cost.flops_per_token,
                               expert_equivalents=shape.overhead_experts(name),
                               expert_dtype_bytes=size)
    return found


def overhead_text(name: str, cost: dict) -> str:
    return (f"{name}: {cost['bytes_per_layer'] / 2**20:.2f} MiB per MoE layer "
            f"(= {cost['expert_equivalents']:.2f} experts), "
            f"{cost['flops_per_token'] / 1e6:.2f} MFLOPs per tree token")


def summary_table(loaded: models.LoadedModel, adapter: MoEAdapter) -> Table:
    total, active = parameter_counts(loaded.model, adapter)
    t = Table(title=f"{loaded.name}  ({loaded.source.location})", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    rows = [
        ("architecture", type(loaded.model).__name__),
        ("device / dtype", f"{loaded.device} / {str(loaded.dtype).removeprefix('torch.')}"),
        ("parameters", f"{total / 1e6:.2f} M total, {active / 1e6:.2f} M active per token"),
        ("decoder layers", f"{adapter.num_decoder_layers} (MoE: {len(adapter)})"),
        ("hidden size", str(families.facts(loaded.model.config).hidden_size)),
        ("experts N / top-k", f"{adapter.num_experts} / {adapter.top_k}"),
        ("routing", describe_rule(adapter)),
        ("vocabulary", f"{len(loaded.tokenizer)} tokens"),
        *(("selection overhead" if i == 0 else "", overhead_text(name, c))
          for i, (name, c) in enumerate(selection_overheads(loaded).items())),
    ]
    for key, value in rows:
        t.add_row(key, value)
    return t


@console.pipes.quiet_broken_pipe
def main(argv: list[str] | None = None) -> int:
    p = console.ArgumentParser(
        prog="inspect-model", examples="""
            inspect-model --model tiny-olmoe
            inspect-model --model tiny-deepseek-v3 --json
            inspect-model --model olmoe --device cuda        # a real checkpoint""",
        description="Load a MoE model (alias, hub id or local folder) and print its MoE structure, "
                    "quality record and a live routing probe.")
    p.add_argument("--model", default=models.DEFAULT_MODEL,
                   help=f"alias ({', '.join(models.ALIASES)}), hub id or folder "
                        f"(default {models.DEFAULT_MODEL})")
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, "
                                                   "bfloat16, float16")
    p.add_argument("--bench", default="mbpp", choices=benchmarks.BENCHMARKS,
                   help="benchmark whose first prompt the routing probe uses (default mbpp)")
    p.add_argument("--benchmarks", default=None, help="benchmarks folder (default: "
                   f"${benchmarks.ENV_VAR} or ../shared/data/benchmarks)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    console.threads.add_argument(p, what="torch (the routing probe)")
    args = p.parse_args(argv)
    try:  # before torch and transformers load
        models.check_available(args.model)
        benchmarks.load(args.bench, root=args.benchmarks, limit=1)
    except UserError as exc:
        return fail("inspect-model", exc)
    console.threads.apply(args.threads)
    from moe_spec.moe.adapter import MoEAdapter
    models.quiet_transformers()
    try:
        loaded = models.load(args.model, device=args.device, dtype=args.dtype)
        adapter = MoEAdapter(loaded.model)
        touched = probe(loaded, adapter, args.bench, args.benchmarks)
    except UserError as exc:
        return fail("inspect-model", exc)
    record_path = loaded.source.path / "quality.json" if loaded.source.path else None
    record = json.loads(record_path.read_text()) if record_path and record_path.is_file() else None
    if args.json:
        total, active = parameter_counts(loaded.model, adapter)
        print(json.dumps(dict(model=loaded.name, location=loaded.source.location,
                              architecture=type(loaded.model).__name__,
                              num_experts=adapter.num_experts, top_k=adapter.top_k,
                              renormalize=adapter.renormalize,
                              routing_rule=adapter.rule.to_dict(),
                              moe_layers=[layer.index for layer in adapter],
                              parameters=total, active_parameters=active,
                              probe_unique_experts=touched, quality=record,
                              selection_overhead=selection_overheads(loaded),
                              routing_warning=record and models.near_uniform_routing(record))))
        return 0
    out = Console()
    out.print(summary_table(loaded, adapter))
    out.print(f"probe: first {PROBE_TOKENS} tokens of {args.bench}'s first prompt touch "
              f"{', '.join(map(str, touched))} experts in MoE layers "
              f"{adapter.layers[0].index}..{adapter.layers[-1].index} "
              f"(mean {sum(touched) / len(touched):.1f} of {adapter.num_experts})")
    if record:
        out.print("quality record (quality.json):")
        out.print(models.format_quality_record(record), highlight=False)
        warning = models.near_uniform_routing(record)
        if warning:
            out.print(f"[bold yellow]warning:[/] {warning}", highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
