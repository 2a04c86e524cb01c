"""The recipe "Add a model family" of docs/architecture.md, kept true: a family is one module of
moe/families/ (its record), and every list of families, aliases, real shapes and tiny models is
derived from those records."""

import ast
import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import overlay_env

from moe_spec.moe import families, models, shapes
from moe_spec.moe.families import REGISTRY, Family, FamilySpec, TinyModel

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("errors", "catalog", "policy", "tasks", "console", "cluster", "moe", "eagle", "capture",
            "replay", "analysis", "app", "training", "profiling")


def test_every_module_of_moe_families_is_a_family_named_after_its_model_type():
    modules = {p.stem for p in (ROOT / "moe" / "families").glob("*.py")} - {"__init__"}
    assert set(REGISTRY) == modules
    assert [f.order for f in REGISTRY.values()] == sorted(f.order for f in REGISTRY.values())
    assert list(REGISTRY)[0] == "olmoe"  # the default model's family comes first


def test_every_registry_is_derived_from_the_records():
    from moe_spec.training.tiny_moe import SPECS
    records = list(REGISTRY.values())
    assert families.FAMILIES == {f.model_type: f.routing for f in records}
    assert list(models.ALIASES) == [f.alias for f in records] + [f.tiny.name for f in records]
    assert models.EMBEDDED == tuple(f.tiny.name for f in records)
    assert list(shapes.REAL_SHAPES) == [f.alias for f in records]
    assert list(SPECS) == list(models.EMBEDDED)
    assert set(models.EXPERT_COUNT_KEYS) == {f.experts_key for f in records}
    for f in records:
        alias = models.ALIASES[f.alias]
        assert (alias.hub_id, alias.embedded_alternative, alias.draft, alias.feature_layers) == (
            f.hub_id, f.tiny.name, f.draft, f.feature_layers)
        shape = shapes.REAL_SHAPES[f.alias]
        assert (shape.checkpoint, shape.model_type, shape.config) == (
            f.hub_id, f.model_type, f.real_config)
        assert shape.config[f.experts_key] > 0  # the key its config names N by
        spec = SPECS[f.tiny.name]
        assert spec.config == f.tiny.config and spec.balancing == f.tiny.balancing
        assert spec.attn_implementation == f.routing.attention
        assert spec.build_config().model_type == f.model_type
        assert spec.model_cls.config_class is spec.config_cls
        for name in (f.alias, f.hub_id, f.tiny.name):
            assert families.lookup(name=name) is f
        assert families.lookup(f.model_type, "whatever") is f
    assert families.lookup("llama", "meta/llama") is None


def test_no_code_outside_the_records_names_a_family():
    """The old second lists (an alias table, a shapes table, tiny specs, the report's tuple of
    family names) stay gone: no project module outside moe/families/ spells a family's model
    type, alias, hub id or tiny model as a string of its own (the default model aside)."""
    names = {n for f in REGISTRY.values() for n in (f.model_type, f.alias, f.hub_id, f.tiny.name)}
    found = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.parent == ROOT / "moe" / "families":
                continue
            tree = ast.parse(path.read_text(), str(path))
            allowed = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                       and [getattr(t, "id", None) for t in node.targets] == ["DEFAULT_MODEL"]}
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}"
                      for node in ast.walk(tree) if isinstance(node, ast.Constant)
                      and node.value in names and id(node) not in allowed]
    assert not found, found
    assert models.DEFAULT_MODEL in models.EMBEDDED


RECORD = '''"""A throwaway family added by the recipe's test."""
from moe_spec.moe.families import Family, FamilySpec, TinyModel

FAMILY = Family(
    FamilySpec("granitemoe", scoring_func="softmax", renormalize=True, router="router"),
    alias="toy-granite", hub_id="example/toy-granite-moe",
    real_config=dict(hidden_size=1024, intermediate_size=512, num_local_experts=32,
                     num_experts_per_tok=8, num_attention_heads=16, num_key_value_heads=8,
                     num_hidden_layers=24, vocab_size=49152, max_position_embeddings=4096),
    tiny=TinyModel("tiny-toy-granite", dict(num_key_value_heads=2, num_local_experts=16,
                                            num_experts_per_tok=4, intermediate_size=32)),
    draft="example/toy-granite-eagle3", feature_layers=(1, 2, 3),
    experts_key="num_local_experts", order=ORDER,
)
'''


def _record(order: int, **changes) -> str:
    text = RECORD.replace("ORDER", str(order))
    for old, new in changes.items():
        text = text.replace(old, new)
    return text


def test_families_are_found_in_order_and_a_module_that_is_no_family_is_refused(tmp_path,
                                                                               monkeypatch):
    package = tmp_path / "somefamilies"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "zeta.py").write_text(_record(1))
    (package / "alpha.py").write_text(_record(2, granitemoe="phimoe", **{
        "toy-granite": "toy-phi"}))
    monkeypatch.syspath_prepend(str(tmp_path))
    found = families.discover("somefamilies")
    assert list(found) == ["granitemoe", "phimoe"]  # by order, not by module name
    assert isinstance(found["phimoe"], Family) and found["phimoe"].tiny.name == "tiny-toy-phi"
    (package / "beta.py").write_text(_record(3))  # the same family again
    importlib.invalidate_caches()
    with pytest.raises(ValueError, match=r"somefamilies\.beta declares granitemoe, "
                                         r"tiny-toy-granite, toy-granite"):
        families.discover("somefamilies")
    (package / "beta.py").unlink()
    (package / "helpers.py").write_text("def dense_layers(config):\n    return set()\n")
    importlib.invalidate_caches()
    with pytest.raises(TypeError, match=r"helpers\.py is in the families' folder but is no "
                                        r"family"):
        families.discover("somefamilies")


@pytest.mark.slow  # a fresh process
def test_a_record_is_plain_data():
    """The moe layer stays free of torch and transformers: a record names its transformers
    classes by ``model_type`` only, and importing the registry (what every --help reads) loads
    neither."""
    code = ("import sys\nimport moe_spec.moe.models, moe_spec.moe.shapes, moe_spec.moe.families\n"
            "print([m for m in ('torch', 'transformers') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr
    for f in REGISTRY.values():
        assert isinstance(f.routing, FamilySpec) and isinstance(f.tiny, TinyModel)
        assert all(isinstance(v, (int, float, bool, str, list)) for v in f.tiny.config.values())
        assert f.tiny.router is None or isinstance(f.tiny.router, dict)


@pytest.mark.slow  # a fresh process on a modified copy
def test_adding_a_family_is_adding_its_module(tmp_path):
    """The recipe of docs/architecture.md: a copy of moe/ with one new module in moe/families/
    has the family in the routing lookup, the aliases, the embedded models, the real shapes,
    the expert-count keys, the random real-shape models and train-tiny's specs."""
    copy = tmp_path / "tree"
    shutil.copytree(ROOT / "moe", copy / "moe", ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "moe" / "families" / "granitemoe.py").write_text(_record(60))
    code = f"""
from types import SimpleNamespace
from moe_spec import moe
assert moe.__file__.startswith({str(copy)!r}), moe.__file__
from moe_spec.moe import families, models, shapes
from moe_spec.training.tiny_moe import SPECS
assert list(families.REGISTRY)[-1] == "granitemoe"
spec = families.spec_for(SimpleNamespace(model_type="granitemoe"))
assert spec is families.FAMILIES["granitemoe"] and spec.router == "router"
alias = models.ALIASES["toy-granite"]
assert (alias.hub_id, alias.embedded_alternative, alias.draft, alias.feature_layers) == (
    "example/toy-granite-moe", "tiny-toy-granite", "example/toy-granite-eagle3", (1, 2, 3))
assert models.EMBEDDED[-1] == "tiny-toy-granite" and models.ALIASES["tiny-toy-granite"].path
try:
    models.resolve("tiny-toy-granite")
except models.ModelError as exc:
    assert "retrain it with" in str(exc) and "--model tiny-toy-granite" in str(exc), exc
assert models.expert_shape(dict(num_local_experts=32, num_experts_per_tok=8)) == (32, 8)
shape = shapes.REAL_SHAPES["toy-granite"]
assert shape.checkpoint == "example/toy-granite-moe"
assert shape.build_config().num_local_experts == 32
net = shapes.random_model("toy-granite", layers=1, vocab_size=64)
assert type(net).__name__ == "GraniteMoeForCausalLM", type(net)
tiny = SPECS["tiny-toy-granite"]
cfg = tiny.build_config()
assert (tiny.model_cls.__name__, cfg.num_local_experts, cfg.hidden_size) == (
    "GraniteMoeForCausalLM", 16, 128)
assert tiny.router is None and tiny.balancing == "aux" and tiny.attn_implementation == "sdpa"
assert families.lookup("granitemoe").alias == "toy-granite"
assert families.lookup(None, "tiny-toy-granite").model_type == "granitemoe"
print("OK", len(families.REGISTRY), len(models.ALIASES), len(SPECS))
"""
    env = overlay_env(copy)
    done = subprocess.run([sys.executable, "-c", code], cwd=copy, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    n = len(REGISTRY) + 1
    assert done.stdout.split() == ["OK", str(n), str(2 * n), str(n)]


# what a model config says about its experts and layers: read by moe.families.facts only
MOE_CONFIG_KEYS = {"num_experts_per_tok", "first_k_dense_replace", "mlp_only_layers",
                   "decoder_sparse_step", "n_shared_experts", "shared_expert_intermediate_size",
                   "moe_intermediate_size", *models.EXPERT_COUNT_KEYS} - {"num_experts"}
# (num_experts is also the workbench's own word: manifests, columns, the adapter's attribute)


def test_no_code_outside_the_family_records_reads_a_moe_config_key():
    """``Family.facts`` (``moe.families.facts``) is the one reader of a model config's experts,
    top-k, dense layers, shared experts and expert widths: no project module outside
    moe/families/ names one of those keys, as a string or an attribute."""
    found = []
    for package in (*PACKAGES, "bench"):
        for path in (ROOT / package).rglob("*.py"):
            if path.parent == ROOT / "moe" / "families":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                key = node.value if isinstance(node, ast.Constant) else \
                    node.attr if isinstance(node, ast.Attribute) else None
                if key in MOE_CONFIG_KEYS:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {key}")
    assert not found, found


def test_facts_read_each_family_by_its_own_rule():
    """A Qwen3-MoE config off its sparse step has dense layers (the cost model ignored the step),
    DeepSeek-V3's first layers are dense beside its shared expert, and a config of no family is
    read by the keys every family uses."""
    qwen = dict(REGISTRY["qwen3_moe"].real_config, model_type="qwen3_moe", decoder_sparse_step=2,
                num_hidden_layers=4)
    found = families.facts(qwen)
    assert found.moe_layers == (1, 3) and found.dense_layers == {0, 2}
    assert shapes.REAL_SHAPES  # (the cost model's shape counts them)
    from moe_spec.analysis.cost import ModelShape
    assert ModelShape.from_config(qwen).dense_layers == 2
    deepseek = families.facts(dict(REGISTRY["deepseek_v3"].real_config, model_type="deepseek_v3"))
    assert deepseek.moe_layers[0] == 3 and deepseek.shared_experts == 1
    assert deepseek.shared_inter == deepseek.expert_inter
    other = families.facts({"model_type": "elsewhere", "num_local_experts": 16,
                            "num_experts_per_tok": 2, "num_hidden_layers": 4,
                            "first_k_dense_replace": 1, "text_config": None})
    assert (other.num_experts, other.top_k, other.moe_layers) == (16, 2, (1, 2, 3))
    assert models.expert_shape({"text_config": {"num_experts": 4, "num_experts_per_tok": 2}}) \
        == (4, 2) and models.expert_shape({}) is None


def test_facts_of_an_absurd_depth_cost_nothing_until_asked_and_model_facts_refuses_it(tmp_path):
    """The dense layers are worked out on first use: the facts of a Qwen3-MoE config stating
    10**7 layers (its rule walks every layer) keep the depth as stated for a size check, and
    model-facts refuses such a config, or a depth that is no number, in one line before
    transformers builds per-layer lists from it."""
    from moe_spec.capture.engines.model import ModelFactsError, model_facts
    deep = dict(REGISTRY["qwen3_moe"].real_config, model_type="qwen3_moe",
                num_hidden_layers=10**7, decoder_sparse_step=2)
    found = families.facts(deep)
    assert found.stated_layers == 10**7 and "dense_layers" not in vars(found)
    assert families.facts(dict(deep, num_hidden_layers="eight")).stated_layers == "eight"
    assert families.facts({"rope_parameters": {"rope_theta": 1e6}}).rope_theta == 1e6
    for depth, shown in ((10**12, "a 13-digit number"), ("eight", "'eight'")):
        folder = tmp_path / str(depth)
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(dict(deep, num_hidden_layers=depth)))
        with pytest.raises(ModelFactsError, match=f"says num_hidden_layers = {shown}: not "):
            model_facts(str(folder))


# a model's widths, depth, vocabulary, positions and rotary base: ConfigFacts' other fields, read
# through ``families.facts`` wherever the workbench reads a model's config (loaded or stored)
WIDTH_KEYS = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
              "rope_theta", "rope_parameters"}
# every folder of the project is scanned (bench/ included; moe/families/ is the reader itself).
# Training *creates* configs (the tiny models' keyword arguments, train-draft's head): a keyword
# argument or a dict literal's key is not a read. What the scan finds that reads no model config, and why:
NOT_MODEL_CONFIGS = {
    # the draft head's own config (DraftConfig, its config.json), not its target's: the
    # target's widths, depth and vocabulary come through families.facts
    "eagle/draft_head.py": {"cfg", "self.cfg", "self.config", "raw", "raw['rope_scaling']",
                            "'rope_theta'"},
    # the manifest field and runs-table column hidden_size (capture writes it from facts), not
    # a config key: the runs table's schema and writers, and a run's facts as its manifest says
    "catalog/runs.py": {"'hidden_size'"},
    "catalog/schema.py": {"'hidden_size'"},
    "catalog/writer.py": {"'hidden_size'"},
    "analysis/sql.py": {"'hidden_size'"},
    "capture/engines/model.py": {"'hidden_size'"},
}
CONFIG_SCANNED = (*PACKAGES, "bench")


def config_reads(path: Path, keys: set[str], allowed: set[str] = frozenset()) -> list[str]:
    """Where ``path`` reads one of ``keys`` off a config: an attribute of a name or attribute
    ending in ``config``/``cfg`` (``model.config.vocab_size``, ``cfg.hidden_size``) or the key
    as a string (``config.get("vocab_size")``, ``getattr(cfg, "head_dim")``); ``allowed``: the
    owners (``self.cfg``) and strings (``'hidden_size'``) that are no model config there."""
    found = []
    tree = ast.parse(path.read_text(), str(path))
    made = {id(key) for node in ast.walk(tree) if isinstance(node, ast.Dict) for key in node.keys}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in keys:
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
            read = name.lower().endswith(("config", "cfg")) and ast.unparse(owner) not in allowed
        else:  # (a dict literal's key, like a keyword argument, creates a config: no read)
            read = isinstance(node, ast.Constant) and node.value in keys and \
                repr(node.value) not in allowed and id(node) not in made
        if read:
            found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def places_reading_model_configs(root: Path = ROOT) -> dict[str, list[str]]:
    """The folders of the project that read a model config directly, with their reads:
    ``moe/families`` (the records and :func:`moe.families.facts`) and nothing else."""
    places: dict[str, list[str]] = {}
    for package in CONFIG_SCANNED:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            hits = config_reads(path, WIDTH_KEYS | MOE_CONFIG_KEYS,
                                NOT_MODEL_CONFIGS.get(relative, frozenset()))
            if hits:
                places.setdefault(path.parent.relative_to(root).as_posix(), []).extend(hits)
    return places


def test_one_place_reads_model_configs():
    """``families.facts`` is the one reader of a model config: profile-target's vocabulary,
    inspect-model's hidden size, the adapter's probe width, capture's manifest and storage
    width, the draft head's target checks, the decoder's context length, model-facts' size
    check and the benches read it (they read ``config.hidden_size`` & co. directly before)."""
    places = places_reading_model_configs()
    assert list(places) == ["moe/families"], {p: r for p, r in places.items()
                                              if p != "moe/families"}


def test_the_scan_finds_a_direct_read_planted_anywhere(tmp_path):
    """A copy of the project's Python files with direct reads planted in folders the scan
    covers (a module of capture/, one of bench/, one of eagle/ reading a model config off
    ``self.cfg``, a name allowed in the draft head's file only): each is a second place."""
    for package in CONFIG_SCANNED:
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.json",
                                                      "*.parquet", "*.safetensors"))
    (tmp_path / "capture" / "planted.py").write_text(
        "def width(model):\n    return model.config.hidden_size\n")
    (tmp_path / "bench" / "planted.py").write_text(
        "def top_k(config):\n    return config['num_experts_per_tok']\n")
    (tmp_path / "eagle" / "planted.py").write_text("h = self.cfg.hidden_size\n")
    places = places_reading_model_configs(tmp_path)
    assert {p: r for p, r in places.items() if p != "moe/families"} == {
        "capture": ["planted.py:2 model.config.hidden_size"],
        "bench": ["planted.py:2 'num_experts_per_tok'"],
        "eagle": ["planted.py:1 self.cfg.hidden_size"]}
    assert places["moe/families"]  # the one reader, found by the same scan


def test_the_width_scan_finds_a_direct_read_and_passes_facts_and_created_configs(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("vocab = model.config.vocab_size\nh = cfg.hidden_size\n"
                      "v = config.get('vocab_size') if config else None\n"
                      "facts = families.facts(model.config)\nok = facts.hidden_size\n"
                      "made = dict(hidden_size=128, num_hidden_layers=8)\n"
                      "also = {**made, 'num_hidden_layers': 1}\n"
                      "shape = surrogate.hidden_size\n")
    found = sorted(hit.split()[0] for hit in config_reads(module, WIDTH_KEYS))
    assert found == ["m.py:1", "m.py:2", "m.py:3"]
    assert config_reads(module, WIDTH_KEYS, {"cfg", "'vocab_size'"}) == \
        ["m.py:1 model.config.vocab_size"]
