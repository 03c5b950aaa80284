"""Shared fixtures: the default model is loaded once per session and shared by every engine a test builds."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The reference is transformers' own torch code: no `kernels` layer from the hub in place of its modules (5.25 on).
os.environ.setdefault("USE_HUB_KERNELS", "NO")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one worker per core (pytest-xdist): a worker that also spread its matmuls over every core
    # would spin-wait against the others (torch's OpenMP threads, and the C kernels, which take torch's count).
    # Servers the tests start inherit the variable. tests/test_threads.py still runs the kernels on 2 threads.
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


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


@pytest.fixture(scope="module")
def one_thread():
    """For modules of tiny models (pytestmark usefixtures): their matrices are a few KB, and a second thread only
    adds spin-waits (10x slower on a busy machine)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def private_tokenizer_cache(tmp_path_factory):
    """GGUF tokenizers are cached by file path: keep a module's temporary files out of the user's cache."""
    import hashlib

    from pagedllm.model import tokenizer as tokenizer_module

    root = tmp_path_factory.mktemp("tokenizers")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            tokenizer_module,
            "cache_dir_for",
            lambda path, kind: str(root / hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]),
        )
        yield
