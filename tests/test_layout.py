"""The layout's rules, checked on the source (ARCHITECTURE.md lists them):

* no import cycle among the modules of ``autoparallel`` and ``verify``, nor among verify's
  families, and ``autoparallel`` never imports ``verify`` or ``tests``;
* verify/ keeps at most 12 top-level entries, and tests/unit/ mirrors the source packages;
* no module of ``autoparallel`` or ``verify`` above 700 lines;
* node-meta keys, role labels and activation-checkpointing policy names are spelled only in their
  home modules (``meta.py``, ``roles.py``, ``ac.py``);
* first-party imports inside functions only where a module says why (cheap CLI / pytest plugin);
* no module imports another's private names;
* outside ``verify/stages/registry.py``, verify/ neither keys a dict literal by a stage name nor
  compares a name with one (``==``, ``!=``, ``in (...)``): what to do for a stage comes from its
  registry entry;
* every test path listed in code exists (xdist module groups, line-mutation defaults);
* names retired by docs/layout.md's "Words with two meanings" stay gone (code, tests and docs).

Each checker is also fed a small bad source, so a checker that cannot fail fails here.
"""

from __future__ import annotations

import ast
import functools
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from autoparallel import ac, roles
from autoparallel import meta as M
from autoparallel.pipeline import PLAN, PLANNED_STAGE_NAMES
from verify.commands.mutation.lines import default_test_paths

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("autoparallel", "verify")
# One worker parses the sources once for every check here (parsing ~200 files takes ~1 s).
pytestmark = pytest.mark.xdist_group("layout")


@functools.cache
def _parse(text: str) -> ast.Module:
    """The checks only read the trees: one parse per distinct source text."""
    return ast.parse(text)


def _sources(*dirs: str) -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for d in dirs for p in sorted((ROOT / d).rglob("*.py"))}


def _module_name(path: str) -> str:
    parts = list(Path(path).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# --- imports ------------------------------------------------------------------------------------


def _imported(tree: ast.AST) -> list[tuple[str, int]]:
    """Every absolute import in ``tree`` (module-level and inside functions), as dotted names."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out += [(a.name, n.lineno) for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
            out += [(f"{n.module}.{a.name}", n.lineno) for a in n.names]
    return out


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """module -> first-party modules it imports (a package's ``__init__`` counts for each module
    imported through it)."""
    modules = {_module_name(p) for p in sources}

    def resolve(name: str) -> set[str]:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        out = set()
        while name:
            if name in modules:
                out.add(name)
            name = name.rpartition(".")[0]
        return out

    graph = {}
    for path, text in sources.items():
        me = _module_name(path)
        deps = set().union(*(resolve(name) for name, _ in _imported(_parse(text))))
        graph[me] = {d for d in deps if d != me and not me.startswith(d + ".")}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    assert import_cycles(import_graph(_sources(*PACKAGES))) == []


def test_import_cycle_check_finds_a_cycle_through_a_function_local_import():
    sources = {
        "pkg/a.py": "from pkg.b import f\n",
        "pkg/b.py": "def f():\n    from pkg import c\n",
        "pkg/c.py": "import pkg.a\n",
        "pkg/d.py": "import pkg.a\n",
    }
    assert import_cycles(import_graph(sources)) == [["pkg.a", "pkg.b", "pkg.c"]]


MAX_VERIFY_TOP_LEVEL = 12  # files plus packages at verify/'s top (issue 29: the public surface, then families)


def top_level_entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name != "__pycache__" and (p.suffix == ".py" or (p / "__init__.py").exists()))


def test_verify_has_at_most_twelve_top_level_entries():
    entries = top_level_entries(ROOT / "verify")
    assert len(entries) <= MAX_VERIFY_TOP_LEVEL, f"group these into verify's families (ARCHITECTURE.md): {entries}"


def family_graph(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """``graph`` collapsed to ``package``'s top-level modules and subpackages (its ``__init__``,
    which every module may import, left out)."""

    def family(module: str) -> str | None:
        parts = module.split(".")
        return ".".join(parts[:2]) if parts[0] == package and len(parts) > 1 else None

    out: dict[str, set[str]] = {}
    for me, deps in graph.items():
        if family(me):
            out.setdefault(family(me), set()).update(f for d in deps if (f := family(d)) and f != family(me))
    return out


def test_verify_families_import_each_other_in_one_direction():
    """graphs <- stages <- parity; goldens and commands above them (ARCHITECTURE.md)."""
    assert import_cycles(family_graph(import_graph(_sources("verify")), "verify")) == []


def layers(graph: dict[str, set[str]]) -> list[list[str]]:
    """``graph``'s nodes in layers: layer 0 imports nothing in the graph, layer k only layers below
    k. A cycle has no layering: ValueError naming what is left."""
    placed: dict[str, int] = {}
    out: list[list[str]] = []
    while len(placed) < len(graph):
        layer = sorted(v for v, deps in graph.items() if v not in placed and all(d in placed for d in deps if d in graph))
        if not layer:
            raise ValueError(f"import cycle among {sorted(set(graph) - set(placed))}")
        placed.update(dict.fromkeys(layer, len(out)))
        out.append(layer)
    return out


def package_layers() -> dict[str, list[list[str]]]:
    """Each package's families (top-level modules and subpackages) in import layers."""
    graph = import_graph(_sources(*PACKAGES))
    return {pkg: layers(family_graph(graph, pkg)) for pkg in PACKAGES}


def test_each_package_imports_its_families_in_layers():
    """autoparallel's families too, not only verify's, import each other in one direction."""
    found = package_layers()
    assert all(len(found[pkg]) >= 2 for pkg in PACKAGES), found


def test_layering_refuses_a_cycle():
    assert layers({"a": {"b"}, "b": set(), "c": {"a", "x"}}) == [["b"], ["a"], ["c"]]
    with pytest.raises(ValueError, match=r"import cycle among \['a', 'b', 'c'\]"):
        layers({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()})


def test_family_cycle_check_finds_two_packages_importing_each_other():
    sources = {"pkg/__init__.py": "", "pkg/a/x.py": "from pkg.b import y\n", "pkg/b/y.py": "from pkg.a import z\n",
               "pkg/a/z.py": "", "pkg/c.py": "import pkg.a.x\n"}
    assert import_cycles(family_graph(import_graph(sources), "pkg")) == [["pkg.a", "pkg.b"]]


MAX_MODULE_LINES = 700  # issue 42: a module one can hold in one's head; split along a seam, allow-list nothing


def long_modules(sources: dict[str, str]) -> list[str]:
    """``path: N lines`` for each module above :data:`MAX_MODULE_LINES`."""
    return [f"{path}: {n} lines" for path, text in sources.items() if (n := len(text.splitlines())) > MAX_MODULE_LINES]


def test_no_module_above_700_lines():
    assert long_modules(_sources(*PACKAGES)) == [], "split these along their seams (docs/layout.md)"


def test_module_length_check_finds_one():
    assert long_modules({"a.py": "x = 1\n" * 701, "b.py": "x = 1\n" * 700}) == ["a.py: 701 lines"]


def unmirrored_test_dirs(root: Path) -> list[str]:
    """Directories under ``root/tests/unit`` with no package at the same path under ``root``."""
    unit = root / "tests" / "unit"
    return [str(d.relative_to(unit)) for d in sorted(unit.rglob("*")) if d.is_dir() and d.name != "__pycache__"
            and not (root / d.relative_to(unit) / "__init__.py").exists()]


def test_unit_tests_mirror_the_source_packages():
    """tests/unit/<package>/... has a directory only where the source has that package."""
    assert unmirrored_test_dirs(ROOT) == []


def test_layout_counts_find_too_many_entries_and_stray_test_dirs(tmp_path):
    for name in ("a.py", "b/__init__.py", "tests/unit/b/x/t.py", "tests/unit/b/t.py", "notes/readme.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert top_level_entries(tmp_path) == ["a.py", "b"]
    assert unmirrored_test_dirs(tmp_path) == ["b/x"]


def test_autoparallel_never_imports_verify_or_tests():
    bad = [
        f"{path}:{line}: {name}"
        for path, text in _sources("autoparallel").items()
        for name, line in _imported(_parse(text))
        if name.split(".")[0] in ("verify", "tests")
    ]
    assert bad == []


def private_imports(sources: dict[str, str]) -> list[str]:
    """``from <first-party module> import _name``: a helper another module needs is public (or
    lives in a shared home such as ``autoparallel/fx_utils.py``), not borrowed."""
    out = []
    for path, text in sources.items():
        for n in ast.walk(_parse(text)):
            if isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").split(".")[0] in PACKAGES:
                out += [f"{path}:{n.lineno}: {n.module}.{a.name}" for a in n.names if a.name.startswith("_")]
    return out


def test_no_module_imports_another_modules_private_names():
    assert private_imports(_sources(*PACKAGES)) == []


def test_private_import_check_finds_one():
    bad = {"m.py": "from verify.graphs.canon import _helper, public\nfrom torch.fx import _private\n"}
    assert private_imports(bad) == ["m.py:1: verify.graphs.canon._helper"]


# Modules whose functions import first-party code on purpose, and why.
LOCAL_IMPORTS_ALLOWED = {
    "verify/__main__.py": "each command imports only its own module (goldens/mutate start without torch)",
    "verify/goldens/text.py": "the golden file format stays free of torch (canon/stats on use)",
    "verify/pytest_plugin.py": "loaded by every pytest run (pytest11): no torch or syrupy on load",
    "verify/commands/planning.py": "its add_arguments builds every python -m verify parser: the planner loads only for plan",
    "verify/commands/mutation/lines.py": "every python -m verify parser imports it: the stage registry (torch) loads on use",
    "verify/commands/html/__init__.py": "the plugin's browser gate imports verify.commands.html.browser: the package loads no torch",
    "tests/conftest.py": "loaded by every pytest process before any test needs the fixtures",
}


def _imports_in_functions(node: ast.AST, inside: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under a function body, each once (one walk: nested functions are
    not walked again)."""
    for child in ast.iter_child_nodes(node):
        if inside and isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        yield from _imports_in_functions(child, inside or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))


def local_first_party_imports(sources: dict[str, str]) -> list[str]:
    out = []
    for path, text in sources.items():
        for n in _imports_in_functions(_parse(text)):
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]
            if any(name.split(".")[0] in PACKAGES for name in names):
                out.append(f"{path}:{n.lineno}")
    return out


def test_first_party_imports_are_at_module_level_unless_a_module_says_why():
    found = local_first_party_imports(_sources(*PACKAGES, "tests"))
    unexpected = [loc for loc in found if loc.split(":")[0] not in LOCAL_IMPORTS_ALLOWED]
    assert unexpected == [], "hoist these imports, or add the module to LOCAL_IMPORTS_ALLOWED with a reason"
    assert {loc.split(":")[0] for loc in found} == set(LOCAL_IMPORTS_ALLOWED), "an allowance no module uses"


def test_local_import_check_finds_one():
    assert local_first_party_imports({"m.py": "def f():\n    from autoparallel import meta\n"}) == ["m.py:2"]
    assert local_first_party_imports({"m.py": "def f():\n    import json\n"}) == []
    nested = "import verify\ndef f():\n    def g():\n        import autoparallel.meta\n    return g\n"
    assert local_first_party_imports({"m.py": nested}) == ["m.py:4"]  # once, not once per enclosing function


# --- vocabularies: meta keys, role labels, AC policy names ---------------------------------------

_META_KEYS = {
    value
    for name, value in vars(M).items()
    if isinstance(value, str) and name.isupper() and not name.startswith(("PHASE_", "REMAT_PASS_TAG_"))
}
_META_HOLDERS = ("meta", "current_meta")


def _is_meta_dict(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr in _META_HOLDERS) or (
        isinstance(node, ast.Name) and node.id in _META_HOLDERS
    )


def meta_key_literals(sources: dict[str, str]) -> list[str]:
    """``x.meta["val"]``, ``x.meta.get("val")`` / ``.pop`` / ``.setdefault``, ``"val" in x.meta``."""
    out = []
    for path, text in sources.items():
        for n in ast.walk(_parse(text)):
            key = None
            if isinstance(n, ast.Subscript) and _is_meta_dict(n.value):
                key = n.slice
            elif (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr in ("get", "pop", "setdefault")
                and _is_meta_dict(n.func.value)
                and n.args
            ):
                key = n.args[0]
            elif isinstance(n, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in n.ops):
                if any(_is_meta_dict(c) for c in n.comparators):
                    key = n.left
            if isinstance(key, ast.Constant) and key.value in _META_KEYS:
                out.append(f"{path}:{n.lineno}: {key.value!r}")
    return out


_ROLE_PREFIX = re.compile(rf"^({'|'.join(k for k in roles.KINDS if k != roles.LOSS)}):")


def role_literals(sources: dict[str, str]) -> list[str]:
    """String constants (f-string pieces included) that start a role label (``param:``, ...)."""
    out = []
    for path, text in sources.items():
        tree = _parse(text)
        # docstrings and other bare string statements document labels; they do not build them
        prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in prose:
                if _ROLE_PREFIX.match(n.value):
                    out.append(f"{path}:{n.lineno}: {n.value!r}")
    return out


_AC_NAMES = {ac.FULL, ac.OP}
_AC_PREFIXES = ("layer:", "_scaled_dot_product")


def ac_policy_literals(sources: dict[str, str]) -> list[str]:
    """AC mode / policy names (``"full"``, ``"op"``, ``"layer:K"``) and SDPA op names outside
    ``ac.py``: a second spelling of the policy. Dict keys and subscript indices (``{"op": ...}``,
    ``v["op"]``) are field names, not policies."""
    out = []
    for path, text in sources.items():
        tree = _parse(text)
        fields = {id(k) for n in ast.walk(tree) if isinstance(n, ast.Dict) for k in n.keys if k is not None}
        fields |= {id(n.slice) for n in ast.walk(tree) if isinstance(n, ast.Subscript)}
        for n in ast.walk(tree):
            if id(n) in fields:
                continue
            if isinstance(n, ast.Constant) and isinstance(n.value, str):
                if n.value in _AC_NAMES or n.value.startswith(_AC_PREFIXES):
                    out.append(f"{path}:{n.lineno}: {n.value!r}")
    return out


def _outside(home: str) -> dict[str, str]:
    return {p: t for p, t in _sources(*PACKAGES).items() if p != home}


@pytest.mark.parametrize(
    "check, home",
    [(meta_key_literals, "autoparallel/meta.py"), (role_literals, "autoparallel/roles.py"), (ac_policy_literals, "autoparallel/ac.py")],
    ids=["meta keys", "role labels", "AC policy"],
)
def test_vocabulary_is_spelled_only_in_its_home_module(check, home):
    assert check(_outside(home)) == [], f"use the names {home} defines"


def test_vocabulary_checks_find_literals():
    bad = {
        "m.py": (
            'node.meta["val"]\nnode.meta.get("recompute")\nif "ap_role" in n.meta: pass\n'
            'role = f"param:{fqn}"\nr.startswith("grad:")\nmode = "full"\nop = "_scaled_dot_product_x"\n'
            '"""param: a docstring may name a label"""\nnode.meta[M.VAL]\nd["val"]\n'
        )
    }
    assert meta_key_literals(bad) == ["m.py:1: 'val'", "m.py:2: 'recompute'", "m.py:3: 'ap_role'"]
    assert role_literals(bad) == ["m.py:4: 'param:'", "m.py:5: 'grad:'"]
    assert ac_policy_literals(bad) == ["m.py:6: 'full'", "m.py:7: '_scaled_dot_product_x'"]
    fields = {"m.py": 'row = {"op": name}\nname = row["op"]\npolicy = "op"\n'}
    assert ac_policy_literals(fields) == ["m.py:3: 'op'"]


# --- stage names: the registry dispatches --------------------------------------------------------

REGISTRY_HOME = "verify/stages/registry.py"
# "plan" also names a field, an argument and a command (docs/layout.md, words with two meanings):
# as a literal it is not taken for the stage; the stage is spelled PLAN.
_STAGE_LITERALS = frozenset(PLANNED_STAGE_NAMES) - {PLAN}


@functools.cache
def _stage_constants() -> frozenset[str]:
    """Module-level names in autoparallel/ and verify/ bound to a stage's name (``JOINT``, ``SECOND_COMPILE``, ...)."""
    out = set()
    for text in _sources(*PACKAGES).values():
        for n in _parse(text).body:
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and n.value.value in PLANNED_STAGE_NAMES:
                out.update(t.id for t in n.targets if isinstance(t, ast.Name))
    return frozenset(out)


def _stage_name(node: ast.AST, constants: frozenset[str]) -> str | None:
    if isinstance(node, ast.Constant) and node.value in _STAGE_LITERALS:
        return repr(node.value)
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name if name in constants else None


def stage_dispatch(sources: dict[str, str], constants: frozenset[str]) -> list[str]:
    """Dict literals keyed by a stage name, and comparisons with one (``==``/``!=`` with a stage's
    name, ``in``/``not in`` a literal tuple, list or set holding one)."""
    out = []
    for path, text in sources.items():
        for n in ast.walk(_parse(text)):
            found: list[ast.AST] = []
            if isinstance(n, ast.Dict):
                found = [k for k in n.keys if k is not None]
            elif isinstance(n, ast.Compare):
                for op, left, right in zip(n.ops, [n.left, *n.comparators[:-1]], n.comparators, strict=True):
                    if isinstance(op, ast.Eq | ast.NotEq):
                        found += [left, right]
                    elif isinstance(op, ast.In | ast.NotIn) and isinstance(right, ast.Tuple | ast.List | ast.Set):
                        found += right.elts
            out += [f"{path}:{n.lineno}: {name}" for name in (_stage_name(k, constants) for k in found) if name]
    return out


def test_only_the_registry_dispatches_on_stage_names():
    verify = {p: t for p, t in _sources("verify").items() if p != REGISTRY_HOME}
    assert stage_dispatch(verify, _stage_constants()) == [], f"read what a stage needs from its entry in {REGISTRY_HOME}"


def test_stage_dispatch_check_finds_keys_and_comparisons():
    assert {"JOINT", "SECOND_COMPILE", "STEP_FIRST_PARTITION", "PLAN"} <= _stage_constants()
    bad = {"m.py": ('d = {JOINT: 1, "cleanup": 2, "plan": 3}\nif r.name == P.SECOND_COMPILE: pass\n'
                    'ok = name in (STEP_FIRST_PARTITION, "other")\nx = {"fsdp": 1}\nif s != "second_compile": pass\n')}
    assert stage_dispatch(bad, _stage_constants()) == [
        "m.py:1: JOINT", "m.py:1: 'cleanup'", "m.py:2: SECOND_COMPILE", "m.py:3: STEP_FIRST_PARTITION", "m.py:5: 'second_compile'"]


# --- retired names (docs/layout.md, "Words with two meanings") ---------------------------------

# The planner's result was ``Plan`` in ``autoparallel.planner.plan``; now "plan" names a ParallelPlan
# only. Pieces of a name, so that this file does not match itself.
RETIRED_NAMES = {"Pl" + "an": "Solution"}
RETIRED_MODULES = {"autoparallel.planner." + "plan": "autoparallel.planner.solution"}
_RETIRED_IN_DOCS = re.compile("|".join(("`Pl" + r"an\b", r"\bPl" + r"an\.[a-z]", r"autoparallel\.planner\.pl" + r"an\b",
                                        r"planner/pl" + r"an\.py")))
# Only a source that spells a retired name somewhere is parsed (tests/ is not in _sources' cache).
_RETIRED_TEXT = re.compile("|".join(rf"\b{re.escape(n)}\b" for n in [*RETIRED_NAMES, *RETIRED_MODULES]))


def retired_names(sources: dict[str, str]) -> list[str]:
    """Identifiers (names, attributes, definitions, imported names) and module names (imports,
    string constants) that docs/layout.md's table retired, in line order."""
    out: list[tuple[str, int, str]] = []
    for path, text in sources.items():
        if not _RETIRED_TEXT.search(text):
            continue
        for n in ast.walk(_parse(text)):
            names: list[str] = []
            if isinstance(n, ast.Name):
                names = [n.id]
            elif isinstance(n, ast.Attribute):
                names = [n.attr]
            elif isinstance(n, ast.ClassDef | ast.FunctionDef):
                names = [n.name]
            elif isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom):
                names = [n.module or "", *(a.name for a in n.names), *(f"{n.module}.{a.name}" for a in n.names)]
            elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                names = [n.value]
            hits = [x for x in names if x in RETIRED_NAMES or x in RETIRED_MODULES]
            out += [(path, n.lineno, x) for x in dict.fromkeys(hits)]
    return [f"{path}:{line}: {x}" for path, line, x in sorted(out)]


def retired_in_docs(texts: dict[str, str]) -> list[str]:
    return [f"{path}:{i}: {m.group(0)}" for path, text in texts.items()
            for i, line in enumerate(text.splitlines(), 1) for m in _RETIRED_IN_DOCS.finditer(line)]


def test_retired_names_are_gone():
    assert retired_names(_sources(*PACKAGES, "tests")) == [], f"renamed: {RETIRED_NAMES | RETIRED_MODULES}"
    docs = {str(p.relative_to(ROOT)): p.read_text() for p in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "ARCHITECTURE.md", ROOT / "README.md"]}
    assert retired_in_docs(docs) == [], f"renamed: {RETIRED_NAMES | RETIRED_MODULES}"


def test_retired_name_checks_find_each_form():
    old, mod = "Pl" + "an", "autoparallel.planner." + "plan"
    bad = {"m.py": (f"from autoparallel.planner import {old}\nfrom {mod} import diff\nimport {mod}\nx: {old} = p.{old}\n"
                    f"class {old}: pass\nok = {{{mod!r}}}\nPlanner, plan, Solution, ParallelPlan\n")}
    assert retired_names(bad) == [f"m.py:1: {old}", f"m.py:2: {mod}", f"m.py:3: {mod}", f"m.py:4: {old}",
                                  f"m.py:4: {old}", f"m.py:5: {old}", f"m.py:6: {mod}"]
    doc = {"d.md": f"`{old}.text` and {old}.load\nsee {mod}.diff and autoparallel/planner/{'plan'}.py\n{old} a model; a `ParallelPlan`\n"}
    assert [r.split(": ", 1)[0] for r in retired_in_docs(doc)] == ["d.md:1", "d.md:1", "d.md:2", "d.md:2"]


# --- test paths listed in code ------------------------------------------------------------------


def _module_groups() -> dict[str, tuple[str, ...]]:
    tree = ast.parse((ROOT / "tests" / "conftest.py").read_text())
    for n in tree.body:
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "MODULE_GROUPS" for t in n.targets):
            return ast.literal_eval(n.value)
    raise AssertionError("tests/conftest.py defines no MODULE_GROUPS")


def test_every_test_path_listed_in_code_exists():
    listed = [p for mods in _module_groups().values() for p in mods] + list(default_test_paths())
    assert listed and [p for p in listed if not (ROOT / p).exists()] == []


def test_no_test_module_directly_in_tests_unit():
    """pytest puts the directory of each test module on sys.path; tests/unit holds directories
    named autoparallel/ and verify/, so that entry would make a spawned process (run_on_world with
    start_method="spawn") import them as namespace packages instead of the real ones."""
    assert sorted(p.name for p in (ROOT / "tests" / "unit").glob("*.py")) == []


# --- the repository refers only to itself ---------------------------------------------------------

# A design doc outside the repository, a sibling checkout, numbered steps of that doc ("pipeline
# step 6"): pieces of a path, so that this file does not match itself.
_OUTSIDE = re.compile("|".join(("DESIGN" + r"\.md", r"\.\./" + "shared", "/work" + "/shared", "pipeline step" + r" \d")))


def outside_references(texts: dict[str, str]) -> list[str]:
    return [f"{path}:{i}: {m.group(0)}" for path, text in texts.items()
            for i, line in enumerate(text.splitlines(), 1) for m in _OUTSIDE.finditer(line)]


def _repo_texts() -> dict[str, str]:
    """Every tracked-looking text file (git's own, virtual environments, caches and goldens left
    out, their directories never walked)."""
    suffixes = {".py", ".md", ".toml", ".ini", ".txt", ".cfg", ""}
    skip = ("goldens", "build", "dist", "venv", "node_modules", "__pycache__")
    out = {}
    for dirpath, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if (d == ".ci" or not d.startswith(".")) and d not in skip and not d.endswith(".egg-info")]
        for name in files:
            p = Path(dirpath) / name
            if p.suffix in suffixes:
                out[str(p.relative_to(ROOT))] = p.read_text(errors="replace")
    return out


def test_nothing_refers_to_a_file_outside_the_repository():
    assert outside_references(_repo_texts()) == [], "the design doc is docs/design.md"


def test_outside_reference_check_finds_them():
    bad = {"m.md": "see " + "DESIGN" + ".md\n" + "cat .." + "/shared/notes\nok\n# pipeline " + "step 6: passes"}
    assert [r.split(": ", 1)[0] for r in outside_references(bad)] == ["m.md:1", "m.md:2", "m.md:4"]


if __name__ == "__main__":  # python tests/test_layout.py: the import graph, as docs/layout.md quotes it
    graph = import_graph(_sources(*PACKAGES))
    print(f"modules {len(graph)}, import edges {sum(map(len, graph.values()))}, module cycles {import_cycles(graph)}")
    for pkg, found in package_layers().items():
        print(f"{pkg}: {sum(map(len, found))} families in {len(found)} layers (bottom first)")
        for i, layer in enumerate(found):
            print(f"  {i}: {' '.join(f.split('.', 1)[1] for f in layer)}")
