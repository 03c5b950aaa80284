"""Shared fixtures: the default model is loaded once per session and shared by every engine a test builds."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def model_fp32():
    from pagedllm.model.loader import load_model

    return load_model(None, "float32")
