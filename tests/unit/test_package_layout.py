"""The package's layout: no import cycles, the runtime apart from the harness.

The import graph is read from the source with ``ast`` (no module is imported): every
``import`` counts, those inside functions too (a lazy import that dodges a cycle is still a
cycle); only imports under ``if TYPE_CHECKING:`` do not, since they never run.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (the project's CI and venv)

REPO = Path(__file__).resolve().parents[2]
RUNTIME = "torchrec_het"
HARNESS = ("torchrec_het_bench", "torchrec_het_testing")
PLOTTING = ("matplotlib", "seaborn", "plotly", "bokeh")


def _package_folders() -> dict[str, Path]:
    """Each package of pyproject.toml's list and its source folder (``package-dir`` mapping)."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = setuptools.get("package-dir", {})
    folders = {}
    for package in setuptools["packages"]:
        parent, _, leaf = package.rpartition(".")
        if package in mapped:
            folders[package] = REPO / mapped[package]
        elif parent:
            folders[package] = folders.get(parent, REPO / parent.replace(".", "/")) / leaf
        else:
            folders[package] = REPO / package
    return folders


def source_modules() -> dict[str, Path]:
    """Every module of the packages pyproject.toml installs, by dotted name, and its file."""
    modules = {}
    for package, folder in _package_folders().items():
        for path in sorted(folder.glob("*.py")):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node that can run (not those under ``if TYPE_CHECKING:``)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imported_names(name: str, path: Path, modules: dict[str, Path] | None = None) -> set[str]:
    """The dotted names module ``name`` imports: ``import a.b`` gives ``a.b``; ``from a import b``
    gives ``a.b`` where that is one of ``modules``, else ``a`` (``b`` is a name defined in ``a``)."""
    modules = modules or {}
    package = name.split(".") if path.stem == "__init__" else name.split(".")[:-1]
    names = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
        for alias in node.names:
            names.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of this repository it imports (the modules named, not their parent
    packages: Python has run those already, as it does for every import)."""
    modules = source_modules()
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in imported_names(name, path, modules):
            while imported and imported not in modules:  # ``a.b.C`` (a class) -> module ``a.b``
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_graph_covers_runtime_and_harness() -> None:
    graph = import_graph()
    for module in (
        "torchrec_het.integration.registration",
        "torchrec_het.planner.planner",
        "torchrec_het.sharders",
        "torchrec_het_bench.configs",
        "torchrec_het_bench.recipes.train_dlrm",
        "torchrec_het_testing.spawn",
    ):
        assert module in graph, module
    assert "torchrec_het.planner.planner" in graph["torchrec_het.integration.registration"]


def test_find_cycle_names_the_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_importing_the_runtime_loads_no_harness_and_no_plotting() -> None:
    script = (
        "import sys\n"
        "import torchrec_het, torchrec_het.integration.registration, torchrec_het.launch, torchrec_het.sharders, "
        "torchrec_het.pipeline, torchrec_het.planner\n"
        f"banned = {HARNESS + ('matplotlib',)!r}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in banned))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def test_the_runtime_depends_on_no_plotting_library() -> None:
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    named = [d for d in dependencies if any(d.lower().startswith(p) for p in PLOTTING)]
    assert not named, f"[project] dependencies name {named}: plotting belongs to the bench/test extras"


def _importers_of(importer_root: str, banned_roots: tuple[str, ...]) -> list[str]:
    """``file: [modules]`` for each module under ``importer_root`` that imports one under ``banned_roots``."""
    offenders = []
    for name, path in source_modules().items():
        if name.split(".")[0] != importer_root:
            continue
        bad = sorted(i for i in imported_names(name, path) if i.split(".")[0] in banned_roots)
        if bad:
            offenders.append(f"{path.relative_to(REPO)}: {bad}")
    return offenders


def test_no_runtime_module_imports_the_harness_or_plotting() -> None:
    offenders = _importers_of(RUNTIME, HARNESS + PLOTTING)
    assert not offenders, "the runtime imports the harness or a plotting library:\n" + "\n".join(offenders)


def test_the_test_rank_bodies_do_not_import_the_benchmark() -> None:
    # what they need (models, batches, comparisons) lives in torchrec_het_testing; rank bodies of
    # tests of the benchmark's own tooling live in torchrec_het_bench.testing
    offenders = _importers_of("torchrec_het_testing", ("torchrec_het_bench",))
    assert not offenders, "torchrec_het_testing imports the benchmark:\n" + "\n".join(offenders)


def _patches_torch_distributed(tree: ast.AST) -> bool:
    """Whether the code assigns an attribute of ``torch.distributed`` (as byte accounting does)."""
    aliases = {"torch.distributed"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    for node in ast.walk(tree):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        )
        for target in targets:
            if isinstance(target, ast.Attribute) and ast.unparse(target.value) in aliases:
                return True
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and node.args:
            if ast.unparse(node.args[0]) in aliases:
                return True
    return False


def test_patches_torch_distributed_finds_both_ways() -> None:
    assert _patches_torch_distributed(ast.parse("import torch.distributed as dist\ndist.all_reduce = f"))
    assert _patches_torch_distributed(ast.parse("from torch import distributed as d\nsetattr(d, 'broadcast', f)"))
    assert not _patches_torch_distributed(ast.parse("import torch.distributed as dist\ndist.all_reduce(t)"))


def test_the_runtime_holds_no_measurement_code() -> None:
    # byte accounting (which wraps torch.distributed's collectives), the ideal cache and the
    # compute-cost calibration are the benchmark's (torchrec_het_bench.comm, .ideal_cache, .calibrate)
    modules = source_modules()
    patching = [
        str(p.relative_to(REPO))
        for n, p in modules.items()
        if n.split(".")[0] == RUNTIME and _patches_torch_distributed(ast.parse(p.read_text()))
    ]
    assert not patching, f"runtime modules that patch torch.distributed: {patching}"
    for moved in ("torchrec_het.comm", "torchrec_het.cache.ideal", "torchrec_het.planner.calibrate"):
        assert moved not in modules, moved
    for tooling in (
        "torchrec_het_bench.comm.accounting",
        "torchrec_het_bench.ideal_cache",
        "torchrec_het_bench.calibrate",
    ):
        assert tooling in modules, tooling


def private_imports(modules: dict[str, Path], root: Path = REPO) -> list[str]:
    """``path:line: from module import _name`` for each private name a module of ``modules`` imports
    from another module of this repository (a private module itself, such as ``_compat``, is fine:
    it is the one place its privates are reached through)."""
    roots = {name.split(".")[0] for name in modules}
    found = []
    for name, path in modules.items():
        package = name.split(".") if path.stem == "__init__" else name.split(".")[:-1]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            if base.split(".")[0] not in roots:
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and f"{base}.{alias.name}" not in modules:
                    found.append(f"{path.relative_to(root)}:{node.lineno}: from {base} import {alias.name}")
    return found


def test_the_private_import_scan_finds_them(tmp_path) -> None:
    (tmp_path / "a.py").write_text("from pkg.b import _hidden, shown\nfrom pkg import _compat\n")
    (tmp_path / "b.py").write_text("_hidden = shown = 1\n")
    (tmp_path / "_compat.py").write_text("")
    modules = {"pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py", "pkg._compat": tmp_path / "_compat.py"}
    assert private_imports(modules, tmp_path) == ["a.py:1: from pkg.b import _hidden"]


def test_no_runtime_module_imports_a_private_name_of_another() -> None:
    runtime = {name: path for name, path in source_modules().items() if name.split(".")[0] == RUNTIME}
    assert "torchrec_het.sharding.het_cache.lookup" in runtime and "torchrec_het.sharders.het" in runtime
    found = private_imports(runtime)
    assert not found, "make these public or move them where they are used:\n" + "\n".join(found)


def test_the_harness_imports_no_private_name_across_modules() -> None:
    # the harness's helpers have public names (the runtime's: test_no_runtime_module_imports_a_private_name_of_another)
    modules = source_modules()
    harness = {str(path.relative_to(REPO)) for name, path in modules.items() if name.split(".")[0] in HARNESS}
    found = [line for line in private_imports(modules) if line.split(":")[0] in harness]
    assert not found, "make these public or move them where they are used:\n" + "\n".join(found)
