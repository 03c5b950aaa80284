"""Structured outputs in the engine: grammars compiled off the step path, a matcher per sample that follows its
tokens, and the token bitmask of every constrained row of a step (vLLM v1's StructuredOutputManager, on
llguidance).

A request's grammar compiles on a worker thread; until it is ready the scheduler leaves the request waiting
(vLLM's WAITING_FOR_FSM), so a slow schema never stalls the requests already running. Compiled grammars are
cached by their text: a matcher fresh from the cache is copied (`deep_copy`) for each sample, which costs
microseconds. The matcher only ever holds the tokens the request really has: drafts are consumed to compute the
masks after them and rolled back at once; preemption keeps a request's tokens, so its matcher stays right.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

import numpy as np
import torch

from pagedllm.errors import UserError
from pagedllm.model.tokenizer import Tokenizer

logger = logging.getLogger("pagedllm")


class Constrained(Protocol):
    """What masking reads of a request (engine.Request fits): its grammar and the drafts to mask after."""

    request_id: str
    grammar: RequestGrammar | None
    spec_token_ids: list[int]


CACHE_SIZE = 256  # compiled grammars kept (a compiled JSON schema takes tens to hundreds of KiB)


class GrammarDeadEnd(UserError):
    """The grammar needs what no token of this model's vocabulary can produce (e.g. a byte that SmolLM2's
    byte-level vocabulary lacks, such as 0xF2): the request asked for output the model cannot write."""


def dead_end(matcher: Any, what: str) -> GrammarDeadEnd:
    reason = (matcher.get_error() or "no token is allowed").splitlines()[0]
    return GrammarDeadEnd(
        "the structured output cannot be written with this model's vocabulary within llguidance's limits: "
        f"{what} ({reason.strip()})"
    )


class GrammarCompiler:
    """Compiles grammars on one worker thread, keeping the last CACHE_SIZE by their text; times every compile."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._ll_tokenizer: Any = None  # built by the worker on first use (~0.4 s for a 49k vocabulary)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._cache: OrderedDict[str, Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.compile_seconds: list[float] = []  # each compile's time, for benchmarks
        self.cache_hits = 0
        self.mask_seconds = 0.0  # time spent computing and applying masks in steps
        self.mask_rows = 0

    def compile(self, grammar: str) -> Future[Any]:
        """A future of the compiled grammar (an LLMatcher that is never advanced; samples copy it)."""
        with self._lock:
            fut = self._cache.get(grammar)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(grammar)
                self.cache_hits += 1
                return fut
            fut = self._cache[grammar] = self._executor.submit(self._build, grammar)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return fut

    def _build(self, grammar: str) -> Any:
        from llguidance import LLMatcher

        start = time.perf_counter()
        if self._ll_tokenizer is None:
            import llguidance.hf

            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                self._tokenizer.hf, n_vocab=self._vocab_size, eos_token=self._tokenizer.eos_token_ids or None
            )
            start = time.perf_counter()
        matcher = LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the grammar does not compile: {matcher.get_error()}")
        self.compile_seconds.append(time.perf_counter() - start)
        return matcher

    def constrain(
        self, to_sample: Sequence[tuple[Constrained, torch.Tensor]], logits: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Exception]]:
        """Structured outputs: every constrained row's logits masked to what its grammar allows (the sampled
        token, and the logprobs reported, come from that distribution), in float32 as the sampler takes them.
        Per request, the error of a grammar that failed (its request fails; the others sample)."""
        spans, start = [], 0
        for req, lg in to_sample:
            if req.grammar is not None:
                spans.append((req, start, len(lg), req.grammar))
            start += len(lg)
        if not spans:
            return logits, {}
        began = time.perf_counter()
        logits = logits.float()
        bitmask = new_bitmask(sum(span[2] for span in spans), logits.shape[-1])
        rows: list[int] = []
        mask_rows: list[int] = []
        failed: dict[str, Exception] = {}
        at = 0
        for req, first, n, grammar in spans:
            try:
                grammar.fill_masks(bitmask, at, req.spec_token_ids)
                rows.extend(range(first, first + n))
                mask_rows.extend(range(at, at + n))
            except Exception as e:  # noqa: BLE001 - a grammar that failed to compile or refused a token
                failed[req.request_id] = e
            at += n
        if rows:
            apply_bitmask(logits, rows, bitmask[mask_rows])
        self.mask_seconds += time.perf_counter() - began
        self.mask_rows += len(rows)
        return logits, failed

    def wait_any(self, grammars: list[RequestGrammar], timeout: float) -> None:
        """Block until one of these grammars is compiled (or `timeout`): the step loop has nothing else to do."""
        wait([g.future for g in grammars], timeout, return_when="FIRST_COMPLETED")

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One sample's matcher, made from the compiled grammar once it is ready and advanced by its tokens."""

    def __init__(self, future: Future[Any]) -> None:
        self.future = future
        self._matcher: Any = None

    @property
    def ready(self) -> bool:
        """Compiled, or failed to compile (the request then fails at its first sampling, naming the reason)."""
        return self.future.done()

    @property
    def matcher(self) -> Any:
        if self._matcher is None:
            self._matcher = self.future.result().deep_copy()
        return self._matcher

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many of the drafts the grammar allows, in order: the rest are cut before they are verified."""
        if not drafts or self.future.exception() is not None:
            return 0
        return self.matcher.validate_tokens(drafts)

    def fill_masks(self, bitmask: np.ndarray, first_row: int, drafts: list[int]) -> None:
        """Rows first_row.. of `bitmask`: the tokens allowed now, then after each draft (consumed, then rolled
        back)."""
        m = self.matcher
        row_bytes = bitmask.shape[1] * bitmask.itemsize
        consumed = 0
        for j in range(len(drafts) + 1):
            m.unsafe_compute_mask_ptr(bitmask[first_row + j].ctypes.data, row_bytes)
            if m.is_error() or not bitmask[first_row + j].any():  # e.g. past llguidance's parser limits
                raise dead_end(m, "the grammar allows no token here")
            if j < len(drafts):
                if not m.consume_token(drafts[j]):
                    raise RuntimeError(f"the grammar refused draft token {drafts[j]}: {m.get_error()}")
                consumed += 1
        if consumed:
            m.rollback(consumed)

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; True once the grammar is complete (nothing but EOS may follow)."""
        m = self.matcher
        if not m.consume_token(token):  # a token its own mask allowed: llguidance's mask cannot be followed
            raise dead_end(m, f"the grammar refused token {token}, which its mask allowed")
        return m.is_stopped()


def new_bitmask(rows: int, vocab: int) -> np.ndarray:
    """All tokens allowed, a row of int32 words per sampled position (llguidance writes the rows)."""
    return np.full((rows, (vocab + 31) // 32), -1, dtype=np.int32)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
    """-inf, in place, at the tokens each listed row's mask forbids (bit t of the int32 words = token t).

    In numpy on a CPU: it runs on the calling thread alone. A torch op here would hand work to torch's OpenMP
    threads while the fused step's own OpenMP threads still spin after the forward pass (measured: 45x slower)."""
    vocab = logits.shape[-1]
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
    if bits.shape[1] < vocab:
        bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
    forbidden = bits[:, :vocab] == 0
    if logits.device.type != "cpu":
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        mask = torch.from_numpy(forbidden).to(logits.device)
        logits.index_copy_(0, index, logits[index].masked_fill_(mask, float("-inf")))
        return
    values = logits.numpy()
    sub = values[rows]
    np.copyto(sub, np.float32(-np.inf), where=forbidden)
    values[rows] = sub
