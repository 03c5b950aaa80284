"""How big a model is and how much of it one decoded token reads, from its config (and a GGUF's tensor table),
without torch: what `kv-calc --model` prints.

Why "active" matters: a mixture of experts routes each token to `num_experts_per_tok` of its experts, so a
decode step reads only those experts' weights (plus everything outside the experts): Qwen3-30B-A3B decodes at
about the bytes of a 3B model. Parameters are counted from the config (the same count transformers' modules
hold); bytes are the checkpoint's own: a GGUF's stored bytes per tensor (its experts in `ffn_*_exps`, of which a
token reads k / experts), a folder's parameters at its dtype. A token reads one row of the embedding table,
and the whole table again where it is also the LM head (tied).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.model.config import ModelConfig

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class WeightCount:
    total_params: int
    active_params: int  # what one token runs through: all but the experts it is not routed to
    total_bytes: int
    read_bytes: int  # weights read to decode one token (one row of an untied embedding table)


def _mlp(hidden: int, inter: int, bias: bool = False, gated: bool = True) -> int:
    return (3 if gated else 2) * hidden * inter + (2 * inter + hidden if bias else 0)


def recurrent_mixer_params(cfg: ModelConfig) -> int:
    """One linear layer's mixer (layers/deltanet.py, mamba2.py, shortconv.py): projections, conv, the rest."""
    h, k = cfg.hidden_size, cfg.linear_conv_kernel_dim
    conv, heads, dim_a, dim_b = cfg.recurrent_state_dims()
    conv_bias = conv if cfg.mixer_conv_bias else 0
    if cfg.recurrent_mixer == "mamba2":  # in_proj to (z, xBC, dt); A_log, dt_bias, D; the gated norm; out_proj
        inner = heads * dim_a
        proj = inner + conv + heads
        bias = proj + h if cfg.mixer_proj_bias else 0
        return h * proj + conv * k + conv_bias + 3 * heads + inner + inner * h + bias
    if cfg.recurrent_mixer == "short_conv":  # in_proj to (B, C, x), conv, out_proj
        return 4 * h * h + conv * k + conv_bias + (4 * h if cfg.mixer_proj_bias else 0)
    value = heads * dim_b  # Gated DeltaNet: q/k/v, z, b, a; conv; A_log, dt_bias; the norm; out
    return h * (conv + value + 2 * heads) + conv * k + 2 * heads + dim_b + value * h


def _kv_projections(cfg: ModelConfig, layer: int) -> int:
    """K and V projections of layer `layer`: 2, 1 where keys are the values, 0 where it reads another's KV."""
    if cfg.kv_source(layer) != layer:
        return 0
    return 1 if cfg.attention_k_eq_v and cfg.layer_window(layer) is None else 2


def _gemma4_extra(cfg: ModelConfig, layer: int) -> int:
    """A Gemma 4 layer's parameters beyond the common layer: its per-layer input's gate, projection and norm, and
    beside a sparse block its dense MLP, three norms and the router's scales (the layer scalar is a buffer)."""
    h, w = cfg.hidden_size, cfg.hidden_size_per_layer_input
    out = 2 * h * w + h if w else 0
    if cfg.moe_beside_mlp and cfg.is_moe_layer(layer):
        out += _mlp(h, cfg.layer_intermediate_size(layer)) + 4 * h + cfg.num_experts
    return out


def layer_params(cfg: ModelConfig, layer: int) -> tuple[int, int, int]:
    """(all, not counting the experts, one expert's) parameters of layer `layer`."""
    h, d, parts = cfg.hidden_size, cfg.layer_head_dim(layer), _kv_projections(cfg, layer)
    q, kv = cfg.num_heads * d, cfg.layer_kv_heads(layer) * d * parts
    attn = h * (q + kv) + q * h + (q + kv if cfg.attention_bias else 0) + (h if cfg.o_proj_bias else 0)
    attn += h * q if cfg.attn_output_gate else 0  # the gate's rows beside the query's
    norms = h * (2 * cfg.pre_norms + 2 * cfg.post_norms) + _gemma4_extra(cfg, layer)
    if cfg.qk_norm is not None:
        norms += d * (1 + (parts > 0)) if cfg.qk_norm == "head" else q + kv // 2
    if cfg.is_linear_layer(layer):  # a recurrent mixer (Gated DeltaNet, Mamba2, short conv) in attention's place
        attn = recurrent_mixer_params(cfg)
        norms = h * (2 * cfg.pre_norms + 2 * cfg.post_norms)
    if not cfg.layer_has_mixer(layer):
        attn = 0
    if cfg.layer_has_mixer(layer) != cfg.layer_has_mlp(layer):  # a single-block layer: the one block's norms
        norms -= h * (cfg.pre_norms + cfg.post_norms)
    if not cfg.layer_has_mlp(layer):
        return attn + norms, attn + norms, 0
    if not cfg.is_moe_layer(layer):
        dense = attn + norms + _mlp(h, cfg.layer_intermediate_size(layer), gated=cfg.mlp_gated)
        return dense, dense, 0
    gated, latent = cfg.mlp_gated, cfg.moe_latent_size  # the experts take the MLP's form, at the latent width
    expert = _mlp(latent or h, cfg.moe_intermediate_size, cfg.expert_bias, gated)
    router = cfg.num_experts * (h + cfg.router_bias) + 2 * h * latent
    shared = _mlp(h, cfg.shared_expert_intermediate_size, gated=gated) if cfg.shared_expert_intermediate_size else 0
    rest = attn + norms + router + shared + (h if cfg.shared_expert_gate and shared else 0)
    return rest + cfg.num_experts * expert, rest, expert


def param_count(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active per token) parameters."""
    embed = cfg.vocab_size * cfg.hidden_size
    total = active = embed * (1 if cfg.tie_word_embeddings else 2) + cfg.hidden_size
    w = cfg.num_layers * cfg.hidden_size_per_layer_input  # Gemma 4's per-layer inputs: a table, a projection, a norm
    total += (cfg.vocab_size_per_layer_input + cfg.hidden_size) * w + cfg.hidden_size_per_layer_input
    active += (1 + cfg.hidden_size) * w + cfg.hidden_size_per_layer_input  # one row of the table
    for i in range(cfg.num_layers):
        whole, rest, expert = layer_params(cfg, i)
        total += whole
        active += rest + cfg.num_experts_per_tok * expert
    return total, active


def weight_count(cfg: ModelConfig, gguf_path: str | None = None) -> WeightCount:
    """Parameters and bytes of `cfg`'s model: a GGUF's stored bytes (from its tensor table), else its
    parameters at the checkpoint's dtype."""
    total, active = param_count(cfg)
    row = cfg.hidden_size * (0 if cfg.tie_word_embeddings else cfg.vocab_size - 1)  # untied: one row read
    if gguf_path is None:
        size = _DTYPE_BYTES.get(cfg.checkpoint_dtype, 4)
        return WeightCount(total, active, total * size, (active - row) * size)
    return WeightCount(total, active, *_gguf_bytes(cfg, gguf_path))


def _gguf_bytes(cfg: ModelConfig, path: str) -> tuple[int, int]:
    import gguf

    from pagedllm.model.formats.gguf_file import GGUFFile

    total = read = 0
    share = cfg.num_experts_per_tok / cfg.num_experts if cfg.num_experts else 1.0
    with GGUFFile(path) as f:
        for name, info in f.tensors.items():
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(info.ggml_type)]
            rows = 1
            for n in info.shape[:-1]:
                rows *= n
            nbytes = rows * info.shape[-1] // block * size
            total += nbytes
            if name == "token_embd.weight" and "output.weight" in f.tensors:
                read += nbytes // info.shape[0]
            else:
                read += round(nbytes * share) if "_exps." in name else nbytes
    return total, read
