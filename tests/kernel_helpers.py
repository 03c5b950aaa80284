"""Where the C kernels are meant to exist: skipped only without a C compiler (or with the torch path forced);
where a compiler exists, a kernel that fails to build fails the tests that need it instead of skipping them."""
from __future__ import annotations

import os
import shlex
import shutil

import pytest

CC = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
KERNEL_EXPECTED = bool(CC[0]) and os.environ.get("PAGEDLLM_ATTENTION", "").lower() != "torch"
needs_kernel = pytest.mark.skipif(not KERNEL_EXPECTED, reason="no C compiler: the kernel is not built here")
