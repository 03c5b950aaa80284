"""Which repetition / frequency penalty keeps `rag ask`'s default model from looping (issue 29, item 5), on
`rag bench`'s questions: each setting answers every question the way `rag ask` does (canonical layout, top-k 4,
greedy, 256 tokens), and the answers are counted.

    .venv/bin/python benchmarks/rag_ask_penalties.py --index rag-index [--num-questions 40 --seed 0]

Questions: `rag bench`'s workload (`zipf_questions(num_questions, seed)`, Zipf 1.1), retrieved once each. Per
setting (repetition_penalty / frequency_penalty, vLLM's meanings: the first divides the logits of every token
of the prompt and the answer so far, the second subtracts per occurrence in the answer):

- loops: answers that repeat themselves: a sentence of 4 words or more written twice, or a run of 8 words
  written three times (the README's question wrote one sentence eight times until 256 tokens);
- cut: answers that ran to max_tokens instead of ending;
- key phrase: answers that name their topic, the first word of its phrase in `TOPIC_PHRASES` that is not
  "the" (a plural's "s" dropped), as a whole word, any case (e.g. "nonlocal", "augmented", "comparison");
- mean words per answer.

All questions of a setting go into one engine at once (the engine's batching; greedy answers do not depend on
the batch), so a setting takes a minute or two on two cores.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import Counter

from pagedllm import SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine
from pagedllm.rag.layout import build_messages
from pagedllm.rag.pipeline import RagPipeline
from pagedllm.rag.workload import TOPIC_PHRASES, zipf_questions

SETTINGS = [  # (repetition_penalty, frequency_penalty)
    (1.0, 0.0),
    (1.1, 0.0),
    (1.2, 0.0),
    (1.3, 0.0),
    (1.0, 0.3),
    (1.0, 0.5),
    (1.0, 1.0),
]


def key_phrase(topic: str) -> str:
    words = [w for w in TOPIC_PHRASES.get(topic, topic).split() if w.lower() != "the"]
    word = words[0].lower().strip(",")
    return word[:-1] if word.endswith("s") and len(word) > 3 else word


def loops(text: str) -> bool:
    """A sentence of >= 4 words written twice, or a run of 8 words written three times."""
    sentences = [" ".join(s.lower().split()) for s in re.split(r"(?<=[.!?])\s+|\n+", text)]
    if any(n > 1 for s, n in Counter(s for s in sentences if len(s.split()) >= 4).items()):
        return True
    words = text.lower().split()
    runs = Counter(tuple(words[i : i + 8]) for i in range(len(words) - 7))
    return any(n >= 3 for n in runs.values())


def answer_all(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[tuple[str, str]]:
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.outputs[0].text, out.outputs[0].finish_reason)
    return [done[str(i)] for i in range(len(prompts))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--index", default="rag-index")
    ap.add_argument("--num-questions", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--json", default=None, help="also write every answer here")
    ap.add_argument(
        "--settings",
        default=",".join(f"{r}:{f}" for r, f in SETTINGS),
        help="repetition_penalty:frequency_penalty pairs, comma-separated (default: the list in this file)",
    )
    args = ap.parse_args()

    pipe = RagPipeline(args.index, top_k=args.top_k)
    workload = zipf_questions(args.num_questions, args.seed)
    # room for every prompt in the prefix cache: only the first setting prefills them
    engine = LLMEngine(EngineConfig(log_stats_interval=0, max_num_seqs=args.num_questions, kv_cache_memory="3GiB"))
    prompts = []
    for question, _ in workload:
        messages, _ = build_messages(question, pipe.retrieve(question), "canonical")
        prompts.append(engine.tokenizer.apply_chat_template(messages))
    keys = [key_phrase(t) for _, t in workload]
    print(f"{len(workload)} questions, {len({t for _, t in workload})} topics; canonical layout, top-k {args.top_k}")
    print("| repetition_penalty | frequency_penalty | loops | cut at max_tokens | key phrase | mean words | s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    record = []
    for rep, freq in [tuple(map(float, pair.split(":"))) for pair in args.settings.split(",")]:
        params = SamplingParams(
            temperature=0.0, max_tokens=args.max_tokens, repetition_penalty=rep, frequency_penalty=freq
        )
        t0 = time.perf_counter()
        answers = answer_all(engine, prompts, params)
        secs = time.perf_counter() - t0
        n = len(answers)
        looped = sum(loops(text) for text, _ in answers)
        cut = sum(reason == "length" for _, reason in answers)
        named = sum(
            re.search(rf"\b{re.escape(k)}", text, re.IGNORECASE) is not None for (text, _), k in zip(answers, keys)
        )
        words = sum(len(text.split()) for text, _ in answers) / n
        print(f"| {rep} | {freq} | {looped}/{n} | {cut}/{n} | {named}/{n} | {words:.0f} | {secs:.0f} |", flush=True)
        record.append({"repetition_penalty": rep, "frequency_penalty": freq, "answers": [a for a, _ in answers]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"questions": [q for q, _ in workload], "settings": record}, f, indent=1)


if __name__ == "__main__":
    main()
