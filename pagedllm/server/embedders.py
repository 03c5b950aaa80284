"""What serves /v1/embeddings: the engine itself pooling a decoder's hidden states (`EngineEmbedder`, through
the engine's own batching, next to generation requests), or an encoder model such as all-MiniLM-L6-v2 run by
sentence-transformers (`SentenceTransformerEmbedder`), so its vectors are exactly the library's. Both check
every input before any work starts: a bad request is a 400 naming the field, and leaves nothing queued."""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

from pagedllm.engine.pooling import PoolerConfig, read_pooler_config
from pagedllm.errors import UserError
from pagedllm.sampling_params import PoolingParams
from pagedllm.server.config import DEFAULT_MAX_EMBEDDING_TOKENS
from pagedllm.server.errors import APIError
from pagedllm.server.serving_engine import EngineRequest, ServingContext

Inputs = list[str] | list[list[int]]
T = TypeVar("T")
ENCODE_BATCH = 32  # inputs per turn at a sentence-transformers model (its own encode batch)
POOLING_IN_FLIGHT = 32  # inputs of one request in the engine at once (--runner pooling)


class Embedder(Protocol):
    """One embedding model: the names requests pick it by, and its vectors (with the tokens they took)."""

    names: list[str]
    max_len: int  # tokens an input may have

    async def embed(
        self,
        inputs: Inputs,
        dimensions: int | None,
        request_id: str,
        truncate: int | None = None,
        budget: int = DEFAULT_MAX_EMBEDDING_TOKENS,
    ) -> tuple[list[list[float]], int]:
        """The vectors of `inputs`, in order, and the tokens counted; APIError for a bad input or dimensions.
        `truncate`: keep each input's last that many tokens (-1: as many as the model takes), vLLM's
        truncate_prompt_tokens; without it an input over the model's limit is a 400. `budget`: the tokens the
        inputs may hold in all (--max-embedding-tokens), past it a 400 before any work."""


def check_dimensions(pooler: PoolerConfig, dimensions: int | None, size: int) -> None:
    try:
        pooler.check_dimensions(dimensions, size)
    except UserError as e:
        raise APIError(str(e), 400, param="dimensions") from None


def check_lengths(lengths: list[int], limit: int, what: str, budget: int) -> None:
    """Every input fits the model (`limit` tokens at most), and all of them the request's `budget`
    (--max-embedding-tokens: one client's request is not minutes of the model's time), or a 400 naming `input`."""
    for i, n in enumerate(lengths):
        if n == 0:
            raise APIError(f"input[{i}] has no tokens", 400, param="input")
        if n > limit:
            raise APIError(
                f"input[{i}] has {n} tokens, more than the {limit} tokens {what} takes; shorten it", 400, param="input"
            )
    if sum(lengths) > budget:
        raise APIError(
            f"input: {sum(lengths):,} tokens in all, more than the {budget:,} one request may hold "
            "(--max-embedding-tokens); send fewer or shorter inputs",
            400,
            param="input",
        )


def check_vocabulary(ids: list[list[int]], vocab_size: int) -> None:
    """Every token id is in the model's vocabulary (an id past its embedding table is a 400, not an IndexError)."""
    for i, row in enumerate(ids):
        bad = next((t for t in row if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise APIError(
                f"input[{i}]: token id {bad} is out of range for this model's vocabulary of {vocab_size}",
                400,
                param="input",
            )


class Turns:
    """First come, first served turns at one model, one per batch (issue 38.3): a request queues behind the
    others for each of its batches, so a one-line request waits for one batch of a large one, not all of it.
    asyncio.Lock hands itself to its waiters in order; one per event loop (one embedder may serve two apps'
    loops, as in tests), and the thread lock beneath keeps the model to one call at a time across them and
    past a cancelled turn whose thread still runs. `waiting`: turns queued now."""

    def __init__(self) -> None:
        self._locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()
        self._model = threading.Lock()
        self.waiting = 0

    def _alone(self, fn: Callable[..., T], *args: Any) -> T:
        with self._model:
            return fn(*args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a worker thread, in its turn."""
        lock = self._locks.setdefault(asyncio.get_running_loop(), asyncio.Lock())
        self.waiting += 1
        try:
            await lock.acquire()
        finally:
            self.waiting -= 1
        try:
            return await asyncio.to_thread(self._alone, fn, *args)
        finally:
            lock.release()


class EngineEmbedder:
    """The engine's model as an embedding model (`pagedllm serve --runner pooling`): one pooling request per
    input, batched by the scheduler with whatever else runs; a request that ends early (client gone, error)
    aborts its pooling requests, so their blocks come back."""

    def __init__(self, ctx: ServingContext, pooler: PoolerConfig) -> None:
        self.ctx = ctx
        self.pooler = pooler
        self.names = list(ctx.model_names)
        self.max_len = ctx.engine.max_model_len - 1

    async def embed(
        self,
        inputs: Inputs,
        dimensions: int | None,
        request_id: str,
        truncate: int | None = None,
        budget: int = DEFAULT_MAX_EMBEDDING_TOKENS,
    ) -> tuple[list[list[float]], int]:
        ctx = self.ctx
        check_dimensions(self.pooler, dimensions, ctx.engine.model_config.hidden_size)
        prompts = [await ctx.encode(x, add_special_tokens=True) if isinstance(x, str) else x for x in inputs]
        limit = ctx.engine.max_model_len - 1  # the engine takes prompts shorter than max_model_len
        if truncate is not None:
            keep = limit if truncate == -1 else min(truncate, limit)
            prompts = [p[-keep:] for p in prompts]
        check_lengths([len(p) for p in prompts], limit, "this model", budget)
        for p in prompts:
            ctx.check_token_ids(p, "input")
        waiting = ctx.engine.max_waiting_requests
        if waiting and len(prompts) > waiting:  # it could never be admitted whole: a 400, not a 503 to retry
            raise APIError(
                f"input: {len(prompts)} inputs are more than the server's --max-waiting-requests ({waiting})",
                400,
                param="input",
            )
        vectors = []
        for s in await self._pooled(prompts, self.pooler.params(dimensions), request_id):
            assert s.final is not None
            ctx.check_error(s.final.outputs[0], "input")
            if s.final.embedding is None:
                raise APIError("the engine returned no embedding", 500)
            vectors.append(s.final.embedding)
        return vectors, sum(len(p) for p in prompts)

    async def _pooled(self, prompts: list[list[int]], params: PoolingParams, request_id: str) -> list[EngineRequest]:
        """Each input's pooling request run to its end, at most POOLING_IN_FLIGHT of them in the engine at once
        (the next queued as one ends): another request's inputs wait behind that many in the engine's queue, not
        behind all of a large request's (issue 38.3). Leaving early aborts those in the engine."""
        slots = asyncio.Semaphore(POOLING_IN_FLIGHT)

        async def one(i: int, prompt: list[int]) -> EngineRequest:
            async with slots:
                (sub,) = await self.ctx.submit([prompt], params, request_id, first=i)
                await self.ctx.run_to_end([sub])
                return sub

        tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()


def embedding_model_path(path: str) -> tuple[str, str]:
    """--embedding-model's folder and the name it is served by ('default': the bundled all-MiniLM-L6-v2); a
    UserError naming the flag when it is not there (checked before anything loads: the cluster checks it before
    Ray starts, not in an ingress that would fail over and over)."""
    if path == "default":
        from pagedllm.rag.embed import EMBED_MODEL_NAME, embed_model_path

        return embed_model_path(), EMBED_MODEL_NAME
    if not os.path.isdir(path):
        raise UserError(f"--embedding-model: {path} is not a folder")
    return path, os.path.basename(os.path.normpath(path))


class SentenceTransformerEmbedder:
    """An encoder model run by sentence-transformers (its own modules: pooling, Normalize), served by the name
    of its folder; `default` is the bundled all-MiniLM-L6-v2 (the one `pagedllm rag` embeds with)."""

    def __init__(self, path: str, device: str = "cpu") -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError:
            raise UserError("--embedding-model: needs sentence-transformers: pip install 'pagedllm[rag]'") from None
        path, name = embedding_model_path(path)
        self.model = SentenceTransformer(path, device=device)
        self.names = [name]
        self.pooler = read_pooler_config(path)
        self.max_len = int(self.model.max_seq_length or 512)
        get_dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(get_dim() or 0)
        encoder: Any = self.model[0]  # sentence-transformers' Transformer module: its embedding table's rows
        self.vocab_size = int(encoder.auto_model.get_input_embeddings().num_embeddings)
        self.turns = Turns()  # one batch at a time, requests in turn: the model is not made for concurrent calls

    async def embed(
        self,
        inputs: Inputs,
        dimensions: int | None,
        request_id: str,
        truncate: int | None = None,
        budget: int = DEFAULT_MAX_EMBEDDING_TOKENS,
    ) -> tuple[list[list[float]], int]:
        check_dimensions(self.pooler, dimensions, self.dim)
        texts = [x for x in inputs if isinstance(x, str)]
        if texts:
            ids = [row for part in await self._batched(self._token_ids, texts) for row in part]
        else:
            ids = [x for x in inputs if isinstance(x, list)]
        check_vocabulary(ids, self.vocab_size)
        if truncate is not None and not (texts and truncate in (-1, self.max_len)):
            keep = self.max_len if truncate == -1 else min(truncate, self.max_len)
            ids, texts = [i[-keep:] for i in ids], []
        elif truncate is not None:  # the model's own limit: sentence-transformers cuts texts to it itself
            ids = [i[: self.max_len - 1] + i[-1:] if len(i) > self.max_len else i for i in ids]
        check_lengths([len(i) for i in ids], self.max_len, "this model", budget)
        vecs = torch.cat(await self._batched(self._encode, texts if texts else ids))
        if dimensions is not None:
            vecs = vecs[:, :dimensions]
            if self.pooler.normalize:
                vecs = vecs / vecs.norm(dim=1, keepdim=True).clamp_min(1e-12)
        return vecs.tolist(), sum(len(i) for i in ids)

    async def _batched(self, fn: Callable[[Any], T], items: list[Any]) -> list[T]:
        """`fn` of each ENCODE_BATCH of `items`, each batch in its turn (Turns), in order."""
        return [await self.turns.run(fn, items[i : i + ENCODE_BATCH]) for i in range(0, len(items), ENCODE_BATCH)]

    def _token_ids(self, texts: list[str]) -> list[list[int]]:
        return [list(x) for x in self.model.tokenizer(texts, add_special_tokens=True)["input_ids"]]

    def _encode(self, inputs: Inputs) -> torch.Tensor:
        """float32 vectors [len(inputs), dim]: texts through `encode`, token ids through the modules directly."""
        with torch.inference_mode():
            if inputs and isinstance(inputs[0], str):
                vecs = self.model.encode(inputs, batch_size=32, convert_to_tensor=True, show_progress_bar=False)
                return vecs.float().cpu()
            out = []
            for ids in inputs:
                t = torch.tensor([ids], device=self.model.device)
                features = {"input_ids": t, "attention_mask": torch.ones_like(t), "token_type_ids": torch.zeros_like(t)}
                out.append(self.model(features)["sentence_embedding"][0].float().cpu())
            return torch.stack(out)
