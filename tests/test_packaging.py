"""What a plain `pip install camshaft` brings: no torch (pinned in the extras that need it; an unpinned torch pulls a
multi-GB CUDA build), and what the runtime imports."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def required_by(requirements: list[str]) -> set[str]:
    """The distributions these requirements pull without extras, as the installed packages declare theirs."""
    todo, seen = [Requirement(r).name.lower() for r in requirements], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            declared = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo.extend(r.name.lower() for r in map(Requirement, declared)
                    if r.marker is None or r.marker.evaluate({"extra": ""}))
    return seen


def test_the_base_install_pulls_no_torch_and_has_jinja_for_chat_templates():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    base = required_by(project["dependencies"])
    assert "torch" not in base  # accelerate required an unpinned one
    assert "jinja2" in base  # transformers renders chat templates with it but declares it under an extra
    for extra, needs in project["optional-dependencies"].items():
        pins = {Requirement(r).name.lower(): str(Requirement(r).specifier) for r in needs}
        if "torch" in required_by(needs):
            assert pins.get("torch") == "==2.13.0", extra
