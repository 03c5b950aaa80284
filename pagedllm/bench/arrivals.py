"""When each request is sent: all at once (rate inf), or a Poisson (burstiness 1) / gamma process.

Same process as vLLM's benchmark: the gaps between requests are Gamma(shape=burstiness,
scale=1 / (rate * burstiness)), so their mean is 1 / rate whatever the burstiness, and their coefficient of
variation is 1 / sqrt(burstiness) (< 1: more even than Poisson, > 1: burstier). The first request goes at 0.
"""

from __future__ import annotations

import math

import numpy as np

from pagedllm.errors import UserError


def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send times in seconds from the start of the run, non-decreasing, the first 0."""
    if request_rate <= 0 or math.isnan(request_rate):
        raise UserError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if burstiness <= 0:
        raise UserError(f"--burstiness must be > 0, got {burstiness}")
    if num_requests <= 0:
        return np.zeros(0)
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    rng = np.random.default_rng(seed)
    theta = 1.0 / (request_rate * burstiness)
    gaps = rng.gamma(shape=burstiness, scale=theta, size=num_requests - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])
