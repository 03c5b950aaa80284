"""`pagedllm generate "prompt"` and `pagedllm chat`: the engine in a terminal, streaming as it goes."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator


def add_parser(sub: argparse._SubParsersAction) -> None:
    from pagedllm.engine.config import add_engine_args

    gen = sub.add_parser("generate", help="complete one prompt, streaming the text")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument(
        "--chat-template",
        action="store_true",
        help="wrap the prompt as a user message in the model's chat template (default: the plain text)",
    )
    chat = sub.add_parser("chat", help="an interactive chat in the terminal (empty line or Ctrl-D ends it)")
    chat.add_argument("--system", default=None, help="a system prompt that starts the chat (default: none)")
    for p, func in ((gen, run_generate), (chat, run_chat)):
        add_engine_args(p, model_positional=False)
        p.add_argument(
            "--lora",
            metavar="[NAME=]PATH",
            help="answer with this LoRA adapter, a PEFT folder or GGUF (default: the base model alone)",
        )
        temperature = 0.7 if p is chat else 0.0
        s = p.add_argument_group("sampling")
        s.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default: 256)")
        s.add_argument(
            "--temperature",
            type=float,
            default=temperature,
            help=f"randomness of sampling; 0 is greedy, the same answer every time (default: {temperature:g})",
        )
        s.add_argument(
            "--top-p",
            type=float,
            default=1.0,
            help="sample only from the most likely tokens whose probabilities add up to this (default: 1, all)",
        )
        s.add_argument(
            "--top-k", type=int, default=0, help="sample only from this many most likely tokens (default: 0, all)"
        )
        s.add_argument(
            "--min-p",
            type=float,
            default=0.0,
            help="drop tokens less likely than this share of the most likely one's probability (default: 0, none)",
        )
        s.add_argument(
            "--repetition-penalty",
            type=float,
            default=1.0,
            help="above 1, tokens already in the prompt or answer become less likely (default: 1, no penalty)",
        )
        s.add_argument(
            "--stop", action="append", default=[], help="stop before this text; repeat for several (default: none)"
        )
        s.add_argument(
            "--sampling-seed",
            type=int,
            default=None,
            help="seed of this request's sampling, for a repeatable random answer (default: the engine's --seed)",
        )
        p.set_defaults(func=func)


def _params(args: argparse.Namespace):
    from pagedllm import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        stop=args.stop,
        seed=args.sampling_seed,
    )


def _engine(args: argparse.Namespace):
    from pagedllm.engine import EngineConfig, LLMEngine

    if args.lora:
        args.enable_lora = True
    engine = LLMEngine(EngineConfig.from_args(args))
    return engine, _lora(engine, args.lora)


def _lora(engine, spec: str | None):
    """--lora's adapter (NAME=PATH, or a PATH named by its last part), loaded now: a bad one fails before the
    first prompt, its error naming the adapter and the tensor."""
    import os

    from pagedllm.errors import UserError
    from pagedllm.lora_request import LoRARequest

    if not spec:
        return None
    name, sep, path = spec.partition("=")
    if not sep:
        name, path = os.path.basename(os.path.normpath(spec)), spec
    if not name or not path:
        raise UserError(f"--lora: {spec!r} is not PATH or NAME=PATH")
    lora = LoRARequest(name, 1, path)
    engine.add_lora(lora)
    return lora


def stream(engine, request_id: str, prompt: str | list[int], params, lora=None) -> Iterator[str]:
    """Text deltas of one request as the engine steps (under --lora's adapter, if any); the request is aborted if
    the consumer stops early."""
    from pagedllm.engine import stream_request

    for delta, _ in stream_request(engine, request_id, prompt, params, lora):
        if delta:
            yield delta


def run_generate(args: argparse.Namespace) -> int:
    params = _params(args)
    engine, lora = _engine(args)
    prompt = (
        engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        if args.chat_template
        else args.prompt
    )
    for delta in stream(engine, "generate", prompt, params, lora):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def run_chat(args: argparse.Namespace) -> int:
    params = _params(args)
    engine, lora = _engine(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    turn = 0
    print("pagedllm chat: type a message; an empty line or Ctrl-D ends it.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        reply = []
        try:
            for delta in stream(engine, f"chat-{turn}", engine.tokenizer.apply_chat_template(messages), params, lora):
                reply.append(delta)
                sys.stdout.write(delta)
                sys.stdout.flush()
        except KeyboardInterrupt:  # Ctrl-C stops this answer, not the chat
            pass
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
        turn += 1
    return 0
