"""The engine loop: add requests, then `step()` schedules, runs the model once, samples, and reports progress.

The loop's parts have their own modules: sizing the KV cache (`memory.py`), checking a request
(`input_checks.py`), keeping a failure to its own request (`fault_isolation.py`), sampling rows and draft
acceptance (`acceptance.py`), the stop rules (`stop_checker.py`) and the statistics (`stats.py`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from pagedllm.engine.acceptance import accept, sampling_rows
from pagedllm.engine.blend import BlendState, apply_copies, check_segments, computed_spans, store_segments
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.disk_tier import kernel_facts, open_disk_tier
from pagedllm.engine.fault_isolation import Computed, Scheduled, forward_guarded, sample_guarded
from pagedllm.engine.input_checks import bad_words_token_ids, check_params, encode_prompt
from pagedllm.engine.memory import (
    check_weights_fit,
    kv_blocks_and_state_slots,
    kv_layout,
    log_kv_cache,
    resolve_device,
    state_bytes,
)
from pagedllm.engine.outputs import RequestMetrics, RequestOutput
from pagedllm.engine.pooling import PoolingState
from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.spec_decode import NgramDrafter, SpecDecodeStats, SpeculativeConfig
from pagedllm.engine.stats import EngineStats, StatsLogger, collect_stats
from pagedllm.engine.stop_checker import check_stop, is_stop_token
from pagedllm.engine.structured_output import GrammarCompiler, RequestGrammar
from pagedllm.errors import UserError
from pagedllm.kv.connector import DiskTierConnector
from pagedllm.kv.events import KVEventLog
from pagedllm.kv.hashing import extra_key, segment_root
from pagedllm.kv.kv_spec import cdiv
from pagedllm.kv.manager import PagedKVCacheManager, make_kv_cache_manager
from pagedllm.kv.offload import DiskKVTier
from pagedllm.kv.segments import SegmentStore
from pagedllm.kv.state_slots import StateCheckpoints, StateSlotPool
from pagedllm.lora_request import LoRARequest, lora_id
from pagedllm.model.kernels.kv_quant import kv_cache_dtype
from pagedllm.model.loader import LoadedModel, load_model
from pagedllm.model.runner import ModelRunner, SeqChunk
from pagedllm.model.sampler import SampleResult, token_logprobs
from pagedllm.sampling_params import PoolingParams, SamplingParams, SamplingParamsError

logger = logging.getLogger("pagedllm")

# A hybrid model's recurrent layers by their mixer (ModelConfig.recurrent_mixer), and the state each keeps per
# request: what kv_blend's refusal names
RECURRENT_LAYER_STATES = {
    "gated_deltanet": ("Gated DeltaNet", "a conv state and a linear-attention recurrent state"),
    "mamba2": ("Mamba2", "a conv state and an SSM state"),
    "short_conv": ("short-convolution", "a conv state (their last inputs)"),
}


def lora_slots(config: EngineConfig) -> int:
    """Adapters kept loaded: --max-cpu-loras, else --max-loras (vLLM's default)."""
    return config.max_cpu_loras or config.max_loras


def _attach_blend(child: Request, blend: BlendState | None, logits_from: int | None) -> None:
    """Each sample its own kv_blend state (its copies and holds are its own), from the checked one."""
    child.blend = BlendState(blend.segments, blend.recompute, blend.root, blend.max_deviation) if blend else None
    child.logits_from = logits_from


@dataclass
class _Parent:
    """One user request; its n samples are child Requests."""

    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    metrics: RequestMetrics
    holdback: int  # characters of text kept back while they could start a stop string


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None) -> None:
        """`loaded` reuses weights already in memory (several engines side by side in a benchmark or test)."""
        self.config = config = config or EngineConfig()
        device = resolve_device(config.device) if loaded is None else loaded.device
        if loaded is None and device.type == "cpu":
            check_weights_fit(config.model)
        self.loaded = loaded or load_model(
            config.model, config.dtype, device, True, config.quantization, None, config.quantized_activations
        )
        self.tokenizer = self.loaded.tokenizer
        self.model_config = cfg = self.loaded.config
        logger.info("loaded %s (%s, %s) in %.1f s", cfg.name, self.loaded.dtype, device, self.loaded.load_seconds)

        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise UserError(
                f"--max-model-len: {self.max_model_len} is more than the model's "
                f"{cfg.max_position_embeddings} positions"
            )
        self.block_size = config.block_size
        # the cache's --kv-cache-dtype name (what kv/sizing prices) and its tensors' torch dtype
        self.kv_cache_dtype, self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.loaded.dtype)
        self.kv_layout = kv_layout(cfg, config)
        self.kv_groups = self.kv_layout.kinds()  # one per kind of layer (the pool's groups split them evenly)
        num_blocks, slots, rows = kv_blocks_and_state_slots(
            config, self.loaded, self.max_model_len, self.kv_cache_dtype, layout=self.kv_layout
        )
        self._build_cache(config, num_blocks, slots, rows)
        self.loras = self.runner.enable_lora(config.max_lora_rank, lora_slots(config)) if config.enable_lora else None
        if config.enable_kv_cache_events:
            self.kv.pool.events = KVEventLog(self.block_size, device.type.upper())
        self.disk_tier = self._attach_connectors(config)
        spec = None if self.runner.states else config.speculative_config  # hybrid: no drafts (_attach_state_slots)
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            NgramDrafter(spec, self.max_model_len) if isinstance(spec, SpeculativeConfig) else None,
            config.scheduling_policy,
            config.max_loras,
        )
        self.spec_stats = SpecDecodeStats()
        self.grammars = GrammarCompiler(self.tokenizer, cfg.vocab_size)
        log_kv_cache(cfg, config, num_blocks, self.kv_cache_dtype, self.kv_layout)

        self.parents: dict[str, _Parent] = {}
        self.requests: dict[str, Request] = {}  # child id -> request, while unfinished
        self.prompt_tokens = 0  # computed, each once
        self.generation_tokens = 0
        self.num_steps = 0
        self._stats_logger = StatsLogger(config.log_stats_interval)
        torch.manual_seed(config.seed)

    def _build_cache(self, config: EngineConfig, num_blocks: int, slots: int, rows: int) -> None:
        """The runner (the cache's tensors; a hybrid model's state rows, one per request that may run, then `rows`
        staging rows for the states at a step's marks) and the KV manager that hands out their blocks and slots."""
        self.runner = ModelRunner(
            self.loaded,
            num_blocks,
            self.block_size,
            self.kv_dtype,
            layout=self.kv_layout,
            num_state_slots=slots + rows,  # the slots, then the staging rows
        )
        self.kv = make_kv_cache_manager(
            config.kv_allocation,
            num_blocks,
            self.block_size,
            self.max_model_len,
            config.enable_prefix_caching,
            self.kv_layout,
        )
        self._attach_state_slots(config, slots, rows)

    def _attach_state_slots(self, config: EngineConfig, slots: int, rows: int) -> None:
        """A hybrid model's recurrent-state slots (one per request that may run, the runner holds their rows),
        what it cannot do (drafts: a rejected one would stay in the state), and why its prefix hits are 0."""
        if not self.runner.states:
            return
        cfg = self.model_config
        if config.speculative_config is not None:
            logger.warning(
                "speculative decoding is off for %s: a rejected draft would stay in its linear-attention layers' "
                "recurrent state",
                cfg.name,
            )
        # (contiguous allocation caches nothing)
        caching = config.enable_prefix_caching and self.kv.enable_caching and config.mamba_cache_mode != "none"
        each = cdiv(self.runner.state_row_bytes, self.runner.bytes_per_block)
        checkpoints = (
            StateCheckpoints(
                self.kv.pool, self.runner, each, self.block_size, config.mamba_cache_mode, range(slots, slots + rows)
            )
            if caching
            else None
        )
        self.kv.attach_state_slots(StateSlotPool(slots, state_bytes(cfg, self.loaded.dtype)), checkpoints)
        if checkpoints is not None:
            logger.info(
                "prefix caching on %s: recurrent-state checkpoints at block boundaries, %d pool blocks each (a hit "
                "ends at one; --mamba-cache-mode %s: %s)",
                cfg.name,
                each,
                config.mamba_cache_mode,
                "prompt chunks are cut at block boundaries so that they exist"
                if config.mamba_cache_mode == "align"
                else "every block boundary of a prompt leaves one",
            )

    def _attach_connectors(self, config: EngineConfig) -> DiskKVTier | None:
        """What plugs in behind the KV manager's connector seam: the disk tier, kv_blend's segment store."""
        disk = None
        if config.kv_offload_dir is not None:  # the config allows it with the paged manager only
            disk = open_disk_tier(config.kv_offload_dir, config.kv_offload_size, self.runner, self.block_size)
            self.kv.add_connector(DiskTierConnector(disk, self.runner, self.kv.pool))
        # kv_blend's segment store: only where a block holds every layer's K/V (a window or a recurrent state could
        # not be re-rotated as a whole)
        kv = self.kv
        if isinstance(kv, PagedKVCacheManager) and kv.enable_caching and kv.one_full_attention_group:
            kv.add_connector(SegmentStore(kv.pool, kv.null_block, kv.fetch))
        return disk

    # ---- requests -----------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text or id prompt, checked against the vocabulary and max_model_len."""
        return encode_prompt(prompt, self.tokenizer, self.model_config.vocab_size, self.max_model_len)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams | None = None,
        cache_salt: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        kv_segments: list[tuple[int, int]] | None = None,
        kv_blend_recompute: float | None = None,
        logits_from: int | None = None,
        kv_blend_max_deviation: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request (its n samples); `prompt_token_ids` gives the ids of a text prompt already encoded.
        PoolingParams make it an embedding request: its prompt computed, no token sampled, one vector out.
        `cache_salt`: its blocks are shared only with requests of the same salt (a tenant's); `priority`: with
        --scheduling-policy priority, lower values are admitted first (vLLM's). `kv_segments`: [start, end) spans
        whose KV may be reused wherever they land (blend.py), `kv_blend_recompute` of each computed again, or
        (`kv_blend_max_deviation`, the bound mode) as many as keep the measured deviation under that bound;
        `logits_from`: each position's log-softmax from it on, in `prompt_logits`; `lora_request`: the LoRA
        adapter it runs under (loaded now if it is not yet; needs enable_lora). All is checked first."""
        pooling = params if isinstance(params, PoolingParams) else None
        params = SamplingParams(max_tokens=0) if pooling is not None else params or SamplingParams()
        assert isinstance(params, SamplingParams)
        if request_id in self.parents:
            raise UserError(f"request id {request_id!r} is already in use")
        if priority != 0 and self.scheduler.policy != "priority":
            raise SamplingParamsError("priority", "needs a server started with --scheduling-policy priority")
        prompt_ids = self.encode_prompt(prompt if prompt_token_ids is None else prompt_token_ids)
        check_params(params, len(prompt_ids), self.model_config.vocab_size, self.max_model_len)
        self._load_lora(lora_request)
        blend = self._blend_state(
            len(prompt_ids),
            kv_segments,
            kv_blend_recompute,
            kv_blend_max_deviation,
            extra_key(cache_salt, lora_id(lora_request)),
        )
        if params.bad_words:
            params = replace(params, bad_words_token_ids=bad_words_token_ids(params.bad_words, self.tokenizer))
        metrics = RequestMetrics(arrival_time=time.monotonic())
        children = self._children(request_id, prompt_ids, params, metrics, cache_salt, priority, lora_request)
        so = params.structured_outputs
        compiled = self.grammars.compile(so.grammar_text) if so is not None else None
        for child in children:
            child.grammar = RequestGrammar(compiled, so.reasoning_end) if compiled is not None and so else None
            child.pooling = PoolingState(pooling) if pooling is not None else None
            _attach_blend(child, blend, logits_from)
            if self.loras is not None and child.lora_int_id:
                self.loras.hold(child.lora_int_id)  # released when it leaves (_release): no unload meanwhile
            self.requests[child.request_id] = child
            self.scheduler.add(child)
        holdback = max((len(s) for s in params.stop), default=1) - 1
        self.parents[request_id] = _Parent(
            prompt if isinstance(prompt, str) else None, prompt_ids, children, metrics, holdback
        )

    def _children(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        metrics: RequestMetrics,
        cache_salt: str | None,
        priority: int,
        lora_request: LoRARequest | None,
    ) -> list[Request]:
        """The request's n samples, each a Request."""
        return [
            Request(
                f"{request_id}#{i}",
                request_id,
                i,
                prompt_ids,
                params.for_sample(i),
                self.tokenizer,
                metrics,
                cache_salt,
                priority,
                lora_request,
            )
            for i in range(params.n)
        ]

    def _load_lora(self, lora_request: LoRARequest | None) -> None:
        """A request's adapter, loaded (and checked) now if it is not yet."""
        if lora_request is None:
            return
        if self.loras is None:
            raise UserError(f"LoRA adapter {lora_request.lora_name!r}: LoRA is not enabled (--enable-lora)")
        self.loras.add(lora_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now (vLLM's add_lora): its errors at load, not at its first request."""
        self._load_lora(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter (vLLM's remove_lora); refused (UserError) while requests use it, so none breaks."""
        if self.loras is None:
            raise UserError("LoRA is not enabled (--enable-lora)")
        return self.loras.remove(lora_int_id)

    def _blend_state(
        self,
        prompt_len: int,
        segments: object,
        recompute: float | None,
        max_deviation: float | None,
        cache_key: object,
    ) -> BlendState | None:
        """A request's kv_blend state (checked), or None: no segments, or keys that cannot be moved (dynamic NTK).
        The segment root covers what stored segment KV depends on besides its tokens, so a copy made under other
        settings is never found: the disk tier's fingerprint (the weights' digest and kernels) when there is one,
        else the checkpoint's path, its dtype, quantization and kernels (disk_tier.kernel_facts); the KV dtype, the
        block size, the cache salt and the LoRA adapter's id (`cache_key`: kv.hashing.extra_key). A request sets the
        fixed share or the bound, else the engine's default (--kv-blend-max-deviation when set: the bound mode)."""
        if segments is None:
            if recompute is not None or max_deviation is not None:
                check_segments([], prompt_len, recompute, max_deviation)
            return None
        spans = check_segments(segments, prompt_len, recompute, max_deviation)
        if spans and self.runner.states:
            cfg = self.model_config
            kind, state = RECURRENT_LAYER_STATES.get(cfg.recurrent_mixer, (cfg.recurrent_mixer, "a recurrent state"))
            layers = ", ".join(map(str, cfg.linear_layers))
            raise UserError(
                f"kv_segments: kv_blend cannot run on {cfg.name}: its {kind} layers (layers {layers}) keep {state} per "
                "request, which cannot be moved to another position as K/V can"
            )
        if not spans or not self.runner.can_shift_keys:
            return None
        loaded = self.loaded
        weights = (
            self.disk_tier.fingerprint
            if self.disk_tier is not None
            else (loaded.path, loaded.quantization, kernel_facts(loaded))
        )
        key = (self.model_config.name, weights, str(loaded.dtype), str(self.kv_dtype), self.block_size, cache_key)
        if recompute is None and max_deviation is None:
            recompute, max_deviation = self.config.kv_blend_recompute, self.config.kv_blend_max_deviation
        return BlendState(spans, 1.0 if recompute is None else recompute, segment_root(key), max_deviation)

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
        if self.requests.pop(req.request_id, None) is not None and self.loras is not None and req.lora_int_id:
            self.loras.release(req.lora_int_id)

    def _fail(self, req: Request, error: str, bad_request: bool = False) -> None:
        """One request failed (its step or its sampling raised): it alone finishes with an error, which is the
        request's own fault (`bad_request`: it asked for what the model cannot do) or the engine's."""
        logger.warning("request %s failed: %s", req.request_id, error)
        req.finish("error", error=error, bad_request=bad_request)
        self._release(req)

    # ---- the step -----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, update the requests it ran; the outputs of those with news."""
        sched = self.scheduler.schedule()
        news = list(sched.failed)  # requests with something to report, in order
        for req in sched.failed:
            self._release(req)
        if sched.scheduled:
            ran = forward_guarded(self._forward, sched.scheduled, self.kv, self.scheduler)
            for req, error in ran.failed:
                self._fail(req, error)
                news.append(req)
            news += self._advance(ran.done)
            self.kv.commit_step()  # what acceptance registered (blocks of accepted drafts) has its K/V written
        elif not sched.failed:
            self._wait_for_grammars()
        self.num_steps += 1
        outputs = [self._output(pid) for pid in dict.fromkeys(r.parent_id for r in news) if pid in self.parents]
        if not self.parents:
            self.kv.offload_cached()  # idle now: the disk tier (if any) gets the hot prefixes too
        self._stats_logger.maybe_log(self.stats)
        return outputs

    def _wait_for_grammars(self) -> None:
        """Nothing ran: if requests wait for their grammar, block a little for one instead of spinning."""
        compiling = [r.grammar for r in self.scheduler.waiting if r.grammar is not None and not r.grammar.ready]
        if compiling:
            self.grammars.wait_any(compiling, 0.05)

    def _chunks(self, req: Request, n: int) -> list[SeqChunk]:
        """The request's next n tokens as one chunk per span it computes (kv_blend: the copied tokens between
        them are not computed; every span runs in this step, each attending to those before it, whose K/V the
        step writes first), then its drafts: verifying them needs the logits at every position. Only the last
        span's logits are used (the positions whose logits are kept are never copied)."""
        spans = computed_spans(req, n)
        tables = self.kv.get_group_block_ids(req.request_id)
        chunks = [
            SeqChunk(
                req.all_token_ids[s:e], s, tables[0], False, tables if len(tables) > 1 else None, None, req.lora_int_id
            )
            for s, e in spans[:-1]
        ]
        start, end = spans[-1]
        keep = req.logits_from is not None and end > req.logits_from
        # a hybrid prompt chunk's states at its inner block boundaries, kept as checkpoints (--mamba-cache-mode all)
        rs = self.kv.recurrent
        marks = rs.marks(req, start, min(end - 1, req.num_prompt_tokens)) if rs is not None else []
        last = SeqChunk(
            req.all_token_ids[start:end] + req.spec_token_ids,
            start,
            tables[0],
            req.wants_prompt_logits or bool(req.spec_token_ids) or keep,
            tables if len(tables) > 1 else None,
            None if rs is None else rs.slot(req.request_id),
            req.lora_int_id,
            marks or None,
        )
        return chunks + [last]

    def _forward(self, scheduled: Scheduled) -> list[torch.Tensor]:
        """Run the model over the scheduled chunks; per request, its logits rows (a pooling request: its final
        hidden states, from a second call over the pooling chunks alone, so generation runs as without them)."""
        for r, _ in scheduled:
            apply_copies(r, self.runner, self.kv)  # before the forward: the computed tokens attend to them
            self._restore_state(r)
        per_req = [self._chunks(r, n) for r, n in scheduled]
        pooled = [r.pooling is not None for r, _ in scheduled]
        gen = [c for cs, p in zip(per_req, pooled) if not p for c in cs]
        logits = iter(self.runner.execute(gen).split([c.num_logits for c in gen]) if gen else [])
        hidden = iter(
            self.runner.execute_hidden([cs[-1] for cs, p in zip(per_req, pooled) if p]) if any(pooled) else []
        )
        return [next(hidden) if p else [next(logits) for _ in cs][-1] for cs, p in zip(per_req, pooled)]

    def _restore_state(self, req: Request) -> None:
        """A hybrid request whose prefix hit ends at a state checkpoint starts from a copy of it."""
        if self.kv.recurrent is not None:
            self.kv.recurrent.restore(req.request_id)

    def _checkpoint_state(self, req: Request) -> None:
        """A hybrid request's state after a prompt chunk that ended at a block boundary, kept for later prefixes."""
        if self.kv.recurrent is not None and req.num_computed_tokens <= req.num_prompt_tokens:
            self.kv.recurrent.checkpoint(req, req.num_computed_tokens)

    def _advance(self, done: Computed) -> list[Request]:
        """Account for the computed chunks; requests whose prompt is done get their next token. Returns the
        requests with news (a token, or the end)."""
        now = time.monotonic()
        news: list[Request] = []
        to_sample: list[tuple[Request, torch.Tensor]] = []
        for req, n, rows in done:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            spans = computed_spans(req, n)
            start = spans[-1][0]  # the first position of the rows (the last span's)
            req.num_computed_tokens += n
            self._checkpoint_state(req)
            self._count_prompt_tokens(req, spans)
            if req.blend is not None:
                req.blend.pending_copy, req.blend.step_spans = 0, None
                store_segments(req, self.runner, self.kv)
            if req.logits_from is not None and start + len(rows) > req.logits_from:
                req.kept_logits.append(rows[max(0, req.logits_from - start) :].float().log_softmax(-1))
            if req.pooling is not None:
                req.pooling.add(rows, start)
            if req.prompt_logprobs is not None and start < req.num_prompt_tokens:
                self._record_prompt_logprobs(req, start, rows)
            if req.num_computed_tokens < len(req.all_token_ids):
                continue  # a prompt chunk: no token is due yet
            if req.params.max_tokens == 0:  # scoring or pooling: the prompt was all that was asked for
                if req.pooling is not None:
                    req.pooling.finish(req.num_prompt_tokens)
                req.finish("stop" if req.pooling is not None else "length")
                self._release(req)
                news.append(req)
                continue
            to_sample.append((req, rows[len(rows) - 1 - len(req.spec_token_ids) :]))
        return news + self._sample(to_sample, now) if to_sample else news

    def _count_prompt_tokens(self, req: Request, spans: list[tuple[int, int]]) -> None:
        """Prompt tokens computed (the step's spans), each once: a preempted request recomputing its prompt is not
        counted again."""
        for start, end in spans:
            end = min(end, req.num_prompt_tokens)
            self.prompt_tokens += max(0, end - max(start, req.prompt_tokens_counted))
        end = min(req.num_computed_tokens, req.num_prompt_tokens)
        req.prompt_tokens_counted = max(req.prompt_tokens_counted, end)

    def _record_prompt_logprobs(self, req: Request, start: int, rows: torch.Tensor) -> None:
        """Row j (position start + j) predicts prompt token start + j + 1."""
        count = min(len(rows), req.num_prompt_tokens - 1 - start)
        if count <= 0 or req.prompt_logprobs is None:
            return
        targets = req.prompt_token_ids[start + 1 : start + 1 + count]
        entries = token_logprobs(rows[:count].float().log_softmax(-1), targets, req.params.prompt_logprobs or 0)
        req.prompt_logprobs[start + 1 : start + 1 + count] = entries

    def _sample(self, to_sample: list[tuple[Request, torch.Tensor]], now: float) -> list[Request]:
        """One sampling call for the batch, a row per logits row (a request with drafts has one per draft and one
        after them); a request whose rows raise, whose grammar fails, or whose detokenizing raises, fails alone.
        Returns the sampled requests (every one has news: a token, or its end)."""
        rows = [sampling_rows(req, self.tokenizer.eos_token_ids) for req, _ in to_sample]
        with torch.inference_mode():  # the rows are a view of the runner's logits, inference tensors a grammar masks
            logits, failed = self.grammars.constrain(to_sample, stacked([lg for _, lg in to_sample]))
            results = sample_guarded(logits, rows)
        for (req, _), res in zip(to_sample, results):
            try:
                res = failed.get(req.request_id, res)
                if isinstance(res, Exception):
                    raise res
                self._accept(req, res, now)
            except UserError as e:  # e.g. its grammar needs bytes no token can produce
                self._fail(req, str(e), bad_request=True)
                continue
            except Exception as e:  # noqa: BLE001 - this request's sampling or detokenizing failed
                self._fail(req, f"sampling failed: {type(e).__name__}: {e}")
                continue
            if req.finished:
                self._release(req)
        return [req for req, _ in to_sample]

    def _accept(self, req: Request, results: list[SampleResult], now: float) -> None:
        """Append the tokens acceptance keeps, each checked against the stop rules and the grammar; then give
        back the rejected drafts' KV slots and register the blocks the accepted ones filled."""
        had_drafts = bool(req.spec_token_ids)
        keep, accepted = accept(req, results, self.spec_stats)
        for res in keep:
            self._append_token(req, res.token_id, res.logprobs, now)
            grammar = req.grammar
            if grammar is not None and not req.finished:
                if not grammar.active:  # the reasoning before the constraint: free, until its end is written
                    grammar.watch(req.text)
                elif grammar.accept(res.token_id):
                    req.finish("stop")  # structured outputs: the grammar is complete, only EOS could follow
            if req.finished:
                return
        if had_drafts:
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
        if not is_stop_token(req, token, self.tokenizer.eos_token_ids):
            req.text += req.detok.add(token)
        check_stop(req, token, before, self.tokenizer.eos_token_ids, self.max_model_len)

    def _output(self, parent_id: str) -> RequestOutput:
        parent = self.parents[parent_id]
        finished = all(c.finished for c in parent.children)
        if finished:
            del self.parents[parent_id]
            parent.metrics.finished_time = time.monotonic()
        first = parent.children[0]
        return RequestOutput(
            parent_id,
            parent.prompt,
            parent.prompt_token_ids,
            [c.completion_output(parent.holdback) for c in parent.children],
            finished,
            first.num_cached_tokens,
            parent.metrics,
            list(first.prompt_logprobs) if first.prompt_logprobs is not None else None,
            first.pooling.embedding if first.pooling is not None else None,
            torch.cat(first.kept_logits) if finished and first.kept_logits else None,
            first.blend.copied_tokens if first.blend is not None else 0,
        )

    def stats(self) -> EngineStats:
        return collect_stats(
            self.kv,
            self.scheduler,
            self.spec_stats,
            self.prompt_tokens,
            self.generation_tokens,
            self.num_steps,
            self.loaded.model.expert_load if self.loaded.config.num_experts else None,
        )


def stacked(parts: list[torch.Tensor]) -> torch.Tensor:
    """The rows of `parts` as one tensor: a view where they lie back to back in one buffer (the runner's logits
    come in chunk order, so they usually do), else a copy. Why: at 64 rows of a 250K vocabulary the copy is ~60
    MB of fresh pages a step, a tenth of a decode step's time spent before sampling starts."""
    first = parts[0]
    end = first.storage_offset()
    for t in parts:
        if not (t.is_contiguous() and t.dtype == first.dtype and t.shape[1:] == first.shape[1:]):
            return torch.cat(parts)
        if t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or t.storage_offset() != end:
            return torch.cat(parts)
        end += t.numel()
    shape = (sum(len(t) for t in parts), *first.shape[1:])
    return first.as_strided(shape, torch.empty(shape, device="meta").stride(), first.storage_offset())
