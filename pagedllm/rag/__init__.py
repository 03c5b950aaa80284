"""Retrieval-augmented generation with a prefix-cache-aware prompt layout.

    from pagedllm.rag import RagPipeline
    messages, hits = RagPipeline("rag-index", top_k=4, layout="canonical").build_messages(question)

Heavy imports (faiss, sentence-transformers, torch) happen on first use, not on `import pagedllm.rag`.
"""

from __future__ import annotations

DEFAULT_INDEX = "rag-index"

__all__ = ["RagPipeline", "build_messages", "bench_prompts", "DEFAULT_INDEX", "LAYOUTS"]


def __getattr__(name):
    if name == "RagPipeline":
        from pagedllm.rag.pipeline import RagPipeline

        return RagPipeline
    if name in ("build_messages", "LAYOUTS"):
        from pagedllm.rag import layout

        return getattr(layout, name)
    raise AttributeError(name)


def bench_prompts(
    num_prompts: int,
    seed: int = 0,
    store: str | None = None,
    layout: str = "canonical",
    top_k: int = 4,
    model: str | None = None,
) -> list[str]:
    """Prompts for `pagedllm bench serve --dataset-name rag`: the Zipf question workload of `pagedllm rag bench`,
    retrieved from the index at `store` (default ./rag-index), laid out, and rendered with the model's chat template
    to plain text (for /v1/completions). Raises UserError when there is no index."""
    from pagedllm.rag.pipeline import RagPipeline
    from pagedllm.rag.tokens import get_tokenizer
    from pagedllm.rag.workload import zipf_questions

    pipe = RagPipeline(store or DEFAULT_INDEX, top_k=top_k, layout=layout)
    tok = get_tokenizer(model)
    questions = [q for q, _ in zipf_questions(num_prompts, seed)]
    hits = pipe.index.search_many(questions, top_k)
    out = []
    for q, hs in zip(questions, hits):
        messages, _ = pipe.build_messages(q, hits=hs)
        render = getattr(tok, "apply_chat_template_text", None)
        out.append(render(messages) if render else tok.decode(tok.apply_chat_template(messages)))
    return out
