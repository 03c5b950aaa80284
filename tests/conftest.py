"""Shared fixtures: the default model is loaded once per session and shared by every engine a test builds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Builds every CPU class this machine can run, beside the first tests (see pytest_collection_finish).
_BUILD_CLASSES = (
    "import os\n"
    "try:\n"  # only on a core the tests leave idle, whatever priority the run has (chrt -f included)
    "    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
    "except (AttributeError, OSError):\n"
    "    os.nice(19)\n"
    "from pagedllm.model.kernels import cpu_kernel\n"
    "for t in cpu_kernel.runnable_targets()[1:]: cpu_kernel.load(t)\n"
)
_class_builds: list[subprocess.Popen] = []


def pytest_collection_finish(session):
    """Start building the kernels of the other CPU classes (x86-64-v4 / v3 / portable; native is built while
    the test files are imported) in a subprocess that runs only on idle cores (SCHED_IDLE: at nice 19 it still
    took a share from the tests, and a real-time run's children ignore nice), when the run includes the tests of
    every class. Why: each class is a from-scratch C build, ~10 s of both cores apiece on a 2-core machine when
    the test that needs it builds it; most tests before those keep one core busy, so the builds fit beside them.
    The builds land in the usual cache (PAGEDLLM_CACHE), where the tests' own load() finds them; a build that
    fails there is built again, and fails, in the test that needs it."""
    from kernel_helpers import KERNEL_EXPECTED

    files = {item.path.name for item in session.items}
    if KERNEL_EXPECTED and "test_cpu_targets.py" in files and len(files) > 1:
        root = str(session.config.rootpath)  # this tree's pagedllm, as the tests import it
        env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        build = subprocess.Popen(
            [sys.executable, "-c", _BUILD_CLASSES],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its compilers with it, should the run stop first
        )
        _class_builds.append(build)


def pytest_unconfigure(config):
    for proc in _class_builds:  # a run cut short: no compiler left behind
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="session")
def cpu_class_builds():
    """Waits for the builds pytest_collection_finish started (if any), so that no test builds a class twice."""
    for proc in _class_builds:
        proc.wait()


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
