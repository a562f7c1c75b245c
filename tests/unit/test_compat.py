"""``torchrec_het._compat``: the pinned TorchRec is checked, every accessor still reaches a real TorchRec
private, and the runtime package reaches TorchRec's privates through ``_compat`` only.

The scan (:func:`scan`) reads each file's syntax tree and flags, for TorchRec and FBGEMM:
imports of private names or through private module paths (torch's too); ``X._name`` where
``X`` was imported from them; ``self._name`` / ``super()._name`` / ``def _name`` in a class
whose TorchRec base defines ``_name``; and ``obj._name`` / ``getattr(obj, "_name")`` on any
other object when ``_name`` is a private TorchRec or FBGEMM defines and no plugin class does.
"""

import ast
import importlib
import importlib.metadata
import inspect
import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import pytest
import torch
import torchrec
import torchrec.distributed.planner.stats as torchrec_stats
import torchrec.distributed.sharding_plan as sharding_plan
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
from torchrec.distributed.planner.types import BasicCommsBandwidths
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het import _compat, _tbe

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ("torchrec_het", "sharders", "recipes")
# Not scanned: the one place itself, and test rank bodies (they inspect internals, as tests do).
EXCLUDED = (
    "torchrec_het/_compat.py",
    "torchrec_het_testing/",
)
EXTERNAL = ("torchrec", "fbgemm_gpu")  # whose privates the scan looks for
PRIVATE_PATHS = ("torch", *EXTERNAL)  # whose private module paths it looks for
PRIVATE = re.compile(r"_[a-z]\w*\Z")  # one leading underscore (dunders are public protocol)
DEFINES = re.compile(r"\bself\.(_[a-z]\w*)\s*(?::|=(?!=))|^\s*def (_[a-z]\w*)|^(_[a-z]\w*)\s*[:=]", re.M)
TOUCHES = re.compile(r"\b(?:self|cls)\.(_[a-z]\w*)|^\s*def (_[a-z]\w*)", re.M)


# ---- the scan ----------------------------------------------------------------------------------


def _names(pattern: re.Pattern, text: str) -> set[str]:
    return {next(g for g in m.groups() if g) for m in pattern.finditer(text)}


@cache
def external_privates() -> frozenset[str]:
    """Private names TorchRec and FBGEMM define (attributes they set, methods, module globals)."""
    names: set[str] = set()
    for package in EXTERNAL:
        for path in Path(importlib.import_module(package).__file__).parent.rglob("*.py"):
            names |= _names(DEFINES, path.read_text(errors="replace"))
    return frozenset(names)


@cache
def inherited_privates(klass: type) -> frozenset[str]:
    """Private names the TorchRec / FBGEMM classes of ``klass``'s MRO define or use on ``self``."""
    names: set[str] = set()
    for base in klass.__mro__:
        if base.__module__.split(".")[0] in EXTERNAL:
            names |= {n for n in vars(base) if PRIVATE.match(n)}
            try:
                names |= _names(TOUCHES, inspect.getsource(base))
            except (OSError, TypeError):
                pass
    return frozenset(names)


class _Scan:
    """One file: its imports, its classes' inherited privates, and what it touches."""

    def __init__(self, source: str, path: str, plugin_privates: frozenset[str]) -> None:
        self.tree, self.path, self.plugin_privates = ast.parse(source), path, plugin_privates
        self.imports: dict[str, str] = {}  # local name -> dotted path
        self.classes: dict[str, ast.ClassDef] = {}
        self.found: list[tuple[str, int, str]] = []
        self.own: set[str] = set()  # privates this file's classes define themselves

    def flag(self, node: ast.AST, symbol: str) -> None:
        self.found.append((self.path, node.lineno, symbol))

    def run(self) -> "_Scan":
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    bound = alias.name if alias.asname else alias.name.split(".")[0]  # `import a.b` binds `a`
                    self.imports[alias.asname or bound] = bound
                    self._check_path(node, alias.name)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                self._check_path(node, node.module)
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                    if node.module.split(".")[0] in EXTERNAL and PRIVATE.match(alias.name):
                        self.flag(node, f"{node.module}.{alias.name}")
        self._visit(self.tree, frozenset())
        return self

    def _check_path(self, node: ast.AST, module: str) -> None:
        parts = module.split(".")
        if parts[0] in PRIVATE_PATHS and any(PRIVATE.match(p) for p in parts):
            self.flag(node, module)

    def _external(self, name: str) -> bool:
        return name in self.imports and self.imports[name].split(".")[0] in EXTERNAL

    def _resolve(self, dotted: str) -> object:
        head, *rest = dotted.split(".")
        if head not in self.imports:
            return None
        full = self.imports[head].split(".") + rest
        for cut in range(len(full), 0, -1):
            try:
                target = importlib.import_module(".".join(full[:cut]))
            except ImportError:
                continue
            for part in full[cut:]:
                target = getattr(target, part, None)
            return target
        return None

    def _inherited(self, node: ast.ClassDef) -> frozenset[str]:
        names: set[str] = set()
        for base in node.bases:
            dotted = ast.unparse(base)
            if dotted in self.classes:
                names |= self._inherited(self.classes[dotted])
            elif isinstance(target := self._resolve(dotted), type):
                names |= inherited_privates(target)
        return frozenset(names)

    def _visit(self, node: ast.AST, inherited: frozenset[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                self.classes[child.name] = child
                theirs = self._inherited(child)
                for item in child.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and PRIVATE.match(item.name):
                        if item.name in theirs:
                            self.flag(item, f"def {child.name}.{item.name} (overrides TorchRec's)")
                        else:
                            self.own.add(item.name)
                self.own |= _names(DEFINES, ast.unparse(child)) - theirs
                self._visit(child, theirs)
                continue
            if isinstance(child, ast.Attribute) and PRIVATE.match(child.attr):
                self._attribute(child, inherited)
            elif isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and len(child.args) > 1:
                name = child.args[1]
                if child.func.id in ("getattr", "setattr", "hasattr", "delattr") and isinstance(name, ast.Constant):
                    if isinstance(name.value, str) and self._foreign(name.value):
                        self.flag(child, f"{child.func.id}(..., {name.value!r})")
            self._visit(child, inherited)

    def _attribute(self, node: ast.Attribute, inherited: frozenset[str]) -> None:
        base = node.value
        if isinstance(base, ast.Name) and base.id in ("self", "cls"):
            if node.attr in inherited:
                self.flag(node, f"{base.id}.{node.attr}")
        elif isinstance(base, ast.Call) and ast.unparse(base.func) == "super":
            if node.attr in inherited:
                self.flag(node, f"super().{node.attr}")
        elif isinstance(base, ast.Name) and self._external(base.id):
            self.flag(node, f"{self.imports[base.id]}.{node.attr}")
        elif self._foreign(node.attr):
            self.flag(node, f"{ast.unparse(base)}.{node.attr}")

    def _foreign(self, name: str) -> bool:
        return bool(PRIVATE.match(name)) and name in external_privates() and name not in self.plugin_privates


def scan(source: str, path: str = "<source>", plugin_privates: Iterable[str] = ()) -> list[tuple[str, int, str]]:
    """(path, line, symbol) of each TorchRec / FBGEMM private ``source`` touches."""
    return _Scan(source, path, frozenset(plugin_privates)).run().found


def runtime_files() -> dict[str, str]:
    """Path relative to the repository -> source, of every file of the runtime package."""
    return {str(p.relative_to(ROOT)): p.read_text() for root in RUNTIME for p in sorted((ROOT / root).rglob("*.py"))}


def plugin_privates(sources: Iterable[str]) -> frozenset[str]:
    """Privates the plugin's own classes define (not inherited from TorchRec)."""
    own: set[str] = set()
    for source in sources:
        own |= _Scan(source, "", frozenset()).run().own
    return frozenset(own)


# ---- the scan finds what it should ----------------------------------------------------------------

SAMPLE = """
import torchrec.distributed.planner.stats as stats_module
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.sharding_plan import _calculate_rw_shard_sizes_and_offsets
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.stats import EmbeddingStats


class Stats(EmbeddingStats):
    def _get_shard_stats(self, *args):     # overrides TorchRec's private
        return None


class Enumerator(EmbeddingEnumerator):
    def __init__(self):
        self._mine = 1                      # the plugin's own: fine

    def read(self):
        return self._compute_device, self._mine

    def _sharder_data(self):                # not TorchRec's: fine
        return super().enumerate


class Deeper(Enumerator):
    def device(self):
        return self._compute_device


class Module(ShardedEmbeddingBagCollection):
    def lookups(self):
        return super()._lookups


def touch(module, topology, plain):
    stats_module._get_sharding_type_abbr("row_wise")
    topology._comms_bandwidths = None
    plain._mine, plain.public = 1, 2
    return module._lookups, getattr(module, "_embedding_bag_configs")
"""


def test_the_scan_finds_each_kind_of_access() -> None:
    found = {(line, symbol) for _, line, symbol in scan(SAMPLE)}
    assert found == {
        (3, "torch.distributed._shard.sharded_tensor"),
        (4, "torchrec.distributed.sharding_plan._calculate_rw_shard_sizes_and_offsets"),
        (11, "def Stats._get_shard_stats (overrides TorchRec's)"),
        (20, "self._compute_device"),
        (28, "self._compute_device"),
        (33, "super()._lookups"),
        (37, "torchrec.distributed.planner.stats._get_sharding_type_abbr"),
        (38, "topology._comms_bandwidths"),
        (40, "module._lookups"),
        (40, "getattr(..., '_embedding_bag_configs')"),
    }, sorted(found)
    # a private some plugin class defines itself is the plugin's, on any object (not on TorchRec's subclasses)
    found = {(line, symbol) for _, line, symbol in scan(SAMPLE, plugin_privates=["_lookups"])}
    assert (40, "module._lookups") not in found and (33, "super()._lookups") in found


def test_the_scan_resolves_the_torchrec_bases_of_the_runtime_classes() -> None:
    """Not trivially passing on the real files: it sees what the plugin's TorchRec subclasses inherit."""
    expected = {
        "torchrec_het/planner/enumerator.py": ("HetEmbeddingEnumerator", "_compute_device"),
        "torchrec_het/planner/planner.py": ("HetEmbeddingShardingPlanner", "_topology"),
        "torchrec_het/planner/stats.py": ("HetEmbeddingStats", "_get_shard_stats"),
        "sharders/row_wise.py": ("CpuRowWiseEmbeddingBagCollectionSharder", "_fused_params"),
    }
    files = runtime_files()
    for path, (cls, private) in expected.items():
        found = _Scan(files[path], path, frozenset()).run()
        assert private in found._inherited(found.classes[cls]), (path, cls, private)


def test_runtime_code_reaches_torchrec_privates_only_through_compat() -> None:
    files = runtime_files()
    own = plugin_privates(files.values())
    found = [hit for path, source in files.items() if not path.startswith(EXCLUDED) for hit in scan(source, path, own)]
    assert not found, "route these through torchrec_het/_compat.py:\n" + "\n".join(f"{p}:{n}: {s}" for p, n, s in found)


def test_the_exclusions_name_existing_paths() -> None:
    for path in EXCLUDED:
        assert (ROOT / path).exists(), path


# ---- the pinned version ---------------------------------------------------------------------------


def stack_pins() -> dict[str, dict[str, str]]:
    """requirements/torchrec-<stack>.txt -> {package: pinned version}, torchrec's ``#no-deps:`` line included."""
    stacks = {}
    for path in sorted((ROOT / "requirements").glob("torchrec-*.txt")):
        lines = [line.removeprefix("#no-deps:").strip() for line in path.read_text().splitlines()]
        pins = dict(line.split("==") for line in lines if re.fullmatch(r"[\w.-]+==[\w.+-]+", line))
        stacks[path.stem.removeprefix("torchrec-")] = pins
    return stacks


def test_each_supported_torchrec_has_a_pinned_stack_the_metadata_admits() -> None:
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ranges = {
        r.name: r.specifier for r in map(Requirement, project["dependencies"] + project["optional-dependencies"]["cpu"])
    }
    stacks = stack_pins()
    assert sorted(pins["torchrec"] for pins in stacks.values()) == sorted(_compat.SUPPORTED_TORCHREC)
    for stack, pins in stacks.items():
        assert pins["torchrec"].startswith(stack + "."), (stack, pins["torchrec"])
        for package in ("torch", "torchrec", "fbgemm-gpu-cpu"):
            assert ranges[package].contains(pins[package]), (stack, package, pins[package], ranges[package])
        assert pins["fbgemm-gpu-cpu"].split(".")[:2] == pins["torchrec"].split(".")[:2]  # FBGEMM pairs with TorchRec
    for unsupported in ("1.7.0", "1.9.0", "1.9.1", "1.10.0"):
        assert not ranges["torchrec"].contains(unsupported), unsupported


def test_the_installed_torchrec_is_a_supported_one_and_its_release_is_read() -> None:
    assert importlib.metadata.version("torchrec") in _compat.SUPPORTED_TORCHREC
    assert _compat.TORCHREC_RELEASE == tuple(int(p) for p in importlib.metadata.version("torchrec").split("."))
    assert _compat.torchrec_release("1.9.2+cpu") == (1, 9, 2) and _compat.torchrec_release("1.10.0") == (1, 10, 0)


@pytest.mark.parametrize("version", [*_compat.SUPPORTED_TORCHREC, *(v + "+cpu" for v in _compat.SUPPORTED_TORCHREC)])
def test_a_supported_torchrec_does_not_warn(version, recwarn) -> None:
    assert _compat.check_torchrec_version(version)
    assert not [w for w in recwarn if issubclass(w.category, _compat.TorchRecVersionWarning)]


def test_another_torchrec_warns_naming_the_supported_versions() -> None:
    for other in ("1.9.0", "1.7.0", "1.10.0"):
        match = rf"torchrec==1\.8\.0 or torchrec==1\.9\.2 .*torchrec {re.escape(other)} is installed"
        with pytest.warns(_compat.TorchRecVersionWarning, match=match):
            assert not _compat.check_torchrec_version(other)


def test_importing_compat_under_another_torchrec_warns_once() -> None:
    code = (
        "import importlib.metadata as m, json, warnings\n"
        "real = m.version\n"
        "m.version = lambda name: '1.9.0' if name == 'torchrec' else real(name)\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    import torchrec_het._compat, torchrec_het.planner, torchrec_het.integration.registration\n"
        "print(json.dumps([str(w.message) for w in seen if w.category.__name__ == 'TorchRecVersionWarning']))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    messages = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(messages) == 1 and "torchrec 1.9.0 is installed" in messages[0], messages


# ---- every accessor reaches a real TorchRec private --------------------------------------------------

TOPOLOGY = dict(world_size=2, compute_device="cpu")


def test_planner_accessors() -> None:
    constraints = {"t": ParameterConstraints(sharding_types=["table_wise"])}
    planner = EmbeddingShardingPlanner(topology=Topology(**TOPOLOGY), batch_size=64, constraints=constraints)
    topology, batch_size, got = _compat.planner_settings(planner)
    assert (topology.world_size, batch_size, got) == (2, 64, constraints)
    other, enumerator, stats = Topology(world_size=4, compute_device="cpu"), EmbeddingEnumerator(topology, 8), []
    _compat.set_planner_parts(planner, topology=other, enumerator=enumerator, stats=stats)
    assert _compat.planner_settings(planner)[0] is other
    assert (
        vars(planner)["_enumerator"] is enumerator and vars(planner)["_stats"] is stats
    )  # the attributes plan() reads
    with pytest.raises(AttributeError, match="_topology"):
        _compat.set_planner_parts(object(), topology=other)


def test_enumerator_and_estimator_accessors() -> None:
    topology = Topology(**TOPOLOGY)
    constraints = {"t": ParameterConstraints()}
    enumerator = EmbeddingEnumerator(topology, batch_size=32, constraints=constraints)
    assert _compat.enumerator_settings(enumerator) == ("cpu", 32, constraints)
    with _compat.enumerator_constraints(enumerator, {}):
        assert _compat.enumerator_settings(enumerator)[2] == {}
    assert _compat.enumerator_settings(enumerator)[2] is constraints
    sharder = EmbeddingBagCollectionSharder()
    _compat.set_enumerator_sharders(enumerator, {"k": sharder})
    assert vars(enumerator)["_sharder_map"] == {"k": sharder}
    for estimator in (EmbeddingPerfEstimator(topology), EmbeddingStorageEstimator(topology)):
        assert _compat.estimator_topology(estimator) is topology
    bandwidths = BasicCommsBandwidths(intra_host_bw=1.0, inter_host_bw=0.5)
    changed = _compat.with_comms_bandwidths(topology, bandwidths)
    assert changed.comms_bandwidths is bandwidths and changed.inter_host_bw == 0.5 and topology.inter_host_bw != 0.5


def test_stats_accessors_reach_the_table_torchrec_prints() -> None:
    assert _compat.stock_sharding_type_abbreviation("row_wise") == "RW"
    original = torchrec_stats._get_sharding_type_abbr
    with _compat.sharding_type_abbreviations(lambda t: "XX"):
        assert torchrec_stats._get_sharding_type_abbr("row_wise") == "XX"
    assert torchrec_stats._get_sharding_type_abbr is original

    shown = []

    class Recording(_compat.EmbeddingStatsWithShardOption):
        def shard_stats_option(self, sharding_option):
            shown.append(sharding_option.name)
            return sharding_option

    tables = [EmbeddingBagConfig(name="t", feature_names=["f"], embedding_dim=8, num_embeddings=100)]
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"), stats=[Recording()])
    planner.plan(EmbeddingBagCollection(tables=tables, device=torch.device("meta")), [EmbeddingBagCollectionSharder()])
    assert "t" in shown  # TorchRec's log asked the override for the shard's stats


@cache
def torchrec_sources() -> list[tuple[str, ast.Module]]:
    """(module name, parsed source) of every TorchRec module, tests and benchmarks aside."""
    source = Path(importlib.import_module("torchrec").__file__).parent
    return [
        (
            "torchrec." + ".".join(path.relative_to(source).with_suffix("").parts).removesuffix(".__init__"),
            ast.parse(path.read_text()),
        )
        for path in sorted(source.rglob("*.py"))
        if not re.search(r"test|benchmark", str(path.relative_to(source)))
    ]


def torchrec_binders(name: str) -> dict[str, str]:
    """Every TorchRec module (tests and benchmarks aside) that binds ``name`` at module level, read from its
    source: module -> ``"defines"``, ``"imports"``, ``"subclasses"`` (imports it only to use it as a base
    class and call the parent's methods) or ``"aliases as X"`` (a binding ``install()`` cannot replace)."""
    found = {}
    for module, tree in torchrec_sources():
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
                found[module] = "defines"
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name == name:
                        found[module] = f"aliases as {alias.asname}" if alias.asname not in (None, name) else "imports"
        if found.get(module) == "imports":
            # a base class (also Base[T]), or the parent's attribute a subclass calls (Base._next_batch(...))
            classes = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
            as_parent = {id(n) for c in classes for base in c.bases for n in ast.walk(base)}
            as_parent |= {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
            uses = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == name]
            if uses and all(id(n) in as_parent for n in uses):
                found[module] = "subclasses"
    return found


def test_torchrec_binders_reads_the_ways_a_module_binds_a_name() -> None:
    binders = torchrec_binders("TrainPipelineSparseDist")
    assert binders["torchrec.distributed.train_pipeline.train_pipelines"] == "defines"
    assert binders["torchrec.distributed.train_pipeline"] == "imports"
    assert binders["torchrec.distributed.train_pipeline.experimental_pipelines"] == "subclasses"
    assert torchrec_binders("get_default_sharders")["torchrec.distributed.sharding_plan"] == "defines"


@pytest.mark.parametrize(
    "name, homes",
    [
        ("get_default_sharders", _compat.default_sharders_homes),
        ("EmbeddingShardingPlanner", _compat.planner_homes),
        ("TrainPipelineSparseDist", _compat.train_pipeline_homes),
    ],
)
def test_registration_homes_bind_the_names_install_replaces(name, homes) -> None:
    homes = homes()
    stock = getattr(homes[0], name)
    assert all(getattr(home, name) is stock for home in homes), name
    binders = torchrec_binders(name)
    # every module of the installed TorchRec that binds the name, other than to subclass it, is a home
    needed = {module for module, how in binders.items() if how != "subclasses"}
    assert needed == {home.__name__ for home in homes}, (name, torchrec.__version__, binders)


def test_plan_and_state_dict_accessors() -> None:
    assert _compat.row_wise_shard_rows(10, 4) == [3, 3, 3, 1]
    sizes, _ = sharding_plan._calculate_rw_shard_sizes_and_offsets(7, 3, 1)
    assert _compat.row_wise_shard_rows(7, 3) == [s[0] for s in sizes]


def _shard(module, sharder, env, generator):
    names = list(sharder.shardable_parameters(module))
    plan = construct_module_sharding_plan(
        module, {n: generator for n in names}, local_size=1, world_size=1, device_type="cpu", sharder=sharder
    )
    return sharder.shard(module, plan, env, torch.device("cpu"))


def test_sharded_module_accessors(one_rank_env) -> None:
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
    bag_tables = [EmbeddingBagConfig(name=n, feature_names=[f"f_{n}"], embedding_dim=4, num_embeddings=8) for n in "ab"]
    bag_sharder = EmbeddingBagCollectionSharder(fused)
    bag = _shard(EmbeddingBagCollection(tables=bag_tables), bag_sharder, one_rank_env, row_wise(compute_kernel="fused"))
    seq_tables = [EmbeddingConfig(name="s", feature_names=["f_s"], embedding_dim=4, num_embeddings=8)]
    seq_sharder = EmbeddingCollectionSharder(fused)
    seq = _shard(
        EmbeddingCollection(tables=seq_tables), seq_sharder, one_rank_env, table_wise(rank=0, compute_kernel="fused")
    )
    for module, names in ((bag, ["a", "b"]), (seq, ["s"])):
        lookups, shardings = _compat.sharded_lookups(module), _compat.sharded_embedding_shardings(module)
        assert len(lookups) == len(shardings) == 1
        assert [c.name for c in _compat.sharded_table_configs(module)] == names
        kernels = _compat.lookup_kernels(lookups[0])
        assert kernels and _tbe.optimizer_name(kernels[0].emb_module) == "exact_row_wise_adagrad"
        arguments = _compat.sharding_lookup_arguments(shardings[0])
        assert arguments["pg"] is not None and arguments["env"] is one_rank_env and arguments["grouped_configs"]
        features = KeyedJaggedTensor.from_lengths_sync(
            [f"f_{n}" for n in names], torch.arange(len(names)), torch.ones(len(names), dtype=torch.int32)
        )
        ctx = module.create_context()
        splits = module.input_dist(ctx, features)
        assert len(_compat.input_dist_awaitables(splits)) == 1  # one per sharding, as the lookups
        dist_input = splits.wait().wait()
        calls = []
        with _compat.lookups_called_with(
            module, {0: lambda kjt, calls=calls, lookups=lookups: calls.append(kjt) or lookups[0](kjt)}
        ):
            module.compute_and_output_dist(ctx, dist_input).wait()
        assert len(calls) == 1 and _compat.sharded_lookups(module)[0] is lookups[0]  # called in place; put back
    assert _compat.uses_index_dedup(seq_sharder) is False
    weights = bag.state_dict()
    assert all(_compat.is_sharded_tensor(weights[f"embedding_bags.{n}.weight"]) for n in "ab")
    assert not _compat.is_sharded_tensor(torch.zeros(2))


def test_train_pipeline_accessors(one_rank_env) -> None:
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    model, optimizer = torch.nn.Linear(2, 1), torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    pipeline = TrainPipelineSparseDist(model, optimizer, torch.device("cpu"))
    assert _compat.pipeline_model(pipeline) is model and _compat.pipeline_optimizer(pipeline) is optimizer
    assert _compat.pipelined_modules(pipeline) == [] and _compat.pipeline_data_dist_stream(pipeline) is None
    _compat.pipeline_attach_if_detached(pipeline)  # attached: nothing to do
    assert _compat.pipeline_model_forward(pipeline, torch.ones(1, 2)).shape == (1, 1)
    assert callable(pipeline._init_pipelined_modules) and hasattr(pipeline, "_dmp_collection_sync_interval_batches")
    semi_sync = _compat.cpu_semi_sync_class()
    for name in ("_mlp_forward", "start_embedding_lookup", "_pipelined_forward_type"):
        assert name in vars(semi_sync), name  # each override replaces a member TorchRec's class has
        assert hasattr(semi_sync.__mro__[1], name), name
