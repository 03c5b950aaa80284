"""The offline API: `LLM().generate(prompts, params)` runs a whole batch through the engine and returns it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from tqdm import tqdm

from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.pooling import read_pooler_config
from pagedllm.lora_request import LoRARequest
from pagedllm.model.loader import LoadedModel
from pagedllm.model.tokenizer import Tokenizer
from pagedllm.sampling_params import PoolingParams, SamplingParams

Prompt = str | list[int]
Messages = list[dict[str, str]]


class LLM:
    """`LLM()` loads the default model; keyword arguments are EngineConfig fields (block_size=..., dtype=...)."""

    def __init__(self, model: str | None = None, loaded: LoadedModel | None = None, **engine_args) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args), loaded)
        self._counter = 0

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of the prompts. Every prompt is checked before any is queued. `lora_request`:
        the LoRA adapter of every prompt, or one per prompt (None: the base model), with LLM(enable_lora=True)."""
        single = isinstance(prompts, str) or (
            isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)
        )
        prompts = cast(list[Prompt], [prompts] if single else list(prompts))
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        for p in params:
            p.validate()
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA requests")
        return self._submit(prompts, params, use_tqdm, loras)

    def embed(
        self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None, use_tqdm: bool = True
    ) -> list[RequestOutput]:
        """vLLM's `LLM.embed`: one vector per prompt (`out.embedding`), pooled by the checkpoint's own rule
        (engine/pooling.py: last token + normalize unless its sentence-transformers files say otherwise)."""
        single = isinstance(prompts, str) or (
            isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)
        )
        prompts = cast(list[Prompt], [prompts] if single else list(prompts))
        params = pooling_params or read_pooler_config(self.engine.loaded.path).params()
        return self._submit(prompts, [params] * len(prompts), use_tqdm)

    def _submit(
        self,
        prompts: list[Prompt],
        params: Sequence[SamplingParams | PoolingParams],
        use_tqdm: bool,
        loras: Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Every prompt checked before any is queued; then the batch run to its end."""
        encoded = [self.engine.encode_prompt(p) for p in prompts]
        ids = []
        try:
            for prompt, prompt_ids, p, lora in zip(prompts, encoded, params, loras or [None] * len(prompts)):
                rid = f"offline-{self._counter}"
                self._counter += 1
                self.engine.add_request(rid, prompt, p, prompt_token_ids=prompt_ids, lora_request=lora)
                ids.append(rid)
        except BaseException:
            self._abort(ids)
            raise
        return self._run(ids, use_tqdm and len(ids) > 1)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One conversation or a list of them, rendered with the model's chat template."""
        conversations = cast(
            list[Messages], [messages] if messages and isinstance(messages[0], dict) else list(messages)
        )
        prompts = [self.engine.tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm)
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            self._abort(ids)  # an interrupted batch must not leave blocks behind
            raise
        finally:
            bar.close()
        return [done[rid] for rid in ids]

    def _abort(self, ids: list[str]) -> None:
        for rid in ids:
            self.engine.abort_request(rid)
