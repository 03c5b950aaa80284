"""The causal depthwise convolution that Mamba2 (mamba2.py) and LFM2's short conv (shortconv.py) run over a flat
batch of sequences, each carrying the last K-1 inputs of the sequence before it as its conv state.

A step's sequences are its `RecurrentStep`'s (deltanet.py): their state rows are gathered into copies first (the
slots change only at `RecurrentStep.commit`), a sequence at position 0 starting from zeros. Decode tokens (one new
token each) are one batched window product; a prompt chunk is one `conv1d` over its state and its tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.model.layers.deltanet import RecurrentStep


def gather_states(
    step: RecurrentStep, conv_cache: torch.Tensor, rec_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the step's sequences' state rows, zeros for a sequence that starts at position 0."""
    conv, rec = conv_cache[step.slots], rec_cache[step.slots]
    fresh = [i for i, f in enumerate(step.fresh) if f]
    if fresh:
        conv[fresh], rec[fresh] = 0, 0
    return conv, rec


def seq_starts(lens: list[int]) -> list[int]:
    """Each sequence's first row in the flat batch, and the end."""
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    return starts


def causal_conv(
    x: torch.Tensor,
    conv: torch.Tensor,
    lens: list[int],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    step: RecurrentStep | None = None,
    at_marks: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [T, C] of sequences of `lens` tokens (flat) -> the convolution [T, C] (before any activation), in x's
    dtype; `conv` [S, C, K-1] (each sequence's last inputs) is advanced in place. weight [C, K], bias [C]. The conv
    states after each of `step`'s marks (RecurrentStep.marks) are appended to `at_marks`, in order."""
    decode = [i for i, n in enumerate(lens) if n == 1]
    if len(decode) == len(lens):  # decode only: one window per sequence, the rows in order
        window = torch.cat([conv, x[:, :, None].to(conv.dtype)], -1)
        conv.copy_(window[..., 1:])
        y = (window * weight).sum(-1)
        return (y if bias is None else y + bias).to(x.dtype)
    out = torch.empty_like(x)
    starts = seq_starts(lens)
    if decode:
        seqs = torch.tensor(decode, dtype=torch.long, device=x.device)
        rows = torch.tensor([starts[i] for i in decode], dtype=torch.long, device=x.device)
        window = torch.cat([conv[seqs], x[rows, :, None].to(conv.dtype)], -1)  # [S, C, K]
        conv[seqs] = window[..., 1:]
        y = (window * weight).sum(-1)
        out[rows] = (y if bias is None else y + bias).to(x.dtype)
    keep = weight.shape[-1] - 1
    for i, n in enumerate(lens):
        if n == 1:
            continue
        a, b = starts[i], starts[i + 1]
        window = torch.cat([conv[i], x[a:b].T.to(conv.dtype)], -1)  # [C, K - 1 + n]
        if step is not None and at_marks is not None:
            at_marks += [window[:, t : t + keep] for t in step.marks_of(i)]  # the last K-1 inputs after t tokens
        if keep:
            conv[i] = window[:, -keep:]
        out[a:b] = F.conv1d(window[None], weight[:, None], bias, groups=weight.shape[0])[0].T.to(x.dtype)
    return out
