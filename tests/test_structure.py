"""The shape of the source tree: no import circles, faast_kernels independent of faast, files small enough to read
in one sitting, and no module writing another object's private attributes (docs/testing.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"faast": ROOT / "python" / "faast", "faast_kernels": ROOT / "faast_kernels"}
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    """Every module of faast and faast_kernels by dotted name (a package by its own name)."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The modules of faast / faast_kernels that `name` imports anywhere in its file (at import time, inside
    functions, or under TYPE_CHECKING: a circle is a circle whenever it closes)."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            # `from pkg import sub` imports the submodule sub when there is one, else a name of pkg itself.
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `import faast.ops.solve as s` -> faast.ops.solve
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _strip_ancestors(name: str, targets: set[str]) -> set[str]:
    # Importing faast.hf.x runs faast/__init__ and faast/hf/__init__ first; that edge from a submodule to its own
    # package is how Python imports work, not a design circle. Edges between sibling modules are what count.
    return {t for t in targets if not name.startswith(t + ".")}


def _cycle() -> list[str] | None:
    graph = {name: _strip_ancestors(name, targets) for name, targets in GRAPH.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_the_module_graph_finds_every_import_it_should():
    # The checks below are only as good as the graph: spot-check edges that exist.
    assert "faast.memory" in GRAPH["faast.hf.layers"]
    assert "faast.hf.capture" in GRAPH["faast.hf.hooks"]
    assert "faast.ops" in GRAPH["faast.memory"]
    assert len(MODULES) > 40


def test_no_import_circle():
    assert _cycle() is None, " -> ".join(_cycle())


def test_a_planted_circle_is_found(monkeypatch):
    monkeypatch.setitem(GRAPH, "faast.ops", GRAPH["faast.ops"] | {"faast.memory"})
    assert _cycle() is not None


def test_faast_kernels_never_imports_faast():
    kernels = [name for name in GRAPH if name.split(".")[0] == "faast_kernels"]
    offenders = {name: sorted(t for t in GRAPH[name] if t.split(".")[0] == "faast") for name in kernels}
    assert not any(offenders.values()), offenders


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_file_over_the_line_limit(package):
    long = {str(p.relative_to(ROOT)): n for p in PACKAGES[package].rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}  # fmt: skip
    assert not long, f"over {MAX_LINES} lines: {long}"


def _own_names(tree: ast.AST) -> set[str]:
    """Names bound to `cls(...)` inside a method: a class building an instance of itself owns its private state."""
    return {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name) and node.value.func.id == "cls"
        for target in node.targets
        if isinstance(target, ast.Name)
    }  # fmt: skip


def _private_writes(path: Path) -> list[str]:
    """`x._name = ...`, `x._name += ...`, `x._name[...] = ...` and `setattr(x, "_name", ...)` where x is not self, cls
    or an instance a classmethod built with cls(...): a module writing the private state of an object it does not
    own."""
    found = []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    own = {"self", "cls", *_own_names(tree)}
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            obj, attr = (node.args + [None, None])[:2]
            if isinstance(attr, ast.Constant) and isinstance(attr.value, str) and attr.value.startswith("_"):
                if not (isinstance(obj, ast.Name) and obj.id in own):
                    found.append(f"{path.name}:{node.lineno} setattr(..., {attr.value!r})")
            continue
        for target in targets:
            for t in ast.walk(target) if isinstance(target, ast.Tuple) else [target]:
                while isinstance(t, ast.Subscript):
                    t = t.value
                if not isinstance(t, ast.Attribute) or not t.attr.startswith("_") or t.attr.startswith("__"):
                    continue
                if isinstance(t.value, ast.Name) and t.value.id in own:
                    continue
                found.append(f"{path.name}:{node.lineno} {ast.unparse(t)}")
    return found


def test_no_module_writes_another_objects_private_attributes():
    found = [w for path in MODULES.values() for w in _private_writes(path)]
    assert not found, found


def test_a_planted_private_write_is_found(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f(layer, memory):\n    layer._tail = []\n    memory._buffers['gram'][0] = 1\n")
    assert _private_writes(planted) == ["planted.py:2 layer._tail", "planted.py:3 memory._buffers"]


# ---------------------------------------------------------------------------------------------------- the lab's code

LAB = ("experiments", "benchmarks", "examples")


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _lab_violations(path: Path) -> list[str]:
    """What a file of the lab (experiments/, benchmarks/, examples/) does outside faast's public API: importing a
    private faast module or name (a dotted component after `faast`, or an imported name, starting with `_`; dunders
    such as __version__ are public), and assigning to an attribute of a faast module (`output.MAX_STEP = ...`, also
    augmented, deleted, or through setattr/delattr) where the module was imported under that name (`import faast.x as
    m`, `from faast.x import m`, or the dotted `faast.x.y`). A tuned constant is varied by passing an OutputPolicy, not
    by rebinding the library's globals."""
    found: list[str] = []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules: set[str] = set()  # local names bound to faast modules anywhere in the file
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] != "faast":
                    continue
                if any(_private(p) for p in parts[1:]):
                    found.append(f"{path.name}:{node.lineno} import {alias.name}")
                modules.add(alias.asname or "faast")
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            parts = node.module.split(".")
            if parts[0] != "faast":
                continue
            if any(_private(p) for p in parts[1:]):
                found.append(f"{path.name}:{node.lineno} from {node.module} import ...")
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{path.name}:{node.lineno} from {node.module} import {alias.name}")
                elif f"{node.module}.{alias.name}" in MODULES:
                    modules.add(alias.asname or alias.name)

    def is_module(expr: ast.expr) -> bool:
        # a name bound to a faast module, or an attribute chain down from one (faast.hf.output_folds)
        while isinstance(expr, ast.Attribute):
            expr = expr.value
        return isinstance(expr, ast.Name) and expr.id in modules

    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [
                t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])
            ]
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.Call) and node.args:
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if name in ("setattr", "delattr") and is_module(node.args[0]):
                found.append(f"{path.name}:{node.lineno} {name}({ast.unparse(node.args[0])}, ...)")
            continue
        for target in targets:
            if isinstance(target, ast.Attribute) and is_module(target.value):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(target)} =")
    return found


def test_the_lab_uses_only_faasts_public_api():
    files = [p for folder in LAB for p in sorted((ROOT / folder).rglob("*.py")) if "results" not in p.parts]
    assert len(files) > 20
    found = [v for path in files for v in _lab_violations(path)]
    assert not found, found


def test_a_planted_lab_violation_is_found(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import faast.ops._dispatch\n"
        "from faast.hf import output_tuning as tuning, OutputPolicy\n"
        "from faast.ops import _autotune\n"
        "from faast.hf.output_tuning import _search\n"
        "import faast.hf.output_folds\n"
        "tuning.MAX_STEP = 8.0\n"
        "faast.hf.output_folds.FOLD_STEP_RATIO += 1\n"
        "setattr(tuning, 'GAP_MULTIPLE', 0)\n"
        "policy = OutputPolicy()\n"
        "policy.max_step = 1.0\n"  # an object, not a module: not this rule's
        "from faast import __version__\n"
    )
    assert _lab_violations(planted) == [
        "planted.py:1 import faast.ops._dispatch",
        "planted.py:3 from faast.ops import _autotune",
        "planted.py:4 from faast.hf.output_tuning import _search",
        "planted.py:6 tuning.MAX_STEP =",
        "planted.py:7 faast.hf.output_folds.FOLD_STEP_RATIO =",
        "planted.py:8 setattr(tuning, ...)",
    ]
