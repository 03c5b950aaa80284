"""`--plot FILE.png`: latency distributions and throughput over time (matplotlib, Agg backend)."""

from __future__ import annotations

import numpy as np


def _mpl():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_serve_result(result: dict, path: str, title: str = "") -> None:
    plt = _mpl()
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    succ = [i for i, e in enumerate(result.get("errors", [])) if not e]
    series = {
        "TTFT (ms)": [result["ttfts"][i] * 1000 for i in succ],
        "TPOT (ms)": [],
        "ITL (ms)": [g * 1000 for i in succ for g in result["itls"][i]],
        "E2E latency (ms)": [result["e2els"][i] * 1000 for i in succ],
    }
    for i in succ:
        n = result["output_lens"][i]
        if n > 1:
            series["TPOT (ms)"].append((result["e2els"][i] - result["ttfts"][i]) * 1000 / (n - 1))
    for ax, (name, vals) in zip(axes.flat[:4], series.items()):
        if vals:
            ax.hist(vals, bins=min(50, max(5, len(vals) // 2)), color="tab:blue", alpha=0.8)
            for q, style in ((50, "-"), (99, "--")):
                ax.axvline(np.percentile(vals, q), color="tab:red", linestyle=style, label=f"p{q}")
            ax.legend()
        ax.set_title(name)
        ax.set_ylabel("count")
    tok = result.get("output_tokens_per_second", [])
    run = result.get("running_requests_per_second", [])
    ax = axes.flat[4]
    ax.plot(np.arange(len(tok)), tok, drawstyle="steps-post", color="tab:green", label="output tokens/s")
    ax.set_xlabel("seconds from start")
    ax.set_ylabel("output tokens / s")
    ax.set_title("throughput over time")
    ax2 = ax.twinx()
    ax2.plot(np.arange(len(run)), run, drawstyle="steps-post", color="tab:orange", label="requests in flight")
    ax2.set_ylabel("requests in flight")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")
    ax = axes.flat[5]
    if succ:
        ins = [result["input_lens"][i] for i in succ]
        e2e = [result["e2els"][i] * 1000 for i in succ]
        ax.scatter(ins, e2e, s=10)
    ax.set_xlabel("input tokens")
    ax.set_ylabel("E2E latency (ms)")
    ax.set_title("latency vs prompt length")
    fig.suptitle(title or "pagedllm bench serve")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(rows: list[dict], path: str, title: str = "") -> None:
    plt = _mpl()
    names = [r["setting"] for r in rows]
    cols = [
        ("peak_running", "peak requests running"),
        ("used_share", "KV used share (tokens / slots)"),
        ("output_throughput", "output tokens/s"),
        ("median_ttft_ms", "TTFT median (ms)"),
        ("p99_ttft_ms", "TTFT p99 (ms)"),
        ("prefix_cache_hit_rate", "prefix-cache hit rate"),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    y = np.arange(len(names))
    for ax, (key, label) in zip(axes.flat, cols):
        vals = [r.get(key) if r.get(key) is not None else 0.0 for r in rows]
        ax.barh(y, vals, color="tab:blue")
        ax.set_yticks(y, names, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(label)
    fig.suptitle(title or "pagedllm bench sweep")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
