"""Which tokens of a reused passage to recompute (kv_blend), measured outside the engine before building one.

A plain-torch Llama forward over the transformers checkpoint (bfloat16 by default, as the engine) where, per
layer, only a chosen set of tokens is computed and every other token of a passage keeps its stored K/V (pre-RoPE,
so the re-rotation is exact): the engine's copy + compute spans, and CacheBlend's scheme (every token computed in
the first layers, then only the tokens whose K/V deviated most). Each passage is stored from the full prefill of
a priming prompt (the same question, its passages in another order: `rag bench --kv-blend-warmup`), then the
measured prompt (the bench's `--order`) is run each variant's way, teacher-forced on full prefill's greedy
answer: top-1 agreement and mean KL over the answer positions, against full prefill of the same prompt.

    python -m benchmarks.kv.blend_variants --index rag-index --model /path/to/smollm2-135m-instruct \
        --num-questions 24 --max-tokens 32 --ratio 0.15 --order shuffle
"""

from __future__ import annotations

import argparse
import math
import types

import torch
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from pagedllm.rag.blend_bench import build_prompts


class Sim:
    def __init__(self, path: str, dtype: torch.dtype):
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        c = self.model.config
        self.nh, self.nkv = c.num_attention_heads, c.num_key_value_heads
        self.hd = c.hidden_size // c.num_attention_heads

    @torch.no_grad()
    def forward(self, ids, stored=None, plan=None):
        """Logits of every computed token of the last layer set, and the fresh pre-RoPE (k, v) of every layer.
        `stored[l]`: (k, v) for every position (None: full prefill); `plan(l, fresh_kv)`: the positions computed
        at layer l (given the fresh K/V of the positions computed at the layer before, for CacheBlend)."""
        m = self.model.model
        T = len(ids)
        pos = torch.arange(T)
        h = m.embed_tokens(torch.tensor(ids))
        cos, sin = m.rotary_emb(h[None], pos[None])
        comp = pos  # computed positions at this layer
        fresh = []
        for li, layer in enumerate(m.layers):
            if plan is not None:
                new = plan(li, fresh[-1] if fresh else None, comp)
                keep = torch.isin(comp, new)
                h, comp = h[keep], comp[keep]
            a = layer.self_attn
            x = layer.input_layernorm(h)
            n = len(comp)
            q = a.q_proj(x).view(n, self.nh, self.hd).transpose(0, 1)
            k = a.k_proj(x).view(n, self.nkv, self.hd).transpose(0, 1)
            v = a.v_proj(x).view(n, self.nkv, self.hd).transpose(0, 1)
            fresh.append((comp, k, v))
            if stored is None or n == T:
                K, V = k, v
            else:
                K, V = stored[li][0].clone(), stored[li][1].clone()
                K[:, comp], V[:, comp] = k, v
            q, _ = apply_rotary_pos_emb(q[None], q[None], cos[:, comp], sin[:, comp])
            K, _ = apply_rotary_pos_emb(K[None], K[None], cos, sin)
            rep = self.nh // self.nkv
            K, V = K[0].repeat_interleave(rep, 0), V.repeat_interleave(rep, 0)
            mask = pos[None, :] <= comp[:, None]
            o = torch.nn.functional.scaled_dot_product_attention(q[0], K, V, attn_mask=mask)
            h = h + a.o_proj(o.transpose(0, 1).reshape(n, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(m.norm(h)), comp, [(k, v) for _, k, v in fresh]

    @torch.no_grad()
    def greedy(self, ids, n):
        out = self.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
        return out[0, len(ids) :].tolist()


def store(sim, ids, spans, bank, key):
    """Each passage's per-layer pre-RoPE K/V from the full prefill of `ids` (absent ones only)."""
    _, _, kv = sim.forward(ids)
    for (s, e), k in zip(spans, key):
        bank.setdefault(k, [(kk[:, s:e].clone(), vv[:, s:e].clone()) for kk, vv in kv])


def stored_for(prompt, keys, bank, full_kv):
    out = []
    for li, (k, v) in enumerate(full_kv):
        k, v = k.clone(), v.clone()
        for (s, e), key in zip(prompt.spans, keys):
            k[:, s:e], v[:, s:e] = bank[key][li]
        out.append((k, v))
    return out


def variant_plan(name, prompt, r, T, stored):
    """Positions computed per layer for a variant at ratio r of each passage's tokens."""
    seg = torch.zeros(T, dtype=torch.bool)
    for s, e in prompt.spans:
        seg[s:e] = True
    always = torch.arange(T)[~seg]
    sel = []
    for s, e in prompt.spans:
        L = e - s
        n = math.ceil(r * L)
        if name == "head":
            sel += range(s, s + n)
        elif name == "tail":
            sel += range(e - n, e)
        elif name == "head+tail":
            sel += list(range(s, s + n // 2)) + list(range(e - (n - n // 2), e))
        elif name == "head4+tail":
            sel += list(range(s, s + min(4, n))) + list(range(e - max(n - 4, 0), e))
    if name == "near-question":  # the budget of every passage spent on the tokens just before the question
        n = sum(math.ceil(r * (e - s)) for s, e in prompt.spans)
        sel = [p for p in torch.arange(T)[seg].tolist()[-n:]]
    static = torch.unique(torch.cat([always, torch.tensor(sel, dtype=torch.long)]))
    if not name.startswith("cacheblend"):
        return lambda li, fresh, comp: static
    # cacheblend-<k|v><n>[-block]: n layers computed over every token, then the tokens (or 16-token blocks) whose
    # K (or V) at layer n-1 deviated most from the stored
    spec = name.split("-")[1]
    by, full_layers, block = spec[0], int(spec[1:]), name.endswith("-block")

    def plan(li, fresh, comp):
        if li < full_layers:
            return torch.arange(T)
        if li > full_layers:
            return comp
        _, k, v = fresh
        sk, sv = stored[li - 1]
        dev = ((v - sv) if by == "v" else (k - sk)).pow(2).sum((0, 2))  # per position, layer li-1
        chosen = [always]
        for s, e in prompt.spans:
            n = math.ceil(r * (e - s))
            d = dev[s:e]
            if block:
                nb = max(1, round(n / 16))
                bd = torch.stack([d[i : i + 16].mean() for i in range(0, e - s, 16)])
                for b in bd.topk(min(nb, len(bd))).indices.tolist():
                    chosen.append(torch.arange(s + 16 * b, min(s + 16 * b + 16, e)))
            else:
                chosen.append(s + d.topk(n).indices)
        return torch.unique(torch.cat(chosen))

    return plan


def score(ref_logits, logits):
    a, b = ref_logits.float().log_softmax(-1), logits.float().log_softmax(-1)
    kl = float((a.exp() * (a - b)).sum(-1).mean())
    return kl, int((a.argmax(-1) == b.argmax(-1)).sum()), a.shape[0]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--index", default="rag-index")
    p.add_argument("--model", required=True)
    p.add_argument("--num-questions", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--zipf", type=float, default=2.0)
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--order", default="shuffle")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--variants", default="none,head,tail,near-question,cacheblend-k2,cacheblend-v2,cacheblend-k2-block")
    a = p.parse_args()
    from pagedllm.model.tokenizer import load_tokenizer

    sim = Sim(a.model, getattr(torch, a.dtype))
    tok = load_tokenizer(a.model)
    cfg = types.SimpleNamespace(
        index=a.index, top_k=a.top_k, num_questions=a.num_questions, zipf=a.zipf, embedding_url=None
    )
    prompts = build_prompts(cfg, a.order, 0, tok, print)
    priming = build_prompts(cfg, "shuffle", 0, tok, print, order_seed=1)
    bank: dict = {}

    def keys(pr):
        return [tuple(pr.ids[s:e]) for s, e in pr.spans]

    for pr in priming:
        store(sim, pr.ids, pr.spans, bank, keys(pr))
    variants = a.variants.split(",")
    totals = {v: [0.0, 0, 0] for v in variants}
    for qi, pr in enumerate(prompts):
        if any(k not in bank for k in keys(pr)):  # a new-front passage no priming prompt has: stored from here
            store(sim, pr.ids, pr.spans, bank, keys(pr))
        answer = sim.greedy(pr.ids, a.max_tokens)
        ids = pr.ids + answer
        n0 = len(pr.ids) - 1
        ref, _, full_kv = sim.forward(ids)
        ref = ref[n0 : n0 + len(answer)]
        st = stored_for(pr, keys(pr), bank, full_kv)
        for v in variants:
            r = 0.0 if v == "none" else a.ratio
            logits, comp, _ = sim.forward(ids, st, variant_plan("head" if v == "none" else v, pr, r, len(ids), st))
            rows = torch.searchsorted(comp, torch.arange(n0, n0 + len(answer)))
            kl, agree, n = score(ref, logits[rows])
            t = totals[v]
            t[0], t[1], t[2] = t[0] + kl * n, t[1] + agree, t[2] + n
        line = "  ".join(f"{v} {t[1] / t[2]:.1%}/{t[0] / t[2]:.4f}" for v, t in totals.items())
        print(f"after {qi + 1}: {line}", flush=True)


if __name__ == "__main__":
    main()
