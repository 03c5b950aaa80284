"""The engine loop: add requests, then `step()` schedules, runs the model once, samples, and reports progress.

Sizing happens once at start-up: the KV cache gets a fixed budget (`--kv-cache-memory`, or a share of the
device's memory after the weights and a warm-up step of the largest batch), cut into blocks.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from pagedllm.engine.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig
from pagedllm.engine.disk_tier import open_disk_tier
from pagedllm.engine.outputs import RequestMetrics, RequestOutput
from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.spec_decode import NgramDrafter, SpecDecodeStats, num_accepted
from pagedllm.engine.stats import EngineStats
from pagedllm.errors import UserError
from pagedllm.kv.events import KVEventLog
from pagedllm.kv.manager import PagedKVCacheManager, cdiv, make_kv_cache_manager
from pagedllm.kv.sizing import kv_dtype_bytes_per_token
from pagedllm.model.kv_quant import QUANT_KV_DTYPES
from pagedllm.model.loader import DTYPES, LoadedModel, load_model
from pagedllm.model.runner import ModelRunner, SeqChunk, bytes_per_block
from pagedllm.model.sampler import SampleResult, SamplingRow, sample, token_logprobs
from pagedllm.sampling_params import SamplingParams, SamplingParamsError

logger = logging.getLogger("pagedllm")


@dataclass
class _Parent:
    """One user request; its n samples are child Requests."""

    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    metrics: RequestMetrics
    holdback: int  # characters of text kept back while they could start a stop string


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise UserError(f"--device: {e}") from None


def _sample_alone(logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult] | Exception:
    try:
        return sample(logits, rows)
    except Exception as e:  # noqa: BLE001 - handed back to fail these rows' request
        return e


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None) -> None:
        """`loaded` reuses weights already in memory (several engines side by side in a benchmark or test)."""
        self.config = config = config or EngineConfig()
        device = resolve_device(config.device) if loaded is None else loaded.device
        self.loaded = loaded or load_model(config.model, config.dtype, device, quantization=config.quantization)
        self.tokenizer = self.loaded.tokenizer
        self.model_config = cfg = self.loaded.config
        logger.info("loaded %s (%s, %s) in %.1f s", cfg.name, self.loaded.dtype, device, self.loaded.load_seconds)

        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise UserError(f"--max-model-len: {self.max_model_len} is more than the model's "
                            f"{cfg.max_position_embeddings} positions")
        self.block_size = config.block_size
        self.kv_dtype = (self.loaded.dtype if config.kv_cache_dtype == "auto"
                         else {**DTYPES, **QUANT_KV_DTYPES}[config.kv_cache_dtype])
        per_block = bytes_per_block(cfg, self.block_size, self.kv_dtype)
        budget = self._kv_budget(device)
        num_blocks = budget // per_block
        if config.kv_allocation == "contiguous" and num_blocks < cdiv(self.max_model_len, self.block_size):
            raise UserError(f"--kv-cache-memory: contiguous allocation reserves {self.max_model_len} tokens per "
                            f"request ({cdiv(self.max_model_len, self.block_size) * per_block:,} bytes) but the "
                            f"budget holds only {num_blocks} blocks; lower --max-model-len or raise the budget")
        if num_blocks < 1:
            raise UserError(f"--kv-cache-memory: {budget:,} bytes hold no KV block of {per_block:,} bytes")
        if num_blocks * self.block_size < self.max_model_len:
            logger.warning("the KV cache holds %d tokens, less than --max-model-len %d: longer requests will fail",
                           num_blocks * self.block_size, self.max_model_len)
        self.runner = ModelRunner(self.loaded, num_blocks, self.block_size, self.kv_dtype)
        self.kv = make_kv_cache_manager(config.kv_allocation, num_blocks, self.block_size, self.max_model_len,
                                        config.enable_prefix_caching)
        if config.enable_kv_cache_events:
            self.kv.pool.events = KVEventLog(self.block_size, device.type.upper())
        self.disk_tier = None
        if config.kv_offload_dir is not None and isinstance(self.kv, PagedKVCacheManager):
            self.disk_tier = open_disk_tier(config.kv_offload_dir, config.kv_offload_size, self.runner, self.block_size)
            self.kv.attach_disk_tier(self.disk_tier, self.runner)
        spec = config.speculative_config
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   NgramDrafter(spec, self.max_model_len) if spec else None)
        self.spec_stats = SpecDecodeStats()
        logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB %s, %d bytes/token, %s allocation, "
                    "prefix caching %s)", num_blocks, self.block_size, num_blocks * self.block_size,
                    num_blocks * per_block / 2**30, str(self.kv_dtype).removeprefix("torch."),
                    per_block // self.block_size, config.kv_allocation, "on" if config.enable_prefix_caching else "off")
        logger.info("KV bytes/token by --kv-cache-dtype: %s", ", ".join(
            f"{name} {kv_dtype_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, name):,}"
            for name in ("float32", "bfloat16", "int8", "fp8")))

        self.parents: dict[str, _Parent] = {}
        self.requests: dict[str, Request] = {}  # child id -> request, while unfinished
        self._ids = itertools.count()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_steps = 0
        self._log_time = time.monotonic()
        self._log_tokens = 0
        torch.manual_seed(config.seed)

    # ---- sizing -------------------------------------------------------------------------------------------
    def _kv_budget(self, device: torch.device) -> int:
        cfg = self.config
        if cfg.kv_cache_memory is not None:
            return cfg.kv_cache_memory
        if cfg.gpu_memory_utilization is None and device.type == "cpu":
            # quantized weights give back what they no longer take dequantized: the cache gets it
            return DEFAULT_CPU_KV_CACHE_MEMORY + max(0, self.loaded.dense_weight_bytes - self.loaded.weight_bytes)
        share = cfg.gpu_memory_utilization or 0.9
        total, used = self._profile(device)
        budget = int(share * total) - used
        logger.info("memory: %.2f GiB x %.2f, minus %.2f GiB for weights and activations -> KV budget %.2f GiB",
                    total / 2**30, share, used / 2**30, budget / 2**30)
        if budget <= 0:
            raise UserError(f"--gpu-memory-utilization: {share} of {total / 2**30:.1f} GiB leaves nothing for the KV "
                            f"cache after {used / 2**30:.2f} GiB of weights and activations")
        return budget

    def _profile(self, device: torch.device) -> tuple[int, int]:
        """(device memory, bytes in use after a warm-up step of the largest batch with a scratch cache)."""
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        scratch = ModelRunner(self.loaded, cdiv(n, self.block_size), self.block_size, self.kv_dtype)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        scratch.execute([SeqChunk([0] * n, 0, list(range(cdiv(n, self.block_size))))])
        del scratch
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[1], torch.cuda.max_memory_allocated(device)
        import psutil

        return psutil.virtual_memory().total, psutil.Process().memory_info().rss

    # ---- requests -----------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text or id prompt, checked against the vocabulary and max_model_len."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
                raise UserError(f"prompt: token ids must be integers in [0, {vocab})")
        if not ids:
            raise UserError("prompt: is empty")
        if len(ids) >= self.max_model_len:
            raise UserError(f"prompt: {len(ids)} tokens is too long: the maximum model length is "
                            f"{self.max_model_len} tokens, prompt and output together")
        return ids

    def _check_params(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """What only the engine knows how to check: token ids against the vocabulary, lengths against the model."""
        params.validate()
        vocab = self.model_config.vocab_size
        room = self.max_model_len - num_prompt_tokens
        if params.min_tokens > room:
            raise SamplingParamsError("min_tokens", f"{params.min_tokens} tokens do not fit after a prompt of "
                                      f"{num_prompt_tokens} tokens: the maximum model length is {self.max_model_len}")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise SamplingParamsError("logit_bias", f"token id {max(params.logit_bias)} is not in [0, {vocab})")
        if params.stop_token_ids and max(params.stop_token_ids) >= vocab:
            raise SamplingParamsError("stop_token_ids", f"token id {max(params.stop_token_ids)} is not in "
                                      f"[0, {vocab})")

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    cache_salt: str | None = None, *, prompt_token_ids: list[int] | None = None) -> None:
        """Queue a request (its n samples); `prompt_token_ids` gives the ids of a text prompt already encoded.

        Everything is checked and every sample built before anything is queued: a bad request leaves nothing.
        """
        params = params or SamplingParams()
        if request_id in self.parents:
            raise UserError(f"request id {request_id!r} is already in use")
        prompt_ids = self.encode_prompt(prompt if prompt_token_ids is None else prompt_token_ids)
        self._check_params(params, len(prompt_ids))
        metrics = RequestMetrics(arrival_time=time.monotonic())
        children = [Request(f"{request_id}#{i}", request_id, i, prompt_ids, params.for_sample(i), self.tokenizer,
                            metrics, cache_salt) for i in range(params.n)]
        for child in children:
            self.requests[child.request_id] = child
            self.scheduler.add(child)
        holdback = max((len(s) for s in params.stop), default=1) - 1
        self.parents[request_id] = _Parent(prompt if isinstance(prompt, str) else None, prompt_ids, children,
                                           metrics, holdback)

    def abort_request(self, request_id: str) -> None:
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return
        for child in parent.children:
            if not child.finished:
                child.finish("abort")
                self._release(child)

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def _release(self, req: Request) -> None:
        self.scheduler.remove(req)
        self.requests.pop(req.request_id, None)

    def _fail(self, req: Request, error: str, touched: dict[str, None]) -> None:
        """One request failed (its step or its sampling raised): it alone finishes with an error."""
        logger.warning("request %s failed: %s", req.request_id, error)
        req.finish("error", error=error)
        self._release(req)
        touched[req.parent_id] = None

    # ---- the step -----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        touched: dict[str, None] = {}  # parent ids with news, in order
        for req in sched.failed:
            self._release(req)
            touched[req.parent_id] = None
        if sched.scheduled:
            done = self._forward_guarded(sched.scheduled, touched)
            self._advance(done, touched)
            self.kv.commit_step()  # what acceptance registered (blocks of accepted drafts) has its K/V written
        self.num_steps += 1
        outputs = [self._output(pid) for pid in touched if pid in self.parents]
        if self.disk_tier is not None and not self.parents:  # idle now: the disk tier gets the hot prefixes too
            self.kv.offload_cached()
        self._maybe_log()
        return outputs

    def _chunk(self, req: Request, n: int) -> SeqChunk:
        """The request's next n tokens, then its drafts: verifying them needs the logits at every position."""
        start = req.num_computed_tokens
        return SeqChunk(req.all_token_ids[start:start + n] + req.spec_token_ids, start,
                        self.kv.get_block_ids(req.request_id), req.wants_prompt_logits or bool(req.spec_token_ids))

    def _forward(self, scheduled: list[tuple[Request, int]]) -> list[torch.Tensor]:
        """Run the model once over the scheduled chunks; per request, its logits rows."""
        chunks = [self._chunk(r, n) for r, n in scheduled]
        logits = self.runner.execute(chunks)
        return list(logits.split([c.num_logits for c in chunks]))

    def _forward_guarded(self, scheduled: list[tuple[Request, int]],
                         touched: dict[str, None]) -> list[tuple[Request, int, torch.Tensor]]:
        """The step's forward pass; if it raises, the prefix-cache entries it made are taken back (their K/V may
        never have been written) and each request runs alone, so that a failure fails only its own request."""
        try:
            logits = self._forward(scheduled)
        except BaseException as e:
            undone = self.kv.rollback_step()
            if not isinstance(e, Exception):  # Ctrl-C: the caller aborts what runs
                raise
            logger.warning("a step of %d requests failed (%r): running each alone", len(scheduled), e)
            return self._forward_each(scheduled, undone, touched)
        self.kv.commit_step()
        return [(req, n, rows) for (req, n), rows in zip(scheduled, logits)]

    def _forward_each(self, scheduled: list[tuple[Request, int]], undone: dict[str, list],
                      touched: dict[str, None]) -> list[tuple[Request, int, torch.Tensor]]:
        """After a failed step: each request alone, in schedule order (a request that shares blocks another
        registered this step runs after it). One that fails again fails; one that shares a block whose writer
        failed is recomputed later, since that block's K/V were never written."""
        unwritten: set[int] = set()
        done = []
        for req, n in scheduled:
            if unwritten.intersection(self.kv.get_block_ids(req.request_id)):
                self.scheduler.requeue(req)
                continue
            try:
                (rows,) = self._forward([(req, n)])
            except Exception as e:  # noqa: BLE001 - any error of this request's step fails this request
                unwritten.update(b.block_id for b in undone.get(req.request_id, ()))
                self._fail(req, f"the model step failed: {type(e).__name__}: {e}", touched)
                continue
            self.kv.cache_computed(req, req.num_computed_tokens + n)
            self.kv.commit_step()
            done.append((req, n, rows))
        return done

    def _advance(self, done: list[tuple[Request, int, torch.Tensor]], touched: dict[str, None]) -> None:
        """Account for the computed chunks; requests whose prompt is done get their next token."""
        now = time.monotonic()
        to_sample: list[tuple[Request, torch.Tensor]] = []
        for req, n, rows in done:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            start = req.num_computed_tokens
            req.num_computed_tokens += n
            self._count_prompt_tokens(req, start)
            if req.prompt_logprobs is not None and start < req.num_prompt_tokens:
                self._record_prompt_logprobs(req, start, rows)
            if req.num_computed_tokens < len(req.all_token_ids):
                continue  # a prompt chunk: no token is due yet
            if req.params.max_tokens == 0:  # scoring: the prompt was all that was asked for
                req.finish("length")
                self._release(req)
                touched[req.parent_id] = None
                continue
            to_sample.append((req, rows[len(rows) - 1 - len(req.spec_token_ids):]))
        if to_sample:
            self._sample(to_sample, now, touched)

    def _count_prompt_tokens(self, req: Request, start: int) -> None:
        """Prompt tokens computed, each once: a preempted request recomputing its prompt is not counted again."""
        end = min(req.num_computed_tokens, req.num_prompt_tokens)
        self.prompt_tokens += max(0, end - max(start, req.prompt_tokens_counted))
        req.prompt_tokens_counted = max(req.prompt_tokens_counted, end)

    def _record_prompt_logprobs(self, req: Request, start: int, rows: torch.Tensor) -> None:
        """Row j (position start + j) predicts prompt token start + j + 1."""
        count = min(len(rows), req.num_prompt_tokens - 1 - start)
        if count <= 0:
            return
        targets = req.prompt_token_ids[start + 1:start + 1 + count]
        entries = token_logprobs(rows[:count].float().log_softmax(-1), targets, req.params.prompt_logprobs or 0)
        req.prompt_logprobs[start + 1:start + 1 + count] = entries

    def _sample(self, to_sample: list[tuple[Request, torch.Tensor]], now: float, touched: dict[str, None]) -> None:
        """One sampling call for the batch, a row per logits row (a request with drafts has one per draft and one
        after them); if it raises, each request alone, and a request whose rows raise fails."""
        rows = [self._sampling_rows(req) for req, _ in to_sample]
        logits = torch.cat([lg for _, lg in to_sample])
        try:
            flat = iter(sample(logits, [r for group in rows for r in group]))
            results: list[list[SampleResult] | Exception] = [[next(flat) for _ in group] for group in rows]
        except Exception:  # noqa: BLE001 - find the request that raised
            results, start = [], 0
            for group in rows:
                results.append(_sample_alone(logits[start:start + len(group)], group))
                start += len(group)
        for (req, _), res in zip(to_sample, results):
            try:
                if isinstance(res, Exception):
                    raise res
                self._accept(req, res, now)
            except Exception as e:  # noqa: BLE001 - this request's sampling or detokenizing failed
                self._fail(req, f"sampling failed: {type(e).__name__}: {e}", touched)
                continue
            touched[req.parent_id] = None
            if req.finished:
                self._release(req)

    def _sampling_rows(self, req: Request) -> list[SamplingRow]:
        """A row per position to sample: the one after the last token, and after each draft, each seeing the
        output as it would be had the drafts before it been accepted (penalties, min_tokens, seeded noise)."""
        out, drafts = req.output_token_ids, req.spec_token_ids
        banned = self.tokenizer.eos_token_ids + req.params.stop_token_ids
        return [SamplingRow(req.params, req.prompt_token_ids, out + drafts[:j] if j else out, banned)
                for j in range(len(drafts) + 1)]  # the first row reads the output as it is: no copy per step

    def _accept(self, req: Request, results: list[SampleResult], now: float) -> None:
        """Keep the drafts the model confirmed and the model's own token after them, so a step appends exactly
        what steps without drafts would have, until a stop; then give back the rejected drafts' KV slots and
        register the blocks the accepted ones filled."""
        drafts, req.spec_token_ids = req.spec_token_ids, []
        accepted = num_accepted(drafts, [r.token_id for r in results])
        if drafts:
            self.spec_stats.record(len(drafts), accepted)
        for res in results[:accepted + 1]:
            self._append_token(req, res.token_id, res.logprobs, now)
            if req.finished:
                return
        if drafts:
            req.num_computed_tokens += accepted
            self.kv.trim(req, req.num_computed_tokens)
            self.kv.cache_computed(req, req.num_computed_tokens)

    def _append_token(self, req: Request, token: int, logprobs: dict[int, float] | None, now: float) -> None:
        req.all_token_ids.append(token)
        self.generation_tokens += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        if req.logprobs is not None:
            req.logprobs.append(logprobs or {})
        before = len(req.text)
        req.text += req.detok.add(token)
        p = req.params
        n_out = req.num_output_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.tokenizer.eos_token_ids:
                return req.finish("stop")
            if token in p.stop_token_ids:
                return req.finish("stop", stop_reason=token)
            for s in p.stop:
                # A stop string ends in the new text: look from just before it.
                pos = req.text.find(s, max(0, before - len(s) + 1))
                if pos != -1:
                    req.text = req.text[:pos]
                    return req.finish("stop", stop_reason=s)
        if (p.max_tokens is not None and n_out >= p.max_tokens) or len(req.all_token_ids) >= self.max_model_len:
            return req.finish("length")

    def _output(self, parent_id: str) -> RequestOutput:
        parent = self.parents[parent_id]
        finished = all(c.finished for c in parent.children)
        if finished:
            del self.parents[parent_id]
            parent.metrics.finished_time = time.monotonic()
        first = parent.children[0]
        return RequestOutput(parent_id, parent.prompt, parent.prompt_token_ids,
                             [c.completion_output(parent.holdback) for c in parent.children], finished,
                             first.num_cached_tokens, parent.metrics,
                             list(first.prompt_logprobs) if first.prompt_logprobs is not None else None)

    # ---- stats --------------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        kv, sched = self.kv, self.scheduler
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting), num_blocks=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks, num_cached_blocks=kv.num_cached_blocks, block_size=kv.block_size,
            kv_usage=kv.usage,
            num_stored_tokens=kv.num_stored_tokens, prefix_cache_queries=kv.prefix_stats.queries,
            prefix_cache_hits=kv.prefix_stats.hits, prefix_cache_disk_hits=kv.prefix_stats.disk_hits,
            num_preemptions=sched.num_preemptions,
            prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens,
            peak_running=sched.peak_running, num_steps=self.num_steps,
            spec_decode_num_drafts=self.spec_stats.num_drafts,
            spec_decode_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(self.spec_stats.accepted_per_pos))

    def _maybe_log(self) -> None:
        interval = self.config.log_stats_interval
        now = time.monotonic()
        if interval <= 0 or now - self._log_time < interval:
            return
        s = self.stats()
        tokens = s.prompt_tokens + s.generation_tokens
        logger.info("running %d, waiting %d, KV usage %.1f%%, prefix-cache hit rate %.1f%%, preemptions %d, "
                    "%.1f tokens/s", s.num_running, s.num_waiting, 100 * s.kv_usage, 100 * s.prefix_cache_hit_rate,
                    s.num_preemptions, (tokens - self._log_tokens) / (now - self._log_time))
        if s.spec_decode_num_drafts:
            logger.info("speculative decoding: %d drafts, %d draft tokens, %.1f%% accepted, %.2f tokens per draft",
                        s.spec_decode_num_drafts, s.spec_decode_num_draft_tokens, 100 * s.spec_decode_acceptance_rate,
                        s.spec_decode_num_accepted_tokens / s.spec_decode_num_drafts)
        self._log_time, self._log_tokens = now, tokens
