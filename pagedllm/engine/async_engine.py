"""AsyncLLMEngine: one background thread runs `LLMEngine.step()` for every caller (continuous batching).

The asyncio side never touches the engine directly. `generate()` puts an *add* on a thread-safe queue; the engine
thread drains that queue (adds and aborts) before every step, runs the step, and hands each request's latest
cumulative `RequestOutput` back to the event loop with `call_soon_threadsafe`. So an HTTP handler awaits, but never
blocks on, a model step, and a request's errors from `add_request` (bad params, a prompt that is too long) come
back to the caller before its first output, as the exception `add_request` raised.

Leaving `generate()` early (a client disconnect, a cancelled task, `break`) aborts the request; the engine thread
sees the abort before its next step, so the request's blocks are freed within one step.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.errors import UserError

logger = logging.getLogger(__name__)


class TooManyWaitingRequestsError(Exception):
    """More requests are waiting than `--max-waiting-requests` allows; the server answers 503 so clients back off."""


class RequestAbortedError(Exception):
    """The request was aborted by the server (shutdown), not by its caller."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shut down or crashed); no request can be served."""


class EngineShuttingDownError(EngineDeadError):
    """The server is shutting down and takes no new requests."""


_ids = itertools.count()


def _shut_down(_: Any) -> Any:
    """What a read asked for after the loop stopped gets instead of running."""
    raise EngineShuttingDownError("the engine has shut down")


def random_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{time.monotonic_ns():x}-{next(_ids)}"


@dataclass
class _Stream:
    """The asyncio side of one request: the latest cumulative output, or the error that ended it."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    event: asyncio.Event = field(default_factory=asyncio.Event)
    added: asyncio.Future | None = None  # set by the engine thread once add_request returned (or raised)
    latest: Any = None
    error: BaseException | None = None
    finished: bool = False
    taken: bool = False  # the consumer has seen `latest`

    def put(self, out: Any) -> None:  # event-loop thread
        if self.finished:
            return
        self.latest = out
        self.taken = False
        if getattr(out, "finished", False):
            self.finished = True
        self.event.set()

    def fail(self, exc: BaseException) -> None:  # event-loop thread
        if self.finished:
            return
        self.error = exc
        self.finished = True
        if self.added is not None and not self.added.done():
            self.added.set_exception(exc)
        self.event.set()


class AsyncLLMEngine:
    """Wraps an `LLMEngine` so many asyncio callers share one engine loop.

    `max_waiting_requests`: when that many requests already wait to be scheduled, `generate()` raises
    `TooManyWaitingRequestsError` instead of queueing another (None: no limit).
    `stat_logger`: an object with `record_step(outputs, now)` and `record_abort(request_id)`, called on the
    engine thread after every step and every abort (the server's metrics hook); None for none.
    """

    def __init__(self, engine: Any, *, max_waiting_requests: int | None = None, stat_logger: Any = None,
                 idle_poll_s: float = 0.5) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise UserError(f"--max-waiting-requests must be >= 0, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.stat_logger = stat_logger
        self._idle_poll_s = idle_poll_s
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine-thread view: requests it has added and not finished
        self._lock = threading.Lock()
        self._pending_adds = 0  # adds queued but not yet handed to the engine
        self._in_engine: set[str] = set()  # request ids the engine holds (engine thread only)
        self._stats: Any = None
        self._stats_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._accepting = True
        self._dead_error: BaseException | None = None
        self.num_aborted = 0  # requests aborted (disconnects, cancellations, shutdown)
        self.aborted_ids: list[str] = []  # the most recent aborted request ids (bounded)
        self.num_steps = 0
        self._refresh_stats()

    # ------------------------------------------------------------------ construction / lifecycle
    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> "AsyncLLMEngine":
        from pagedllm.engine.llm_engine import LLMEngine

        return cls(LLMEngine(config), **kwargs)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def is_healthy(self) -> bool:
        return self._dead_error is None and (self._thread is None or self._thread.is_alive())

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    def stop_accepting(self) -> None:
        """New generate() calls fail with EngineShuttingDownError; what runs goes on (see abort_all)."""
        self._accepting = False

    def abort_all(self) -> None:
        self._ops.put(("abort_all", None))

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop accepting, abort everything in flight, stop the loop and join its thread."""
        self._accepting = False
        self._stopping = True
        self._ops.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ stats
    def _refresh_stats(self) -> None:
        try:
            st = self.engine.stats()
        except Exception:  # pragma: no cover - stats are best effort
            logger.exception("engine.stats() failed")
            return
        with self._stats_lock:
            self._stats = st

    def stats(self) -> Any:
        """The engine's stats as of the end of the last step (never waits for a step)."""
        with self._stats_lock:
            return self._stats

    def num_waiting(self) -> int:
        st = self.stats()
        waiting = int(getattr(st, "num_waiting", 0) or 0) if st is not None else 0
        with self._lock:
            return waiting + self._pending_adds

    # ------------------------------------------------------------------ public async API
    async def add_request(self, prompt: Any, params: Any, request_id: str) -> _Stream:
        """Hand a request to the engine; returns once the engine accepted it (raises what add_request raised)."""
        if self._dead_error is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self._dead_error}")
        if not self._accepting:
            raise EngineShuttingDownError("the server is shutting down")
        if self._thread is None:
            self.start()
        loop = asyncio.get_running_loop()
        if self.max_waiting_requests is not None and self.num_waiting() >= self.max_waiting_requests:
            raise TooManyWaitingRequestsError(
                f"too many waiting requests (the limit is {self.max_waiting_requests}); try again later")
        stream = _Stream(request_id=request_id, loop=loop)
        stream.added = loop.create_future()
        with self._lock:
            self._pending_adds += 1
        self._ops.put(("add", (request_id, prompt, params, stream)))
        try:
            await stream.added
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    async def iterate(self, stream: _Stream) -> AsyncIterator[Any]:
        """Yield the stream's cumulative outputs until it finishes; leaving early aborts the request."""
        finished = False
        try:
            while True:
                # put()/fail() run on this event loop too, so nothing changes between these checks and the wait.
                if stream.latest is not None and not stream.taken:
                    stream.taken = True
                    out = stream.latest
                    if stream.error is None and getattr(out, "finished", False):
                        finished = True
                    yield out
                    if finished:
                        return
                elif stream.error is not None:
                    finished = True
                    raise stream.error
                else:
                    stream.event.clear()
                    await stream.event.wait()
        finally:
            if not finished:
                self.abort(stream.request_id)

    async def generate(self, prompt: Any, params: Any, request_id: str | None = None) -> AsyncIterator[Any]:
        """Add a request and yield its cumulative RequestOutputs; the last one has finished=True."""
        request_id = request_id or random_request_id()
        stream = await self.add_request(prompt, params, request_id)
        async for out in self.iterate(stream):
            yield out

    def abort(self, request_id: str) -> None:
        """Thread-safe and non-blocking; the engine frees the request's blocks before its next step."""
        self._ops.put(("abort", request_id))

    async def run_on_engine(self, fn: Callable[[Any], Any], timeout: float = 30.0) -> Any:
        """`fn(engine)` on the engine thread between two steps, for a consistent read-only view (the /kv page's
        snapshot); it rides the op queue, so the loop pays nothing while nobody asks."""
        if self._dead_error is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self._dead_error}")
        if self._thread is None:  # not started: no other thread touches the engine
            return fn(self.engine)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._ops.put(("call", (fn, future, loop)))
        return await asyncio.wait_for(future, timeout)

    # ------------------------------------------------------------------ engine thread
    def _deliver(self, stream: _Stream, fn: str, arg: Any) -> None:
        try:
            stream.loop.call_soon_threadsafe(getattr(stream, fn), arg)
        except RuntimeError:  # the caller's event loop is closed
            pass

    def _added(self, stream: _Stream, exc: BaseException | None) -> None:
        def done() -> None:
            if stream.added is not None and not stream.added.done():
                if exc is None:
                    stream.added.set_result(None)
                else:
                    stream.added.set_exception(exc)
        try:
            stream.loop.call_soon_threadsafe(done)
        except RuntimeError:
            pass

    def _abort_one(self, request_id: str, reason: str = "aborted") -> None:
        stream = self._streams.pop(request_id, None)
        if request_id in self._in_engine:
            self._in_engine.discard(request_id)
            try:
                self.engine.abort_request(request_id)
            except Exception:  # pragma: no cover
                logger.exception("abort_request(%s) failed", request_id)
            self.num_aborted += 1
            self.aborted_ids.append(request_id)
            del self.aborted_ids[:-256]
            if self.stat_logger is not None:
                try:
                    self.stat_logger.record_abort(request_id)
                except Exception:  # pragma: no cover
                    logger.exception("stat_logger.record_abort failed")
        if stream is not None:
            self._deliver(stream, "fail", RequestAbortedError(reason))

    def _call(self, fn: Callable[[Any], Any], future: asyncio.Future, loop: asyncio.AbstractEventLoop) -> None:
        try:
            result, exc = fn(self.engine), None
        except Exception as e:  # handed to the caller, as add_request's errors are
            result, exc = None, e

        def done() -> None:
            if future.done():
                return
            if exc is None:
                future.set_result(result)
            else:
                future.set_exception(exc)
        try:
            loop.call_soon_threadsafe(done)
        except RuntimeError:  # the caller's event loop is closed
            pass

    def _drain_ops(self, block: bool) -> None:
        """Apply every queued add/abort; the stats snapshot is refreshed when any changed the engine."""
        first = True
        changed = False
        while True:
            try:
                if block and first:
                    op, arg = self._ops.get(timeout=self._idle_poll_s)
                else:
                    op, arg = self._ops.get_nowait()
            except queue.Empty:
                if changed:
                    self._refresh_stats()
                return
            first = False
            if op == "call":  # a read: the stats stay as they are
                self._call(*arg)
                continue
            changed = True
            if op == "add":
                request_id, prompt, params, stream = arg
                with self._lock:
                    self._pending_adds -= 1
                if self._stopping:
                    self._added(stream, EngineShuttingDownError("the server is shutting down"))
                    continue
                if request_id in self._streams or request_id in self._in_engine:
                    self._added(stream, UserError(f"request id {request_id!r} is already in use"))
                    continue
                try:
                    self.engine.add_request(request_id, prompt, params)
                except Exception as e:  # UserError for bad input; anything else is passed on as it is
                    self._added(stream, e)
                    continue
                self._in_engine.add(request_id)
                self._streams[request_id] = stream
                self._added(stream, None)
            elif op == "abort":
                self._abort_one(arg)
            elif op == "abort_all":
                for rid in list(self._streams):
                    self._abort_one(rid, "the server is shutting down")
            elif op == "stop":
                self._stopping = True

    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                self._drain_ops(block=not busy)
                if self._stopping:
                    break
                if not self.engine.has_unfinished_requests():
                    continue
                outputs = self.engine.step()
                self.num_steps += 1
                now = time.monotonic()
                self._refresh_stats()
                if self.stat_logger is not None:
                    try:
                        self.stat_logger.record_step(outputs, now)
                    except Exception:  # pragma: no cover - metrics must never kill the loop
                        logger.exception("stat_logger.record_step failed")
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if getattr(out, "finished", False):
                        self._streams.pop(out.request_id, None)
                        self._in_engine.discard(out.request_id)
                    if stream is not None:
                        self._deliver(stream, "put", out)
        except BaseException as e:  # a bug in the engine: fail every caller instead of hanging them
            logger.exception("engine loop crashed")
            self._dead_error = e
            for rid, stream in list(self._streams.items()):
                self._deliver(stream, "fail", EngineDeadError(f"the engine loop crashed: {e!r}"))
                try:
                    self.engine.abort_request(rid)
                except Exception:
                    pass
            self._streams.clear()
        finally:
            # Shut down: abort what is left, fail queued adds, so no caller waits forever.
            for rid in list(self._streams):
                self._abort_one(rid, "the server is shutting down")
            while True:
                try:
                    op, arg = self._ops.get_nowait()
                except queue.Empty:
                    break
                if op == "add":
                    with self._lock:
                        self._pending_adds -= 1
                    self._added(arg[3], EngineShuttingDownError("the server is shutting down"))
                elif op == "call":
                    self._call(_shut_down, *arg[1:])
            self._refresh_stats()
            if self._dead_error is None:
                self._dead_error = EngineShuttingDownError("the engine has shut down")
