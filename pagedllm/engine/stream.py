"""One request streamed from an in-process engine (`pagedllm generate`, `pagedllm chat`, `rag ask` without a
server): the text each step added, with the output it came from."""

from __future__ import annotations

from collections.abc import Iterator

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.outputs import RequestOutput
from pagedllm.errors import UserError
from pagedllm.lora_request import LoRARequest
from pagedllm.sampling_params import SamplingParams


def stream_request(
    engine: LLMEngine,
    request_id: str,
    prompt: str | list[int],
    params: SamplingParams,
    lora_request: LoRARequest | None = None,
) -> Iterator[tuple[str, RequestOutput]]:
    """(new text, output) for each step that advanced the request, until it finishes; a request that fails raises
    UserError with its error, and one the consumer stops reading early is aborted (its blocks freed). Other
    requests in the engine keep running, their outputs dropped here: use an engine of its own."""
    engine.add_request(request_id, prompt, params, lora_request=lora_request)
    sent = 0
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                completion = out.outputs[0]
                if out.finished and completion.finish_reason == "error":
                    raise UserError(f"generation failed: {completion.error}")
                delta, sent = completion.text[sent:], max(sent, len(completion.text))
                yield delta, out
                if out.finished:
                    return
    finally:
        engine.abort_request(request_id)  # a no-op once finished
