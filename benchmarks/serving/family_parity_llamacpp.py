"""Every family x format on the same synthetic checkpoints: pagedllm's logits against transformers' and llama.cpp's.

The checkpoints are the tests' tiny random models (devkit/family_helpers.py; the hybrid families' from
devkit/hybrid_gguf.py: qwen3_5, qwen3_5_moe, qwen3_next, granitemoehybrid[_dense], lfm2_moe, nemotron_h,
nemotron_h_moe[_latent], and the last two's all-sparse twins nemotron_h_moe[_latent]_sparse, which llama.cpp loads;
dense LFM2's from devkit/lfm2_gguf.py: lfm2; Gemma 4's from devkit/gemma4_gguf.py: gemma4, dense, gemma4_moe and
gemma4_moe_full, its sparse block beside every MLP, and twins in the layer order llama.cpp assumes (see OWN)): an HF
folder per family and GGUF files written from it the way llama.cpp's converter writes them (F32, F16, Q8_0, Q4_0).
For each, one sequence of 104 tokens (past the 64-token original context of the scaled RoPE types) is run through
  - pagedllm (float32, the GGUF's weights as stored: quantized kernels for Q8_0 / Q4_0),
  - transformers on the HF folder holding the file's values (dequantized): the reference,
  - llama.cpp (llama-cpp-python in its own venv, /work/shared/anchors/setup-llamacpp.sh) on the GGUF itself:
    the independent check of what a GGUF means (rope_freqs, Phi-3's factors, Gemma's stored 1 + w norms).
and the table gives each one's largest logit difference relative to the largest logit, whether the argmax
agrees at every position, and pagedllm's resident weight bytes next to the file's.

    .venv/bin/python -m benchmarks.serving.family_parity_llamacpp [--llamacpp-python PY] [--markdown] [--families F,..]

Where llama.cpp refuses a file or aborts on it, its row says why (llama.cpp's own "error loading model" line, or
the assertion) and keeps the pagedllm / transformers figures.

With an F32 file llama.cpp (run with an F32 KV cache) agrees to ~1e-6..5e-4; on F16 files it multiplies in F16
and on Q8_0 / Q4_0 files it quantizes the activations to 8 bits, so there its figures are 1e-2..1e-1 against
both transformers and pagedllm (which keep float32 activations); a wrong RoPE or a missing norm shows as ~1 on
the F32 rows. llama.cpp insists on at least one BPE merge, transformers refuses merges of tokens the tests'
word-level vocabulary lacks: llama.cpp reads a twin file with one merge and the same tensors.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from devkit.family_helpers import FAMILIES, ORIG_CTX, make_family, write_gguf  # noqa: E402
from devkit.gemma4_gguf import MOE, make_gemma4, write_gemma4_gguf  # noqa: E402
from devkit.hybrid_gguf import CONFIGS, SPARSE_TWINS, make_hybrid, write_hybrid_gguf  # noqa: E402
from devkit.lfm2_gguf import make_lfm2, write_lfm2_gguf  # noqa: E402
from pagedllm.model import ModelRunner, SeqChunk, load_model  # noqa: E402

FORMATS = ["hf", "f32", "f16", "q8_0", "q4_0"]
HYBRID = CONFIGS | SPARSE_TWINS


def _gemma4(**shape: Any) -> tuple[Callable[[str], Any], Callable[..., Any]]:
    """Gemma 4 of `shape` (make_gemma4's overrides): its maker and its writer."""
    return (
        lambda folder: make_gemma4(folder, **shape),
        lambda hf, folder, fmt, path, merges=None: write_gemma4_gguf(folder, fmt, path, merges=merges, **shape),
    )


# Families with a writer of their own: make(folder) -> the transformers model; write(hf, folder, fmt, path, merges)
# -> the state dict (the model's names, torch tensors) of the values the file holds. gemma4: the tests' dense one
# (per-layer inputs, KV shared by the last two layers, double-wide MLPs there, k = v on full layers); gemma4_moe: the
# sparse block beside every dense MLP, without per-layer inputs or shared KV (tests/test_model_gemma4.py's GGUF MoE
# shape); gemma4_moe_full: the sparse block with every other piece too (its engine test's moe_folder). *_full_last:
# the same with the last layer before the shared ones full and the one before it sliding, as in the released E2B /
# E4B: llama.cpp's gemma4 has a shared layer reuse layer (first shared - 1) if full, (first shared - 2) if sliding,
# and aborts on the tests' order (sliding, sliding, full, sliding | shared: sliding, full), pagedllm and transformers
# take the last earlier layer of the kind
_FULL_LAST = ["sliding_attention"] * 3 + ["full_attention", "sliding_attention", "full_attention"]
_MOE_FULL = dict(hidden_size_per_layer_input=32, num_key_value_heads=4, **MOE)
OWN: dict[str, tuple[Callable[[str], Any], Callable[..., Any]]] = {
    "lfm2": (make_lfm2, write_lfm2_gguf),
    "gemma4": _gemma4(),
    "gemma4_full_last": _gemma4(layer_types=_FULL_LAST),
    "gemma4_moe": _gemma4(hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False, **MOE),
    "gemma4_moe_full": _gemma4(**_MOE_FULL),
    "gemma4_moe_full_full_last": _gemma4(**_MOE_FULL, layer_types=_FULL_LAST),
}

DEFAULT_LLAMACPP = "/work/anchors-work/llamacpp-venv/bin/python"
# Run inside llama.cpp's venv: every position's logits of one token sequence, as float32 .npy.
LLAMACPP_SCRIPT = """
import sys, json, numpy as np
from llama_cpp import Llama
path, out, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = Llama(model_path=path, n_ctx=int(sys.argv[4]), logits_all=True, n_threads=2, n_threads_batch=2,
            n_batch=512, type_k=0, type_v=0, flash_attn=False, verbose=True)  # an F32 KV cache, as ours
# verbose: llama.cpp's log on stderr says why it refuses a file
llm.eval(ids)
np.save(out, np.array(llm.scores[: len(ids)], dtype=np.float32))
"""


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def ours(path: str, ids: list[int]) -> tuple[np.ndarray, int]:
    """pagedllm's float32 logits at every position, and its resident weight bytes."""
    loaded = load_model(path, dtype="float32", verbose=False)
    runner = ModelRunner(loaded, num_blocks=-(-len(ids) // 16), block_size=16)
    logits = runner.execute([SeqChunk(ids, 0, list(range(runner.num_blocks)), all_logits=True)])
    return logits.numpy(), loaded.weight_bytes


@torch.inference_mode()
def reference(hf: torch.nn.Module, state: dict[str, torch.Tensor] | None, ids: list[int]) -> np.ndarray:
    model = hf
    if state is not None:
        model = copy.deepcopy(hf)
        model.load_state_dict(state, strict=False)
    return model(torch.tensor([ids])).logits[0].float().numpy()


@torch.inference_mode()
def hybrid_reference(folder: str, state: dict[str, np.ndarray], ids: list[int], work: str) -> np.ndarray:
    """transformers on a copy of `folder` holding the file's values (under model.safetensors' own names)."""
    import shutil

    from safetensors.numpy import save_file
    from transformers import AutoModelForCausalLM

    ref = os.path.join(work, "reference")
    shutil.rmtree(ref, ignore_errors=True)
    shutil.copytree(folder, ref, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(state, os.path.join(ref, "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    return model(torch.tensor([ids])).logits[0].float().numpy()


def _write(family: str, folder: str, fmt: str, path: str, hf: Any, merges: list[str] | None = None) -> object:
    if family in HYBRID:
        return write_hybrid_gguf(folder, family, fmt, path, merges=merges)
    if family in OWN:
        return OWN[family][1](hf, folder, fmt, path, merges=merges)
    return write_gguf(folder, family, fmt, path, merges=merges)


def llamacpp(python: str, path: str, ids: list[int], n_ctx: int, work: str) -> np.ndarray | str:
    """llama.cpp's logits for `ids` on the GGUF at `path`, or why it failed: its "error loading model" line, or
    the assertion it aborted on."""
    out = os.path.join(work, "llamacpp.npy")
    proc = subprocess.run(
        [python, "-c", LLAMACPP_SCRIPT, path, out, json.dumps(ids), str(n_ctx)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"]
        marker = "error loading model: "
        load = next((line.split(marker, 1)[1] for line in lines if marker in line), "")
        abort = next((line.split("/llama.cpp/", 1)[-1] for line in lines if "GGML_ASSERT" in line), "")
        reason = f"refuses: {load}" if load else f"aborts: {abort}" if abort else f"fails: {lines[-1]}"
        print(f"llama.cpp on {os.path.basename(path)}: {reason}", file=sys.stderr)
        return reason.strip()
    return np.load(out)


def family_rows(family: str, work: str, llamacpp_python: str | None) -> list[dict]:
    folder = os.path.join(work, family)
    os.makedirs(folder + "-gguf", exist_ok=True)
    if family in HYBRID:
        hf = make_hybrid(family, folder)
    else:
        hf = OWN[family][0](folder) if family in OWN else make_family(family, folder)
    n_ctx = hf.config.max_position_embeddings
    ids = [6 + (7 * i + 3) % 250 for i in range(ORIG_CTX + 40)]
    rows = []
    for fmt in FORMATS:
        path, state = folder, None
        if fmt != "hf":
            path = os.path.join(folder + "-gguf", f"tiny-{family}.{fmt}.gguf")
            state = _write(family, folder, fmt, path, hf)
        got, weight_bytes = ours(path, ids)
        if family in HYBRID and isinstance(state, dict):
            want = hybrid_reference(folder, state, ids, work)
        else:
            want = reference(hf, state, ids)  # type: ignore[arg-type]
        row = {"family": family, "format": fmt, "vs_transformers": rel(got, want)}
        row["argmax_agrees"] = bool((got.argmax(-1) == want.argmax(-1)).all())
        row["weights_kib"] = weight_bytes / 1024
        size = os.path.getsize(path) if fmt != "hf" else os.path.getsize(os.path.join(folder, "model.safetensors"))
        row["file_kib"] = size / 1024
        if fmt != "hf" and llamacpp_python:
            twin = os.path.join(work, "llamacpp.gguf")  # the same tensors, with the BPE merge llama.cpp insists on
            _write(family, folder, fmt, twin, hf, merges=["t 1"])
            theirs = llamacpp(llamacpp_python, twin, ids, n_ctx, work)
            if isinstance(theirs, str):
                row["llamacpp_fails"] = theirs
            else:
                row["vs_llamacpp"] = rel(got, theirs)
                row["llamacpp_vs_transformers"] = rel(theirs, want)
                row["llamacpp_argmax_agrees"] = float((theirs.argmax(-1) == want.argmax(-1)).mean())
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    cols = ["family", "format", "vs transformers", "argmax", "vs llama.cpp", "llama.cpp vs transformers"]
    cols += ["llama.cpp argmax"]
    cols += ["weights KiB", "file KiB"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cpp = f"{r['vs_llamacpp']:.1e}" if "vs_llamacpp" in r else "-"
        cpp = r.get("llamacpp_fails", cpp)
        cpp_ref = f"{r['llamacpp_vs_transformers']:.1e}" if "llamacpp_vs_transformers" in r else "-"
        argmax = "same" if r["argmax_agrees"] else "DIFFERS"
        cpp_top = f"{100 * r['llamacpp_argmax_agrees']:.0f}%" if "llamacpp_argmax_agrees" in r else "-"
        lines.append(
            f"| {r['family']} | {r['format']} | {r['vs_transformers']:.1e} | {argmax} "
            f"| {cpp} | {cpp_ref} | {cpp_top} | {r['weights_kib']:.0f} | {r['file_kib']:.0f} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llamacpp-python", default=DEFAULT_LLAMACPP, help="python of a venv with llama-cpp-python")
    ap.add_argument("--families", default=",".join(FAMILIES + list(HYBRID) + list(OWN)))
    ap.add_argument("--markdown", action="store_true", help="print the docs table instead of JSON lines")
    args = ap.parse_args()
    torch.set_num_threads(1)  # tiny matrices: threads only add spin-waits
    python = args.llamacpp_python if os.path.exists(args.llamacpp_python) else None
    if python is None:
        print(f"no llama.cpp at {args.llamacpp_python}: its columns stay empty", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for family in args.families.split(","):
            for row in family_rows(family, work, python):
                rows.append(row)
                if not args.markdown:
                    print(json.dumps(row), flush=True)
    if args.markdown:
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
