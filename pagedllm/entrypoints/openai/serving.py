"""What /v1/completions, /v1/chat/completions, /tokenize and /detokenize do, over an AsyncLLMEngine.

A request becomes one engine request per prompt (with `n` completions each); their cumulative outputs are turned
into OpenAI response objects, or into server-sent-event chunks carrying only the part not sent yet. Everything that
can be checked before generation starts (model name, prompt length, n, parameters the engine refuses, the waiting
limit) is checked before the HTTP response begins, so a streaming request gets a proper status code too.
"""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from pagedllm.engine.async_engine import AsyncLLMEngine, RequestAbortedError
from pagedllm.entrypoints.openai import protocol as P
from pagedllm.entrypoints.openai.errors import APIError, error_sse

logger = logging.getLogger("pagedllm.server")


def _sampling_params_module() -> Any:
    import importlib

    for name in ("pagedllm.engine.sampling_params", "pagedllm.sampling_params"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("pagedllm has no SamplingParams module")


def _accepted_fields(cls: type) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    fields = getattr(cls, "model_fields", None)
    if fields:
        return set(fields)
    return {n for n, p in inspect.signature(cls).parameters.items() if n != "self"}


def _sse(body: dict[str, Any]) -> str:
    return "data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")) + "\n\n"


@dataclasses.dataclass
class _Chunks:
    """Makes the SSE chunks of one streamed response, completion or chat: every chunk carries the same id, object,
    creation time and model, and a usage field exactly when the request's stream_options ask for one."""

    request_id: str
    object: str
    model: str
    include_usage: bool
    continuous: bool  # usage on every chunk, not only the last
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @classmethod
    def for_request(cls, req: Any, request_id: str, obj: str, model: str) -> _Chunks:
        opts = req.stream_options
        return cls(request_id, obj, model, bool(opts and opts.include_usage),
                   bool(opts and opts.continuous_usage_stats))

    def __call__(self, choices: list[dict], usage: dict | None = None) -> str:
        body: dict[str, Any] = {"id": self.request_id, "object": self.object, "created": self.created,
                                "model": self.model, "choices": choices}
        if self.include_usage:
            body["usage"] = usage
        return _sse(body)


@dataclasses.dataclass
class _Sub:
    """One engine request of an HTTP request: prompt `prompt_index`, choices base .. base + n_here - 1."""

    prompt_index: int
    base: int
    request_id: str
    prompt_ids: list[int]
    stream: Any = None
    final: Any = None


@dataclasses.dataclass
class _ChoiceState:
    text_sent: int = 0
    tokens_sent: int = 0
    finished: bool = False


@dataclasses.dataclass
class _Piece:
    """What one choice produced since its last chunk: text[text_from:], tokens [tokens_from, tokens_to)."""

    index: int
    text: str
    text_from: int
    tokens_from: int
    tokens_to: int
    done: bool


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str], max_n: int | None = None) -> None:
        self.engine = engine
        self.names = served_model_names
        sp_module = _sampling_params_module()
        self.max_n = max_n or int(getattr(sp_module, "MAX_N", 0) or 0) or 64
        self.sp_cls = sp_module.SamplingParams
        self.sp_fields = _accepted_fields(self.sp_cls)
        self.engine_does_n = "n" in self.sp_fields
        self._tok_cache: dict[int, str] = {}

    # ------------------------------------------------------------------ tokenizer adapters
    @property
    def tok(self) -> Any:
        return self.engine.tokenizer

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """None: the tokenizer's default, which is what the engine uses for a text prompt (LLM.generate too)."""
        if add_special_tokens is None:
            return list(self.tok.encode(text))
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        try:
            return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)
        except TypeError:
            return self.tok.decode(ids)

    def token_str(self, tid: int) -> str:
        s = self._tok_cache.get(tid)
        if s is None:
            s = self._tok_cache[tid] = self.decode([tid], skip_special_tokens=False)
        return s

    def vocab_size(self) -> int | None:
        for obj, name in ((self.engine.engine, "model_config"),):
            mc = getattr(obj, name, None)
            v = getattr(mc, "vocab_size", None)
            if v:
                return int(v)
        try:
            return len(self.tok)
        except TypeError:
            return None

    def chat_prompt_ids(self, messages: list[P.ChatMessage], add_generation_prompt: bool,
                        continue_final_message: bool) -> list[int]:
        try:
            msgs = [{"role": m.role, "content": m.text()} for m in messages]
        except ValueError as e:
            raise APIError(str(e), 400, param="messages") from None
        if continue_final_message:
            raise APIError("continue_final_message is not supported", 400, param="continue_final_message")
        try:
            out = self.tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # a template that refuses the conversation (roles out of order, ...)
            raise APIError(f"Cannot apply the chat template to these messages: {e}", 400, param="messages") from None
        if isinstance(out, str):
            return self.encode(out, add_special_tokens=False)
        if isinstance(out, dict):
            out = out["input_ids"]
        return list(out)

    # ------------------------------------------------------------------ checks and parameters
    def check_model(self, model: str | None) -> str:
        if model is None:
            return self.names[0]
        if model not in self.names:
            raise APIError(f"The model `{model}` does not exist. Available models: {', '.join(self.names)}", 404,
                           param="model")
        return model

    def check_n(self, n: int) -> None:
        if n > self.max_n:
            raise APIError(f"Invalid value for 'n': must be at most {self.max_n} (got {n})", 400, param="n")

    def check_length(self, n_prompt: int, max_tokens: int | None, what: str) -> None:
        limit = self.engine.max_model_len
        if n_prompt == 0:
            raise APIError(f"The {what} is empty", 400, param=what)
        if n_prompt >= limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, your {what} has {n_prompt} "
                f"tokens. Please reduce the length of the {what}.", 400, param=what)
        if max_tokens is not None and n_prompt + max_tokens > limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the {what}, {max_tokens} in the completion). "
                f"Please reduce the length of the {what} or completion.", 400, param="max_tokens")

    def check_token_ids(self, ids: list[int]) -> None:
        vs = self.vocab_size()
        bad = [t for t in ids if t < 0 or (vs is not None and t >= vs)]
        if bad:
            raise APIError(f"Invalid value for 'prompt': token id {bad[0]} is out of range [0, {vs})", 400,
                           param="prompt")

    def sampling_params(self, req: P._SamplingFields, max_tokens: int | None, logprobs: int | None) -> Any:
        stop = [req.stop] if isinstance(req.stop, str) else (list(req.stop) if req.stop else None)
        wanted: dict[str, Any] = {
            "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p,
            "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
            "repetition_penalty": req.repetition_penalty, "seed": req.seed, "stop": stop,
            "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos, "max_tokens": max_tokens,
            "min_tokens": req.min_tokens, "logprobs": logprobs, "skip_special_tokens": req.skip_special_tokens,
        }
        if self.engine_does_n:
            wanted["n"] = req.n
        defaults = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "ignore_eos": False, "min_tokens": 0,
                    "skip_special_tokens": True}
        kw: dict[str, Any] = {"max_tokens": max_tokens}  # None: up to max_model_len
        for k, v in wanted.items():
            if v is None or k == "max_tokens":
                continue
            if k not in self.sp_fields:
                if k in defaults and v == defaults[k]:
                    continue
                raise APIError(f"'{k}' is not supported by this engine", 400, param=k)
            kw[k] = v
        try:
            return self.sp_cls(**kw)
        except (ValueError, TypeError) as e:
            raise APIError(str(e), 400, param=getattr(e, "param", None)) from None

    # ------------------------------------------------------------------ engine requests
    async def submit(self, prompts: list[list[int]], params: Any, n: int, request_id: str) -> list[_Sub]:
        subs: list[_Sub] = []
        for i, ids in enumerate(prompts):
            if self.engine_does_n:
                subs.append(_Sub(i, i * n, f"{request_id}-{i}", ids))
            else:
                subs.extend(_Sub(i, i * n + j, f"{request_id}-{i}-{j}", ids) for j in range(n))
        results = await asyncio.gather(*(self.engine.add_request(s.prompt_ids, params, s.request_id) for s in subs),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for s, r in zip(subs, results):
                if not isinstance(r, BaseException):
                    self.engine.abort(s.request_id)
            e = errors[0]
            if isinstance(e, ValueError) and not isinstance(e, APIError):
                raise APIError(str(e), 400) from None
            raise e
        for s, r in zip(subs, results):
            s.stream = r
        return subs

    def abort(self, subs: list[_Sub]) -> None:
        for s in subs:
            if s.final is None:
                self.engine.abort(s.request_id)

    async def run_to_end(self, subs: list[_Sub]) -> None:
        async def last(s: _Sub) -> None:
            async for out in self.engine.iterate(s.stream):
                s.final = out

        tasks = [asyncio.ensure_future(last(s)) for s in subs]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            self.abort(subs)

    async def merged(self, subs: list[_Sub]) -> AsyncIterator[tuple[_Sub, Any]]:
        """(sub, cumulative output) as they come, from all subs; leaving early aborts them all."""
        if len(subs) == 1:
            s = subs[0]
            async for out in self.engine.iterate(s.stream):
                if out.finished:
                    s.final = out
                yield s, out
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(s: _Sub) -> None:
            try:
                async for out in self.engine.iterate(s.stream):
                    if out.finished:
                        s.final = out
                    q.put_nowait((s, out))
                q.put_nowait((s, None))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                q.put_nowait((s, e))
                if isinstance(e, asyncio.CancelledError):
                    raise

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
    def usage(self, subs: list[_Sub]) -> dict[str, Any]:
        prompt = cached = 0
        seen: set[int] = set()
        completion = 0
        for s in subs:
            out = s.final
            if s.prompt_index not in seen:
                seen.add(s.prompt_index)
                prompt += len(s.prompt_ids)
                cached += int(getattr(out, "num_cached_tokens", 0) or 0) if out is not None else 0
            if out is not None:
                completion += sum(len(c.token_ids) for c in out.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _lp_entries(self, c: Any, start: int, end: int) -> list[tuple[int, float | None, list[tuple[int, float]]]]:
        """(token id, its logprob, top (id, logprob) pairs) for generated tokens start..end-1."""
        lps = c.logprobs or []
        res = []
        for i in range(start, min(end, len(c.token_ids))):
            tid = c.token_ids[i]
            d = lps[i] if i < len(lps) else {}
            top = sorted(d.items(), key=lambda kv: kv[1], reverse=True)
            res.append((tid, d.get(tid), top))
        return res

    def completion_logprobs(self, c: Any, start: int, end: int, k: int, offset: int) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, lp, top in self._lp_entries(c, start, end):
            s = self.token_str(tid)
            tokens.append(s)
            token_lps.append(lp)
            tops.append({self.token_str(t): v for t, v in top[:k]} if k else None)
            offsets.append(offset)
            offset += len(s)
        return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}

    def chat_logprobs(self, c: Any, start: int, end: int, k: int) -> dict[str, Any]:
        content = []
        for tid, lp, top in self._lp_entries(c, start, end):
            s = self.token_str(tid)
            content.append({"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")),
                            "top_logprobs": [{"token": self.token_str(t), "logprob": v,
                                              "bytes": list(self.token_str(t).encode("utf-8"))}
                                             for t, v in top[:k]]})
        return {"content": content}

    @staticmethod
    def _check_error(c: Any) -> None:
        if getattr(c, "finish_reason", None) == "error":
            raise APIError(f"Generation failed: {getattr(c, 'error', None) or 'engine error'}", 500)

    # ------------------------------------------------------------------ /v1/completions
    async def _prepare_completion(self, req: P.CompletionRequest) -> tuple[str, list[list[int]], list[str], Any]:
        model = self.check_model(req.model)
        self.check_n(req.n)
        p = req.prompt
        if isinstance(p, str):
            texts: list[str | None] = [p]
        elif p and isinstance(p[0], str):
            texts = list(p)  # type: ignore[arg-type]
        else:
            texts = [None] * (1 if p and isinstance(p[0], int) else len(p))
        prompts: list[list[int]] = []
        if isinstance(p, list) and p and isinstance(p[0], int):
            prompts = [list(p)]  # type: ignore[arg-type]
        elif isinstance(p, list) and p and isinstance(p[0], list):
            prompts = [list(x) for x in p]  # type: ignore[union-attr]
        else:
            prompts = [self.encode(t) for t in texts]  # type: ignore[arg-type]
        for ids in prompts:
            self.check_token_ids(ids)
            self.check_length(len(ids), req.max_tokens, "prompt")
        echo_texts = [t if t is not None else self.decode(ids) for t, ids in zip(texts, prompts)] if req.echo else []
        params = self.sampling_params(req, req.max_tokens, req.logprobs)
        return model, prompts, echo_texts, params

    async def completion(self, req: P.CompletionRequest, request_id: str) -> dict[str, Any]:
        model, prompts, echo_texts, params = await self._prepare_completion(req)
        subs = await self.submit(prompts, params, req.n, request_id)
        try:
            await self.run_to_end(subs)
        except RequestAbortedError as e:
            raise APIError(f"The request was aborted: {e}", 503) from None
        choices = []
        for s in subs:
            for c in s.final.outputs:
                self._check_error(c)
                prefix = echo_texts[s.prompt_index] if req.echo else ""
                choices.append({
                    "index": s.base + c.index, "text": prefix + c.text,
                    "logprobs": (self.completion_logprobs(c, 0, len(c.token_ids), req.logprobs, len(prefix))
                                 if req.logprobs is not None else None),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason, "prompt_logprobs": None,
                })
        choices.sort(key=lambda ch: ch["index"])
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": self.usage(subs), "system_fingerprint": None}

    async def completion_stream(self, req: P.CompletionRequest, request_id: str) -> tuple[AsyncIterator[str], Any]:
        model, prompts, echo_texts, params = await self._prepare_completion(req)
        subs = await self.submit(prompts, params, req.n, request_id)
        chunk = _Chunks.for_request(req, request_id, "text_completion", model)

        async def gen() -> AsyncIterator[str]:
            if req.echo:
                for s in subs:
                    for j in range(req.n if self.engine_does_n else 1):
                        yield chunk([{"index": s.base + j, "text": echo_texts[s.prompt_index],
                                      "logprobs": None, "finish_reason": None, "stop_reason": None}])
            async for s, out, c, p in self._pieces(subs):
                lp = (self.completion_logprobs(c, p.tokens_from, p.tokens_to, req.logprobs, p.text_from)
                      if req.logprobs is not None else None)
                yield chunk([{"index": p.index, "text": p.text, "logprobs": lp,
                              "finish_reason": c.finish_reason if p.done else None,
                              "stop_reason": c.stop_reason if p.done else None}],
                            self._partial_usage(subs, s, out) if chunk.continuous else None)
            if chunk.include_usage:
                yield chunk([], self.usage(subs))

        return self._events(gen(), subs), lambda: self.abort(subs)

    async def _pieces(self, subs: list[_Sub]) -> AsyncIterator[tuple[_Sub, Any, Any, _Piece]]:
        """Each choice's new text and tokens as the engine produces them, skipping outputs that add nothing and
        anything after a choice finished: what both streaming endpoints send, each in its own wrapping."""
        states: dict[int, _ChoiceState] = {}
        async for s, out in self.merged(subs):
            for c in out.outputs:
                self._check_error(c)
                idx = s.base + c.index
                st = states.setdefault(idx, _ChoiceState())
                if st.finished:
                    continue
                ntok, done = len(c.token_ids), c.finish_reason is not None
                if len(c.text) == st.text_sent and ntok == st.tokens_sent and not done:
                    continue
                piece = _Piece(idx, c.text[st.text_sent:], st.text_sent, st.tokens_sent, ntok, done)
                st.text_sent, st.tokens_sent, st.finished = len(c.text), ntok, done
                yield s, out, c, piece

    async def _events(self, events: AsyncIterator[str], subs: list[_Sub]) -> AsyncIterator[str]:
        """How every stream ends, whatever ended it: an error becomes an SSE error event, the engine requests
        are aborted (freeing their blocks), and `[DONE]` closes it unless the client is already gone."""
        try:
            async for event in events:
                yield event
        except asyncio.CancelledError:
            raise
        except RequestAbortedError as e:
            yield error_sse(APIError(f"The request was aborted: {e}", 503))
        except APIError as e:
            yield error_sse(e)
        except Exception as e:  # noqa: BLE001
            logger.exception("streaming failed")
            yield error_sse(APIError(f"Internal server error: {type(e).__name__}: {e}", 500))
        finally:
            await events.aclose()
            self.abort(subs)
        yield "data: [DONE]\n\n"

    def _partial_usage(self, subs: list[_Sub], s: _Sub, out: Any) -> dict[str, Any]:
        ntok = sum(len(c.token_ids) for c in out.outputs)
        n_prompt = len(s.prompt_ids)
        return {"prompt_tokens": n_prompt, "completion_tokens": ntok, "total_tokens": n_prompt + ntok}

    # ------------------------------------------------------------------ /v1/chat/completions
    async def _prepare_chat(self, req: P.ChatCompletionRequest) -> tuple[str, list[int], Any, int | None]:
        model = self.check_model(req.model)
        self.check_n(req.n)
        ids = self.chat_prompt_ids(req.messages, req.add_generation_prompt, req.continue_final_message)
        max_tokens = req.effective_max_tokens
        self.check_length(len(ids), max_tokens, "messages")
        if max_tokens is None:
            max_tokens = self.engine.max_model_len - len(ids)
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, k)
        return model, ids, params, k

    async def chat(self, req: P.ChatCompletionRequest, request_id: str) -> dict[str, Any]:
        model, ids, params, k = await self._prepare_chat(req)
        subs = await self.submit([ids], params, req.n, request_id)
        try:
            await self.run_to_end(subs)
        except RequestAbortedError as e:
            raise APIError(f"The request was aborted: {e}", 503) from None
        choices = []
        for s in subs:
            for c in s.final.outputs:
                self._check_error(c)
                choices.append({
                    "index": s.base + c.index, "message": {"role": "assistant", "content": c.text,
                                                           "tool_calls": []},
                    "logprobs": self.chat_logprobs(c, 0, len(c.token_ids), k) if k is not None else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                })
        choices.sort(key=lambda ch: ch["index"])
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": self.usage(subs), "system_fingerprint": None}

    async def chat_stream(self, req: P.ChatCompletionRequest, request_id: str) -> tuple[AsyncIterator[str], Any]:
        model, ids, params, k = await self._prepare_chat(req)
        subs = await self.submit([ids], params, req.n, request_id)
        chunk = _Chunks.for_request(req, request_id, "chat.completion.chunk", model)

        async def gen() -> AsyncIterator[str]:
            for i in range(req.n):
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            async for s, out, c, p in self._pieces(subs):
                lp = self.chat_logprobs(c, p.tokens_from, p.tokens_to, k) if k is not None else None
                yield chunk([{"index": p.index, "delta": {"content": p.text} if p.text or not p.done else {},
                              "logprobs": lp, "finish_reason": c.finish_reason if p.done else None,
                              "stop_reason": c.stop_reason if p.done else None}],
                            self._partial_usage(subs, s, out) if chunk.continuous else None)
            if chunk.include_usage:
                yield chunk([], self.usage(subs))

        return self._events(gen(), subs), lambda: self.abort(subs)

    # ------------------------------------------------------------------ /tokenize, /detokenize
    def tokenize(self, req: P.TokenizeCompletionRequest | P.TokenizeChatRequest) -> dict[str, Any]:
        self.check_model(req.model)
        if isinstance(req, P.TokenizeChatRequest):
            ids = self.chat_prompt_ids(req.messages, req.add_generation_prompt, req.continue_final_message)
        else:
            ids = self.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids,
                "token_strs": [self.token_str(t) for t in ids] if req.return_token_strs else None}

    def detokenize(self, req: P.DetokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        self.check_token_ids(req.tokens)
        return {"prompt": self.decode(req.tokens, skip_special_tokens=False)}

