"""The layering of the library and the harness, checked on the source (docs/architecture.md
states the rules).

Every module of ``src/attnuq`` (the library) and ``harness/src/attnuq_bench`` (the harness) is
parsed (nothing is imported) and its imports are resolved to modules of the two packages; the
harness's layers all lie above the library's. Module-level imports (outside functions, classes
and ``if TYPE_CHECKING:``) must form no cycle and must not reach a higher layer, and no library
module imports, at module level, anything but the standard library and its required
dependencies (torch, numpy, scipy, tqdm): an optional extra is imported inside the function that
needs it. Some rules hold for imports anywhere in a module (also inside functions): the library
never imports the harness; only ``suites`` and ``cli`` import ``suites``; no suite imports another
suite; methods and models do not import each other.

Each rule is also run on a small synthetic tree that breaks it, so that a checker which found
nothing could not pass silently.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: package -> the folder that holds it
SOURCES = {"attnuq": ROOT / "src", "attnuq_bench": ROOT / "harness" / "src"}
LIBRARY, HARNESS = "attnuq", "attnuq_bench"

#: (package, top-level component) -> layer; a module may import its own layer or lower ones.
#: The harness's layers (100 + n) all lie above the library's.
LAYERS: dict[tuple[str, str], int] = {
    (LIBRARY, "_validation"): 0, (LIBRARY, "_io"): 0, (LIBRARY, "_runtime"): 0,
    (LIBRARY, "ops"): 1, (LIBRARY, "data"): 1, (LIBRARY, "metrics"): 1,
    (LIBRARY, "predictive"): 1, (LIBRARY, "categorical"): 1, (LIBRARY, "distributed"): 1,
    (LIBRARY, "nn"): 2, (LIBRARY, "patching"): 2, (LIBRARY, "models"): 2,
    (LIBRARY, "calibration"): 3, (LIBRARY, "montecarlo"): 3, (LIBRARY, "conformal"): 3,
    (LIBRARY, "plots"): 3, (LIBRARY, "html_report"): 3, (LIBRARY, "conformal_sets"): 3,
    (LIBRARY, "estimators"): 4, (LIBRARY, "cli"): 4,
    (HARNESS, "data"): 101, (HARNESS, "models"): 102,
    (HARNESS, "training"): 103,
    (HARNESS, "methods"): 104,
    (HARNESS, "suites"): 105,
    (HARNESS, "demo"): 106,
    (HARNESS, "cli"): 107,
}
#: a package's root (``__init__.py``, a facade) counts as that package's top layer
ROOT_LAYER = {LIBRARY: 5, HARNESS: 108}
#: the suite modules of ``attnuq_bench.suites`` (a private ``_<suite>_*`` module is the suite's)
SUITES = ("uci", "ett", "era5", "physionet", "nu_search", "mortality", "digits", "sa_evidence")
#: what a library module may import at module level besides the standard library and itself
REQUIRED = frozenset({"torch", "numpy", "scipy", "tqdm"})


@dataclass
class Module:
    name: str  # dotted, e.g. "attnuq_bench.suites.uci"
    is_package: bool
    top: set[str] = field(default_factory=set)  # module-level imports (modules of the packages)
    anywhere: set[str] = field(default_factory=set)  # every import, also inside functions
    external: set[str] = field(default_factory=set)  # module-level imports of other packages


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.Import | ast.ImportFrom, mod: Module) -> list[str]:
    """Dotted names an import statement refers to (modules, or ``module.attr`` candidates)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = mod.name.split(".")
        if not mod.is_package:
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    return [prefix] + [f"{prefix}.{a.name}" for a in node.names]


def _collect(body: list[ast.stmt], mod: Module, top_level: bool, runtime: bool = True) -> None:
    """Record the imports of ``body``: ``top_level`` outside functions and classes, ``runtime``
    outside ``if TYPE_CHECKING:`` (imports only a type checker runs are not recorded)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if runtime:
                names = _targets(node, mod)
                mod.anywhere.update(names)
                if top_level:
                    mod.top.update(names)
        elif isinstance(node, ast.If):
            tc = _is_type_checking(node.test)
            _collect(node.body, mod, top_level, runtime and not tc)
            _collect(node.orelse, mod, top_level, runtime)
        elif isinstance(node, (ast.Try, ast.With)):
            for part in ("body", "orelse", "finalbody"):
                _collect(getattr(node, part, []), mod, top_level, runtime)
            for h in getattr(node, "handlers", []):
                _collect(h.body, mod, top_level, runtime)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            _collect(node.body, mod, False, runtime)
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    _collect([child], mod, top_level, runtime)


def load_tree(sources: dict[str, Path]) -> dict[str, Module]:
    """Parse every module of each package (name -> folder holding it); imports resolved to
    known modules of the packages, other module-level imports kept by their top-level name."""
    mods: dict[str, Module] = {}
    for pkg, src in sources.items():
        for path in sorted((src / pkg).rglob("*.py")):
            rel = path.relative_to(src).with_suffix("")
            parts = list(rel.parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            m = Module(".".join(parts), is_pkg)
            _collect(ast.parse(path.read_text(), str(path)).body, m, True)
            mods[m.name] = m
    for m in mods.values():  # keep the packages' modules; `from pkg import name` -> pkg.name
        m.external = {n.split(".")[0] for n in m.top if n and n.split(".")[0] not in sources}
        m.top = _resolve(m.top, mods) - {m.name}
        m.anywhere = _resolve(m.anywhere, mods) - {m.name}
    return mods


def _resolve(names: set[str], mods: dict[str, Module]) -> set[str]:
    """Known modules among ``names``; ``pkg`` of ``from pkg import sub`` only if it also names
    something that is not a submodule (then the package's ``__init__`` is what is used)."""
    out = {n for n in names if n in mods}
    for n in list(out):
        if mods[n].is_package:
            subs = {x for x in names if x.startswith(n + ".") and x.count(".") == n.count(".") + 1}
            attrs = subs - set(mods)
            if subs and not attrs:
                out.discard(n)
    return out


def _package(name: str) -> str:
    return name.split(".")[0]


def _component(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def _layer(name: str) -> int:
    comp = _component(name)
    if comp is None:
        return ROOT_LAYER[_package(name)]
    key = (_package(name), comp)
    if key not in LAYERS:
        raise KeyError(f"module {name} belongs to no layer: add {key!r} to LAYERS and to "
                       "docs/architecture.md")
    return LAYERS[key]


def _ancestors(name: str) -> set[str]:
    """Packages whose ``__init__`` runs when ``name`` is imported (not counting the root)."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(2, len(parts))}


def cycles(mods: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components (size > 1, or a self-loop) of the module-level graph."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(mods[v].top):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(mods):
            if v not in index:
                strong(v)
    finally:
        sys.setrecursionlimit(limit)
    return out


def upward(mods: dict[str, Module]) -> list[str]:
    """Module-level imports of a higher layer (a package importing its own parts is fine)."""
    bad = []
    for m in mods.values():
        if _component(m.name) is None and _package(m.name) == HARNESS:
            continue  # the harness's facade may name anything of its own
        for t in sorted(m.top):
            if t in _ancestors(m.name):
                continue
            if _layer(t) > _layer(m.name):
                bad.append(f"{m.name} (layer {_layer(m.name)}) imports {t} "
                           f"(layer {_layer(t)}) at module level")
    return bad


def extras_at_import(mods: dict[str, Module]) -> list[str]:
    """Library modules importing, at module level, more than the standard library and the
    library's required dependencies (an optional extra belongs inside the function using it).

    A private module that no module imports at module level (it is loaded by the function that
    needs it, e.g. Triton kernels, whose decorators need triton) may import its extra there."""
    bad = []
    allowed = REQUIRED | set(sys.stdlib_module_names)
    loaded_at_import = {t for m in mods.values() for t in m.top} | {
        a for m in mods.values() for t in m.top for a in _ancestors(t)}
    for m in mods.values():
        if _package(m.name) != LIBRARY:
            continue
        if m.name.split(".")[-1].startswith("_") and m.name not in loaded_at_import:
            continue
        for ext in sorted(m.external - allowed):
            bad.append(f"{m.name} imports {ext} at module level (not a required dependency)")
    return bad


def _suite(name: str) -> str | None:
    """The suite a suites module belongs to: ``suites.ett`` and its own ``suites._ett_page``."""
    leaf = name.split(".")[-1]
    for s in SUITES:
        if leaf == s or leaf.startswith(f"_{s}_"):
            return s
    return None


def anywhere_rules(mods: dict[str, Module]) -> list[str]:
    """Rules on every import, also inside functions."""
    bad = []
    for m in mods.values():
        comp = _component(m.name)
        harness_m = _package(m.name) == HARNESS
        for t in sorted(m.anywhere):
            tcomp = _component(t)
            harness_t = _package(t) == HARNESS
            if harness_t and not harness_m:
                bad.append(f"{m.name} imports {t}: the library never imports the harness")
            if harness_t and tcomp == "suites" and comp not in ("suites", "cli"):
                bad.append(f"{m.name} imports {t}: only suites and cli import suites")
            suite_m = _suite(m.name) if harness_m and comp == "suites" else None
            suite_t = _suite(t) if harness_t and tcomp == "suites" else None
            if (suite_m in SUITES and suite_t in SUITES and suite_m != suite_t):
                bad.append(f"suite {m.name} imports suite {t}")
            if {comp, tcomp} == {"methods", "models"}:
                bad.append(f"{m.name} imports {t}: methods and models do not import each other")
    return bad


@pytest.fixture(scope="module")
def tree() -> dict[str, Module]:
    return load_tree(SOURCES)


def test_every_module_has_a_layer(tree: dict[str, Module]) -> None:
    for pkg in SOURCES:  # both packages were read whole
        assert sum(_package(n) == pkg for n in tree) > 15, pkg
    missing = sorted({(_package(n), c) for n in tree
                      if (c := _component(n)) is not None and (_package(n), c) not in LAYERS})
    assert not missing, f"components without a layer: {missing}"


def test_module_level_imports_form_no_cycle(tree: dict[str, Module]) -> None:
    assert cycles(tree) == []


def test_module_level_imports_go_downward(tree: dict[str, Module]) -> None:
    assert upward(tree) == []


def test_library_imports_no_optional_extra_at_module_level(tree: dict[str, Module]) -> None:
    assert extras_at_import(tree) == []


def test_library_never_imports_harness_and_no_suite_imports_another(
    tree: dict[str, Module],
) -> None:
    assert anywhere_rules(tree) == []


def test_the_checks_catch_a_tree_that_breaks_each_rule(tmp_path: Path) -> None:
    lib, harness = tmp_path / "lib", tmp_path / "harness"
    files = {
        lib / "attnuq/__init__.py": "",
        lib / "attnuq/ops/__init__.py": "from attnuq.ops import a\n",
        lib / "attnuq/ops/a.py": "from . import b\nimport numpy, json\n",  # required, stdlib
        lib / "attnuq/ops/b.py": "from attnuq.ops.a import x\n",  # cycle a <-> b
        lib / "attnuq/data/__init__.py": "from attnuq.cli import main\n",  # upward
        lib / "attnuq/nn/__init__.py": (
            "import matplotlib.pyplot as plt\n"  # an extra at import
            "from attnuq.nn import _eager\ndef f():\n    from attnuq.nn import _lazy\n"),
        lib / "attnuq/nn/_lazy.py": "import triton\n",  # loaded only inside a function: fine
        lib / "attnuq/nn/_eager.py": "import triton\n",  # loaded at import by nn
        lib / "attnuq/patching/__init__.py": (
            "try:\n    import transformers\nexcept ImportError:\n    pass\n"  # still imported
            "def f():\n    import timm\n"),  # inside a function: fine
        lib / "attnuq/models/__init__.py": "def f():\n    from attnuq_bench import training\n",
        lib / "attnuq/plots.py": "from attnuq_bench.suites import uci\n",  # library -> harness
        lib / "attnuq/cli/__init__.py": "",
        harness / "attnuq_bench/__init__.py": "",
        harness / "attnuq_bench/data/__init__.py": (
            "import pandas\nfrom attnuq_bench.methods import make\n"),  # pandas: fine here
        harness / "attnuq_bench/methods/__init__.py": (
            "def make():\n    from attnuq.models import m\n"),  # methods -> models
        harness / "attnuq_bench/models/__init__.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from attnuq_bench.suites import uci\n"),  # allowed: TYPE_CHECKING
        harness / "attnuq_bench/models/m.py": "def f():\n    import attnuq_bench.suites.uci\n",
        harness / "attnuq_bench/training.py": "from attnuq.ops import a\n",  # downward: fine
        harness / "attnuq_bench/suites/__init__.py": "",
        harness / "attnuq_bench/suites/uci.py": (
            "def f():\n    from attnuq_bench.suites import ett\n"),
        harness / "attnuq_bench/suites/ett.py": "from attnuq_bench.suites import _ett_page\n",
        harness / "attnuq_bench/suites/_ett_page.py": "",  # a suite's own part: fine
        harness / "attnuq_bench/suites/_uci_page.py": (
            "from attnuq_bench.suites._ett_page import x\n"),  # another suite's part
        harness / "attnuq_bench/cli.py": "from attnuq_bench.suites import uci\n",  # fine
    }
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    mods = load_tree({"attnuq": lib, "attnuq_bench": harness})
    assert cycles(mods) == [["attnuq.ops.a", "attnuq.ops.b"]]
    assert sorted(upward(mods)) == [
        "attnuq.data (layer 1) imports attnuq.cli (layer 4) at module level",
        "attnuq.plots (layer 3) imports attnuq_bench.suites.uci (layer 105) at module level",
        "attnuq_bench.data (layer 101) imports attnuq_bench.methods (layer 104) at module level",
    ]
    assert extras_at_import(mods) == [
        "attnuq.nn imports matplotlib at module level (not a required dependency)",
        "attnuq.nn._eager imports triton at module level (not a required dependency)",
        "attnuq.patching imports transformers at module level (not a required dependency)",
    ]
    assert sorted(anywhere_rules(mods)) == [
        "attnuq.models imports attnuq_bench.training: the library never imports the harness",
        "attnuq.plots imports attnuq_bench.suites.uci: only suites and cli import suites",
        "attnuq.plots imports attnuq_bench.suites.uci: the library never imports the harness",
        "attnuq_bench.methods imports attnuq.models: methods and models do not import each "
        "other",
        "attnuq_bench.models.m imports attnuq_bench.suites.uci: only suites and cli import "
        "suites",
        "suite attnuq_bench.suites._uci_page imports suite attnuq_bench.suites._ett_page",
        "suite attnuq_bench.suites.uci imports suite attnuq_bench.suites.ett",
    ]
