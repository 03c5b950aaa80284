"""The Mamba2 mixer (model/layers/mamba2.py) and LFM2's short conv (shortconv.py) against transformers' own modules
with the same weights, in float32: a sequence fed in uneven chunks (the state carried across each, through slots
and commits) and then token by token equals transformers' whole-sequence output; several sequences in one step
each keep their own state; a step never committed leaves the states as they were; the chunked SSD scan equals the
token-by-token recurrence from a nonzero state."""

from __future__ import annotations

import pytest
import torch
from model_helpers import garbage_state_caches, run_in_chunks, states_at_marks

from pagedllm.model.config import ModelConfig
from pagedllm.model.layers.deltanet import RecurrentStep
from pagedllm.model.layers.mamba2 import CHUNK, Mamba2, chunk_scan, recurrent_step
from pagedllm.model.layers.shortconv import ShortConv

TOL = 1e-5
HIDDEN = 64


def _config(mixer: str) -> ModelConfig:
    return ModelConfig(
        architecture="",
        vocab_size=256,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        recurrent_mixer=mixer,
        linear_conv_kernel_dim=4 if mixer == "mamba2" else 3,
        mamba_num_heads=8,
        mamba_head_dim=16,
        mamba_state_size=16,
        mamba_num_groups=2,
        mixer_conv_bias=True,
        mixer_proj_bias=mixer == "short_conv",
    )


def _reference(mixer: str):
    """transformers' module with random weights (A_log, dt_bias and D drawn so decays and skips vary)."""
    torch.manual_seed(0)
    if mixer == "mamba2":
        from transformers import GraniteMoeHybridConfig
        from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer

        cfg = GraniteMoeHybridConfig(
            hidden_size=HIDDEN,
            num_hidden_layers=1,
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_d_state=16,
            mamba_n_groups=2,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_conv_bias=True,
            rms_norm_eps=1e-5,
            layer_types=["linear_attention"],
        )
        ref = GraniteMoeHybridMambaLayer(cfg, 0).eval()
    else:
        from transformers import Lfm2Config
        from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

        cfg = Lfm2Config(hidden_size=HIDDEN, num_hidden_layers=1, conv_L_cache=3, conv_bias=True)
        ref = Lfm2ShortConv(cfg, 0).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
        if mixer == "mamba2":
            ref.A_log.uniform_(-2, 1)
            ref.dt_bias.uniform_(-1, 1)
            ref.norm.weight.uniform_(0.5, 1.5)
    return ref


def _ours(mixer: str, ref) -> Mamba2 | ShortConv:
    m = (
        Mamba2(_config(mixer), torch.float32, "cpu")
        if mixer == "mamba2"
        else ShortConv(_config(mixer), torch.float32, "cpu")
    )
    names = {
        "ssm_in": "in_proj",
        "ssm_conv": "conv1d",
        "ssm_a_log": "A_log",
        "ssm_dt_bias": "dt_bias",
        "ssm_d": "D",
        "ssm_norm": "norm",
        "ssm_out": "out_proj",
        "conv_in": "in_proj",
        "conv_conv": "conv",
        "conv_out": "out_proj",
    }
    sd = ref.state_dict()
    with torch.no_grad():
        for slot, mod in m.slots().items():
            for kind in ("weight", "bias"):
                param = getattr(mod, kind, None)
                if isinstance(param, torch.Tensor):
                    bare = getattr(mod, "bare", False)
                    param.copy_(sd[names[slot] if bare else f"{names[slot]}.{kind}"].reshape(param.shape))
    return m


@pytest.mark.parametrize("mixer", ["mamba2", "short_conv"])
def test_chunks_then_decode_match_transformers(mixer):
    ref = _reference(mixer)
    m = _ours(mixer, ref)
    torch.manual_seed(1)
    x = torch.randn(1, 180, HIDDEN)
    with torch.no_grad():
        want = ref(x)[0]
    # uneven chunks, a 70-token one crossing a chunk of the scan
    got_all, pos = run_in_chunks(m, x[0], (37, 70, 1, 2, 45, 1, 1, 5, 1))
    assert (got_all - want[:pos]).abs().max().item() < TOL * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("mixer", ["mamba2", "short_conv"])
def test_a_chunk_leaves_its_state_at_each_mark(mixer):
    """--mamba-cache-mode all: a 150-token prompt chunk asked for its state after 1, 16, 63, 64, 65, 100 and 128
    tokens writes each into its row at commit: the conv (and SSM) states the token-by-token update reaches."""
    m = _ours(mixer, _reference(mixer))
    torch.manual_seed(4)
    assert max(states_at_marks(m, torch.randn(150, HIDDEN), [1, 16, 63, 64, 65, 100, 128])) < TOL


@pytest.mark.parametrize("mixer", ["mamba2", "short_conv"])
def test_batched_sequences_keep_their_own_state(mixer):
    """Three sequences and then decodes in one step, in other slots, equal each run alone; an uncommitted step
    changes no slot."""
    ref = _reference(mixer)
    m = _ours(mixer, ref)
    torch.manual_seed(2)
    xs = [torch.randn(n, HIDDEN) for n in (20, 9, 30)]
    with torch.no_grad():
        alone = [ref(x[None])[0] for x in xs]
    conv, rec = garbage_state_caches(m, 4)
    with torch.no_grad():
        first = RecurrentStep(torch.tensor([0, 3, 1]), [12, 8, 29], [True, True, True])
        m(torch.cat([xs[0][:12], xs[1][:8], xs[2][:29]]), conv, rec, first)
        first.commit()
        before = conv.clone(), rec.clone()
        lost = RecurrentStep(torch.tensor([0]), [3], [False])
        m(xs[0][12:15], conv, rec, lost)  # never committed: a failed step
        assert torch.equal(conv, before[0]) and torch.equal(rec, before[1])
        second = RecurrentStep(torch.tensor([3, 0, 1]), [1, 8, 1], [False, False, False])
        out = m(torch.cat([xs[1][8:9], xs[0][12:], xs[2][29:]]), conv, rec, second)
    for got, want in ((out[:1], alone[1][8:9]), (out[1:9], alone[0][12:]), (out[9:], alone[2][29:])):
        assert (got - want).abs().max().item() < TOL * max(1.0, want.abs().max().item())


def test_chunked_scan_equals_the_recurrence():
    """The SSD scan from a nonzero state equals the token-by-token update, over lengths around the chunk."""
    torch.manual_seed(3)
    H, P, N = 3, 8, 5
    for L in (1, CHUNK - 1, CHUNK, 2 * CHUNK + 5):
        x, b, c = torch.randn(L, H, P), torch.randn(L, H, N), torch.randn(L, H, N)
        dt = torch.rand(L, H) * 0.5
        a = dt * -torch.rand(H) * 2
        s0 = torch.randn(H, P, N)
        out, s = chunk_scan(x * dt[..., None], a, b, c, s0)
        state = s0.clone()[None]
        want = torch.cat(
            [
                recurrent_step(x[t : t + 1], dt[t : t + 1], a[t : t + 1], b[t : t + 1], c[t : t + 1], state)
                for t in range(L)
            ]
        )
        assert (out - want).abs().max().item() < 1e-4
        assert (s - state[0]).abs().max().item() < 1e-4
