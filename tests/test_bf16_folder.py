"""A Hugging Face folder of bfloat16 weights under the default `--quantization auto`: its matrices kept as stored
(the kernels' bf16 format: the file's values, nothing rounded) so that the fused C step runs it; against the
torch path over the same file (`--quantization none`: dense bfloat16 through oneDNN, transformers' layout), for
a dense family (tied embeddings), a mixture of experts and the Gated DeltaNet hybrids. A float32 folder stays
dense (its exact path), and `none` stays the torch path."""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch
from model_helpers import fused_and_torch, make_tiny_hf
from moe_helpers import make_moe
from test_model_gemma4 import make_gemma4
from test_model_hybrid import make_hybrid

from pagedllm.model import ModelRunner, load_model
from pagedllm.model.kernels import cpu_kernel, kernel_choice
from pagedllm.model.kernels.quant_linear import qrows
from pagedllm.model.layers.moe import SparseMoE

pytestmark = [
    pytest.mark.usefixtures("one_thread", "private_tokenizer_cache"),  # tests/conftest.py
    pytest.mark.skipif(cpu_kernel.load() is None, reason="the C kernels are not built here"),
]
# (family, the dtype its folder is saved in): a dense family with tied embeddings, one with q/k/v biases in
# float16 (the kernels' f16 format), a mixture of experts and the hybrids (Qwen3-Next: experts too)
FOLDERS = [
    ("llama_gqa_tied", torch.bfloat16),
    ("qwen2_bias", torch.float16),
    ("qwen3_moe", torch.bfloat16),
    ("qwen3_5", torch.bfloat16),
    ("qwen3_next", torch.bfloat16),
]
# of the largest logit: the C step's bfloat16 route rounds the matmul inputs to bfloat16, and a hybrid's conv
# states are kept in bfloat16 between steps (the torch path rounds every activation, and is 3-10x further off)
TOL = 0.1
EXACT = 1e-4  # float32 activations over the same values: only the order of the sums differs


REAL_CHOOSE = kernel_choice.choose


@pytest.fixture(autouse=True)
def kept_as_stored(monkeypatch) -> None:
    """What "auto" keeps does not rest on this machine's speed: the kernel choice as measured (its routes and row
    thresholds), but with dense never faster, so the folder's matrices are kept (test_auto_follows_the_measured_choice
    checks the other outcome). On tiny shapes under load, one row of dense can time faster and fail the tests."""
    from pagedllm.model.kernels import kernel_choice

    measured = kernel_choice.choose

    def choose(layer, dtype, dot=True, int8=True, stored=False):
        c = measured(layer, dtype, dot, int8, stored)
        ms = {k: v for k, v in c.ms.items() if k != "dense"}
        return kernel_choice.decide(ms, c.build, dot, int8, stored)

    monkeypatch.setattr(kernel_choice, "choose", choose)


def _make(family: str, folder: str) -> torch.nn.Module:
    if family in ("qwen3_5", "qwen3_next"):
        return make_hybrid(family, folder, shared_expert_intermediate_size=64)  # every matmul in groups of 32
    if family == "qwen3_moe":
        return make_moe(family, folder)
    if family == "gemma4":
        return make_gemma4(folder, hidden_size_per_layer_input=32)  # every matmul in groups of 32
    return make_tiny_hf(family, folder)


def _save16(family: str, dtype: torch.dtype, root) -> str:
    """The family's tiny random checkpoint saved in 16 bits (what a released checkpoint is), beside its tokenizer;
    its folder."""
    f32, folder = str(root / f"{family}-f32"), str(root / f"{family}-16")
    hf = _make(family, f32)
    hf.to(dtype).save_pretrained(folder, safe_serialization=True)
    for name in os.listdir(f32):
        if not name.endswith(".safetensors") and name != "config.json" and not os.path.exists(f"{folder}/{name}"):
            shutil.copy(os.path.join(f32, name), folder)
    return folder


@pytest.fixture(scope="module", params=FOLDERS, ids=[f for f, _ in FOLDERS])
def bf16_folder(request, tmp_path_factory) -> tuple[str, str]:
    family, dtype = request.param
    return family, _save16(family, dtype, tmp_path_factory.mktemp(family))


def _file_bytes(folder: str) -> int:
    from safetensors import safe_open

    total = 0
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        with safe_open(path, framework="pt") as f:
            total += sum(f.get_tensor(k).numel() * 2 for k in f.keys())
    return total


def test_auto_keeps_the_matrices_as_stored_and_runs_the_fused_step(bf16_folder):
    """Every matmul weight and the embedding table in the bf16 format (the table's rows the file's values, bit for
    bit), the fused C step built, and the weights resident at about the file's size (no float32 or second copy
    left: a merged q/k/v pads to whole blocks of 16 rows)."""
    from safetensors import safe_open

    family, folder = bf16_folder
    loaded = load_model(folder, verbose=False)
    m = loaded.model
    fmt = "f16" if family == "qwen2_bias" else "bf16"
    assert loaded.dtype == torch.bfloat16 and loaded.quantization == "auto" and loaded.kernel_choice is not None
    assert {w.fmt for w in m.quant_weights()} == {fmt}
    assert all(lin.quant is not None for lin in m.linears() if not lin.keep_dense)
    assert ModelRunner(loaded, num_blocks=8, block_size=8).fused is not None
    with safe_open(glob.glob(os.path.join(folder, "*.safetensors"))[0], framework="pt") as f:
        name = next(k for k in f.keys() if k.endswith("embed_tokens.weight"))
        table = f.get_tensor(name)
    ids = torch.arange(table.shape[0])
    assert torch.equal(qrows(m.embed.quant, ids), table.float())
    assert loaded.weight_bytes < 1.1 * _file_bytes(folder)
    moe = [layer.moe for layer in m.decoder_layers if isinstance(layer.moe, SparseMoE)]
    assert all(b.experts_kernel() is not None for b in moe)


def _error(got: tuple[torch.Tensor, list[int]], ids: list[int], reference: torch.nn.Module, picks: float) -> float:
    """Largest difference of a path's logits from transformers' float32 ones over the same tokens (the prompt and
    the path's own greedy tokens, teacher-forced), over the largest logit; each greedy token one the reference
    ranks first, or within `picks` (of the largest logit) of first: a near-tie may break either way."""
    logits, tokens = got
    with torch.no_grad():
        want = reference(torch.tensor([ids + tokens])).logits[0].float()[: len(logits)]
    scale = want.abs().max().item()
    picked = want[len(ids) - 1 : len(ids) - 1 + len(tokens)]
    assert (picked.max(-1).values - picked[torch.arange(len(tokens)), tokens] <= picks * scale).all()
    return (logits - want).abs().max().item() / scale


def test_the_fused_step_is_as_close_to_float32_as_the_torch_path(bf16_folder):
    """The fused C step over the file's bfloat16 values and `--quantization none` (the torch path: oneDNN's dense
    bfloat16 matmuls, every activation rounded to bfloat16) against transformers in float32 over the same values:
    a prompt in two chunks over shuffled blocks, then 8 greedy tokens, a float32 KV cache. The C step keeps the
    stream and the recurrent states in float32 (see TOL), so it is within TOL and no further off than the torch
    path; for the dense family the two paths pick the same tokens (a tiny random MoE or hybrid in bfloat16 routes
    or decays near-ties either way)."""
    from transformers import AutoModelForCausalLM

    family, folder = bf16_folder
    kept = load_model(folder, verbose=False)
    dense = load_model(folder, quantization="none", verbose=False)
    assert dense.quantization == "none" and dense.model.embed.quant is None
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = [3 + (i * 37) % 250 for i in range(40)]
    fused = fused_and_torch(kept, ids, 17, 8, torch.float32, paths=(True,))[True]
    torch_path = fused_and_torch(dense, ids, 17, 8, torch.float32, paths=(False,))[False]
    err, torch_err = _error(fused, ids, reference, TOL), _error(torch_path, ids, reference, 1.0)
    assert err < TOL and err <= torch_err + 1e-3, f"{err:.2e} against the torch path's {torch_err:.2e}"
    if family in ("llama_gqa_tied", "qwen2_bias"):
        assert fused[1] == torch_path[1]


def test_float32_activations_over_the_stored_values_are_transformers_float32(bf16_folder):
    """--dtype float32 over a bfloat16 folder: the matrices still kept as stored (lossless), float32 activations
    and KV cache on the fused C step: transformers' float32 logits over the file's values within EXACT, its
    greedy tokens."""
    from transformers import AutoModelForCausalLM

    _, folder = bf16_folder
    kept = load_model(folder, dtype="float32", verbose=False)
    assert kept.quantization == "auto" and {w.fmt for w in kept.model.quant_weights()} <= {"bf16", "f16"}
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = [3 + (i * 37) % 250 for i in range(40)]
    assert _error(fused_and_torch(kept, ids, 17, 8, paths=(True,))[True], ids, reference, EXACT) < EXACT


def test_auto_follows_the_measured_choice(tmp_path, monkeypatch):
    """The folder's "auto" is decided as a GGUF's is (kernel_choice): kept as stored where the kernel is measured
    no slower than dense for one row, loaded dense (the torch path) where it is slower."""
    from pagedllm.model.kernels import kernel_choice

    folder = _save16("llama_gqa_tied", torch.bfloat16, tmp_path)
    fast = {1: 0.2, 8: 0.6, 64: 3.0, 256: 12.0}
    for dense_1, want in ((0.5, "auto"), (0.1, "none")):
        ms = {"q-f32": fast, "dense": {**fast, 1: dense_1}}
        monkeypatch.setattr(
            kernel_choice,
            "choose",
            lambda layer, dtype, dot, int8, stored, ms=ms: kernel_choice.decide(ms, "t", dot, int8, stored),
        )
        loaded = load_model(folder, verbose=False)
        assert loaded.quantization == want and bool(loaded.model.quant_weights()) == (want == "auto")
        assert (ModelRunner(loaded, num_blocks=8, block_size=8).fused is not None) == (want == "auto")


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
def test_a_folder_the_torch_path_runs_slowly_stays_as_stored_where_dense_times_faster(tmp_path, monkeypatch, family):
    """A model with recurrent layers (Qwen3.5) or per-layer inputs (Gemma 4) keeps its 16-bit matrices as stored
    even where one row of dense measures faster: dense is the torch path, which runs op by op what the C step fuses
    (loader._dense_may_win)."""
    from pagedllm.model.kernels import kernel_choice

    folder = _save16(family, torch.bfloat16, tmp_path)
    fast = {1: 0.2, 8: 0.6, 64: 3.0, 256: 12.0}
    ms = {"q-f32": fast, "q-dot": fast, "dense": {**fast, 1: 0.1}, "q-bf16": {1: 0.3, 8: 0.5, 64: 1.5, 256: 6.0}}
    monkeypatch.setattr(kernel_choice, "choose", REAL_CHOOSE)  # not kept_as_stored's
    monkeypatch.setattr(kernel_choice, "_cache_file", lambda layer, dtype: None)  # choose() measures afresh ...
    monkeypatch.setattr(  # ... these times
        kernel_choice, "measure", lambda layer, dtype, build, dot, int8: kernel_choice.decide(ms, build, dot, int8)
    )
    assert not kernel_choice.decide(ms, "t").quantized  # the times say dense ...
    loaded = load_model(folder, verbose=False)
    assert loaded.quantization == "auto" and loaded.model.quant_weights()  # ... and the matrices stay as stored,
    choice = loaded.kernel_choice
    assert choice.quantized and choice.kept and "kept as stored although dense timed faster" in choice.describe()
    # with the row counts decided as for any quantized model: q-bf16 from 8 rows, where it is faster (not "never")
    assert choice.amx_min_rows == 8 and {w.amx_min_rows for w in loaded.model.quant_weights()} == {8}
    slots = 1 if loaded.config.linear_layers else 0  # a state slot where the model has recurrent layers
    assert ModelRunner(loaded, num_blocks=8, block_size=8, num_state_slots=slots).fused is not None


def test_a_float32_folder_stays_dense(tmp_path):
    """auto on a float32 checkpoint: the dense float32 path (its exact values and sums), no weight quantized."""
    make_tiny_hf("llama_gqa_tied", str(tmp_path))
    loaded = load_model(str(tmp_path), verbose=False)
    assert loaded.quantization == "none" and loaded.dtype == torch.float32 and not loaded.model.quant_weights()
