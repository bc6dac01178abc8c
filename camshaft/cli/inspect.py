"""camshaft inspect: what an engine directory holds and whether it runs here."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from camshaft.cli import app, require_stdout


@app.command("inspect")
def inspect_engine(
    engine: Annotated[Path, typer.Option(help="Engine directory")],
    json_output: Annotated[bool, typer.Option("--json", help="Print it as JSON")] = False,
) -> None:
    """Describe an engine (model, precision, target, limits, KV cache, files, tools) and whether it runs here.

    Its files are checked as loading checks them. Exit status 1 when it does not run here."""
    require_stdout()
    import json

    from camshaft.runtime.engine_info import engine_info, info_lines

    info = engine_info(engine)
    typer.echo(json.dumps(info, indent=2) if json_output else "\n".join(info_lines(info)))
    if not info["runs_here"]:
        raise typer.Exit(1)
