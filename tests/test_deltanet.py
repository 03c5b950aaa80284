"""The Gated DeltaNet mixer (model/layers/deltanet.py) against transformers' own modules with the same weights, in
float32: a sequence fed in uneven chunks (the state carried across each, through slots and commits) and then
token by token equals transformers' whole-sequence output; several sequences in one step each keep their own
state; a step that is never committed leaves the states as they were."""

from __future__ import annotations

import pytest
import torch
from model_helpers import garbage_state_caches, run_in_chunks, states_at_marks

from pagedllm.model.config import ModelConfig
from pagedllm.model.layers.deltanet import (
    CHUNK,
    GatedDeltaNet,
    RecurrentStep,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

TOL = 1e-5


def _config(family: str) -> ModelConfig:
    return ModelConfig(
        architecture="",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        family=family,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        linear_proj="fused" if family == "qwen3_next" else "split",  # as transformers' folders store them
    )


def _reference(family: str):
    """transformers' mixer of `family` with random weights (A_log and dt_bias drawn so decays vary)."""
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet as Mixer

        cls = Qwen3NextConfig
    else:
        from transformers import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet as Mixer

        cls = Qwen3_5TextConfig
    cfg = cls(
        hidden_size=64,
        num_hidden_layers=1,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-5,
        layer_types=["linear_attention"],
    )
    torch.manual_seed(0)
    ref = Mixer(cfg, 0).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
        ref.A_log.uniform_(-2, 1)
        ref.norm.weight.uniform_(0.5, 1.5)
    return ref


def _ours(family: str, ref) -> GatedDeltaNet:
    m = GatedDeltaNet(_config(family), torch.float32, "cpu")
    names = {
        "lin_qkvz": "in_proj_qkvz",
        "lin_ba": "in_proj_ba",
        "lin_qkv": "in_proj_qkv",
        "lin_z": "in_proj_z",
        "lin_b": "in_proj_b",
        "lin_a": "in_proj_a",
        "lin_conv": "conv1d",
        "lin_norm": "norm",
        "lin_out": "out_proj",
    }
    sd = ref.state_dict()
    with torch.no_grad():
        for slot, mod in m.slots().items():
            key = {"lin_a_log": "A_log", "lin_dt_bias": "dt_bias"}.get(slot) or names[slot] + ".weight"
            mod.weight.copy_(sd[key])
    return m


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_chunks_then_decode_match_transformers(family):
    ref = _reference(family)
    m = _ours(family, ref)
    torch.manual_seed(1)
    x = torch.randn(1, 160, 64)
    with torch.no_grad():
        want = ref(x)[0]
    # uneven chunks, a 70-token one crossing a 64-token chunk of the scan
    got_all, pos = run_in_chunks(m, x[0], (37, 70, 1, 45, 1, 1, 5))
    assert (got_all - want[:pos]).abs().max().item() < TOL * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_a_chunk_leaves_its_state_at_each_mark(family):
    """--mamba-cache-mode all: a 150-token prompt chunk asked for its state after 1, 16, 63, 64, 65, 100 and 128
    tokens (block boundaries, in and at the ends of the scan's 64-token chunks) writes each into its row at commit:
    the conv and delta-rule states the token-by-token update reaches after those tokens."""
    m = _ours(family, _reference(family))
    torch.manual_seed(4)
    assert max(states_at_marks(m, torch.randn(150, 64), [1, 16, 63, 64, 65, 100, 128])) < TOL


@pytest.mark.parametrize("family", ["qwen3_5"])
def test_batched_sequences_keep_their_own_state(family):
    """Two sequences and a decode in one step, in other slots, equal each run alone; an uncommitted step changes
    no slot."""
    ref = _reference(family)
    m = _ours(family, ref)
    torch.manual_seed(2)
    xs = [torch.randn(n, 64) for n in (20, 9, 30)]
    with torch.no_grad():
        alone = [ref(x[None])[0] for x in xs]
    conv, rec = garbage_state_caches(m, 4)
    with torch.no_grad():
        first = RecurrentStep(torch.tensor([0, 3, 1]), [12, 9, 29], [True, True, True])
        m(torch.cat([xs[0][:12], xs[1], xs[2][:29]]), conv, rec, first)
        first.commit()
        before = conv.clone(), rec.clone()
        lost = RecurrentStep(torch.tensor([0]), [3], [False])
        m(xs[0][12:15], conv, rec, lost)  # never committed: a failed step
        assert torch.equal(conv, before[0]) and torch.equal(rec, before[1])
        second = RecurrentStep(torch.tensor([3, 0, 1]), [1, 8, 1], [False, False, False])
        out = m(torch.cat([xs[1][8:9] * 0 + torch.randn(1, 64), xs[0][12:], xs[2][29:]]), conv, rec, second)
    # sequence 1 got one more (random) token: only sequences 0 and 2 are compared
    assert (out[1:9] - alone[0][12:]).abs().max().item() < TOL
    assert (out[9:] - alone[2][29:]).abs().max().item() < TOL


@pytest.mark.parametrize("keys,decay", [("random", 1.0), ("correlated", 0.01)])
def test_chunked_rule_equals_the_recurrence(keys, decay):
    """The chunked scan from a nonzero state equals the token-by-token rule, over lengths around the chunk; also
    with slowly decaying, correlated keys (silu's mostly positive outputs), where a chunk's triangular system is
    ill-conditioned and an inverse by products of its powers lost every digit in float32."""
    torch.manual_seed(3)
    H, dk, dv = 3, 16, 8
    for L in (1, CHUNK - 1, CHUNK, 2 * CHUNK + 5):
        raw_q, raw_k = torch.randn(L, H, dk), torch.randn(L, H, dk)
        if keys == "correlated":
            raw_q, raw_k = raw_q.abs(), raw_k.abs()
        q = torch.nn.functional.normalize(raw_q, dim=-1) * dk**-0.5
        k = torch.nn.functional.normalize(raw_k, dim=-1)
        v, g, beta = torch.randn(L, H, dv), -torch.rand(L, H) * decay, torch.rand(L, H)
        s0 = torch.randn(H, dk, dv)
        out, s = chunk_gated_delta_rule(q, k, v, g, beta, s0)
        state = s0.clone()[None].double()
        want = torch.cat(
            [recurrent_gated_delta_rule(*(x[t : t + 1].double() for x in (q, k, v, g, beta)), state) for t in range(L)]
        )
        assert (out - want).abs().max().item() < 1e-4
        assert (s - state[0]).abs().max().item() < 1e-4
