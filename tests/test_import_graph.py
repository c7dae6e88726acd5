"""The import graph's contract: no circles, and layers that import only downwards.

Every module under ``specjax/`` is parsed with :mod:`ast` (nothing is
imported), and each ``import`` / ``from ... import`` statement, at module level
or inside a function, becomes an edge to the specjax module it names (relative
imports resolved; ``from package import name`` is an edge to the submodule when
``name`` is one). A package's ``__init__`` that Python runs on the way to a
submodule is not an edge: only what a file names is.

The layers, bottom to top, are data (:data:`LAYERS`): a module may import its
own layer and the layers below it. Scripts in ``training/``, ``benchmarks/``,
``examples/`` and ``checkpoints_conversion/`` use the public API only: they
import nothing from ``specjax._src``.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import pathlib
from typing import Optional

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Bottom to top. A module belongs to the layer of the longest pattern (fnmatch) that matches its
# name; it may import modules of its own layer and of the layers below, never above.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation: the LM protocol, argument checks and the numerics (kernels, quantized weights) every layer shares", (
        "specjax._src", "specjax._src.models.lm", "specjax._src.foundation*", "specjax._src.models.chat",
        "specjax._src.models.multihost",
        "specjax._src.logits*", "specjax._src.kernels*",
    )),
    ("models and rules: checkpoints and their formats, model pairs and meshes, acceptance rules, drafting", (
        "specjax._src.models*", "specjax._src.rules*",
        "specjax._src.proposals*",
        "specjax._src.theory*",
    )),
    ("engine: the decode loop, its cycles and the slots", (
        "specjax._src.engine*",
    )),
    ("built on the engine: certificates, evaluation and the server", (
        "specjax._src.theory.certify", "specjax._src.evaluation*", "specjax._src.serve*",
    )),
    ("public modules", (
        "specjax", "specjax.*",
    )),
    ("command line", (
        "specjax.cli*", "specjax.__main__",
    )),
)
# Matches every library module, so that a new one under _src that no layer names is caught
# (instead of falling into the public layer through "specjax.*").
UNPLACED = "specjax._src.*"

# Outside the package: scripts that must run on the public API alone.
PUBLIC_API_ONLY = (
    "training/*.py", "benchmarks/*.py", "benchmarks/*/*.py", "examples/*.py", "checkpoints_conversion/*.py",
)
# The exceptions, each with what it needs that no public name gives.
PRIVATE_IMPORTS_ALLOWED = {
    "benchmarks/profile_decode.py": "wraps the decode loop's private jitted function to read its compiled HLO",
    "benchmarks/chunked_prefill.py": "drives the server's scheduler in process, to time the streams' gaps without "
                                     "HTTP; the scheduler's public face is `specjax serve`",
    "benchmarks/prefix_cache_engine.py": "drives two of the server's schedulers in process, paired, with and without "
                                         "the prefix cache, and turns on the persistent compilation cache as "
                                         "`specjax serve` does; their public face is `specjax serve`",
    "benchmarks/live_costs.py": "drives the server's schedulers in process (with and without live costs) to time "
                                "served requests without HTTP; their public face is `specjax serve`",
    "benchmarks/serve_step_trace.py": "drives the server's scheduler in process and wraps its step to time every "
                                      "served step without HTTP; its public face is `specjax serve`",
    "benchmarks/qmatmul_before_after.py": "builds another commit's quantized kernels with the library's compiler "
                                          "settings and times single products, which have no public face",
}


@dataclasses.dataclass(frozen=True)
class Edge:
    source: str
    target: str
    where: str  # file:line of the import statement


def module_names(root: pathlib.Path, package: str = "specjax") -> dict[str, pathlib.Path]:
    """``{dotted module name: file}`` for every ``.py`` under ``root / package``."""
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imported_names(module: str, path: pathlib.Path) -> list[tuple[str, int]]:
    """``(dotted name, line)`` for what each import statement of a file asks for, anywhere in it
    (``from a import b`` gives ``a.b``; relative imports resolved against ``module``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return found


def imports_of(module: str, path: pathlib.Path, known: dict[str, pathlib.Path], root: pathlib.Path) -> list[Edge]:
    """Edges from ``module`` to the specjax modules its import statements name."""
    edges = []
    for name, line in imported_names(module, path):
        while name and name not in known:  # `from package import function`: the edge is to the package
            name = name.rpartition(".")[0]
        if name and name != module:
            edges.append(Edge(module, name, f"{path.relative_to(root)}:{line}"))
    return edges


def import_graph(root: pathlib.Path = ROOT) -> tuple[dict[str, list[Edge]], dict[str, pathlib.Path]]:
    known = module_names(root)
    return {m: imports_of(m, p, known, root) for m, p in known.items()}, known


def find_cycle(graph: dict[str, list[Edge]]) -> Optional[list[Edge]]:
    """One circle of imports, as its edges in order; None when there is none (depth-first search)."""
    done: set[str] = set()
    stack: list[str] = []  # the modules on the current path
    path: list[Edge] = []  # path[i] leads from stack[i] to stack[i + 1]

    def visit(module: str) -> Optional[list[Edge]]:
        stack.append(module)
        for edge in graph.get(module, ()):
            if edge.target in stack:
                return path[stack.index(edge.target):] + [edge]
            if edge.target not in done:
                path.append(edge)
                found = visit(edge.target)
                if found:
                    return found
                path.pop()
        stack.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done:
            found = visit(module)
            if found:
                return found
    return None


def layer_of(module: str) -> Optional[int]:
    """Index into :data:`LAYERS` of ``module``'s layer; None when only :data:`UNPLACED` matches."""
    best, best_len = None, -1
    for index, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if fnmatch.fnmatchcase(module, pattern) and len(pattern) > best_len:
                best, best_len = index, len(pattern)
    if fnmatch.fnmatchcase(module, UNPLACED) and best_len < len(UNPLACED):
        return None
    return best


def _shown(cycle: list[Edge]) -> str:
    return "\n".join(f"  {e.source} -> {e.target}   ({e.where})" for e in cycle)


# --------------------------------------------------------------------------- the contract


@pytest.fixture(scope="module")
def graph():
    return import_graph()[0]


def test_no_import_circles(graph):
    cycle = find_cycle(graph)
    assert cycle is None, (
        "specjax's modules import each other in a circle:\n" + _shown(cycle)
        + "\nMove what the modules of the circle share to a module below them; an import inside a "
        "function does not break a circle, it hides it."
    )


def test_every_library_module_has_a_layer(graph):
    unplaced = sorted(m for m in graph if layer_of(m) is None)
    assert not unplaced, f"modules in no layer of LAYERS (tests/test_import_graph.py): {unplaced}"


def test_layers_import_only_downwards(graph):
    upward = []
    for module, edges in sorted(graph.items()):
        for edge in edges:
            source, target = layer_of(edge.source), layer_of(edge.target)
            if source is not None and target is not None and target > source:
                upward.append(f"  {edge.source} ({LAYERS[source][0].split(':')[0]}) imports {edge.target} "
                              f"({LAYERS[target][0].split(':')[0]})   ({edge.where})")
    assert not upward, "imports from a lower layer into a higher one:\n" + "\n".join(upward)


# Private names one library module takes from another, each with why it is not a plain name yet. A helper
# two modules share gets a plain name in the module that owns it (docs/layout.md); add none here.
PRIVATE_NAMES_ALLOWED: dict[tuple[str, str], str] = {}  # (module, name): why


def private_names_used(module: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> list[tuple[str, int]]:
    """``(dotted name, line)`` for each ``_``-prefixed name a module takes from another specjax module:
    ``from m import _x`` and ``m._x`` where ``m`` names a specjax module it imported."""
    private = lambda name: name.startswith("_") and not name.startswith("__")  # noqa: E731
    found, modules = [], {}
    tree = ast.parse(path.read_text(), str(path))
    for name, line in imported_names(module, path):
        owner, _, last = name.rpartition(".")
        if owner in known and owner != module and private(last):
            found.append((name, line))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if isinstance(node, ast.Import):  # `import a.b` binds a; `import a.b as c` binds c to a.b
                    modules[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else \
                        alias.name.split(".")[0]
                else:
                    base = node.module or ""
                    if node.level:
                        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                        package = package[:len(package) - (node.level - 1)]
                        base = ".".join(package + ([node.module] if node.module else []))
                    if f"{base}.{alias.name}" in known:
                        modules[alias.asname or alias.name] = f"{base}.{alias.name}"
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and private(node.attr) and isinstance(node.value, ast.Name)
                and modules.get(node.value.id) in known and modules[node.value.id] != module):
            found.append((f"{modules[node.value.id]}.{node.attr}", node.lineno))
    return found


def test_library_modules_take_no_private_names_from_each_other():
    known = module_names(ROOT)
    offences = [
        f"  {module} uses {name}   ({path.relative_to(ROOT)}:{line})"
        for module, path in known.items() if module.startswith("specjax._src")
        for name, line in private_names_used(module, path, known)
        if (module, name) not in PRIVATE_NAMES_ALLOWED
    ]
    assert not offences, ("library modules use each other's private names; give the helper a plain name in the "
                          "module that owns it:\n" + "\n".join(offences))
    used = {(module, name) for module, path in known.items() for name, _ in private_names_used(module, path, known)}
    stale = sorted(set(PRIVATE_NAMES_ALLOWED) - used)
    assert not stale, f"no longer used; remove them from PRIVATE_NAMES_ALLOWED: {stale}"


def test_the_private_name_check_sees_both_forms(tmp_path):
    _write(tmp_path, {
        "specjax/_src/a.py": "def _helper():\n    pass\n",
        "specjax/_src/b.py": "from specjax._src.a import _helper\nfrom specjax._src import a\na._helper()\n",
    })
    known = module_names(tmp_path)
    found = private_names_used("specjax._src.b", tmp_path / "specjax/_src/b.py", known)
    assert found == [("specjax._src.a._helper", 1), ("specjax._src.a._helper", 3)]


def test_the_library_imports_no_command_line_server_or_scripts():
    # The server sits above the library; the command line and the scripts sit outside it.
    forbidden = ("specjax.cli", "specjax.__main__", "specjax._src.serve", "training", "benchmarks")
    offences = [
        f"  {module} imports {name}   ({path.relative_to(ROOT)}:{line})"
        for module, path in module_names(ROOT).items()
        if module.startswith("specjax._src") and not module.startswith("specjax._src.serve")
        for name, line in imported_names(module, path)
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]
    assert not offences, "the library imports the command line, the server or the scripts:\n" + "\n".join(offences)


def private_imports(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """``file:line name`` for every import of ``specjax._src`` in a script outside the package."""
    return [f"{path.relative_to(root)}:{line} {name}" for name, line in imported_names("__main__", path)
            if name == "specjax._src" or name.startswith("specjax._src.")]


def test_scripts_use_the_public_api_only():
    scripts = sorted(p for pattern in PUBLIC_API_ONLY for p in ROOT.glob(pattern)
                     if str(p.relative_to(ROOT)) not in PRIVATE_IMPORTS_ALLOWED)
    assert scripts, "no scripts found"
    offences = [o for path in scripts for o in private_imports(path)]
    assert not offences, (
        "scripts import specjax's private modules; use the public name (specjax, specjax.rules, "
        "specjax.heads, ...) or make the needed function public where a user would look for it:\n"
        + "\n".join(offences)
    )
    # An exception that no longer needs a private name leaves the list.
    stale = [name for name in PRIVATE_IMPORTS_ALLOWED if not private_imports(ROOT / name)]
    assert not stale, f"no longer import private names; remove them from PRIVATE_IMPORTS_ALLOWED: {stale}"


# --------------------------------------------------------------------------- the checks can fail


def _write(root: pathlib.Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_circle_through_function_local_and_relative_imports_is_found(tmp_path):
    _write(tmp_path, {
        "specjax/__init__.py": "",
        "specjax/_src/__init__.py": "",
        "specjax/_src/models/__init__.py": "",
        "specjax/_src/models/a.py": "from specjax._src.models import b\n",
        "specjax/_src/models/b.py": "def f():\n    from . import c\n",
        "specjax/_src/models/c.py": "from ..models.a import something\n",
    })
    graph, _ = import_graph(tmp_path)
    cycle = find_cycle(graph)
    assert cycle is not None
    assert {e.source for e in cycle} == {"specjax._src.models.a", "specjax._src.models.b", "specjax._src.models.c"}
    assert "specjax/_src/models/b.py:2" in _shown(cycle)


def test_layers_place_modules_and_catch_unplaced_ones():
    lm, loading, loop = (layer_of(f"specjax._src.{m}") for m in ("models.lm", "models.loading", "engine.loop"))
    assert lm < loading < loop
    assert layer_of("specjax._src.engine.loop") < layer_of("specjax._src.serve.api") < layer_of("specjax.rules")
    assert layer_of("specjax.rules") < layer_of("specjax.cli.compare")
    assert layer_of("specjax._src.new_module") is None


def test_the_private_import_check_sees_every_form(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import specjax._src.models.lm\nfrom specjax._src import stats\nfrom specjax import rules\n"
                      "from specjax import _src\ndef f():\n    from specjax._src.models.loading import load\n")
    found = [o.split(" ", 1)[1] for o in private_imports(script, tmp_path)]
    assert found == ["specjax._src.models.lm", "specjax._src.stats", "specjax._src", "specjax._src.models.loading.load"]


def test_the_library_check_sees_a_server_import(tmp_path):
    _write(tmp_path, {"specjax/_src/rules/x.py": "def f():\n    from specjax._src.serve import api\n"})
    names = imported_names("specjax._src.rules.x", tmp_path / "specjax/_src/rules/x.py")
    assert names == [("specjax._src.serve.api", 2)]
