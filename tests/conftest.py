"""Shared fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from camshaft.models import default_model_dir, fetch_model

# Tests read the CLI's plain text and talk to servers on loopback: a CI's colour or proxy settings must not change
# either (set before anything imports typer or rich).
for _name in ("FORCE_COLOR", "PY_COLORS", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "GITHUB_ACTIONS", "TERMINAL_WIDTH"):
    os.environ.pop(_name, None)
for _name in ("NO_PROXY", "no_proxy"):
    os.environ[_name] = ",".join(filter(None, [os.environ.get(_name), "127.0.0.1", "localhost"]))

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a float32 HF checkpoint, fetched once into the camshaft cache and reused across runs."""
    return fetch_model(SMOLLM2, default_model_dir(SMOLLM2))


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CPU engine of SmolLM2-135M-Instruct, built once per test session."""
    from camshaft.builder.build import build_engine
    from camshaft.builder.config import BuildConfig

    out = tmp_path_factory.mktemp("smollm2") / "engine"
    build_engine(BuildConfig(smollm2_dir, out, max_seq_len=1024, max_num_tokens=256))
    return out


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_dir: Path):
    """transformers' float32 model of the same checkpoint: the numerics reference."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype="float32").eval()
