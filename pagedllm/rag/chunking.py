"""Split a document into chunks measured in the LLM's tokens, on paragraph, then sentence, then token boundaries."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass

_PARA = re.compile(r"\n\s*\n")
_SENT = re.compile(r"(?<=[.!?:;])\s+(?=\S)")


@dataclass(frozen=True)
class Chunk:
    chunk_id: str  # stable: a hash of source + text
    source: str
    title: str
    position: int  # index of the chunk within its source
    text: str
    num_tokens: int

    def to_dict(self) -> dict:
        return asdict(self)


def chunk_id(source: str, text: str) -> str:
    return hashlib.sha256(f"{source}\0{text}".encode()).hexdigest()[:16]


def _units(text: str, count: Callable[[str], int], size: int) -> list[tuple[str, int, str]]:
    """Pieces no longer than `size` tokens, each with its token count and the separator that joins it to the
    previous piece: paragraphs; a paragraph too long is split into sentences; a sentence too long into tokens."""
    out: list[tuple[str, int, str]] = []
    for para in _PARA.split(text):
        if not para.strip():
            continue
        para = para.rstrip()
        n = count(para)
        if n <= size:
            out.append((para, n, "\n\n"))
            continue
        first = True
        for sent in _SENT.split(para):
            n = count(sent)
            sep = "\n\n" if first else " "
            first = False
            if n <= size:
                out.append((sent, n, sep))
                continue
            # a "sentence" longer than a chunk (a table, a long code line): cut by characters on a token budget
            step = max(1, int(len(sent) * size / n * 0.9))
            for i in range(0, len(sent), step):
                piece = sent[i : i + step]
                out.append((piece, count(piece), sep if i == 0 else ""))
    return out


def chunk_text(
    source: str,
    title: str,
    text: str,
    count_tokens: Callable[[str], int],
    chunk_size: int = 256,
    chunk_overlap: int = 32,
) -> list[Chunk]:
    """Greedy packing of pieces up to `chunk_size` tokens; each new chunk starts with whole trailing pieces of the
    previous one worth at most `chunk_overlap` tokens. Token counts add the pieces' counts (a close estimate)."""
    if chunk_size < 16:
        raise ValueError("chunk size must be at least 16 tokens")
    if not 0 <= chunk_overlap < chunk_size // 2:
        raise ValueError("chunk overlap must be >= 0 and less than half the chunk size")
    units = _units(text, count_tokens, chunk_size)
    groups: list[list[tuple[str, int, str]]] = []
    cur: list[tuple[str, int, str]] = []
    cur_n = 0
    fresh = 0  # pieces in `cur` that are not overlap
    for u in units:
        if cur and cur_n + u[1] > chunk_size:
            groups.append(cur)
            carry: list[tuple[str, int, str]] = []
            carry_n = 0
            for prev in reversed(cur):
                if carry_n + prev[1] > chunk_overlap or carry_n + prev[1] + u[1] > chunk_size:
                    break
                carry.insert(0, prev)
                carry_n += prev[1]
            cur, cur_n = carry, carry_n
            fresh = 0
        cur.append(u)
        cur_n += u[1]
        fresh += 1
    if cur and fresh:
        groups.append(cur)
    chunks = []
    for pos, g in enumerate(groups):
        body = g[0][0] + "".join(sep + t for t, _, sep in g[1:])
        chunks.append(Chunk(chunk_id(source, body), source, title, pos, body, sum(n for _, n, _ in g)))
    return chunks
