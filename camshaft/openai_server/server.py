"""`camshaft serve --api openai`: the app on uvicorn (Ctrl-C / SIGTERM stop it cleanly)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import uvicorn

from camshaft.openai_server.app import create_app
from camshaft.runtime.llm import LLM

GRACEFUL_SHUTDOWN_S = 5  # open streams get this long to finish before they are cut


def build_server(engine: Path, *, host: str, port: int, llm_options: dict, log_level: str = "info",
                 model_name: str | None = None) -> tuple[uvicorn.Server, LLM]:
    """The uvicorn server and the LLM it serves (the caller closes the LLM after the server stops)."""
    llm = LLM(engine, spin_wait=False, **llm_options)
    try:
        app = create_app(llm, model_name or Path(engine).resolve().name)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="off")
        return uvicorn.Server(config), llm
    except BaseException:
        llm.close()
        raise


def serve(engine: Path, *, host: str, port: int, llm_options: dict, log: Callable[[str], None]) -> None:
    server, llm = build_server(engine, host=host, port=port, llm_options=llm_options)
    log(f"OpenAI API for model {Path(engine).resolve().name!r} at http://{host}:{port}/v1 "
        f"(health: /health, metrics: /metrics)")
    try:
        server.run()
    finally:
        llm.close()
