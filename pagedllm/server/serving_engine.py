"""What every endpoint shares: the checks that need the engine, tokenization off the event loop, submitting one
engine request per prompt and collecting their outputs, usage and logprob formatting (vLLM's serving_engine).

Everything that can be checked before generation starts (model name, prompt length, n, token ids, the waiting
limit) is checked before the HTTP response begins, so a streaming request gets a proper status code too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from pagedllm.engine.async_engine import RequestAbortedError
from pagedllm.engine.blend import check_segments
from pagedllm.engine.interfaces import AsyncEngine
from pagedllm.engine.outputs import CompletionOutput, RequestOutput
from pagedllm.lora_request import LoRARequest
from pagedllm.sampling_params import MAX_N, PoolingParams, SamplingParams, SamplingParamsError
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import (
    CompletionTokensDetails,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    ResponseModel,
    Usage,
    finite_logprob,
)
from pagedllm.server.protocol_chat import ChatChoiceLogprobs, ChatLogprob, ChatMessage, TopLogprob
from pagedllm.server.protocol_completion import CompletionLogprobs
from pagedllm.server.protocol_sampling import KVBlend
from pagedllm.server.reasoning import ReasoningFormat

logger = logging.getLogger("pagedllm.server")
T = TypeVar("T")


@dataclass
class EngineRequest:
    """One engine request of an HTTP request: prompt `prompt_index`, choices base .. base + n - 1."""

    prompt_index: int
    base: int
    request_id: str
    prompt_ids: list[int]
    stream: object | None = None  # what the engine's add_request returned
    final: RequestOutput | None = None


@dataclass
class ChatTemplateArgs:
    """How a request asks its chat to be rendered, beyond the messages and tools."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # the request's own (checked against --trust-request-chat-template)
    kwargs: dict[str, Any] | None = None  # chat_template_kwargs


@dataclass
class ServingContext:
    """The engine and the served names, shared by every router (`request.app.state.serving`), and the server's
    choices about chats: the reasoning format (--reasoning-parser) and whether a request may bring its own chat
    template (--trust-request-chat-template)."""

    engine: AsyncEngine
    model_names: list[str]
    model_root: str
    max_n: int = MAX_N
    tool_call_parser: str | None = None  # --tool-call-parser: the "auto" tool-call format (else the template's)
    reasoning: ReasoningFormat | None = None
    trust_request_chat_template: bool = False
    loras: dict[str, LoRARequest] = field(default_factory=dict)  # LoRA adapters served by name (serving_lora.py)
    created: int = field(default_factory=lambda: int(time.time()))
    _token_strs: dict[int, str] = field(default_factory=dict)
    _lora_ids: int = 0  # the highest adapter id handed out

    # ------------------------------------------------------------------ tokenizer (CPU work off the event loop)
    async def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids as the engine makes them from a text prompt; in a worker thread, since a long text takes
        seconds and the event loop must keep serving every other request meanwhile."""
        return await asyncio.to_thread(self.engine.tokenizer.encode, text, add_special_tokens)

    async def chat_prompt(
        self, messages: list[ChatMessage], args: ChatTemplateArgs, tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[int]]:
        """The rendered prompt's text and token ids. A request's own template is refused (400 naming
        chat_template) unless the server trusts them: it runs in Jinja's sandbox, but a loop in it can still
        take a worker thread for as long as it likes."""
        if args.chat_template is not None and not self.trust_request_chat_template:
            raise APIError(
                "chat_template: this server does not take chat templates from requests "
                "(start it with --trust-request-chat-template)",
                400,
                param="chat_template",
            )
        try:
            msgs = [{"role": m.role, "content": m.text()} for m in messages]
        except ValueError as e:
            raise APIError(str(e), 400, param="messages") from None
        tok = self.engine.tokenizer
        param = "chat_template" if args.chat_template is not None else "messages"
        try:
            text = await asyncio.to_thread(
                tok.apply_chat_template_text,
                msgs,
                args.add_generation_prompt,
                tools,
                chat_template=args.chat_template,
                continue_final_message=args.continue_final_message,
                template_kwargs=args.kwargs,
            )
        except Exception as e:  # noqa: BLE001 - a template that refuses the conversation (roles out of order, ...)
            raise APIError(f"Cannot apply the chat template to these messages: {e}", 400, param=param) from None
        if not isinstance(text, str):
            raise APIError("the chat template did not render text", 400, param=param)
        return text, await self.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.engine.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_str(self, tid: int) -> str:
        s = self._token_strs.get(tid)
        if s is None:
            s = self._token_strs[tid] = self.decode([tid], skip_special_tokens=False)
        return s

    # ------------------------------------------------------------------ checks that need the engine
    def check_model(self, model: str | None) -> str:
        """The served name a request asks for (a LoRA adapter's name too); an unknown one is vLLM's 404."""
        if model is None:
            return self.model_names[0]
        if model not in self.model_names and model not in self.loras:
            raise APIError(
                f"The model `{model}` does not exist. Available models: {', '.join([*self.model_names, *self.loras])}",
                404,
                param="model",
            )
        return model

    def lora_request(self, model: str) -> LoRARequest | None:
        """The adapter a checked model name stands for (None: the base model)."""
        return self.loras.get(model)

    def next_lora_id(self) -> int:
        """An id no adapter of this server had: one more than the highest so far."""
        self._lora_ids = max([self._lora_ids, *(lora.lora_int_id for lora in self.loras.values())]) + 1
        return self._lora_ids

    def check_n(self, n: int, prompts: int = 1) -> None:
        """n against the engine's limit, and all the request's samples against --max-waiting-requests (a request
        that could never be admitted is a 400, not a 503 to retry forever)."""
        if n > self.max_n:
            raise APIError(f"Invalid value for 'n': must be at most {self.max_n} (got {n})", 400, param="n")
        limit = self.engine.max_waiting_requests
        if limit and n * prompts > limit:
            raise APIError(
                f"Invalid value for 'n': {prompts} prompt(s) x n={n} samples is more than the server's "
                f"--max-waiting-requests ({limit})",
                400,
                param="n",
            )

    def check_length(self, n_prompt: int, max_tokens: int | None, min_tokens: int, what: str) -> int:
        """The request's max_tokens, or what is left of the context when it gave none."""
        limit = self.engine.max_model_len
        if n_prompt == 0:
            raise APIError(f"The {what} is empty", 400, param=what)
        if n_prompt >= limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, your {what} has {n_prompt} "
                f"tokens. Please reduce the length of the {what}.",
                400,
                param=what,
            )
        for name, value in (("max_tokens", max_tokens), ("min_tokens", min_tokens)):
            if value is not None and n_prompt + value > limit:
                raise APIError(
                    f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{n_prompt + value} tokens ({n_prompt} in the {what}, {value} in the completion). "
                    f"Please reduce the length of the {what} or completion.",
                    400,
                    param=name,
                )
        return limit - n_prompt if max_tokens is None else max_tokens

    def truncate(self, ids: list[int], keep: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: as many as max_model_len)."""
        if keep is None:
            return ids
        limit = self.engine.max_model_len
        if keep > limit:
            raise APIError(
                f"truncate_prompt_tokens: {keep} is more than the model's maximum context length ({limit})",
                400,
                param="truncate_prompt_tokens",
            )
        return ids[-(limit if keep == -1 else keep) :]

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """Prompt and /detokenize ids (the engine checks logit_bias and stop_token_ids itself, naming them)."""
        vocab = self.engine.model_config.vocab_size
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise APIError(
                f"Invalid value for '{param}': token id {bad} is out of range [0, {vocab})", 400, param=param
            )

    # ------------------------------------------------------------------ engine requests
    async def submit(
        self,
        prompts: list[list[int]],
        params: SamplingParams | PoolingParams,
        request_id: str,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
        kv_blend: KVBlend | None = None,
        first: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> list[EngineRequest]:
        """One engine request per prompt (n samples each); if any is refused, the others are aborted. `first`:
        the index of the first prompt, for a request that submits its prompts a few at a time.
        `cache_salt` keeps the request's prefix blocks to requests of the same salt (a tenant's); `kv_blend`
        (checked against every prompt before any is queued) marks spans whose KV may be reused; `lora_request`:
        the LoRA adapter the request's `model` names."""
        blend: dict = {}
        if kv_blend is not None:
            for ids in prompts:
                try:
                    check_segments(
                        [list(x) for x in kv_blend.segments], len(ids), kv_blend.recompute, kv_blend.max_deviation
                    )
                except SamplingParamsError as e:
                    raise APIError(f"kv_blend: {e}", 400, param="kv_blend") from None
            blend = {"kv_segments": list(kv_blend.segments), "kv_blend_recompute": kv_blend.recompute}
            if kv_blend.max_deviation is not None:  # passed only when set: engines without the bound stay usable
                blend["kv_blend_max_deviation"] = kv_blend.max_deviation
        if lora_request is not None:  # passed only when asked for, as kv_blend
            blend["lora_request"] = lora_request
        subs = [EngineRequest(i, i * params.n, f"{request_id}-{i}", ids) for i, ids in enumerate(prompts, first)]
        results = await asyncio.gather(
            *(
                self.engine.add_request(
                    s.request_id, s.prompt_ids, params, cache_salt=cache_salt, priority=priority, **blend
                )
                for s in subs
            ),
            return_exceptions=True,
        )
        for s, r in zip(subs, results):
            if not isinstance(r, BaseException):
                s.stream = r
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is not None:
            self.abort(subs)
            raise error
        return subs

    def abort(self, subs: list[EngineRequest]) -> None:
        for s in subs:
            if s.stream is not None and s.final is None:
                self.engine.abort(s.request_id)

    async def run_to_end(self, subs: list[EngineRequest]) -> None:
        """Wait for every sub's final output; a server-side abort is a 503."""

        async def last(s: EngineRequest) -> None:
            assert s.stream is not None
            async for out in self.engine.iterate(s.stream):
                s.final = out

        tasks = [asyncio.ensure_future(last(s)) for s in subs]
        try:
            await asyncio.gather(*tasks)
        except RequestAbortedError as e:
            raise APIError(f"The request was aborted: {e}", 503) from None
        finally:
            for t in tasks:
                t.cancel()
            self.abort(subs)

    async def merged(self, subs: list[EngineRequest]) -> AsyncIterator[tuple[EngineRequest, RequestOutput]]:
        """(sub, cumulative output) as they come, from all subs; leaving early aborts them all."""
        q: asyncio.Queue[tuple[EngineRequest, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(s: EngineRequest) -> None:
            assert s.stream is not None
            try:
                async for out in self.engine.iterate(s.stream):
                    if out.finished:
                        s.final = out
                    q.put_nowait((s, out))
                q.put_nowait((s, None))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                q.put_nowait((s, e))

        tasks = [asyncio.ensure_future(pump(s)) for s in subs]
        try:
            remaining = len(subs)
            while remaining:
                s, item = await q.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield s, item
        finally:
            for t in tasks:
                t.cancel()
            self.abort(subs)

    # ------------------------------------------------------------------ output formatting
    @staticmethod
    def usage(subs: list[EngineRequest], reasoning_tokens: int | None = None) -> Usage:
        """The request's usage; `reasoning_tokens` (with a reasoning parser) goes in completion_tokens_details."""
        prompt = sum(len(s.prompt_ids) for s in subs)
        cached = sum(s.final.num_cached_tokens for s in subs if s.final is not None)
        completion = sum(len(c.token_ids) for s in subs if s.final is not None for c in s.final.outputs)
        usage = Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )
        if reasoning_tokens is not None:
            usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
        return usage

    @staticmethod
    def partial_usage(s: EngineRequest, out: RequestOutput) -> Usage:
        ntok = sum(len(c.token_ids) for c in out.outputs)
        return Usage(prompt_tokens=len(s.prompt_ids), completion_tokens=ntok, total_tokens=len(s.prompt_ids) + ntok)

    def prompt_logprobs(self, out: RequestOutput) -> PromptLogprobs:
        """vLLM's per-prompt-token form: None for the first token, else {token id: {logprob, decoded_token}}."""
        return [
            None
            if d is None
            else {
                str(t): PromptLogprob(logprob=finite_logprob(v), decoded_token=self.token_str(t)) for t, v in d.items()
            }
            for d in out.prompt_logprobs or []
        ]

    def completion_logprobs(
        self, ids: list[int], lps: list[dict[int, float] | None], k: int, offset: int
    ) -> CompletionLogprobs:
        """The completions API's parallel lists over tokens `ids` (whose logprob dicts are `lps`)."""
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for tid, d in zip(ids, lps):
            s = self.token_str(tid)
            tokens.append(s)
            token_lps.append(None if d is None or tid not in d else finite_logprob(d[tid]))
            top = sorted((d or {}).items(), key=lambda kv: kv[1], reverse=True)[:k]
            tops.append(None if d is None else {self.token_str(t): finite_logprob(v) for t, v in top})
            offsets.append(offset)
            offset += len(s)
        return CompletionLogprobs(text_offset=offsets, token_logprobs=token_lps, tokens=tokens, top_logprobs=tops)

    def chat_logprobs(self, c: CompletionOutput, start: int, end: int, k: int) -> ChatChoiceLogprobs:
        content = []
        for tid, d in zip(c.token_ids[start:end], (c.logprobs or [])[start:end]):
            top = sorted(d.items(), key=lambda kv: kv[1], reverse=True)[:k]
            content.append(
                ChatLogprob(
                    token=self.token_str(tid),
                    logprob=finite_logprob(d.get(tid, -9999.0)),
                    bytes=list(self.token_str(tid).encode("utf-8")),
                    top_logprobs=[
                        TopLogprob(
                            token=self.token_str(t),
                            logprob=finite_logprob(v),
                            bytes=list(self.token_str(t).encode("utf-8")),
                        )
                        for t, v in top
                    ],
                )
            )
        return ChatChoiceLogprobs(content=content)

    @staticmethod
    def check_error(c: CompletionOutput, param: str | None = None) -> None:
        """A failed choice as an error: the request's own fault (its grammar, which llguidance took but then
        cannot follow) is a 400 naming `param`, the field the constraint came from; anything else a 500."""
        if c.finish_reason == "error":
            if c.bad_request:
                raise APIError(c.error or "the request cannot be served", 400, param=param)
            raise APIError(f"Generation failed: {c.error or 'engine error'}", 500)


def json_response(body: ResponseModel | Response) -> Response:
    """A built answer as JSON (a Response is one already: the client went away, see cancel_on_disconnect)."""
    return body if isinstance(body, Response) else JSONResponse(body.body())


def serving(request: Request) -> ServingContext:
    """The FastAPI dependency that hands a route its ServingContext."""
    ctx: ServingContext = request.app.state.serving
    return ctx


def request_id(request: Request, given: str | None, prefix: str) -> str:
    """`<prefix>-<uuid>`, or `<prefix>-<X-Request-Id or body request_id>-<8 hex>` so a reused one cannot
    collide."""
    given = given or request.headers.get("x-request-id") or None
    return f"{prefix}-{given}-{uuid.uuid4().hex[:8]}" if given else f"{prefix}-{uuid.uuid4().hex}"


async def cancel_on_disconnect(request: Request, coro: Coroutine[Any, Any, T]) -> T | Response:
    """Run `coro` (a non-streaming answer); if the client goes away first, cancel it, which aborts its engine
    requests and frees their blocks at once instead of after a whole generation nobody will read."""
    task = asyncio.ensure_future(coro)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return Response(status_code=499)  # nobody reads it
    finally:
        watcher.cancel()
        task.cancel()
