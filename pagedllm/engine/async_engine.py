"""AsyncLLMEngine: one background thread runs `EngineCore.step()` for every caller (continuous batching).

The asyncio side never touches the engine directly. `add_request()` puts an `_Add` on a thread-safe queue; the
engine thread applies the queued adds and aborts before every step, runs the step, and hands each request's
latest cumulative `RequestOutput` back to the caller's event loop with `call_soon_threadsafe`. So an HTTP handler
awaits, but never blocks on, a model step, and an error from `EngineCore.add_request` (bad params, a prompt that
is too long) reaches its caller as the exception it raised.

Leaving `iterate()` early (a client disconnect, a cancelled task, `break`) aborts the request; the engine thread
sees the abort before its next step, so the request's blocks are freed within one step.

However the loop ends (shutdown or a crash), one path, `_close`, fails every queued add and every stream in
flight; admission checks and that path hold the same lock, so an add either reaches the queue before the loop
closes (and is failed by `_close`) or sees the loop closed: no caller waits forever. A crash also calls the
`on_dead` hook given at construction, if any (the server itself watches `is_healthy` and exits non-zero, so that
a supervisor restarts it: vLLM's behaviour).

Every step's outputs and every abort go to the engine's stat logger (`metrics`, engine/metrics.py), whose
Prometheus page the server's /metrics sends.
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

from pagedllm.engine.interfaces import EngineCore
from pagedllm.engine.metrics import PrometheusStatLogger
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.stats import AbortLog, EngineStats
from pagedllm.errors import UserError
from pagedllm.lora_request import LoRARequest
from pagedllm.model.config import ModelConfig
from pagedllm.model.tokenizer import Tokenizer
from pagedllm.sampling_params import PoolingParams, SamplingParams

logger = logging.getLogger(__name__)


class TooManyWaitingRequestsError(Exception):
    """More requests are waiting than `--max-waiting-requests` allows; the server answers 503 so clients back off."""


class RequestAbortedError(Exception):
    """The request was aborted by the server (shutdown), not by its caller."""


class EngineBusyError(Exception):
    """The engine thread did not reach a read between two steps in time: a step is taking longer (a 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shut down or crashed); no request can be served."""


class EngineShuttingDownError(EngineDeadError):
    """The server is shutting down and takes no new requests."""


_ids = itertools.count()


def random_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{time.monotonic_ns():x}-{next(_ids)}"


@dataclass
class RequestStream:
    """The asyncio side of one request: the latest cumulative output, or the error that ended it. Its methods run
    on the caller's event loop only (the engine thread reaches them through `call_soon_threadsafe`)."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    added: asyncio.Future[None]  # resolved once the engine took the request (or refused it)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    latest: RequestOutput | None = None
    error: BaseException | None = None
    finished: bool = False
    taken: bool = False  # the consumer has seen `latest`

    def accepted(self, exc: BaseException | None) -> None:
        if self.added.done():
            return
        if exc is None:
            self.added.set_result(None)
        else:
            self.added.set_exception(exc)

    def put(self, out: RequestOutput) -> None:
        if self.finished:
            return
        self.latest, self.taken = out, False
        self.finished = out.finished
        self.event.set()

    def fail(self, exc: BaseException) -> None:
        if self.finished:
            return
        self.error, self.finished = exc, True
        self.accepted(exc)
        self.event.set()


# The messages from callers to the engine thread.
@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams | PoolingParams
    stream: RequestStream
    cache_salt: str | None = None
    priority: int = 0
    kv_segments: list[tuple[int, int]] | None = None
    kv_blend_recompute: float | None = None
    kv_blend_max_deviation: float | None = None
    lora_request: LoRARequest | None = None


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _AbortAll:
    pass


@dataclass(frozen=True)
class _Stop:
    pass


@dataclass(frozen=True)
class _Call:
    """A read of the engine between two steps (run_on_engine)."""

    fn: Callable[[EngineCore], object]
    future: asyncio.Future[object]
    loop: asyncio.AbstractEventLoop

    def answer(self, fn: Callable[[EngineCore], object], engine: EngineCore) -> None:
        try:
            result, error = fn(engine), None
        except Exception as e:  # noqa: BLE001 - handed to the caller, as add_request's errors are
            result, error = None, e

        def done() -> None:
            if not self.future.done():
                self.future.set_exception(error) if error is not None else self.future.set_result(result)

        try:
            self.loop.call_soon_threadsafe(done)
        except RuntimeError:  # the caller's event loop is closed
            pass


_Op = _Add | _Abort | _AbortAll | _Stop | _Call


def _call_on_loop(stream: RequestStream, fn: Callable[..., None], *args: object) -> None:
    try:
        stream.loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the caller's event loop is closed: nobody is waiting any more
        pass


def _raiser(error: BaseException) -> Callable[[EngineCore], object]:
    """What a read queued when the loop closed runs instead of its own function."""

    def fail(_: EngineCore) -> object:
        raise error

    return fail


class AsyncLLMEngine:
    """Wraps an `EngineCore` so many asyncio callers share one engine loop.

    `max_waiting_requests`: refuse (TooManyWaitingRequestsError) a request whose samples would bring the waiting
    ones over this (None: no limit); each of a request's `n` samples counts.
    `on_dead`: called on the engine thread, once, if the loop crashes.
    """

    def __init__(
        self,
        engine: EngineCore,
        *,
        max_waiting_requests: int | None = None,
        idle_poll_s: float = 0.5,
        on_dead: Callable[[BaseException], None] | None = None,
    ) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise UserError(f"--max-waiting-requests must be >= 0, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.metrics = PrometheusStatLogger()  # fed on the engine thread; the server renders its page
        self.on_dead = on_dead
        self._idle_poll_s = idle_poll_s
        self._ops: queue.SimpleQueue[_Op] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only: added and not finished
        self._lock = threading.Lock()  # admission (_closed_error, _accepting, _pending) and _close
        self._pending = 0  # samples of adds queued but not yet handed to the engine
        self._accepting = True
        self._closed_error: EngineDeadError | None = None  # set once, by _close
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._stats = engine.stats()
        self.aborts = AbortLog()

    # ------------------------------------------------------------------ lifecycle
    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.model_config

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def is_healthy(self) -> bool:
        return self._closed_error is None

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
                self._thread.start()

    def stop_accepting(self) -> None:
        """New add_request() calls fail with EngineShuttingDownError; what runs goes on (see abort_all)."""
        with self._lock:
            self._accepting = False

    def abort_all(self) -> None:
        self._ops.put(_AbortAll())

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop accepting, abort everything in flight, stop the loop and join its thread."""
        self.stop_accepting()
        self._ops.put(_Stop())
        if self._thread is None:
            self._close(None)
        else:
            self._thread.join(timeout)

    def stats(self) -> EngineStats:
        """The engine's stats as of the end of the last step (never waits for a step)."""
        return self._stats

    async def add_lora(self, lora: LoRARequest) -> None:
        await self.run_on_engine(lambda e: e.add_lora(lora))  # type: ignore[attr-defined]  # LLMEngine's

    async def remove_lora(self, lora_int_id: int) -> None:
        await self.run_on_engine(lambda e: e.remove_lora(lora_int_id))  # type: ignore[attr-defined]  # LLMEngine's

    # ------------------------------------------------------------------ the asyncio side
    def _admit(self, n: int) -> None:
        """Raise why a request of `n` samples cannot be queued now; called under the lock."""
        if self._closed_error is not None:
            raise self._closed_error
        if not self._accepting:
            raise EngineShuttingDownError("the server is shutting down")
        limit = self.max_waiting_requests
        if limit is not None and self._stats.num_waiting + self._pending + n > limit:
            raise TooManyWaitingRequestsError(
                f"too many waiting requests (the limit is {limit} samples); try again later"
            )

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
        kv_segments: list[tuple[int, int]] | None = None,
        kv_blend_recompute: float | None = None,
        kv_blend_max_deviation: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Hand a request to the engine; returns once the engine took it (raises what the engine raised)."""
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, loop, loop.create_future())
        with self._lock:
            self._admit(params.n)
            self._pending += params.n
            self._ops.put(
                _Add(
                    request_id,
                    prompt,
                    params,
                    stream,
                    cache_salt,
                    priority,
                    kv_segments,
                    kv_blend_recompute,
                    kv_blend_max_deviation,
                    lora_request,
                )
            )
        self.start()
        try:
            await stream.added
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    async def iterate(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """Yield the stream's cumulative outputs until it finishes; leaving early aborts the request."""
        done = False
        try:
            while True:
                # put()/fail() run on this event loop too, so nothing changes between these checks and the wait.
                if stream.latest is not None and not stream.taken:
                    stream.taken = True
                    done = stream.error is None and stream.latest.finished
                    yield stream.latest
                    if done:
                        return
                elif stream.error is not None:
                    done = True
                    raise stream.error
                else:
                    stream.event.clear()
                    await stream.event.wait()
        finally:
            if not done:
                self.abort(stream.request_id)

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its cumulative RequestOutputs; the last one has finished=True."""
        stream = await self.add_request(request_id or random_request_id(), prompt, params)
        async for out in self.iterate(stream):
            yield out

    def abort(self, request_id: str) -> None:
        """Thread-safe and non-blocking; the engine frees the request's blocks before its next step."""
        self._ops.put(_Abort(request_id))

    async def run_on_engine(self, fn: Callable[[EngineCore], object], timeout: float = 30.0) -> object:
        """`fn(engine)` on the engine thread between two steps, for a consistent read-only view; it rides the
        message queue, so the loop pays nothing while nobody asks."""
        loop = asyncio.get_running_loop()
        call = _Call(fn, loop.create_future(), loop)
        with self._lock:
            if self._closed_error is not None:
                raise self._closed_error
            if self._thread is None:  # not started: no other thread touches the engine
                return fn(self.engine)
            self._ops.put(call)
        try:
            return await asyncio.wait_for(call.future, timeout)
        except TimeoutError:  # the call stays queued; answering a future that gave up is a no-op
            raise EngineBusyError(
                f"the engine did not get between two steps within {timeout:g} s (a step is taking longer); try again"
            ) from None

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        crash: BaseException | None = None
        try:
            while not self._stopping:
                self._apply_ops(block=not self.engine.has_unfinished_requests())
                if not self._stopping and self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as e:  # a bug in the engine itself (a request's own failure never gets here)
            logger.exception("engine loop crashed")
            crash = e
        finally:
            self._close(crash)

    def _step(self) -> None:
        outputs = self.engine.step()
        now = time.monotonic()
        self._stats = self.engine.stats()
        try:
            self.metrics.record_step(outputs, now)
        except Exception:  # metrics must never kill the loop
            logger.exception("metrics.record_step failed")
        for out in outputs:
            stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if stream is not None:
                _call_on_loop(stream, stream.put, out)

    def _apply_ops(self, block: bool) -> None:
        """Apply every queued message; waits up to idle_poll_s for the first when `block` (nothing to step)."""
        changed = False
        while True:
            try:
                op = self._ops.get(timeout=self._idle_poll_s) if block and not changed else self._ops.get_nowait()
            except queue.Empty:
                break
            if isinstance(op, _Call):  # a read: nothing changes
                op.answer(op.fn, self.engine)
                continue
            changed = True
            if isinstance(op, _Add):
                self._apply_add(op)
            elif isinstance(op, _Abort):
                self._abort_one(op.request_id, RequestAbortedError("aborted"))
            elif isinstance(op, _AbortAll):
                for rid in list(self._streams):
                    self._abort_one(rid, RequestAbortedError("the server is shutting down"))
            else:
                self._stopping = True
        if changed:
            self._stats = self.engine.stats()

    def _apply_add(self, op: _Add) -> None:
        error: BaseException | None = None
        if self._stopping:
            error = EngineShuttingDownError("the server is shutting down")
        elif op.request_id in self._streams:
            error = UserError(f"request id {op.request_id!r} is already in use")
        else:
            try:
                args = (op.request_id, op.prompt, op.params, op.cache_salt)
                extra: dict = {} if op.lora_request is None else {"lora_request": op.lora_request}
                if op.kv_segments is None:  # kv_blend (and LoRA) passed only when asked for: other engines stay usable
                    self.engine.add_request(*args, priority=op.priority, **extra)
                else:
                    self.engine.add_request(
                        *args,
                        priority=op.priority,
                        kv_segments=op.kv_segments,
                        kv_blend_recompute=op.kv_blend_recompute,
                        kv_blend_max_deviation=op.kv_blend_max_deviation,
                        **extra,
                    )
            except Exception as e:  # noqa: BLE001 - UserError for bad input; anything else is the caller's to see too
                error = e
        if error is None:
            self._streams[op.request_id] = op.stream
            self._stats = self.engine.stats()  # its samples now wait in the engine: count them there ...
        with self._lock:
            self._pending -= op.params.n  # ... before they stop counting as pending
        _call_on_loop(op.stream, op.stream.accepted, error)

    def _abort_one(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        try:
            self.engine.abort_request(request_id)
        except Exception:  # a crashed engine may fail here too; the caller is told all the same
            logger.exception("abort_request(%s) failed", request_id)
        self.aborts.record(request_id)
        try:
            self.metrics.record_abort(request_id)
        except Exception:
            logger.exception("metrics.record_abort failed")
        _call_on_loop(stream, stream.fail, error)

    def _close(self, crash: BaseException | None) -> None:
        """The one way the loop ends: refuse new adds, fail the queued ones and every stream in flight."""
        closed = (
            EngineDeadError(f"the engine loop crashed: {crash!r}")
            if crash is not None
            else EngineShuttingDownError("the engine has shut down")
        )
        with self._lock:
            self._closed_error = closed
            ops: list[_Op] = []
            while not self._ops.empty():
                ops.append(self._ops.get_nowait())
            self._pending = 0
        for op in ops:
            if isinstance(op, _Add):
                _call_on_loop(op.stream, op.stream.accepted, closed)
            elif isinstance(op, _Call):
                op.answer(_raiser(closed), self.engine)
        for rid in list(self._streams):
            self._abort_one(rid, closed if crash is not None else RequestAbortedError("the server is shutting down"))
        try:
            self._stats = self.engine.stats()
        except Exception:
            logger.exception("engine.stats() failed while closing")
        if crash is not None and self.on_dead is not None:
            self.on_dead(crash)
