"""What model tests share: tiny random Hugging Face checkpoints of each supported architecture, saved with a
word-level tokenizer so that load_model reads them as it reads a real folder."""

from __future__ import annotations

import contextlib
import os

import torch

from devkit.tiny_tokenizer import save_tiny_tokenizer

VOCAB = 256


def make_tiny_hf(kind: str, folder: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "llama_gqa_tied":
        cfg = LlamaConfig(**common, tie_word_embeddings=True, max_position_embeddings=256)
    elif kind == "qwen2_bias":
        cfg = Qwen2Config(**common, max_position_embeddings=256, rope_theta=1e6)
    elif kind == "llama3_rope":
        cfg = LlamaConfig(
            **common,
            max_position_embeddings=512,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
    elif kind == "llama_linear_rope":
        cfg = LlamaConfig(**common, max_position_embeddings=256, rope_scaling={"rope_type": "linear", "factor": 2.0})
    elif kind == "mistral":
        cfg = MistralConfig(**common, max_position_embeddings=256, sliding_window=None)
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    if kind == "qwen2_bias":  # random init leaves biases at zero: make them matter
        with torch.no_grad():
            for layer in hf.model.layers:
                for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    p.bias.normal_(0, 0.5)
    hf.save_pretrained(folder, safe_serialization=True)
    save_tiny_tokenizer(folder, VOCAB)
    return hf


def all_logits(runner, chunks):
    """float32 logits for every new token of each chunk: one [len(token_ids), vocab] tensor per chunk."""
    from dataclasses import replace

    out = runner.execute([replace(c, all_logits=True) for c in chunks])
    return list(out.split([len(c.token_ids) for c in chunks]))


def chunked_logits_error(loaded, ids: list[int], want: torch.Tensor) -> float:
    """A hybrid model's logits against `want` (transformers' for `ids`, 110 tokens): prefilled in chunks of 37 and
    70 (the state crosses chunk ends, one a scan chunk's) over shuffled blocks, then three decoded; the largest
    difference over the largest logit."""
    import random

    from pagedllm.model import ModelRunner, SeqChunk

    runner = ModelRunner(loaded, num_blocks=32, block_size=8, num_state_slots=2)
    table = random.Random(2).sample(range(32), 16)
    got = all_logits(runner, [SeqChunk(ids[:37], 0, table, state_slot=1)])
    got += all_logits(runner, [SeqChunk(ids[37:107], 37, table, state_slot=1)])
    for pos in range(107, 110):
        got.append(runner.execute([SeqChunk(ids[pos : pos + 1], pos, table, state_slot=1)]))
    return (torch.cat(got) - want).abs().max().item() / want.abs().max().item()


def fused_and_torch(
    loaded,
    ids: list[int],
    split: int,
    steps: int,
    kv_dtype: torch.dtype | None = None,
    paths: tuple[bool, ...] = (True, False),
) -> dict[bool, tuple[torch.Tensor, list[int]]]:
    """Per path (the fused C step or the torch path; `paths`: which): the logits of `ids` prefilled in two chunks
    over shuffled blocks, then of `steps` greedy decode tokens each path picks itself, and those tokens.
    `kv_dtype`: the KV cache's (default: the model's)."""
    import random

    from pagedllm.model import ModelRunner, SeqChunk

    out = {}
    for fused in paths:
        runner = ModelRunner(loaded, num_blocks=16, block_size=8, kv_dtype=kv_dtype, fused=fused)
        assert (runner.fused is not None) == fused
        table = random.Random(4).sample(range(16), 16)
        rows = [all_logits(runner, [SeqChunk(ids[:split], 0, table)])[0]]
        rows.append(all_logits(runner, [SeqChunk(ids[split:], split, table)])[0])
        tokens: list[int] = []
        for _ in range(steps):
            tokens.append(int(rows[-1][-1].argmax()))
            rows.append(runner.execute([SeqChunk(tokens[-1:], len(ids) + len(tokens) - 1, table)]))
        out[fused] = (torch.cat(rows), tokens)
    return out


# Two steps of two sequences with state marks (SeqChunk.state_marks: (offset, row)): a 29-token chunk of sequence
# 0 marked at its first token, mid-block and at its last-but-one token beside a 9-token chunk of sequence 1 marked
# once; then sequence 0's next 41 tokens marked three times beside a decode token of sequence 1 (no marks). Slots
# 0 and 1; every mark its own row of the 10.
MARKED_STEPS = (([(1, 4), (8, 5), (16, 6), (28, 7)], [(4, 8)]), ([(3, 2), (24, 3), (40, 9)], []))


def marks_fused_and_torch(loaded, ids: list[int], other: list[int]) -> dict[bool, tuple[torch.Tensor, dict]]:
    """Per path (the fused C step or the torch path): MARKED_STEPS over `ids` (70 tokens, sequence 0) and `other`
    (9 prompt tokens then a decode token, sequence 1): every row's logits, and every linear layer's (conv,
    recurrent) state rows after the second step (the slots and the mark rows alike)."""
    from pagedllm.model import ModelRunner, SeqChunk

    out = {}
    for fused in (True, False):
        runner = ModelRunner(loaded, num_blocks=24, block_size=8, fused=fused, num_state_slots=10)
        assert (runner.fused is not None) == fused
        tables = [list(range(23, 11, -1)), list(range(12))]
        (a0, b0), (a1, b1) = MARKED_STEPS
        rows = all_logits(
            runner, [SeqChunk(ids[:29], 0, tables[0], state_marks=a0), SeqChunk(other, 0, tables[1], state_marks=b0)]
        )
        decode = int(rows[1][-1].argmax())
        rows += all_logits(
            runner,
            [
                SeqChunk(ids[29:70], 29, tables[0], state_marks=a1),
                SeqChunk([decode], len(other), tables[1], state_marks=b1 or None),
            ],
        )
        states = {i: (conv.clone(), rec.clone()) for i, (conv, rec) in runner.states.items()}
        out[fused] = (torch.cat(rows), states)
    return out


def assert_marked_states_match(got: dict[bool, tuple[torch.Tensor, dict]], tol: float) -> None:
    """marks_fused_and_torch's two paths agree: logits within `tol` of the largest, and every layer's state rows
    (slots and marks, conv and recurrent) within `tol` of its largest value (at least 1); a mark row was written
    (no longer zeros)."""
    (fused, fused_states), (want, want_states) = got[True], got[False]
    assert (fused - want).abs().max().item() < tol * want.abs().max().item()
    marked = [r for step in MARKED_STEPS for seq in step for _, r in seq]
    for layer, pair in want_states.items():
        for got_t, want_t in zip(fused_states[layer], pair):
            if not want_t.numel():
                continue
            assert want_t[marked].abs().amax(dim=tuple(range(1, want_t.dim()))).min() > 0, layer
            scale = max(1.0, want_t.abs().max().item())
            assert (got_t.float() - want_t.float()).abs().max().item() < tol * scale, layer


def assert_long_marked_chunks_match(loaded, ids: list[int], sizes: tuple[int, ...], tol: float) -> None:
    """Per path (the fused C step, the torch path): `ids` prefilled in chunks of `sizes` tokens, each marked at
    every 16-token block boundary inside it (--mamba-cache-mode all; a row each), then 4 greedy decode tokens: every
    row's logits within `tol` of the largest, and every linear layer's (conv, recurrent) state rows (slot 0, then
    the marks' rows) within `tol` of its largest value (at least 1), every row written."""
    import random

    from pagedllm.model import ModelRunner, SeqChunk

    out = {}
    for fused in (True, False):
        runner = ModelRunner(loaded, num_blocks=12, block_size=16, fused=fused, num_state_slots=10)
        assert (runner.fused is not None) == fused
        table, rows, start, row = random.Random(5).sample(range(12), 12), [], 0, 1
        for size in sizes:
            marks = [(t - start, row + i) for i, t in enumerate(range((start // 16 + 1) * 16, start + size, 16))]
            chunk = SeqChunk(ids[start : start + size], start, table, state_slot=0, state_marks=marks)
            rows += all_logits(runner, [chunk])
            start, row = start + size, row + len(marks)
        for _ in range(4):
            token = int(rows[-1][-1].argmax())
            rows.append(runner.execute([SeqChunk([token], start, table, state_slot=0)]))
            start += 1
        out[fused] = (torch.cat(rows), {i: (c[:row].clone(), r[:row].clone()) for i, (c, r) in runner.states.items()})
    (fused_logits, fused_states), (want, want_states) = out[True], out[False]
    assert (fused_logits - want).abs().max().item() < tol * want.abs().max().item()
    for layer, pair in want_states.items():
        for got_t, want_t in zip(fused_states[layer], pair):
            if want_t.numel():
                assert want_t.abs().amax(dim=tuple(range(1, want_t.dim()))).min() > 0, layer  # every row written
                scale = max(1.0, want_t.abs().max().item())
                assert (got_t.float() - want_t.float()).abs().max().item() < tol * scale, layer


def assert_state_round_trip(runner) -> None:
    """A prefix-cache checkpoint's round trip: slot 0's random states laid across pool blocks
    (runner.state_to_blocks, any blocks in any order) and read back into slot 1 (blocks_to_state) give every
    layer's conv and recurrent state back, bit for bit."""
    ids = list(range(-(-runner.state_row_bytes // runner.bytes_per_block) + 1))[::-1]
    torch.manual_seed(0)
    for conv, rec in runner.states.values():
        conv[0].normal_(), rec[0].normal_()
    runner.state_to_blocks(0, ids)
    runner.blocks_to_state(ids, 1)
    assert all(torch.equal(t[0], t[1]) for pair in runner.states.values() for t in pair)


@contextlib.contextmanager
def cpu_target(name: str):
    """The kernels of one CPU class (PAGEDLLM_CPU_TARGET, as tests/test_cpu_targets.py forces it) while the block
    runs: what cpu_kernel.load() gives the model's runners built inside it."""
    from pagedllm.model.kernels import cpu_kernel

    before = os.environ.get("PAGEDLLM_CPU_TARGET")
    os.environ["PAGEDLLM_CPU_TARGET"] = name
    cpu_kernel.load.cache_clear()
    try:
        assert cpu_kernel.load() is not None, f"the {name} build failed (see the warning logged)"
        yield
    finally:
        if before is None:
            del os.environ["PAGEDLLM_CPU_TARGET"]
        else:
            os.environ["PAGEDLLM_CPU_TARGET"] = before
        cpu_kernel.load.cache_clear()


def garbage_state_caches(mixer, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A recurrent mixer's conv and recurrent state rows for `slots` slots, filled with garbage (7.0): a sequence
    that starts fresh must zero its slot, not read what a slot held before."""
    conv, rec = mixer.state_shapes()
    return torch.full((slots, *conv), 7.0), torch.full((slots, *rec), 7.0)


@torch.no_grad()
def run_in_chunks(mixer, x: torch.Tensor, chunks: tuple[int, ...], slot: int = 2) -> tuple[torch.Tensor, int]:
    """x [T, hidden] through `mixer` one sequence in slot `slot`, chunk by chunk (each step committed, the first
    starting fresh): the outputs concatenated, and how many tokens they cover."""
    from pagedllm.model.layers.deltanet import RecurrentStep

    conv, rec = garbage_state_caches(mixer, slot + 1)
    got, pos = [], 0
    for n in chunks:
        step = RecurrentStep(torch.tensor([slot]), [n], [pos == 0])
        got.append(mixer(x[pos : pos + n], conv, rec, step))
        step.commit()
        pos += n
    return torch.cat(got), pos


@torch.no_grad()
def states_at_marks(mixer, x: torch.Tensor, marks: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """x [T, hidden] through `mixer` as one prompt chunk asking for its states after each of `marks` tokens
    (RecurrentStep.marks: prefix-cache checkpoints inside a chunk), written to their rows at commit, each paired
    with the state after feeding those first tokens one by one (the decode path's update, not the scan): the
    largest difference of each, relative to the largest state value."""
    from pagedllm.model.layers.deltanet import RecurrentStep

    conv, rec = garbage_state_caches(mixer, 2 + len(marks))
    rows = list(range(2, 2 + len(marks)))
    step = RecurrentStep(torch.tensor([0]), [len(x)], [True], marks=[marks], mark_rows=torch.tensor(rows))
    mixer(x, conv, rec, step)
    step.commit()
    diffs = []
    at = dict(zip(marks, rows))
    for i in range(max(marks)):
        one = RecurrentStep(torch.tensor([1]), [1], [i == 0])
        mixer(x[i : i + 1], conv, rec, one)
        one.commit()
        if i + 1 in at:
            for got, want in ((conv[at[i + 1]], conv[1]), (rec[at[i + 1]], rec[1])):
                diffs.append((got - want).abs().max().item() / max(1.0, want.abs().max().item()) if want.numel() else 0)
    return diffs
