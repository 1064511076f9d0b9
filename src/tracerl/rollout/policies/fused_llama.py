"""Lean decode and training forwards for Llama-architecture causal LMs (Llama, Qwen2, Mistral
without sliding window).

For a small model, most of a transformers decode step is not arithmetic but bookkeeping: mask
construction, cache objects, rotary modules, per-projection calls, output dataclasses. This
module runs the same mathematics with a handful of tensor ops per layer:

- q/k/v and gate/up projections concatenated into one matrix each (one matmul instead of three
  or two), biases included when the model has them (Qwen2's q/k/v);
- a preallocated key/value cache ``(layers, 2, B, H_kv, T_max, D)`` written in place;
- a rotary table computed once per batch from the model's config (``default``, ``linear`` and
  ``llama3`` scaling; other types are refused, so the caller falls back);
- RMSNorm as transformers computes it (in float32, cast back, times the weight);
- ``scaled_dot_product_attention`` with a boolean mask that hides left padding, grouped-query
  attention through ``enable_gqa``;
- logits only for the last position after prefill, and the (tied or untied) head at each step.

The decoder itself, its cache and its length groups are :mod:`.fused_decoder`; this module
packs the weights and holds the per-layer mathematics both the decoder and training use.

Freshness: ``pack_llama`` reads the module's parameters when called and ``HFPolicy`` calls it at
every ``generate()``, so a trainer's weight update is always seen by the next call; the packed
matrices are the only copies and live for one call. Their cost is one pass over the weights,
about what a single decode step reads anyway.

Training: ``fused_sequence_forward`` is the same mathematics over whole sequences and
differentiable (the packed matrices are ``torch.cat`` of the parameters, so gradients reach
each projection). The update (``train.update.ActorCritic.evaluate``) uses it: per-token work
runs on real tokens only, a prefix shared by several rows is computed once
(``shared_prefix_owner``), and the output head can be applied at chosen positions only
(``fused_head``).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2", "mistral")
"""``config.model_type`` values whose decoder block is Llama's (pre-norm RMSNorm, rotary
attention, SwiGLU MLP). Others (e.g. Qwen3's q/k norms, Gemma's scaled embeddings) fall back."""

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")
"""Rotary scalings implemented here; any other type makes the model fall back."""


@dataclass(frozen=True)
class LayerWeights:
    """One decoder block's weights, packed for one ``generate()`` call."""

    input_norm: torch.Tensor
    """RMSNorm weight before attention, ``(hidden,)``."""
    input_norm_eps: float
    """Epsilon of that RMSNorm."""
    qkv: torch.Tensor
    """q, k and v projections stacked, ``((H + 2 H_kv) D, hidden)``."""
    qkv_bias: torch.Tensor | None
    """Their biases stacked (zeros for a projection without one); None when none has a bias."""
    o: torch.Tensor
    """Attention output projection, ``(hidden, H D)``."""
    o_bias: torch.Tensor | None
    """Its bias, if any."""
    post_norm: torch.Tensor
    """RMSNorm weight before the MLP."""
    post_norm_eps: float
    """Epsilon of that RMSNorm."""
    gate_up: torch.Tensor
    """Gate and up projections stacked, ``(2 I, hidden)``."""
    gate_up_bias: torch.Tensor | None
    """Their biases stacked, if any."""
    down: torch.Tensor
    """Down projection, ``(hidden, I)``."""
    down_bias: torch.Tensor | None
    """Its bias, if any."""


@dataclass(frozen=True)
class PackedLlama:
    """Everything a fused decode needs, read from the model at one moment."""

    embed: torch.Tensor
    """Input embedding matrix ``(V, hidden)`` (the module's own tensor, not a copy)."""
    layers: tuple[LayerWeights, ...]
    """Decoder blocks in order."""
    final_norm: torch.Tensor
    """Final RMSNorm weight."""
    final_norm_eps: float
    """Its epsilon."""
    head: torch.Tensor
    """Output head ``(V, hidden)``; the embedding itself when the model ties them."""
    head_bias: torch.Tensor | None
    """Head bias, if any."""
    n_heads: int
    """Query heads ``H``."""
    n_kv_heads: int
    """Key/value heads ``H_kv`` (``H`` is a multiple: grouped-query attention)."""
    head_dim: int
    """Per-head width ``D``."""
    intermediate: int
    """MLP width ``I``."""
    inv_freq: torch.Tensor
    """Rotary inverse frequencies ``(D / 2,)`` after scaling, float32."""
    attention_scaling: float
    """Factor on cos/sin (1 for the implemented rotary types)."""


def _rope_parameters(config: Any) -> dict[str, Any]:
    """Rotary parameters in transformers 5 form (``rope_parameters``), or from 4.x fields."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return dict(params)
    scaling = getattr(config, "rope_scaling", None) or {}
    result = dict(scaling)
    result.setdefault("rope_type", result.get("type", "default"))
    result["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    return result


def _head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def rope_inv_freq(config: Any) -> tuple[torch.Tensor, float]:
    """Rotary inverse frequencies and cos/sin scaling from ``config``; ValueError if unsupported."""
    params = _rope_parameters(config)
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not implemented (have {SUPPORTED_ROPE_TYPES})")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings are not implemented")
    dim = _head_dim(config)
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        original = float(params["original_max_position_embeddings"])
        wavelength = 2 * math.pi / inv_freq
        # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept, and the
        # band between interpolated linearly in original / wavelength.
        slowed = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelength - low) / (high - low)
        blended = (1 - smooth) * slowed / factor + smooth * slowed
        medium = (wavelength >= original / high) & (wavelength <= original / low)
        inv_freq = torch.where(medium, blended, slowed)
    return inv_freq, 1.0


def _is_plain_linear(module: Any) -> bool:
    # Subclasses (quantised layers, LoRA wrappers) compute something else from their weight.
    return type(module) is torch.nn.Linear and module.weight.is_floating_point()


_REASONS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Any, str | None]] = (
    weakref.WeakKeyDictionary())
"""Last verdict per model, with the fingerprint of its modules it was reached for."""


def _fingerprint(model: torch.nn.Module) -> tuple[Any, ...]:
    # What the verdict depends on and may change after construction: the config object, the
    # module tree (a LoRA wrapper replaces a Linear; types guard against a reused id), hooks,
    # and each weight's identity.
    return (id(getattr(model, "config", None)),
            *[(id(m), type(m), tuple(m._forward_hooks), tuple(m._forward_pre_hooks),
               id(getattr(m, "weight", None)), "_hf_hook" in m.__dict__) for m in model.modules()])


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot use the fused path, or None when it can.

    Checked at every ``generate()`` and update forward: adapters or hooks added after the
    policy was built (LoRA wrappers, device-map hooks) make the model fall back rather than be
    silently bypassed. The verdict is kept while the model's config object, modules, hooks and
    weight tensors stay the same objects (a config edited in place is not noticed).
    """
    key = _fingerprint(model)
    cached = _REASONS.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    reason = _unsupported_reason(model)
    _REASONS[model] = (key, reason)
    return reason


def _unsupported_reason(model: torch.nn.Module) -> str | None:
    config: Any = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    if getattr(config, "hidden_act", None) not in ("silu", "swish"):
        return f"hidden_act {getattr(config, 'hidden_act', None)!r} is not silu"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        return "sliding-window attention layers"
    window = getattr(config, "sliding_window", None)
    if model_type == "mistral" and window is not None and window < config.max_position_embeddings:
        return "sliding-window attention"
    try:
        rope_inv_freq(config)
    except (ValueError, KeyError) as error:
        return f"rotary embedding: {error}"
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if base is None or layers is None or len(layers) < config.num_hidden_layers:
        return "no model.layers"
    if type(getattr(base, "embed_tokens", None)) is not torch.nn.Embedding:
        return "input embedding is not a plain nn.Embedding"
    if not _is_plain_linear(getattr(model, "lm_head", None)):
        return "lm_head is not a plain nn.Linear"
    for index, layer in enumerate(layers[: config.num_hidden_layers]):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        projections: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
        if attn is None or not all(_is_plain_linear(getattr(attn, n, None)) for n in projections):
            return f"layer {index}: attention projections are not plain nn.Linear"
        if any(hasattr(attn, n) for n in ("q_norm", "k_norm")):
            return f"layer {index}: query/key norms are not implemented"
        projections = ("gate_proj", "up_proj", "down_proj")
        if mlp is None or not all(_is_plain_linear(getattr(mlp, n, None)) for n in projections):
            return f"layer {index}: MLP projections are not plain nn.Linear"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            if not hasattr(getattr(layer, norm, None), "variance_epsilon"):
                return f"layer {index}: {norm} is not an RMSNorm"
    if not hasattr(getattr(base, "norm", None), "variance_epsilon"):
        return "final norm is not an RMSNorm"
    for module in model.modules():
        hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
        if any(not _observes_only(hook) for hook in hooks) or hasattr(module, "_hf_hook"):
            return f"{type(module).__name__} has forward hooks"
    return None


_OBSERVING_HOOK_MODULES: tuple[str, ...] = ("transformers.utils.output_capturing",)
"""Modules whose forward hooks only record outputs (transformers 5 installs them for good the
first time a forward asks for ``output_hidden_states``): they change nothing we compute."""


def _observes_only(hook: Any) -> bool:
    return getattr(hook, "__module__", None) in _OBSERVING_HOOK_MODULES


def _stack_bias(linears: list[torch.nn.Linear]) -> torch.Tensor | None:
    if all(m.bias is None for m in linears):
        return None
    return torch.cat(
        [m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears]
    )


def pack_llama(model: torch.nn.Module, *, check: bool = True) -> PackedLlama:
    """Read ``model``'s current weights into the fused layout; ValueError if it does not qualify
    (``check=False``: the caller has just asked ``unsupported_reason``)."""
    reason = unsupported_reason(model) if check else None
    if reason is not None:
        raise ValueError(f"{type(model).__name__} cannot use the fused Llama path: {reason}")
    config: Any = model.config
    base: Any = model.model
    head: Any = model.lm_head
    layers = []
    for layer in base.layers[: config.num_hidden_layers]:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        gate_up = [mlp.gate_proj, mlp.up_proj]
        layers.append(
            LayerWeights(
                input_norm=layer.input_layernorm.weight,
                input_norm_eps=float(layer.input_layernorm.variance_epsilon),
                qkv=torch.cat([m.weight for m in qkv]),
                qkv_bias=_stack_bias(qkv),
                o=attn.o_proj.weight,
                o_bias=attn.o_proj.bias,
                post_norm=layer.post_attention_layernorm.weight,
                post_norm_eps=float(layer.post_attention_layernorm.variance_epsilon),
                gate_up=torch.cat([m.weight for m in gate_up]),
                gate_up_bias=_stack_bias(gate_up),
                down=mlp.down_proj.weight,
                down_bias=mlp.down_proj.bias,
            )
        )
    inv_freq, scaling = rope_inv_freq(config)
    return PackedLlama(
        embed=base.embed_tokens.weight,
        layers=tuple(layers),
        final_norm=base.norm.weight,
        final_norm_eps=float(base.norm.variance_epsilon),
        head=head.weight,
        head_bias=head.bias,
        n_heads=int(config.num_attention_heads),
        n_kv_heads=int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
        head_dim=_head_dim(config),
        intermediate=int(layers[0].gate_up.shape[0] // 2) if layers else 0,
        inv_freq=inv_freq.to(base.embed_tokens.weight.device),
        attention_scaling=scaling,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers computes it (statistics in float32, cast back, times weight)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one kernel, same arithmetic
    # As transformers: statistics in float32, cast back, then the weight.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` (last dimension split in halves)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def shared_prefix_owner(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        position_ids: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` flat index ``b' * T + t`` of the first row ``b'`` whose columns ``0..t``
    (token ids, mask and positions) equal row ``b``'s: the row that computes position
    ``(b, t)`` for all rows sharing that prefix (``b`` itself when none earlier does)."""
    seq = input_ids.shape[1]
    same = ((input_ids[:, None] == input_ids[None]) & (attention_mask[:, None] == attention_mask[None])
            & (position_ids[:, None] == position_ids[None]))  # (B, B, T)
    same = same.to(torch.int32).cumprod(dim=-1)
    first = same.argmax(dim=1)  # the first maximum: the earliest equal row (b itself at worst)
    return first * seq + torch.arange(seq, device=input_ids.device)[None, :]


def fused_sequence_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    head: bool = True,
    check: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Logits ``(B, T, V)`` and final hidden states ``(B, T, hidden)`` of whole sequences,
    differentiable with respect to ``model``'s parameters: the training-side twin of the
    decoder above, for computing logprobs in an update.

    The same mathematics as the model's own forward (a test compares logits and gradients),
    with fewer operations: packed q/k/v and gate/up matrices (``torch.cat`` of the parameters,
    so gradients flow back to each projection), one rotary table, one boolean mask per batch.
    Keys at padded positions are hidden; every position may also attend to itself, so a query
    at a padded position never has an empty row and stays finite. Outputs at padded positions
    are zeros (logits: the head's bias).

    Per-token work (norms, projections, MLP) runs on packed tokens ``(N, .)``: real tokens
    only, and a token that has the same tokens, padding and positions before it (itself
    included) in an earlier row is computed once, in that row (``shared_prefix_owner``). A
    group's attempts at one task share their prompt, so the prompt is computed once per group
    instead of once per row; since a shared token's hidden states feed every row that shares
    it, its gradient is the sum of what the copies would receive, which is what autograd
    computes. Only attention works in the ``(B, T)`` layout, gathered from the packed tokens.
    ``head=False`` skips the output head (logits None): a caller that needs logits at a few
    positions only applies ``fused_head`` to those, which at a small model's vocabulary is
    most of the forward's arithmetic saved. ValueError if the model does not qualify
    (``unsupported_reason``; ``check=False`` when the caller has just asked it).
    """
    p = pack_llama(model, check=check)
    batch, seq = input_ids.shape
    h_q, h_kv, dim = p.n_heads, p.n_kv_heads, p.head_dim
    heads = h_q + 2 * h_kv
    dtype = p.embed.dtype
    device = input_ids.device
    flat = torch.arange(batch * seq, device=device)
    owner = shared_prefix_owner(input_ids, attention_mask, position_ids).reshape(-1)
    computed = torch.nonzero((owner == flat) & attention_mask.reshape(-1).bool()).squeeze(1)
    count = computed.numel()
    # Packed index of each (b, t): its owner's slot, or ``count`` (a zero row) for padding.
    slot = torch.full((batch * seq,), count, dtype=torch.long, device=device)
    slot[computed] = torch.arange(count, device=device)
    source = slot[owner]
    freqs = position_ids.reshape(-1)[computed].to(torch.float32)[:, None] * p.inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * p.attention_scaling).to(dtype)[:, None]  # (N, 1, D)
    sin = (emb.sin() * p.attention_scaling).to(dtype)[:, None]
    index = torch.arange(seq, device=device)
    causal = index[None, :] <= index[:, None]  # (T, T): key <= query
    keys = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T)
    mask = (causal[None, None] & keys) | torch.eye(seq, dtype=torch.bool, device=device)[None, None]
    gqa = h_q != h_kv
    hidden = F.embedding(input_ids.reshape(-1)[computed], p.embed)  # (N, hidden)
    for w in p.layers:
        x = rms_norm(hidden, w.input_norm, w.input_norm_eps)
        qkv = F.linear(x, w.qkv, w.qkv_bias).view(-1, heads, dim)
        qkv = torch.cat([rotate_half(qkv[:, : h_q + h_kv], cos, sin), qkv[:, h_q + h_kv:]], dim=1)
        # index_select, not [source]: its backward is an index_add, far cheaper on CPU than
        # the accumulating index_put that advanced indexing's backward runs.
        laid = torch.cat([qkv, qkv.new_zeros(1, heads, dim)]).index_select(0, source)
        laid = laid.view(batch, seq, heads, dim).transpose(1, 2)  # (B, heads, T, D)
        attn = F.scaled_dot_product_attention(
            laid[:, :h_q], laid[:, h_q:h_q + h_kv], laid[:, h_q + h_kv:], attn_mask=mask,
            enable_gqa=gqa)
        attn = attn.transpose(1, 2).reshape(batch * seq, h_q * dim).index_select(0, computed)
        hidden = hidden + F.linear(attn, w.o, w.o_bias)
        x = rms_norm(hidden, w.post_norm, w.post_norm_eps)
        gate, up = F.linear(x, w.gate_up, w.gate_up_bias).split(p.intermediate, dim=-1)
        hidden = hidden + F.linear(F.silu(gate) * up, w.down, w.down_bias)
    hidden = rms_norm(hidden, p.final_norm, p.final_norm_eps)
    laid_out = torch.cat([hidden, hidden.new_zeros(1, hidden.shape[-1])]).index_select(0, source)
    laid_out = laid_out.view(batch, seq, -1)
    return (F.linear(laid_out, p.head, p.head_bias) if head else None), laid_out


def fused_head(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Logits of final hidden states ``(..., hidden)`` under ``model``'s output head."""
    lm_head: Any = getattr(model, "lm_head")  # noqa: B009 (a transformers model)
    return F.linear(hidden, lm_head.weight, lm_head.bias)
