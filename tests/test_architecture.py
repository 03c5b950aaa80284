"""The shape docs/architecture.md describes, kept true: the module graph has no cycle and every import goes down
the layer order; bench/ and rag/ use only the public surface of the engine, model and KV packages (never a
private module); no function in pagedllm/ is over 60 lines."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pagedllm

ROOT = Path(pagedllm.__file__).parent
MAX_FUNCTION_LINES = 60
# Modules bench/ and rag/ may import besides their own packages (docs/architecture.md, "What may import what").
TOP_LEVEL = {
    "pagedllm",
    "pagedllm.errors",
    "pagedllm.sampling_params",
    "pagedllm.sse",
    "pagedllm.settings",
    "pagedllm.report",
    "pagedllm.lora_request",
}
PACKAGES = {"pagedllm.engine", "pagedllm.model", "pagedllm.kv"}  # their __all__ only
OWN = ("pagedllm.bench", "pagedllm.rag")
# Top to bottom, one package per layer (no layer is a part of a package): a module may import its own layer's
# modules and those below, never one above (docs/architecture.md, "What may import what"). The CLI commands parse
# flags and call the cluster or the server; the cluster builds on the server's OpenAI app; the server may serve
# RAG; bench and rag use the public API.
LAYERS = [
    ("pagedllm.entrypoints",),  # the CLI commands only
    ("pagedllm.cluster",),
    ("pagedllm.server",),
    ("pagedllm.bench",),
    ("pagedllm.rag",),
    ("pagedllm.__init__",),  # `from pagedllm import LLM, SamplingParams`
    ("pagedllm.engine",),
    ("pagedllm.model",),
    ("pagedllm.kv",),
    ("pagedllm.sampling_params", "pagedllm.lora_request", "pagedllm.settings", "pagedllm.sse", "pagedllm.report"),
    ("pagedllm.errors",),
]


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, imported names) of every import in a file, at any depth (lazy imports included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module, [a.name for a in node.names]))
    return found


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name: its __init__)."""
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _module_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports, lazy imports included. `from package import name` imports the
    package (its __init__ runs), and the submodule `name` if there is one; `import a.b.c` imports a.b.c."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = node.module
                if node.level:  # relative: from the importing module's package
                    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(package[: len(package) - node.level + 1] + [node.module])
                targets.update(t for t in [base] + [f"{base}.{a.name}" for a in node.names] if t in modules)
        graph[name] = targets - {name}
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def _layer(module: str) -> int:
    """Index in LAYERS of the longest prefix that names the module's layer."""
    name = "pagedllm.__init__" if module == "pagedllm" else module
    best = max(
        (prefix for layer in LAYERS for prefix in layer if name == prefix or name.startswith(prefix + ".")), key=len
    )
    return next(i for i, layer in enumerate(LAYERS) if best in layer)


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{a} imports {b}, a layer above it" for a in sorted(graph) for b in sorted(graph[a]) if _layer(b) < _layer(a)
    ]


def test_the_module_graph_has_no_cycle():
    cycle = _find_cycle(_module_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_go_down_the_layers():
    bad = _upward_imports(_module_graph())
    assert not bad, "imports against the layer order (docs/architecture.md):\n" + "\n".join(bad)


def test_each_layer_is_whole_top_level_packages():
    """No layer is a part of a package (the server is `pagedllm.server`, not a corner of `entrypoints`), and
    every module of the package is in one."""
    prefixes = [prefix for layer in LAYERS for prefix in layer]
    assert all(p.count(".") == 1 for p in prefixes), prefixes
    assert len(prefixes) == len(set(prefixes))
    top = {".".join(m.split(".")[:2]) for m in _modules() if m != "pagedllm"}
    assert top <= set(prefixes) | {"pagedllm.__init__"}, top - set(prefixes)


def test_the_graph_rules_catch_a_cycle_and_an_upward_import():
    graph = {
        "pagedllm.model": {"pagedllm.model.loader"},
        "pagedllm.model.loader": {"pagedllm.model"},
        "pagedllm.cluster.launch": {"pagedllm.entrypoints.cli"},
    }
    assert _find_cycle(graph) == ["pagedllm.model", "pagedllm.model.loader", "pagedllm.model"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None
    assert _upward_imports(graph) == ["pagedllm.cluster.launch imports pagedllm.entrypoints.cli, a layer above it"]
    assert _layer("pagedllm.server.protocol") > _layer("pagedllm.cluster.app") > _layer("pagedllm.entrypoints.serve")


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


# model/'s rooms, top to bottom (docs/architecture.md, "model/ in rooms"): a module imports its own room and the
# rooms below, never one above. model/'s own modules load and run a model (loader, runner, the fused step, the
# weights into the decoder, the tokenizer); the decoder's layers read its config; the config reads files
# (formats/) as the families describe them; the kernels know nothing of models.
MODEL_ROOMS = [
    ("pagedllm.model.__init__", "pagedllm.model.loader", "pagedllm.model.runner", "pagedllm.model.fused_step"),
    ("pagedllm.model.lora",),  # adapters: read with weights.py's names, hooked into the layers
    ("pagedllm.model.weights", "pagedllm.model.tokenizer", "pagedllm.model.params", "pagedllm.model.sampler"),
    ("pagedllm.model.layers",),
    ("pagedllm.model.config", "pagedllm.model.default_model"),
    ("pagedllm.model.formats",),
    ("pagedllm.model.families",),
    ("pagedllm.model.kernels",),
]


def _room(module: str) -> int | None:
    name = "pagedllm.model.__init__" if module == "pagedllm.model" else module
    for i, room in enumerate(MODEL_ROOMS):
        if any(name == prefix or name.startswith(prefix + ".") for prefix in room):
            return i
    return None


def _upward_in_model(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for a in sorted(m for m in graph if m == "pagedllm.model" or m.startswith("pagedllm.model.")):
        for b in sorted(graph[a]):
            ra, rb = _room(a), _room(b)
            if ra is not None and rb is not None and rb < ra:
                bad.append(f"{a} imports {b}, a room above it")
    return bad


def test_model_is_in_rooms_and_imports_go_down_them():
    modules = {m: p for m, p in _modules().items() if m.startswith("pagedllm.model")}
    unplaced = [m for m in modules if _room(m) is None]
    assert not unplaced, f"model/ modules outside every room: {unplaced}"
    bad = _upward_in_model(_module_graph())
    assert not bad, "imports against model/'s rooms (docs/architecture.md):\n" + "\n".join(bad)


def test_the_room_rule_catches_an_upward_import():
    graph = {"pagedllm.model.kernels.quant_linear": {"pagedllm.model.layers.linear"}}
    assert _upward_in_model(graph) == [
        "pagedllm.model.kernels.quant_linear imports pagedllm.model.layers.linear, a room above it"
    ]
    assert _room("pagedllm.model") == 0 and _room("pagedllm.model.kernels") == len(MODEL_ROOMS) - 1


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
    assert _violation("pagedllm.server.protocol", ["CompletionRequest"]) is not None
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


def test_benchmarks_and_devkit_never_import_the_tests():
    """The benchmarks and the tests share devkit/ (synthetic checkpoints, blocks, the browser); neither a
    benchmark nor devkit reaches into tests/, and no benchmark edits sys.path to find a module."""
    repo = ROOT.parent
    test_modules = {p.stem for p in (repo / "tests").glob("*.py")}
    bad = []
    for path in sorted((repo / "benchmarks").rglob("*.py")) + sorted((repo / "devkit").rglob("*.py")):
        text = path.read_text()
        bad += [f"{path.relative_to(repo)}:{line} imports {m}" for line, m, _ in _imports(path) if m in test_modules]
        if "sys.path.insert" in text:
            bad.append(f"{path.relative_to(repo)} edits sys.path")
    assert not bad, "\n".join(bad)
