"""The scripts BENCHMARKS.md's numbers come from import what camshaft has (their imports sit inside functions, so a
renamed helper broke scripts/bench_throughput.py only when it ran)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parent.parent / "scripts").glob("*.py"))


def _top_level_names(script: Path) -> set[str]:
    names = set()
    for node in ast.parse(script.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_every_camshaft_name_a_script_imports_exists(script):
    missing = []
    siblings = {path.stem: path for path in SCRIPTS}
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module in siblings:  # another script's helpers
            defined = _top_level_names(siblings[node.module])
            missing += [f"{node.module}.{a.name}" for a in node.names if a.name not in defined]
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "camshaft":
            try:
                module = importlib.import_module(node.module)
            except ImportError as exc:
                if exc.name and exc.name.split(".")[0] != "camshaft":  # an optional extra (tensorrt, llama_cpp)
                    continue
                raise
            missing += [f"{node.module}.{a.name}" for a in node.names
                        if not hasattr(module, a.name) and not _is_submodule(node.module, a.name)]
    assert not missing, f"{script.name} imports names that are not there: {missing}"


def _is_submodule(package: str, name: str) -> bool:
    try:
        importlib.import_module(f"{package}.{name}")
    except ImportError:
        return False
    return True
