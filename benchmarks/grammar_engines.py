"""Why llguidance: llguidance vs outlines-core on the default model's tokenizer (49,152 tokens), the measurement
behind issue 21's choice. Per engine: the tokenizer/vocabulary set-up, compiling a typical JSON schema, and the
time per token to get the allowed-token set as a bitmask (llguidance) or as a boolean tensor from the allowed ids
(outlines-core), following a 31-token answer. outlines-core is not a dependency of pagedllm: install it aside,

    .venv/bin/pip download --no-deps outlines-core==0.2.14 -d /tmp/oc && \\
      .venv/bin/pip install --no-deps --target /tmp/oc/site /tmp/oc/outlines_core-*.whl
    .venv/bin/python benchmarks/grammar_engines.py --outlines-site /tmp/oc/site

Also what each can express: outlines-core compiles JSON schemas and regexes only (no context-free grammar, so
no Lark/GBNF `grammar`, and recursive schemas are unrolled to a fixed depth); llguidance takes all of them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "city": {"type": "string", "enum": ["Paris", "Seoul", "Lima"]},
    },
    "required": ["name", "age", "tags", "city"],
    "additionalProperties": False,
}
ANSWER = json.dumps({"name": "Ann Lee", "age": 31, "tags": ["a", "bcd"], "city": "Seoul"}, separators=(",", ":"))


def llguidance_figures(tok) -> dict:
    import llguidance
    import llguidance.hf

    t = time.perf_counter()
    llt = llguidance.hf.from_tokenizer(tok.hf, n_vocab=tok.vocab_size, eos_token=tok.eos_token_ids)
    setup = time.perf_counter() - t
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides={"whitespace_flexible": False})
    t = time.perf_counter()
    matcher = llguidance.LLMatcher(llt, grammar)
    compile_s = time.perf_counter() - t
    mask = torch.full((1, (tok.vocab_size + 31) // 32), -1, dtype=torch.int32)
    times = []
    for token in tok.encode(ANSWER):
        t = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        times.append(time.perf_counter() - t)
        assert matcher.consume_token(token), matcher.get_error()
    return {"setup_s": setup, "compile_ms": 1e3 * compile_s, "mask_us": 1e6 * sum(times) / len(times)}


def outlines_figures(tok) -> dict:
    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema

    eos = tok.eos_token_id
    vocab: dict[str, list[int]] = {}
    t = time.perf_counter()
    for token, i in tok.hf.get_vocab().items():
        if i != eos:
            vocab.setdefault(token, []).append(i)
    v = oc.Vocabulary(eos, vocab)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    index = oc.Index(build_regex_from_schema(json.dumps(SCHEMA)), v)
    compile_s = time.perf_counter() - t
    guide = oc.Guide(index)
    times = []
    for token in tok.encode(ANSWER):
        t = time.perf_counter()
        allowed = torch.zeros(tok.vocab_size, dtype=torch.bool)
        allowed[guide.get_tokens()] = True
        times.append(time.perf_counter() - t)
        guide.advance(token)
    return {"setup_s": setup, "compile_ms": 1e3 * compile_s, "mask_us": 1e6 * sum(times) / len(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outlines-site", help="a folder where outlines-core is installed (pip install --target)")
    a = ap.parse_args()
    from pagedllm.model.tokenizer import load_tokenizer

    tok = load_tokenizer()
    rows = {"llguidance": llguidance_figures(tok)}
    if a.outlines_site:
        sys.path.insert(0, a.outlines_site)
        rows["outlines-core"] = outlines_figures(tok)
    for name, r in rows.items():
        print(
            f"{name:14s} set-up {r['setup_s']:.2f} s, compile {r['compile_ms']:.1f} ms, "
            f"mask {r['mask_us']:.0f} us per token"
        )


if __name__ == "__main__":
    main()
