"""Documents to ingest: text / Markdown files and folders, or the default corpus (the Python language reference
that ships with every Python as `pydoc_data.topics`, one document per topic)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pagedllm.errors import UserError

TEXT_SUFFIXES = {".txt", ".md", ".markdown", ".rst", ".text"}


@dataclass(frozen=True)
class Document:
    source: str  # topic name for the default corpus, else the file path
    title: str
    text: str


def default_corpus(topics: list[str] | None = None) -> list[Document]:
    """One document per `pydoc_data.topics` topic (source = topic name, e.g. `with`)."""
    import pydoc_data.topics

    all_topics = pydoc_data.topics.topics
    names = sorted(all_topics) if topics is None else list(topics)
    docs = []
    for name in names:
        if name not in all_topics:
            raise UserError(f"unknown pydoc topic {name!r}")
        text = all_topics[name].strip()
        title = text.splitlines()[0].strip() if text else name
        docs.append(Document(source=name, title=title, text=text))
    return docs


def _title(path: Path, text: str) -> str:
    for line in text.splitlines():
        s = line.strip().lstrip("#").strip()
        if s:
            return s[:200]
    return path.stem


def load_paths(paths: list[str]) -> list[Document]:
    """Text and Markdown files; folders are walked for files with a text suffix (sorted, so order is stable)."""
    files: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            files.extend(sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES))
        elif path.is_file():
            files.append(path)
        else:
            raise UserError(f"no such file or folder: {p}")
    docs = []
    seen = set()
    for f in files:
        source = str(f)
        if source in seen:
            continue
        seen.add(source)
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{f} is not UTF-8 text ({e.reason})") from None
        docs.append(Document(source=source, title=_title(f, text), text=text))
    return docs
