"""Imports run one way: cli → servers → runtime / builder → quantize → leaf modules. Checked on every import
statement in the source, including the lazy ones inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LEAF = {"camshaft", "camshaft.errors", "camshaft.manifest", "camshaft.model_config", "camshaft.outdir",
        "camshaft.version", "camshaft.models", "camshaft.gguf_wheel", "camshaft.weight_files", "camshaft.checks",
        "camshaft.hf_config", "camshaft.hf_fields", "camshaft.hf_rope", "camshaft.hf_archs", "camshaft.rope_config",
        "camshaft.graph_meta",
        "camshaft.engine_files", "camshaft.io_signature",
        "camshaft.float_model", "camshaft.cuda_gpu", "camshaft.trt_logger", "camshaft.stop_signals", "camshaft.ports",
        "camshaft.transformers_import"}
# package folder → the camshaft packages its modules may import (besides the leaf modules and itself)
ALLOWED = {
    "quantize": set(),
    "builder": {"camshaft.quantize"},
    "runtime": {"camshaft.quantize"},
    "camshaft/openai_server": {"camshaft.runtime"},
    "triton_repo": {"camshaft.runtime"},
    "camshaft/bench_serve": {"camshaft.runtime"},
}
OWN = {"quantize": "camshaft.quantize", "builder": "camshaft.builder", "runtime": "camshaft.runtime",
       "camshaft/openai_server": "camshaft.openai_server", "triton_repo": "camshaft.triton_repo",
       "camshaft/bench_serve": "camshaft.bench_serve"}


def camshaft_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {n for n in names if n == "camshaft" or n.startswith("camshaft.")}


def allowed(module: str, folder: str) -> bool:
    if module in LEAF:
        return True
    return any(module == p or module.startswith(p + ".") for p in ALLOWED[folder] | {OWN[folder]})


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_imports_run_one_way(folder):
    wrong = [f"{path.relative_to(REPO)} imports {module}"
             for path in sorted((REPO / folder).rglob("*.py"))
             for module in sorted(camshaft_imports(path)) if not allowed(module, folder)]
    assert not wrong, "\n".join(wrong)


def test_only_the_cli_layer_imports_nothing_below_it():
    sources = [p for p in REPO.rglob("*.py") if ".venv" not in p.parts and "tests" not in p.parts
               and "scripts" not in p.parts and (REPO / "camshaft" / "cli") not in p.parents
               and p != REPO / "camshaft" / "__main__.py"]  # `python -m camshaft`: the CLI's entry point
    assert [str(p.relative_to(REPO)) for p in sources if "camshaft.cli" in camshaft_imports(p)] == []
    leaves = [REPO / (name.replace("camshaft.", "camshaft/") + ".py") for name in LEAF - {"camshaft"}]
    for path in leaves:
        assert camshaft_imports(path) <= LEAF, path
