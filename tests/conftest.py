"""Shared fixtures: the default model is loaded once per session and shared by every engine a test builds."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def model_fp32():
    """The default model as users get it: GGUF weights kept quantized, float32 activations."""
    from pagedllm.model.loader import load_model

    return load_model(None, "float32")


@pytest.fixture(scope="session")
def model_fp32_exact():
    """The default model kept quantized with float32 activations everywhere (--quantized-activations none)."""
    from pagedllm.model.loader import load_model

    return load_model(None, "float32", quantized_activations="none")


@pytest.fixture(scope="session")
def model_fp32_dense():
    """The default model dequantized to float32 (--quantization none): the exact path."""
    from pagedllm.model.loader import load_model

    return load_model(None, "float32", quantization="none")
