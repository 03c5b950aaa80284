"""One model's decode on the fused C step against the torch path, in paired rounds in one process (issue 36.1).

Loads the model once, prefills one request of random tokens, then decodes in rounds: each round times `--steps`
decode steps on the fused step, then as many on the torch path (the same weights, the same kernels for the
matmuls and the routed experts; the torch path pays torch's per-op cost around them). The machine is shared, so
the rounds are paired and the medians reported; the ratio is what counts. Tok/s is of the whole engine step;
the runner's share (`runner.execute`) is given too.

    .venv/bin/python -m benchmarks.kernels.fused_vs_torch --model FILE.gguf --steps 16 --rounds 3
    .venv/bin/python -m benchmarks.kernels.fused_vs_torch --hybrid qwen3.5-2b@8 --quantization int8

`--hybrid NAME@L`: a random-weight Hugging Face folder of a hybrid shape's first L layers (HYBRID_SHAPES; written
once under ~/.cache/pagedllm/real-sizes), its weights rounded at load by --quantization.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

if __name__ == "__main__":  # before torch loads: the class to build and measure (cpu_target.py)
    from benchmarks import cpu_target

    cpu_target.select()

from benchmarks.common import cpu_line
from pagedllm import SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine

# Hybrid shapes as transformers configs. Qwen3.5-2B-like: Qwen3.5's layer (three Gated DeltaNet layers to one
# gated full-attention one, 16 key / 16 value heads of 128, conv 4; attention 8 heads / 2 KV of 256, the output
# gate) at a 2B model's width (hidden 2048, MLP 6144, 24 layers) and Qwen3.5's 248,320 vocabulary, tied.
HYBRID_SHAPES = {
    "qwen3.5-2b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        vocab_size=248320,
        tie_word_embeddings=True,
    ),
}


def hybrid_folder(name: str, root: str = "~/.cache/pagedllm/real-sizes") -> str:
    """The random HF folder of NAME@L under `root` (bfloat16 N(0, 0.02) matrices, A_log spread as a trained
    model's), written on first use."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from devkit.tiny_tokenizer import save_tiny_tokenizer

    base, _, layers = name.partition("@")
    shape = HYBRID_SHAPES[base] | ({"num_hidden_layers": int(layers)} if layers else {})
    folder = os.path.join(os.path.expanduser(root), f"{name}-random-hf")
    config = os.path.join(folder, "config.json")
    if os.path.isfile(config):
        _published_fields(config)
        return folder
    cfg = Qwen3_5TextConfig(**shape)
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "A_log" in pname:
                p.uniform_(-2, 1)
            elif "norm" not in pname and p.dim() >= 2:
                p.normal_(0, 0.02)
    model.save_pretrained(folder, safe_serialization=True)
    save_tiny_tokenizer(folder, cfg.vocab_size)
    _published_fields(config)
    return folder


# Fields Qwen3.5's published config.json files carry that transformers' config class does not write. vLLM reads
# mamba_ssm_dtype (its Qwen3_5 config hook): without it vLLM keeps the Gated DeltaNet state in the model's dtype,
# half the bytes of the float32 state the real checkpoints ask for (and pagedllm keeps, as transformers does).
PUBLISHED_FIELDS = {"mamba_ssm_dtype": "float32"}


def _published_fields(config: str) -> None:
    """Add PUBLISHED_FIELDS to a folder written here (an older one lacks them), so vLLM runs the real model's
    state dtype."""
    raw = json.load(open(config))
    if all(raw.get(k) == v for k, v in PUBLISHED_FIELDS.items()):
        return
    with open(config + ".part", "w") as f:  # then replaced: a link at `config` is replaced, not written through
        json.dump(raw | PUBLISHED_FIELDS, f, indent=2)
    os.replace(config + ".part", config)


def run(a) -> dict[str, list[float]]:
    """Per path: each round's (step ms, runner ms), as two lists of per-round means."""
    model = hybrid_folder(a.hybrid) if a.hybrid else a.model
    engine = LLMEngine(
        EngineConfig(
            model=model,
            dtype=a.dtype,
            quantization=a.quantization,
            log_stats_interval=0,
            max_model_len=a.input_len + 1024,
        )
    )
    runner, fused = engine.runner, engine.runner.fused
    if fused is None:
        raise SystemExit("this model does not run the fused step here (see the log line)")
    rng = random.Random(0)
    prompt = [rng.randrange(200, engine.model_config.vocab_size) for _ in range(a.input_len)]
    need = 8 + 2 * a.rounds * a.steps
    engine.add_request("0", prompt, SamplingParams(temperature=0, max_tokens=need + 8, ignore_eos=True))
    for _ in range(8):  # the prefill and a few warm-up decodes (fused)
        engine.step()
    inner = [0.0]
    execute = runner.execute

    def timed(chunks):
        t = time.perf_counter()
        out = execute(chunks)
        inner[0] += time.perf_counter() - t
        return out

    runner.execute = timed
    out: dict[str, list[float]] = {"fused step": [], "fused runner": [], "torch step": [], "torch runner": []}
    for _ in range(a.rounds):
        for path, step in (("fused", fused), ("torch", None)):
            runner.fused, inner[0] = step, 0.0
            t = time.perf_counter()
            for _ in range(a.steps):
                engine.step()
            out[f"{path} step"].append(1e3 * (time.perf_counter() - t) / a.steps)
            out[f"{path} runner"].append(1e3 * inner[0] / a.steps)
    runner.fused = fused
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="GGUF file (its weights kept quantized: the fused step's)")
    p.add_argument("--hybrid", help=f"instead of --model: NAME@L of {', '.join(HYBRID_SHAPES)}")
    p.add_argument("--quantization", default=None, help="as --quantization (int8 | int4 for --hybrid)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=16, help="decode steps per path per round")
    p.add_argument("--rounds", type=int, default=3)
    cpu_target.add_argument(p)
    a = p.parse_args()
    if not a.model and not a.hybrid:
        p.error("--model or --hybrid")
    ms = {k: statistics.median(v) for k, v in run(a).items()}
    print(f"CPU: {cpu_line()}")
    for path in ("fused", "torch"):
        step, inner = ms[f"{path} step"], ms[f"{path} runner"]
        print(f"{path:<6} {1e3 / step:6.2f} tok/s  (step {step:8.2f} ms, runner.execute {inner:8.2f} ms)")
    print(
        f"fused / torch: {ms['torch step'] / ms['fused step']:.2f}x decode tok/s, "
        f"{ms['torch runner'] / ms['fused runner']:.2f}x runner time (medians of {a.rounds} paired rounds)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
