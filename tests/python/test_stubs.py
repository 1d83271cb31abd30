"""The type stubs shipped with the package: _core.pyi parses and covers the module; py.typed is there."""

import ast
import enum
import os

import tierzero
from tierzero import _core

PKG = os.path.dirname(tierzero.__file__)


def stub_tree():
    path = os.path.join(PKG, "_core.pyi")
    assert os.path.isfile(path), f"{path} is missing from the installed package"
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path)


def test_stub_parses_and_names_every_public_member():
    tree = stub_tree()
    top = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    top |= {t.id for n in tree.body if isinstance(n, ast.AnnAssign) for t in [n.target] if isinstance(t, ast.Name)}
    public = {name for name in dir(_core) if not name.startswith("_")}
    assert public <= top, f"not in _core.pyi: {sorted(public - top)}"
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    for name, node in classes.items():
        cls = getattr(_core, name)
        stubbed = {m.name for m in node.body if isinstance(m, ast.FunctionDef)}
        if issubclass(cls, enum.Enum):
            stubbed = {t.id for m in node.body if isinstance(m, ast.Assign) for t in m.targets}
            real = set(cls.__members__)
        else:
            real = {m for m in vars(cls) if not m.startswith("_")}
        assert real <= stubbed, f"{name}: not in _core.pyi: {sorted(real - stubbed)}"


def test_stub_states_array_arguments_and_defaults():
    tree = stub_tree()
    step = next(m for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CpuOptimizer"
                for m in n.body if isinstance(m, ast.FunctionDef) and m.name == "step")
    args = {a.arg: ast.unparse(a.annotation) for a in step.args.args if a.annotation is not None}
    assert "NDArray" in args["param"] and "writable=False" in args["grad"]
    assert ast.get_docstring(step) and "float32" in ast.get_docstring(step)


def test_package_is_typed():
    assert os.path.isfile(os.path.join(PKG, "py.typed"))
