"""AsyncLLMEngine over a fake LLMEngine (no model): one loop for all callers, aborts on early exit, add errors
reach the caller, the waiting limit, shutdown. Fast; the real-model server tests are in test_server.py."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import pytest

from pagedllm.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineShuttingDownError,
    RequestAbortedError,
    TooManyWaitingRequestsError,
)
from pagedllm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.engine.stats import EngineStats
from pagedllm.errors import UserError
from pagedllm.model.config import ModelConfig


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)


class FakeEngine:
    """One token per running request per step; each running request holds one block per 4 tokens."""

    max_model_len = 64
    tokenizer = None  # prompts here are token ids: nothing is ever tokenized
    model_config = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=1000,
        hidden_size=8,
        intermediate_size=8,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=8,
    )

    def __init__(self, max_running: int = 4, step_s: float = 0.005, num_blocks: int = 64) -> None:
        self.max_running = max_running
        self.step_s = step_s
        self.num_blocks = num_blocks
        self.reqs: dict[str, _Req] = {}
        self.order: list[str] = []
        self.aborted: list[str] = []
        self.aborted_one = threading.Event()  # set at each abort: tests wait on it, never on a poll with a deadline
        self.thread_ids: set[int] = set()
        self.steps = 0
        self.explode = False  # the next step raises, as an engine bug would

    def add_request(self, request_id, prompt, params, cache_salt=None, *, prompt_token_ids=None):
        self.thread_ids.add(threading.get_ident())
        ids = list(prompt) if not isinstance(prompt, str) else [1] * len(prompt.split())
        if len(ids) >= self.max_model_len:
            raise UserError(f"prompt has {len(ids)} tokens, max_model_len is {self.max_model_len}")
        self.reqs[request_id] = _Req(request_id, ids, params.max_tokens)
        self.order.append(request_id)

    def abort_request(self, request_id):
        self.thread_ids.add(threading.get_ident())
        if self.reqs.pop(request_id, None) is not None:
            self.order.remove(request_id)
            self.aborted.append(request_id)
            self.aborted_one.set()

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def _running(self):
        return self.order[: self.max_running]

    def step(self):
        self.thread_ids.add(threading.get_ident())
        time.sleep(self.step_s)
        if self.explode:
            raise RuntimeError("boom")
        self.steps += 1
        outs = []
        for rid in list(self._running()):
            r = self.reqs[rid]
            r.tokens.append(100 + len(r.tokens))
            done = len(r.tokens) >= r.max_tokens
            c = CompletionOutput(0, " ".join(f"t{t}" for t in r.tokens), list(r.tokens), "length" if done else None)
            outs.append(RequestOutput(rid, None, r.prompt, [c], done, 0, RequestMetrics(r.arrival)))
            if done:
                del self.reqs[rid]
                self.order.remove(rid)
        return outs

    def stats(self):
        used = sum((len(self.reqs[r].prompt) + len(self.reqs[r].tokens)) // 4 + 1 for r in self._running())
        return EngineStats(
            num_running=len(self._running()),
            num_waiting=max(0, len(self.order) - self.max_running),
            num_blocks=self.num_blocks,
            num_free_blocks=self.num_blocks - used,
            num_cached_blocks=0,
            block_size=4,
            kv_usage=used / self.num_blocks,
            num_stored_tokens=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_preemptions=0,
            prompt_tokens=0,
            generation_tokens=0,
            peak_running=0,
            num_steps=self.steps,
        )


NEVER = 10**9  # tokens: at step_s or more per step, a request that finishes only when the test ends it


@dataclass
class P:
    max_tokens: int = 5
    n: int = 1


def run(coro):
    """The test's coroutine, failed as hung after 120 s (a guard, never reached unless something is broken)."""
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_many_callers_share_one_engine_thread():
    fake = FakeEngine(max_running=8)
    eng = AsyncLLMEngine(fake)

    async def one(i):
        outs = [o async for o in eng.generate([1, 2, 3], P(max_tokens=3 + i % 4), f"r{i}")]
        return outs

    async def main():
        return await asyncio.gather(*(one(i) for i in range(20)))

    try:
        results = run(main())
    finally:
        eng.shutdown()
    for i, outs in enumerate(results):
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3 + i % 4
        assert not any(o.finished for o in outs[:-1])
    assert len(fake.thread_ids) == 1 and threading.get_ident() not in fake.thread_ids
    assert not fake.reqs


def test_leaving_early_aborts_and_frees():
    fake = FakeEngine()
    eng = AsyncLLMEngine(fake)

    async def main():
        n = 0
        async for _ in eng.generate([1, 2], P(max_tokens=50), "early"):
            n += 1
            if n == 2:
                break
        await asyncio.to_thread(fake.aborted_one.wait, 60)

    try:
        run(main())
        assert fake.aborted == ["early"] and not fake.reqs and eng.aborts.total == 1
    finally:
        eng.shutdown()


def test_cancelled_task_aborts():
    fake = FakeEngine(step_s=0.01)
    eng = AsyncLLMEngine(fake)

    async def main():
        running = asyncio.Event()

        async def consume():
            async for _ in eng.generate([1], P(max_tokens=NEVER), "c"):
                running.set()

        t = asyncio.ensure_future(consume())
        await running.wait()  # the request runs: cancelling must abort it in the engine
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        await asyncio.to_thread(fake.aborted_one.wait, 60)

    try:
        run(main())
        assert fake.aborted == ["c"]
    finally:
        eng.shutdown()


def test_add_error_reaches_caller_and_loop_keeps_serving():
    fake = FakeEngine()
    eng = AsyncLLMEngine(fake)

    async def main():
        with pytest.raises(UserError, match="max_model_len"):
            async for _ in eng.generate(list(range(100)), P(), "long"):
                pass
        return [o async for o in eng.generate([1], P(max_tokens=2), "ok")]

    try:
        outs = run(main())
        assert outs[-1].finished
    finally:
        eng.shutdown()


def test_max_waiting_requests():
    fake = FakeEngine(max_running=1, step_s=0.01)
    eng = AsyncLLMEngine(fake, max_waiting_requests=1)

    async def main():
        s1 = await eng.add_request("a", [1], P(max_tokens=NEVER))
        async for _ in eng.iterate(s1):
            break  # "a" runs ... and is aborted by leaving; start again with a held iterator
        it1 = eng.generate([1], P(max_tokens=NEVER), "b")
        await it1.__anext__()  # b running
        s2 = await eng.add_request("c", [1], P(max_tokens=NEVER))  # c waits
        while eng.stats().num_waiting < 1:  # the stats the limit reads are the engine thread's, set after the add
            await asyncio.sleep(0.001)  # (run() fails it as hung after 120 s)
        with pytest.raises(TooManyWaitingRequestsError):
            await eng.add_request("d", [1], P(max_tokens=100))
        await it1.aclose()
        eng.abort(s2.request_id)

    try:
        run(main())
    finally:
        eng.shutdown()
    assert "d" not in fake.order and not fake.reqs


def test_shutdown_aborts_in_flight_and_refuses_new():
    fake = FakeEngine(step_s=0.01)
    eng = AsyncLLMEngine(fake)

    async def main():
        it = eng.generate([1], P(max_tokens=NEVER), "long")
        await it.__anext__()
        eng.stop_accepting()
        eng.abort_all()
        with pytest.raises(RequestAbortedError):
            async for _ in it:
                pass
        with pytest.raises(EngineShuttingDownError):
            await eng.add_request("late", [1], P())

    try:
        run(main())
    finally:
        eng.shutdown()
    assert fake.aborted == ["long"] and not eng.is_running


def test_n_counts_against_max_waiting_requests():
    """Each of a request's n samples waits in the engine: n=64 must not slip past a limit of 8."""
    fake = FakeEngine(max_running=1)
    eng = AsyncLLMEngine(fake, max_waiting_requests=8)

    async def main():
        with pytest.raises(TooManyWaitingRequestsError):
            await eng.add_request("big", [1], P(max_tokens=1, n=9))
        outs = [o async for o in eng.iterate(await eng.add_request("fits", [1], P(max_tokens=1, n=8)))]
        return outs

    try:
        assert run(main())[-1].finished
    finally:
        eng.shutdown()
    assert "big" not in fake.order


class _CrashWhilePutting:
    """A queue whose put() first makes the engine crash and gives its thread time to die: the window between
    add_request's liveness check and its put, held open."""

    def __init__(self, inner, fake, eng):
        self.inner, self.fake, self.eng = inner, fake, eng

    def put(self, op):
        if type(op).__name__ in ("_Add", "tuple") and not self.fake.explode:
            self.fake.explode = True
            self.eng._thread.join(1.0)  # the fixed engine cannot finish dying: its clean-up waits on the lock
        self.inner.put(op)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_add_racing_an_engine_crash_is_answered():
    fake = FakeEngine(step_s=0.01)
    died = []
    eng = AsyncLLMEngine(fake, on_dead=died.append)

    async def main():
        it = eng.generate([1], P(max_tokens=NEVER), "running")
        await it.__anext__()
        eng._ops = _CrashWhilePutting(eng._ops, fake, eng)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(eng.add_request("late", [1], P()), 60)  # the old bug: a hang
        with pytest.raises(EngineDeadError):  # the stream in flight is failed too
            async for _ in it:
                pass
        with pytest.raises(EngineDeadError):  # and every later add is refused at once
            await eng.add_request("later", [1], P())

    try:
        run(main())
    finally:
        eng.shutdown()
    assert not eng.is_healthy and len(died) == 1 and isinstance(died[0], RuntimeError)


def test_run_on_engine_reads_between_steps_and_fails_once_closed():
    fake = FakeEngine()
    eng = AsyncLLMEngine(fake)

    async def main():
        assert await eng.run_on_engine(lambda e: e.max_model_len) == 64  # not started: run in place
        eng.start()
        seen = await eng.run_on_engine(lambda e: threading.get_ident())
        assert seen != threading.get_ident()
        with pytest.raises(ZeroDivisionError):
            await eng.run_on_engine(lambda e: 1 / 0)
        eng.shutdown()
        with pytest.raises(EngineShuttingDownError):
            await eng.run_on_engine(lambda e: 1)

    run(main())
