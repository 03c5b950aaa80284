"""What sampling a batch of greedy rows costs the engine a step, and what the copies it no longer makes cost.

The engine hands the sampler one tensor of every request's last logits row. At 64 rows of a 250K vocabulary that
batch is ~60 MB: a `torch.cat` of the requests' rows into a fresh one, or a `nan_to_num` copy of it, costs as
much as the argmax (fresh pages). `llm_engine.stacked` views the rows where they lie back to back, and
`sampler.greedy_tokens` takes the argmax without a finite copy. This times `sampler.sample` on greedy rows and,
beside it, the two copies the step no longer makes (`torch.cat` of one-row slices, `nan_to_num` of the batch).

    .venv/bin/python -m benchmarks.kernels.sample_step --rows 56 --vocab 248320
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import cpu_line
from pagedllm.model.sampler import SamplingRow, sample
from pagedllm.sampling_params import SamplingParams


def mean_ms(fn, repeat: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t) / repeat * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=56)
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--repeat", type=int, default=10)
    a = p.parse_args()
    logits = torch.randn(a.rows, a.vocab)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    rows = [SamplingRow(params, [1] * 256, [2] * 8, []) for _ in range(a.rows)]
    parts = list(logits.split(1))
    big = torch.finfo(logits.dtype).max
    print(f"CPU: {cpu_line()}; torch threads {torch.get_num_threads()}; {a.rows} greedy rows x {a.vocab} logits")
    print(f"sample():                       {mean_ms(lambda: sample(logits, rows), a.repeat):7.2f} ms")
    print(f"  of which the argmax:          {mean_ms(lambda: logits.argmax(-1), a.repeat):7.2f} ms")
    print(f"torch.cat of the rows (gone):   {mean_ms(lambda: torch.cat(parts), a.repeat):7.2f} ms")
    nan_to_num = mean_ms(lambda: torch.nan_to_num(logits, nan=float("-inf"), posinf=big), a.repeat)
    print(f"nan_to_num of the batch (gone): {nan_to_num:7.2f} ms")


if __name__ == "__main__":
    main()
