"""A question workload over the default corpus: topics drawn with Zipf-skewed popularity, each question worded by
one of twenty templates, so popular topics come back often but the same words rarely do, as with real users.

The wording count matters for what the benchmark shows: with only a few phrasings, a good share of a topic's
repeats are word-for-word repeats, which every layout (naive included) serves from the cache; users asking about
the same documents in their own words are the case where only the layout decides."""

from __future__ import annotations

import random

# A readable phrase for each `pydoc_data.topics` topic.
TOPIC_PHRASES: dict[str, str] = {
    "assert": "the assert statement",
    "assignment": "assignment statements",
    "async": "async def and async for",
    "atom-identifiers": "identifiers used as atoms",
    "atom-literals": "literals in expressions",
    "attribute-access": "customizing attribute access with __getattr__",
    "attribute-references": "attribute references",
    "augassign": "augmented assignment like +=",
    "await": "the await expression",
    "binary": "binary arithmetic operators",
    "bitwise": "bitwise operators",
    "bltin-code-objects": "code objects",
    "bltin-ellipsis-object": "the Ellipsis object",
    "bltin-null-object": "the None object",
    "bltin-type-objects": "type objects",
    "booleans": "boolean operations and, or, not",
    "break": "the break statement",
    "callable-types": "callable types",
    "calls": "function calls",
    "class": "class definitions",
    "comparisons": "comparison operators",
    "compound": "compound statements",
    "context-managers": "context managers",
    "continue": "the continue statement",
    "conversions": "arithmetic conversions",
    "customization": "basic customization with __init__ and __repr__",
    "debugger": "the pdb debugger",
    "del": "the del statement",
    "dict": "dictionary displays",
    "dynamic-features": "dynamic features like exec and eval",
    "else": "the else clause",
    "exceptions": "exceptions",
    "execmodel": "the execution model",
    "exprlists": "expression lists",
    "floating": "floating-point literals",
    "for": "the for statement",
    "formatstrings": "format string syntax",
    "function": "function definitions",
    "global": "the global statement",
    "id-classes": "reserved classes of identifiers",
    "identifiers": "identifiers and keywords",
    "if": "the if statement",
    "imaginary": "imaginary literals",
    "import": "the import statement",
    "in": "membership tests with in",
    "integers": "integer literals",
    "lambda": "lambda expressions",
    "lists": "list displays",
    "naming": "naming and binding",
    "nonlocal": "the nonlocal statement",
    "numbers": "numeric literals",
    "numeric-types": "emulating numeric types",
    "objects": "objects, values and types",
    "operator-summary": "operator precedence",
    "pass": "the pass statement",
    "power": "the power operator",
    "raise": "the raise statement",
    "return": "the return statement",
    "sequence-types": "emulating container types",
    "shifting": "shifting operations",
    "slicings": "slicings",
    "specialattrs": "special attributes",
    "specialnames": "special method names",
    "string-methods": "string methods",
    "strings": "string literals",
    "subscriptions": "subscriptions",
    "truth": "truth value testing",
    "try": "the try statement",
    "types": "the standard type hierarchy",
    "typesfunctions": "function objects",
    "typesmapping": "mapping types like dict",
    "typesmethods": "method objects",
    "typesmodules": "module objects",
    "typesseq": "sequence types",
    "typesseq-mutable": "mutable sequence types",
    "unary": "unary arithmetic operators",
    "while": "the while statement",
    "with": "the with statement",
    "yield": "the yield expression",
}

TEMPLATES = [
    "Explain {p} in Python.",
    "How does {p} work in Python?",
    "What are the rules for {p}?",
    "Give a short example of {p}.",
    "What does the language reference say about {p}?",
    "When should I use {p}?",
    "Summarize {p} in two sentences.",
    "What are common mistakes with {p}?",
    "How is {p} defined in Python?",
    "Describe the semantics of {p}.",
    "What happens at run time with {p}?",
    "Can you walk me through {p}?",
    "What is the syntax of {p}?",
    "Tell me about {p}.",
    "Why does Python have {p}?",
    "How do I use {p} correctly?",
    "What should a beginner know about {p}?",
    "I am confused by {p}. Can you help?",
    "What are the edge cases of {p}?",
    "Quick question about {p}: how does it behave?",
]


def zipf_questions(
    num_questions: int,
    seed: int = 0,
    topics: list[str] | None = None,
    s: float = 1.1,
    templates: list[str] | None = None,
) -> list[tuple[str, str]]:
    """`num_questions` (question, topic) pairs; topic ranks are a seeded shuffle, rank r drawn with weight 1/r^s."""
    rng = random.Random(seed)
    names = sorted(topics if topics is not None else TOPIC_PHRASES)
    rng.shuffle(names)
    weights = [1.0 / (r + 1) ** s for r in range(len(names))]
    tmpl = templates or TEMPLATES
    out = []
    for _ in range(num_questions):
        t = rng.choices(names, weights)[0]
        q = rng.choice(tmpl).format(p=TOPIC_PHRASES.get(t, t.replace("-", " ")))
        out.append((q, t))
    return out
