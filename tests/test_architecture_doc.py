"""docs/architecture.md names modules, classes, functions and files; this keeps every such name true. A renamed
class or a moved module fails here with the stale name, so the page cannot drift from the code again (it once
named `LlamaForCausalLM.hidden_states` long after the class became `decoder.CausalLM`).

What is checked, of each `code span` in the page:
- a path (`kv/hashing.py`, `model/families/`, `csrc/model_step.c`, `engine_helpers.py`): a file or folder of the
  repository, under its root, `tests/`, `pagedllm/` or any package folder;
- a dotted name (`attention.step_index`, `ModelRunner.read_block`, `pagedllm.settings`): where its head is one
  of pagedllm's modules or classes, or class-like, the rest is defined there (a module's top-level name or a
  class's method or attribute); a lowercase head of no module of ours is a checkpoint's tensor name
  (`experts.gate_up_proj`);
- a class-like name (`PrometheusStatLogger`, `StepLayer`): a class or constant defined in pagedllm, or a C
  struct of its headers;
- a snake_case name with an underscore (`rope_and_store`, `add_engine_args`): an identifier in pagedllm's
  sources (Python or C).
Names of other projects (vLLM's `SlidingWindowManager`, Ray's `RequestRouter`) are listed in EXTERNAL.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pagedllm

PACKAGE = Path(pagedllm.__file__).parent
REPO = PACKAGE.parent
DOC = REPO / "docs" / "architecture.md"
# Names the page cites from other projects (vLLM, Ray Serve, FastAPI, Python), never defined here.
EXTERNAL = {
    "APIRouter",
    "Literal",
    "RequestRouter",
    "KVEventBatch",
    "SlidingWindowManager",
    "KVCacheManager.trim",
    "argparse.Namespace",
    "pydantic.ByteSize",
    "routing_context.should_backoff",
    "app.state.embedders",
    "entrypoints/openai",
    "v1/metrics/loggers.py",
    "1_Pooling/config.json",
    "modules.json",
    "match_rate_threshold",
    "max_ongoing_requests",
    "choose_replicas",
    "include_router",
    "matryoshka_dimensions",
    "is_matryoshka",
    "last_hidden_state",
    "cache_aware",
}
_PATH = re.compile(r"^[\w.-]+(/[\w.-]+)*(/|\.(py|c|h|json|toml))$")
_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
_CLASS_LIKE = re.compile(r"^[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*$")
_SNAKE = re.compile(r"^_?[a-z][a-z0-9]*(_[a-z0-9]+)+$")


def _spans() -> set[str]:
    """Each code span, a call's arguments and a `path: Name` suffix cut off."""
    out = set()
    for span in re.findall(r"`([^`\n]+)`", DOC.read_text()):
        span = re.sub(r"\(.*\)$", "", span.split(": ")[0].strip())
        out.add(span)
    return out


@cache
def _index() -> tuple[dict[str, list[ast.Module]], dict[str, set[str]], set[str]]:
    """(module base name -> parsed modules, class name -> its members, every name defined at a module's top)."""
    modules: dict[str, list[ast.Module]] = {}
    classes: dict[str, set[str]] = {}
    top: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        name = path.parent.name if path.name == "__init__.py" else path.stem
        modules.setdefault(name, []).append(tree)
        top |= _defined(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, set()).update(_members(node))
    return modules, classes, top


def _defined(tree: ast.Module) -> set[str]:
    """Names a module defines or imports at its top level."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _members(cls: ast.ClassDef) -> set[str]:
    """A class's methods, class attributes and the attributes its methods set on self."""
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


@cache
def _c_types() -> set[str]:
    """The structs the C headers name (`typedef struct { ... } StepLayer;`)."""
    return {m for path in PACKAGE.rglob("*.h") for m in re.findall(r"}\s*(\w+)\s*;", path.read_text())}


@cache
def _identifiers() -> set[str]:
    words: set[str] = set()
    for pattern in ("*.py", "*.c", "*.h"):
        for path in PACKAGE.rglob(pattern):
            words |= set(re.findall(r"[A-Za-z_]\w*", path.read_text()))
    return words


def _path_exists(span: str) -> bool:
    rel = span.rstrip("/")
    roots = [REPO, PACKAGE, REPO / "tests"] + [p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__"]
    return any((root / rel).exists() for root in roots)


def _dotted_exists(span: str) -> bool:
    modules, classes, _ = _index()
    head, *rest = span.split(".")
    if head == "pagedllm":
        path = PACKAGE.joinpath(*rest)
        if path.is_dir() or path.with_suffix(".py").exists():
            return True
        parent = PACKAGE.joinpath(*rest[:-1])
        file = parent / "__init__.py" if parent.is_dir() else parent.with_suffix(".py")
        return file.exists() and rest[-1] in _defined(ast.parse(file.read_text()))
    if head in classes:
        return rest[0] in classes[head]
    if head in modules:
        if (PACKAGE / head).is_dir() or any(p.name == head for p in PACKAGE.rglob(head) if p.is_dir()):
            return _dotted_exists("pagedllm." + _package_path(head) + "." + ".".join(rest))
        if any(rest[0] in _defined(tree) for tree in modules[head]):
            return len(rest) == 1 or rest[1] in classes.get(rest[0], {rest[1]}) or rest[0] in modules
        return False
    return not _CLASS_LIKE.match(head)  # a lowercase head of no module of ours: a checkpoint's key, not a name


def _package_path(name: str) -> str:
    """The dotted path under pagedllm of the package folder called `name` (`kv`, `server`, `tool_parsers`)."""
    folder = next(p for p in sorted(PACKAGE.rglob(name)) if p.is_dir())
    return ".".join(folder.relative_to(PACKAGE).parts)


def _stale(span: str) -> bool:
    """Whether a span names something of pagedllm's that does not exist (False: it does, or it is not a name)."""
    if span in EXTERNAL or " " in span:
        return False
    if _PATH.match(span):
        return not _path_exists(span)
    if _DOTTED.match(span):
        return not _dotted_exists(span)
    if _CLASS_LIKE.match(span):
        _, classes, top = _index()
        return span not in classes and span not in top and span not in _c_types()
    if _SNAKE.match(span):
        return span not in _identifiers()
    return False


def test_every_name_the_architecture_page_gives_exists():
    stale = sorted(s for s in _spans() if _stale(s))
    assert not stale, f"docs/architecture.md names what the code no longer has: {stale}"


def test_the_check_sees_a_stale_name():
    """The checker itself: each kind of name it checks is caught when wrong, and passes when right."""
    wrong_names = ("LlamaForCausalLM.hidden_states", "kv/no_such.py", "NoSuchManager", "no_such_function", "kv.no_such")
    for wrong in wrong_names:
        assert _stale(wrong), wrong
    for right in ("decoder.CausalLM", "kv/hashing.py", "ModelRunner.read_block", "pagedllm.settings", "kv.sizing"):
        assert not _stale(right), right
