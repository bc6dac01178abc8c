"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from camshaft.models import default_model_dir, fetch_model

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a float32 HF checkpoint, fetched once into the camshaft cache and reused across runs."""
    return fetch_model(SMOLLM2, default_model_dir(SMOLLM2))
