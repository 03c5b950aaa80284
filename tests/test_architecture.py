"""The shape docs/architecture.md describes, kept true: bench/ and rag/ use only the public surface of the
engine, model and KV packages (never a private module), and no function in pagedllm/ is over 60 lines."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pagedllm

ROOT = Path(pagedllm.__file__).parent
MAX_FUNCTION_LINES = 60
# Modules bench/ and rag/ may import besides their own packages (docs/architecture.md, "What may import what").
TOP_LEVEL = {"pagedllm", "pagedllm.errors", "pagedllm.sampling_params", "pagedllm.sse"}
PACKAGES = {"pagedllm.engine", "pagedllm.model", "pagedllm.kv"}  # their __all__ only
OWN = ("pagedllm.bench", "pagedllm.rag")


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, imported names) of every import in a file, at any depth (lazy imports included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module, [a.name for a in node.names]))
    return found


def _violation(module: str, names: list[str]) -> str | None:
    """What an import reaches that it may not, or None."""
    if not module.startswith("pagedllm") or module.startswith(OWN) or module in TOP_LEVEL - {"pagedllm"}:
        return None
    if module == "pagedllm":  # `from pagedllm import LLM` or a whole public package (`from pagedllm import kv`)
        allowed = set(pagedllm.__all__) | {m.split(".")[1] for m in PACKAGES | TOP_LEVEL | set(OWN) if "." in m}
        private = [n for n in names if n not in allowed]
        return f"pagedllm.{private[0]}" if private else None
    if module in PACKAGES:
        public = importlib.import_module(module).__all__
        private = [n for n in names if n not in public]
        return f"{module}.{private[0]} (not in its __all__)" if private else None
    return module


def test_bench_and_rag_import_only_public_surfaces():
    bad = []
    for path in sorted((ROOT / "bench").rglob("*.py")) + sorted((ROOT / "rag").rglob("*.py")):
        for line, module, names in _imports(path):
            why = _violation(module, names)
            if why:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {why}")
    assert not bad, "bench/ and rag/ reach past the public API (docs/architecture.md):\n" + "\n".join(bad)


def test_the_rule_catches_a_private_import():
    assert _violation("pagedllm.kv.manager", ["PagedKVCacheManager"]) == "pagedllm.kv.manager"
    assert _violation("pagedllm.model", ["cpu_kernel"]) is not None
    assert _violation("pagedllm.entrypoints.openai.protocol", ["CompletionRequest"]) is not None
    assert _violation("pagedllm.kv", ["PagedKVCacheManager"]) is None
    assert _violation("pagedllm", ["LLM", "kv"]) is None


def test_no_function_over_60_lines():
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}() is {lines} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)
