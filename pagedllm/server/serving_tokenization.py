"""POST /tokenize and POST /detokenize (vLLM's routes): what the server's own tokenizer makes of a text or a
conversation, and back. Behind the API key like /v1/*: a tokenizer is CPU work anyone could make us do."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from pagedllm.server.errors import ERROR_RESPONSES
from pagedllm.server.protocol_tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.server.serving_engine import ChatTemplateArgs, ServingContext, serving

router = APIRouter()


@router.post("/tokenize", response_model=TokenizeResponse, responses={**ERROR_RESPONSES})
async def tokenize(req: TokenizeRequest, ctx: ServingContext = Depends(serving)) -> TokenizeResponse:
    """Token ids of `prompt` (special tokens added by default), or of `messages` through the chat template."""
    ctx.check_model(req.model)
    if req.messages is not None:
        args = ChatTemplateArgs(
            req.add_generation_prompt, req.continue_final_message, req.chat_template, req.chat_template_kwargs
        )
        ids = (await ctx.chat_prompt(req.messages, args))[1]
    else:
        assert req.prompt is not None
        ids = await ctx.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    return TokenizeResponse(
        count=len(ids),
        max_model_len=ctx.engine.max_model_len,
        tokens=ids,
        token_strs=[ctx.token_str(t) for t in ids] if req.return_token_strs else None,
    )


@router.post("/detokenize", response_model=DetokenizeResponse, responses={**ERROR_RESPONSES})
def detokenize(req: DetokenizeRequest, ctx: ServingContext = Depends(serving)) -> DetokenizeResponse:
    """The text of `tokens`, special tokens included."""
    ctx.check_model(req.model)
    ctx.check_token_ids(req.tokens, "tokens")
    return DetokenizeResponse(prompt=ctx.decode(req.tokens, skip_special_tokens=False))
