"""The shape of the source tree: no import circles, faast_kernels independent of faast, files small enough to read
in one sitting, no module writing another object's private attributes, no mixin in the output memory's package,
and no class of faast.hf reading state it does not own (docs/testing.md)."""

from __future__ import annotations

import ast
import re
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

# The lab's code (lab/pyproject.toml: the package faast_lab), its tests and the examples. The tests hand an experiment
# what it would otherwise take from a faast module through its arguments (main's load_model for a tiny model, an
# OutputPolicy, head_gradients' chunk) and patch only the lab's own modules or objects, never a faast module.
LAB = ("lab/experiments", "lab/benchmarks", "lab/tests", "examples")


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _lab_violations(path: Path) -> list[str]:
    """What a file of the lab (lab/experiments/, lab/benchmarks/, lab/tests/) or of examples/ does outside faast's
    public API: importing a private faast module or name (a dotted component after `faast`, or an imported name,
    starting with `_`; dunders such as __version__ are public), and assigning to an attribute of a faast module
    (`output.MAX_STEP = ...`, also augmented, deleted, or through setattr/delattr, monkeypatch's among them) where the
    module was imported under that name (`import faast.x as m`, `from faast.x import m`, or the dotted `faast.x.y`) or
    is named in a string target (`monkeypatch.setattr("faast.x.attr", ...)`). A tuned constant is varied by passing an
    OutputPolicy, not by rebinding the library's globals."""
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
        # a name bound to a faast module, or an attribute chain down from one (faast.hf.output.diagnosis)
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
            first = node.args[0]
            # monkeypatch.setattr("faast.x.y.attr", value): the dotted string names the module and its attribute
            named = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else ""
            if name in ("setattr", "delattr") and (is_module(first) or named.split(".")[0] == "faast"):
                found.append(f"{path.name}:{node.lineno} {name}({ast.unparse(first)}, ...)")
            continue
        for target in targets:
            if isinstance(target, ast.Attribute) and is_module(target.value):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(target)} =")
    return found


def test_the_lab_uses_only_faasts_public_api():
    files = [p for folder in LAB for p in sorted((ROOT / folder).rglob("*.py")) if "results" not in p.parts]
    assert len(files) > 20
    assert {"lm_domains.py", "test_gpu_check.py", "test_profile_read.py"} <= {p.name for p in files}
    found = [v for path in files for v in _lab_violations(path)]
    assert not found, found


# Where code finds other code: installed packages (faast, and the lab as faast_lab), and for the tests pytest's
# pythonpath setting (pyproject.toml), never a path inserted at run time. The examples run with faast installed.
SYS_PATH_FOLDERS = ("lab", "tests", "scripts", "examples")
SYS_PATH_EDIT = re.compile(r"sys\.path\.(insert|append|extend)\(|sys\.path(\[[^\]]*\])?\s*\+?=(?!=)")


def _sys_path_edits(path: Path) -> list[str]:
    """`file:line code` for each line that edits sys.path (insert, append, extend, or an assignment to it or to a slice
    of it), also inside code strings a test runs in a fresh interpreter (python -c); comments do not count."""
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if SYS_PATH_EDIT.search(line.split("#", 1)[0]):
            found.append(f"{path.name}:{number} {line.strip()}")
    return found


def test_no_file_edits_sys_path():
    files = [p for folder in SYS_PATH_FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
    files = [p for p in files if "results" not in p.parts and p != Path(__file__)]  # this file names the pattern
    assert len(files) > 100
    found = [edit for path in files for edit in _sys_path_edits(path)]
    assert not found, found


def test_a_planted_sys_path_edit_is_found(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import sys\n"
        "sys.path.insert(0, 'x')\n"
        "code = \"sys.path.append('tests')\"\n"
        "sys.path[:0] = ['a']\n"
        "print(sys.path[0])  # sys.path.insert(0, 'a comment')\n"
        "sys.path = []\n"
        "assert sys.path[0] == 'x'\n"
    )
    assert [f.split(" ", 1)[0] for f in _sys_path_edits(planted)] == ["planted.py:2", "planted.py:3", "planted.py:4",
                                                                      "planted.py:6"]  # fmt: skip


def test_a_planted_lab_violation_is_found(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import faast.ops._dispatch\n"
        "from faast.hf.output import tuning as tuning, OutputPolicy\n"
        "from faast.ops import _autotune\n"
        "from faast.hf.output.tuning import _search\n"
        "import faast.hf.output.diagnosis\n"
        "tuning.MAX_STEP = 8.0\n"
        "faast.hf.output.diagnosis.PART_STEP_RATIO += 1\n"
        "setattr(tuning, 'GAP_MULTIPLE', 0)\n"
        "policy = OutputPolicy()\n"
        "policy.max_step = 1.0\n"  # an object, not a module: not this rule's
        "from faast import __version__\n"
        "def test_x(monkeypatch, module, layer):\n"  # a lab test: monkeypatch's writes, by module or by name
        "    monkeypatch.setattr(tuning, 'MAX_STEP', 8.0)\n"
        "    monkeypatch.setattr('faast.hf.output.layer.head_gradients', print)\n"
        "    monkeypatch.delattr('faast.hf.default.load_base_model')\n"
        "    monkeypatch.setattr(module, 'BIAS_KAPPAS', (0.0,))\n"  # a lab module or an object: allowed
        "    monkeypatch.setattr(layer, 'gradients', print)\n"
        "    monkeypatch.setattr('faast_lab.experiments.lm_domains.run_domain', print)\n"
        "    monkeypatch.setenv('FAAST_BACKEND', 'x')\n"
    )
    assert _lab_violations(planted) == [
        "planted.py:1 import faast.ops._dispatch",
        "planted.py:3 from faast.ops import _autotune",
        "planted.py:4 from faast.hf.output.tuning import _search",
        "planted.py:6 tuning.MAX_STEP =",
        "planted.py:7 faast.hf.output.diagnosis.PART_STEP_RATIO =",
        "planted.py:8 setattr(tuning, ...)",
        "planted.py:13 setattr(tuning, ...)",
        "planted.py:14 setattr('faast.hf.output.layer.head_gradients', ...)",
        "planted.py:15 delattr('faast.hf.default.load_base_model', ...)",
    ]


# ------------------------------------------------------------------------------------- no mixins in faast.hf.output

OUTPUT_PACKAGE = PACKAGES["faast"] / "hf" / "output"
# The bases a class of faast.hf.output may name: library classes whose state the subclass owns or that hold none.
# A class of faast (a mixin such as the StepChoice base the layer once had, reading the layer's attributes) is not one.
LIBRARY_BASES = {"nn.Module", "torch.nn.Module", "object", "NamedTuple", "Protocol", "Enum", "Exception", "Warning",
                 "UserWarning", "RuntimeWarning", "ValueError", "RuntimeError"}  # fmt: skip


def _mixin_bases(path: Path) -> list[str]:
    """`file:line Class(Base)` for every base of a class in `path` that is not in LIBRARY_BASES."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ClassDef):
            found += [f"{path.name}:{node.lineno} {node.name}({ast.unparse(base)})" for base in node.bases
                      if ast.unparse(base) not in LIBRARY_BASES]  # fmt: skip
    return found


def test_no_class_of_the_output_package_inherits_from_a_mixin():
    files = sorted(OUTPUT_PACKAGE.glob("*.py"))
    assert {p.stem for p in files} >= {"layer", "step", "head", "state", "policy"}
    found = [v for path in files for v in _mixin_bases(path)]
    assert not found, found
    from faast.hf.output import ResidualOutputLayer
    from faast.hf.output.head import HeadBuffers

    for cls in (ResidualOutputLayer, HeadBuffers):  # each owns its state: no faast class above it
        assert [c for c in cls.__mro__ if c.__module__.startswith("faast")] == [cls], cls.__mro__


def test_a_planted_mixin_is_found(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("from torch import nn\nclass StepChoice:\n    pass\nclass Layer(StepChoice, nn.Module):\n"
                       "    pass\nclass Warned(UserWarning):\n    pass\n")  # fmt: skip
    assert _mixin_bases(planted) == ["planted.py:4 Layer(StepChoice)"]


# ------------------------------------------------------------------------------- each class of faast.hf owns its state

# Methods that register an attribute by name (nn.Module): `self.register_buffer("gram", ...)` defines `self.gram`.
_REGISTERS = {"register_buffer", "register_parameter", "register_module", "add_module"}


def _self_attributes(cls_node: ast.ClassDef, *, read: bool) -> dict[str, int]:
    """{attribute: first line} of `self.<attribute>` read (read=True) or assigned / registered (read=False) anywhere
    in a class body, nested functions included."""
    found: dict[str, int] = {}
    for n in ast.walk(cls_node):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
            if isinstance(n.ctx, ast.Load) == read:
                found.setdefault(n.attr, n.lineno)
        elif not read and isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            registers = n.func.attr in _REGISTERS and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"
            if registers and n.args and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str):
                found.setdefault(n.args[0].value, n.lineno)
    return found


def _class_node(path: Path, name: str) -> ast.ClassDef:
    return next(n for n in ast.parse(path.read_text(encoding="utf-8")).body
                if isinstance(n, ast.ClassDef) and n.name == name)  # fmt: skip


def _defined_attributes(cls: type) -> set[str]:
    """What an instance of `cls` has without anyone else's help: class-level names along its MRO (methods,
    properties, class variables), the attributes each faast class of the MRO assigns to self (or registers, or
    declares as a dataclass field), and those nn.Module's constructor sets."""
    import dataclasses
    import inspect

    from torch import nn

    names = set(dir(cls))
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] == "faast":
            names |= set(_self_attributes(_class_node(Path(inspect.getfile(klass)), klass.__name__), read=False))
            names |= {f.name for f in dataclasses.fields(klass)} if dataclasses.is_dataclass(klass) else set()
        elif klass is nn.Module:
            names |= set(vars(nn.Module()))
    return names


def _unowned_reads(path: Path, namespace: dict) -> list[str]:
    """`file:line Class reads self.x` for every attribute a class of `path` reads from self that neither it nor a
    class above it defines: a mixin reading state its subclass owns (as FaastModel's named-memory and stream-reading
    mixins once did), or a read answered only by the base model's delegation. `namespace`: the module's names."""
    found = []
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef):
            defined = _defined_attributes(namespace[node.name])
            reads = sorted(_self_attributes(node, read=True).items())
            found += [f"{path.name}:{line} {node.name} reads self.{a}" for a, line in reads if a not in defined]
    return found


def test_every_class_of_faast_hf_owns_the_state_it_reads():
    import importlib

    names = sorted(name for name in MODULES if name.startswith("faast.hf.") and not name.endswith(".__main__"))
    assert {"faast.hf.model", "faast.hf.named_memories", "faast.hf.reading", "faast.hf.modules"} <= set(names)
    found = [r for name in names for r in _unowned_reads(MODULES[name], vars(importlib.import_module(name)))]
    assert not found, found
    from faast.hf import FaastModel, FaastModuleModel
    from faast.hf.base import BaseModelDelegate, FaastModelBase

    for cls in (FaastModel, FaastModuleModel):  # the shared API is the only faast class above either model
        assert [c for c in cls.__mro__ if c.__module__.startswith("faast")] == [cls, FaastModelBase, BaseModelDelegate]


def test_a_planted_mixin_reading_its_subclass_state_is_found(tmp_path, monkeypatch):
    import sys
    import types

    planted = tmp_path / "planted.py"
    planted.write_text(
        "from torch import nn\n"
        "class Memories:\n"
        "    def names(self):\n"
        "        return self.memory_store.names\n"
        "class Model(Memories, nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.memory_store = object()\n"
        "        self.register_buffer('gram', None)\n"
        "    def read(self):\n"
        "        return self.gram, self.training, self.memory_store, self.names()\n"
    )
    module = types.ModuleType("faast.planted")  # a faast module: its classes' own assignments count
    module.__file__ = str(planted)
    monkeypatch.setitem(sys.modules, "faast.planted", module)
    exec(compile(planted.read_text(), str(planted), "exec"), vars(module))  # noqa: S102 - the planted source above
    assert _unowned_reads(planted, vars(module)) == ["planted.py:4 Memories reads self.memory_store"]
