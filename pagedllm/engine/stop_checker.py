"""When a request is done after a new token: EOS, a stop token, a stop string (the text is cut before it),
max_tokens or max_model_len. Checked token by token, so tokens past a stop (accepted drafts too) are dropped.

A stop token's text (EOS's or one of stop_token_ids) is never part of the output, with skip_special_tokens off
too: vLLM's detokenizer skips the token that stopped a request (pagedllm has no include_stop_str_in_output). So
a parser that reads special tokens (the mistral tool-call format's `[TOOL_CALLS]`) never sees `</s>` in an
answer."""

from __future__ import annotations

from pagedllm.engine.request import Request


def is_stop_token(req: Request, token: int, eos_token_ids: list[int]) -> bool:
    """Whether `token` (just appended) ends `req` as EOS or one of its stop_token_ids: its text is not added."""
    p = req.params
    if req.num_output_tokens < p.min_tokens:
        return False
    return (not p.ignore_eos and token in eos_token_ids) or token in p.stop_token_ids


def check_stop(req: Request, token: int, text_before: int, eos_token_ids: list[int], max_model_len: int) -> None:
    """Finish `req` if `token` (just appended; the text was `text_before` characters before it) ends it."""
    p = req.params
    n_out = req.num_output_tokens
    if n_out >= p.min_tokens:
        if not p.ignore_eos and token in eos_token_ids:
            return req.finish("stop")
        if token in p.stop_token_ids:
            return req.finish("stop", stop_reason=token)
        for s in p.stop:
            # A stop string ends in the new text: look from just before it.
            pos = req.text.find(s, max(0, text_before - len(s) + 1))
            if pos != -1:
                req.text = req.text[:pos]
                return req.finish("stop", stop_reason=s)
    if (p.max_tokens is not None and n_out >= p.max_tokens) or len(req.all_token_ids) >= max_model_len:
        return req.finish("length")
    return None
