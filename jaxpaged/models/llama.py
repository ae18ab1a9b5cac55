"""The decoder of every supported family (Llama, Mistral, Qwen2/3, Phi-3, Mixtral, Qwen3-MoE, Gemma 2/3, gpt-oss)
over one paged KV buffer; `ModelConfig` switches the family details (models/hf_config.py).

The whole batch is a flat list of `num_tokens` tokens from many sequences (see `StepInput` in
`jaxpaged/device/runner.py`). Per layer the model writes this step's K/V into the page pool by one
scatter over `slot_mapping`, then calls the pluggable paged attention (DESIGN.md contract) on the
layer's pages. The parameters are stacked (a leading num_layers axis) and the layers are one
`nn.scan` over them; given one parameter tree per layer instead (`params["params"]["layers"]` a
tuple: the runner's serving layout, jaxpaged/device/layer_params.py) the layers are unrolled, each
reading its own weights in place. Either way the KV buffer

    kv_pages: [num_layers, 2, num_kv_heads, num_pages, page_size, head_dim]   (axis 1: K, V)

rides in the carry, so XLA updates it in place when the caller donates it.
"""

import functools
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxpaged.ops import gguf_panels
from jaxpaged.ops.attention import reference_paged_attention
from jaxpaged.ops.kv_quant import QuantizedKV, layer_pools, rotate, rotates, write_slots
from jaxpaged.ops.ordered_sum import ordered_sum
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.rope_scaling import LongRope, RopeScaling, Yarn
from jaxpaged.models.gguf_blocks import kept_panels, linear, panels_head, stack_of
from jaxpaged.models.lora import add_lora, slot_rows
from jaxpaged.models.moe import ACTIVATIONS, ExpertFn, MoE, grouped_experts

# Einsum legend:
#   T=num_tokens  S=num_seqs  D=hidden_size  F=intermediate_size  V=vocab_size
#   N=num_heads   K=num_kv_heads  H=head_dim

AttentionFn = Callable[..., Float[Array, "num_tokens num_heads head_dim"]]
# The KV state: one float array, or a QuantizedKV pytree (jaxpaged/ops/kv_quant.py) for int8/fp8 caches.
KVPages = Float[Array, "num_layers 2 num_kv_heads num_pages page_size head_dim"] | QuantizedKV

_init = nn.initializers.normal(stddev=0.02)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | LongRope | Yarn | None) -> np.ndarray:
    """Inverse frequencies of the `head_dim // 2` rotated pairs, with Llama-3, LongRoPE or YaRN scaling if given."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv_freq.astype(np.float32)
    if isinstance(scaling, Yarn):
        return _yarn_inv_freq(head_dim, theta, scaling)
    if isinstance(scaling, LongRope):  # Phi-3: each frequency divided by its factor (cos/sin scaled apart)
        factors = np.asarray(scaling.long_factor if scaling.use_long else scaling.short_factor, np.float64)
        return (inv_freq / factors).astype(np.float32)
    # Llama 3: long wavelengths (low frequencies) are slowed down by `factor`, short ones are
    # kept, and the band between is interpolated smoothly.
    wavelen = 2 * np.pi / inv_freq
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    scaled = np.where((wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen), interpolated, scaled)
    return scaled.astype(np.float32)


def _yarn_inv_freq(head_dim: int, theta: float, yarn: Yarn) -> np.ndarray:
    """YaRN: dimension pair i keeps its frequency (extrapolates) below the ramp, takes it divided by `factor`
    (interpolates) above it; in float32 in HF's order of operations (modeling_rope_utils._compute_yarn_parameters)."""
    def correction_dim(num_rotations):  # the pair that turns `num_rotations` times over the original context
        return head_dim * math.log(yarn.original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    pos_freqs = np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(yarn.factor) * pos_freqs)
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (np.float32(1.0) - ramp).astype(np.float32)
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


def apply_rope(
    x: Float[Array, "num_tokens heads head_dim"],
    cos: Float[Array, "num_tokens half"],
    sin: Float[Array, "num_tokens half"],
) -> Float[Array, "num_tokens heads head_dim"]:
    """Rotate-half RoPE, as Hugging Face: dimension i pairs with i + head_dim/2."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, H/2], shared by every head
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def write_kv(
    kv_pages: KVPages,
    layer_idx: Int[Array, ""],
    k: Float[Array, "num_tokens num_kv_heads head_dim"],
    v: Float[Array, "num_tokens num_kv_heads head_dim"],
    slot_mapping: Int[Array, "num_tokens"],
) -> KVPages:
    """Stores token t's K/V at slot `slot_mapping[t]` of layer `layer_idx`, by one scatter.

        slot = page_id * page_size + offset      e.g. page_size 4: slot 13 -> page 3, offset 1

    Padding tokens carry slot `num_pages * page_size`, i.e. page `num_pages`: out of range, and
    `mode="drop"` discards them. A quantized cache stores int8/fp8 values and one scale per (token,
    KV head), quantized here (`jaxpaged.ops.kv_quant.write_slots`).
    """
    page_size = kv_pages.shape[4]
    page_ids, offsets = slot_mapping // page_size, slot_mapping % page_size
    new_kv = jnp.stack([k, v], axis=1)  # [T, 2, K, H]
    # Indices on axes 0, 3, 4 are separated by slices, so the indexed (token) axis comes first:
    # the update has shape [T, 2, K, H] (scales: [T, 2, K]).
    return write_slots(kv_pages, (layer_idx, slice(None), slice(None), page_ids, offsets), new_kv)


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype
    plus_one: bool = False  # Gemma: multiply by (1 + scale), in float32
    ordered: bool = False  # the mean's sum in an order fixed by dim alone (batch_invariant: ops/ordered_sum.py)

    @nn.compact
    def __call__(self, x: Float[Array, "... dim"]) -> Float[Array, "... dim"]:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        if self.ordered:
            mean_square = (ordered_sum(x32 * x32) / jnp.float32(x.shape[-1]))[..., None]
        else:
            mean_square = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        normed = x32 * jax.lax.rsqrt(mean_square + self.eps)
        if self.plus_one:
            return (normed * (1.0 + scale.astype(jnp.float32))).astype(self.dtype)
        return scale * normed.astype(self.dtype)


class Attention(nn.Module):
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_bias: bool
    o_proj_bias: bool
    qk_norm: bool
    rms_norm_eps: float
    dtype: jnp.dtype
    attention_fn: AttentionFn
    decode_only: bool = False  # static: every sequence of the step has exactly one token
    norm_plus_one: bool = False
    scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    soft_cap: float | None = None
    # Static windows: `windows` is the set of distinct per-layer windows (None = global). One
    # window: passed as is. Two (Gemma's local + global): `is_local` (traced, per layer) picks
    # between two calls by lax.cond, so each backend sees a static window.
    windows: tuple[int | None, ...] = (None,)
    matmul_kernels: frozenset = frozenset()  # static: CausalLM.matmul_kernels
    min_dot_rows: int = 1  # static: CausalLM.min_dot_rows
    batch_invariant: bool = False  # static: CausalLM.batch_invariant (the q/k norms' sums ordered)
    sinks: bool = False  # gpt-oss: a learned logit per query head, passed to the backend as `sinks` [N] float32

    @nn.compact
    def __call__(self, x, cos, sin, kv_pages, layer_idx, slot_mapping, block_tables, seq_lens,
                 query_start_loc, is_local=None, kv_centres=None, weight_stack=None, lora=None):
        # lora: (rows [T, S], this layer's adapter stacks) or None (models/lora.py)
        dim, n, k, h = x.shape[-1], self.num_heads, self.num_kv_heads, self.head_dim
        # Float weights, or GGUF codes: dequantized by XLA or multiplied by the CPU kernel (models/gguf_blocks.py).
        project = functools.partial(linear, self, dtype=self.dtype, init=_init, kernels=self.matmul_kernels,
                                    stack=weight_stack, layer=layer_idx, min_rows=self.min_dot_rows)
        q = add_lora(project("q_proj", x, (dim, n, h), "TD,DNH->TNH"), x, lora, "q_proj")
        key = add_lora(project("k_proj", x, (dim, k, h), "TD,DKH->TKH"), x, lora, "k_proj")
        value = add_lora(project("v_proj", x, (dim, k, h), "TD,DKH->TKH"), x, lora, "v_proj")
        if self.attention_bias:
            q = q + self.param("q_bias", _init, (n, h), self.dtype)
            key = key + self.param("k_bias", _init, (k, h), self.dtype)
            value = value + self.param("v_bias", _init, (k, h), self.dtype)
        if self.qk_norm:
            q = RMSNorm(self.rms_norm_eps, self.dtype, self.norm_plus_one, self.batch_invariant, name="q_norm")(q)
            key = RMSNorm(self.rms_norm_eps, self.dtype, self.norm_plus_one, self.batch_invariant, name="k_norm")(key)
        q, key = apply_rope(q, cos, sin), apply_rope(key, cos, sin)
        if kv_centres is not None:  # a quantized cache stores k - mu_k, v - mu_v (device/kv_centres.py)
            centre = kv_centres[layer_idx]  # [2, K, H] float32
            key = (key.astype(jnp.float32) - centre[0]).astype(key.dtype)
            value = (value.astype(jnp.float32) - centre[1]).astype(value.dtype)
        rotated = rotates(kv_pages)  # int8 pages hold K/V in a Hadamard basis (ops/kv_quant.py)
        if rotated:
            q, key, value = rotate(q), rotate(key), rotate(value)

        kv_pages = write_kv(kv_pages, layer_idx, key, value, slot_mapping)
        # A backend with a decode kernel is told, statically, that the step is decode-only.
        has_decode_kernel = getattr(self.attention_fn, "has_decode_kernel", False)
        extra = {"decode_only": True} if self.decode_only and has_decode_kernel else {}
        if self.soft_cap is not None:
            extra["soft_cap"] = self.soft_cap
        if self.sinks:  # only then: a backend without sinks is never handed them silently (it refuses the kwarg)
            extra["sinks"] = self.param("sinks", _init, (n,), self.dtype).astype(jnp.float32)
        scale = h**-0.5 if self.scale is None else self.scale

        def attend(window):
            kwargs = dict(extra, sliding_window=window) if window is not None else extra
            if getattr(self.attention_fn, "reads_whole_kv_buffer", False):
                # The backend indexes this layer's pages itself: no per-layer copy of the pool.
                return self.attention_fn(
                    q, kv_pages, block_tables, seq_lens, query_start_loc, layer_idx=layer_idx, scale=scale, **kwargs,
                )
            # The DESIGN.md contract: this layer's K and V pools (QuantizedKV pools if quantized).
            k_pool, v_pool = layer_pools(kv_pages, layer_idx)
            return self.attention_fn(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, scale=scale, **kwargs)

        if len(self.windows) == 1:
            out = attend(self.windows[0])  # [T, N, H]
        else:
            local_window = max(w for w in self.windows if w is not None)
            out = jax.lax.cond(is_local, lambda: attend(local_window), lambda: attend(None))
        if rotated:
            out = rotate(out)  # back from the Hadamard basis: H is its own inverse
        if kv_centres is not None:  # the weights sum to 1: + mu_v restores sum_j p_j v_j (query head -> its KV head)
            out = (out.astype(jnp.float32) + jnp.repeat(centre[1], n // k, axis=0)).astype(out.dtype)
        # One plain [T, N*H] x [N*H, D] matmul (both reshapes are free). The einsum "TNH,NHD->TD" let XLA
        # contract (H, N) in that order: the CPU program transposed o_proj (and the activations) every layer.
        out = out.astype(self.dtype).reshape(-1, n * h)  # [T, N*H]
        y = add_lora(project("o_proj", out, (n, h, dim), "TM,MD->TD", matrix=True), out, lora, "o_proj")
        if self.o_proj_bias:
            y = y + self.param("o_bias", _init, (dim,), self.dtype)
        return y, kv_pages


class MLP(nn.Module):
    intermediate_size: int
    dtype: jnp.dtype
    act: str = "silu"
    matmul_kernels: frozenset = frozenset()  # static: CausalLM.matmul_kernels
    min_dot_rows: int = 1  # static: CausalLM.min_dot_rows

    @nn.compact
    def __call__(self, x: Float[Array, "num_tokens dim"], layer_idx=0, weight_stack=None,
                 lora=None) -> Float[Array, "num_tokens dim"]:
        dim, f = x.shape[-1], self.intermediate_size
        project = functools.partial(linear, self, dtype=self.dtype, init=_init, kernels=self.matmul_kernels,
                                    stack=weight_stack, layer=layer_idx,  # float or GGUF codes (models/gguf_blocks.py)
                                    min_rows=self.min_dot_rows)
        gate = add_lora(project("gate_proj", x, (dim, f), "TD,DF->TF"), x, lora, "gate_proj")
        up = add_lora(project("up_proj", x, (dim, f), "TD,DF->TF"), x, lora, "up_proj")
        hidden = ACTIVATIONS[self.act](gate) * up
        return add_lora(project("down_proj", hidden, (f, dim), "TF,FD->TD"), hidden, lora, "down_proj")


class DecoderLayer(nn.Module):
    """One pre-norm block; scanned over layers with the KV buffer in the carry."""

    config: ModelConfig
    attention_fn: AttentionFn
    decode_only: bool = False
    expert_fn: ExpertFn = grouped_experts
    matmul_kernels: frozenset = frozenset()  # static: CausalLM.matmul_kernels
    min_dot_rows: int = 1  # static: CausalLM.min_dot_rows
    batch_invariant: bool = False  # static: CausalLM.batch_invariant

    @nn.compact
    def __call__(self, carry, layer_idx, is_local, rope, slot_mapping, block_tables, seq_lens, query_start_loc,
                 kv_centres=None, weight_stack=None, lora_stacks=None, lora_rows=None):
        # weight_stack: {"attn": {...}, "mlp": {...}} the kernels' leaves of every layer, or None (gguf_blocks.linear)
        # lora_stacks: this layer's adapter slots {module: {"a": [S, I, R], "b": [S, R, O]}}, lora_rows: [T, S]
        # one-hot of each token's slot; both None without adapters (models/lora.py)
        c, dtype = self.config, jnp.dtype(self.config.dtype)
        norm = lambda name: RMSNorm(c.rms_norm_eps, dtype, c.norm_plus_one, self.batch_invariant, name=name)
        x, kv_pages = carry
        cos, sin, local_cos, local_sin = rope
        if c.local_rope_theta is not None:  # Gemma 3: local layers rotate with their own base
            cos, sin = jnp.where(is_local, local_cos, cos), jnp.where(is_local, local_sin, sin)
        attn = Attention(
            c.num_heads, c.num_kv_heads, c.head_dim, c.attention_bias, c.o_proj_bias, c.qk_norm,
            c.rms_norm_eps, dtype, self.attention_fn, self.decode_only, c.norm_plus_one,
            None if c.query_pre_attn_scalar is None else c.query_pre_attn_scalar**-0.5, c.attn_soft_cap,
            tuple(sorted(set(c.layer_windows), key=lambda w: -1 if w is None else w)), self.matmul_kernels,
            self.min_dot_rows, self.batch_invariant, c.attention_sinks, name="attn",
        )
        stack = weight_stack or {}
        lora = None if lora_stacks is None else (lora_rows, lora_stacks)
        h, kv_pages = attn(
            norm("input_norm")(x), cos, sin, kv_pages, layer_idx, slot_mapping, block_tables, seq_lens,
            query_start_loc, is_local, kv_centres, stack.get("attn"), lora,
        )
        x = x + (norm("attn_out_norm")(h) if c.sandwich_norms else h)
        h = norm("post_attn_norm")(x)  # the norm in front of the MLP
        if c.num_experts:
            h = MoE(c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob, c.hidden_act,
                    dtype, self.expert_fn, c.moe_bias, name="moe")(h)
        else:
            h = MLP(c.intermediate_size, dtype, c.hidden_act, self.matmul_kernels, self.min_dot_rows, name="mlp")(
                h, layer_idx, stack.get("mlp"), lora)
        x = x + (norm("mlp_out_norm")(h) if c.sandwich_norms else h)
        return (x, kv_pages), None


class CausalLM(nn.Module):
    config: ModelConfig
    attention_fn: AttentionFn = reference_paged_attention
    # Static: the step is decode-only (one token per sequence, num_tokens == num_seqs), so a backend
    # with `has_decode_kernel` runs its decode kernel. Same parameters as the default model.
    decode_only: bool = False
    expert_fn: ExpertFn = grouped_experts  # MoE only; sharding.TensorParallel.shard_experts for EP
    # Static: a tied LM head computes embedding @ x^T where that is faster (tied_lm_head); the
    # runner sets it for XLA:CPU. Same logits up to float32 summation order.
    vocab_major_head: bool = False
    # Static: the C++ kernels that multiply layer projections in every step (gguf_blocks.linear):
    # "gguf_matmul" for GGUF codes (ops/cpu/gguf_matmul.cc), "dense_matmul" for float32 weights
    # (ops/cpu/dense_matmul.cc); the runner sets them on XLA:CPU. Same weights, float32 sums in another order.
    matmul_kernels: frozenset = frozenset()
    # Static: the fewest rows a layer projection's dot is given (gguf_blocks.linear pads fewer with zero
    # rows); the runner sets 2 on a GPU, where XLA strength-reduces a one-row dot of a small weight into
    # multiply + reduce that writes the weight-sized product (docs: jaxpaged/static_profile/__init__.py).
    min_dot_rows: int = 1
    # Static: every token's logits computed in an order that does not depend on the other rows
    # (EngineConfig.batch_invariant): RMSNorm's sums by ops/ordered_sum.py, the LM head by `invariant_lm_head`.
    batch_invariant: bool = False
    # Static: the matmul kernels read each layer's weight from the whole stack (no slice copies: the
    # engine). False: from the scan's own slice of it, whose cotangent is that layer's alone (a
    # trainer differentiating the step: jaxpaged/rl/).
    kernels_read_stack: bool = True

    @nn.compact
    def __call__(
        self,
        kv_pages: KVPages,
        token_ids: Int[Array, "num_tokens"],
        positions: Int[Array, "num_tokens"],
        slot_mapping: Int[Array, "num_tokens"],
        block_tables: Int[Array, "num_seqs pages_per_seq"],
        seq_lens: Int[Array, "num_seqs"],
        query_start_loc: Int[Array, "num_seqs_plus_1"],
        logits_indices: Int[Array, "num_logits"],  # num_seqs, or num_seqs + num_tokens (prompt logprobs)
        kv_centres: Float[Array, "num_layers 2 num_kv_heads head_dim"] | None = None,  # device/kv_centres.py
        # (token_slots [T] int32, stacks {module: {"a": [L, S, I, R], "b": [L, S, R, O]}}, or with one parameter
        # tree per layer a tuple of L {module: {"a": [S, I, R], "b": [S, R, O]}}: device/lora_slots.py)
        lora: tuple | None = None,
    ) -> tuple[Float[Array, "num_logits vocab_size"], KVPages]:
        """Runs one step; returns float32 logits at `logits_indices` and the updated KV buffer. With `lora`
        each token adds its adapter slot's delta to every adapted projection (models/lora.py)."""
        c, dtype = self.config, jnp.dtype(self.config.dtype)
        panels = kept_panels(self)  # a tied embedding kept as GGUF codes (models/gguf_blocks.py), or None
        embedding = None if panels else self.param("embedding", _init, (c.vocab_size, c.hidden_size), dtype)
        x = gguf_panels.rows(*panels, token_ids).astype(dtype) if panels else embedding[token_ids]  # [T, D]
        if c.scale_embedding:  # Gemma: sqrt(D), rounded to the activation dtype as HF does
            x = x * jnp.asarray(c.hidden_size**0.5, dtype)

        def rotations(theta, scaling):
            inv_freq = jnp.asarray(rope_inv_freq(c.head_dim, theta, scaling))
            angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
            if isinstance(scaling, (LongRope, Yarn)):  # cos/sin scaled by its attention factor
                return jnp.cos(angles) * scaling.attention_factor, jnp.sin(angles) * scaling.attention_factor
            return jnp.cos(angles), jnp.sin(angles)

        rope = rotations(c.rope_theta, c.rope_scaling)
        rope += rotations(c.local_rope_theta, None) if c.local_rope_theta is not None else rope

        shared = (rope, slot_mapping, block_tables, seq_lens, query_start_loc, kv_centres)
        lora_stacks, lora_rows = None, None
        if lora is not None:
            token_slots, lora_stacks = lora
            first = jax.tree.leaves(lora_stacks)[0]  # [S, I, R] per layer, or [L, S, I, R]
            num_slots = first.shape[0] if isinstance(lora_stacks, tuple) else first.shape[1]
            lora_rows = slot_rows(token_slots, num_slots, dtype)  # [T, S]
        is_local = [w is not None for w in c.layer_windows]
        per_layer = None if self.is_initializing() else self.variables["params"].get("layers")
        if isinstance(per_layer, (tuple, list)):
            # One parameter tree per layer (the runner's serving layout, device/layer_params.py): the
            # layers are unrolled and each reads its own weight buffers in place. A loop over stacked
            # weights would copy every layer's slice first (XLA's dynamic-slice fusions are memcpys).
            layer = DecoderLayer(c, self.attention_fn, self.decode_only, self.expert_fn, self.matmul_kernels,
                                 self.min_dot_rows, self.batch_invariant, parent=None)
            carry = (x, kv_pages)
            for i, layer_params in enumerate(per_layer):
                layer_lora = (lora_stacks[i] if isinstance(lora_stacks, tuple) else None if lora_stacks is None
                              else jax.tree.map(lambda leaf: leaf[i], lora_stacks))
                carry, _ = layer.apply({"params": layer_params}, carry, jnp.int32(i), jnp.asarray(is_local[i]), *shared,
                                       None, layer_lora, lora_rows)
            x, kv_pages = carry
        else:  # stacked parameters (the canonical tree): one scan over the leading num_layers axis
            layers = nn.scan(
                DecoderLayer,
                variable_axes={"params": 0, "intermediates": 0},  # a leading num_layers axis (intermediates: MoE ids)
                split_rngs={"params": True},
                # layer_idx and is_local scanned, the step's arrays shared; adapter stacks scanned, their rows shared
                in_axes=(0, 0) + (nn.broadcast,) * 7 + (0, nn.broadcast),
                length=c.num_layers,
            )(c, self.attention_fn, self.decode_only, self.expert_fn, self.matmul_kernels, self.min_dot_rows,
              self.batch_invariant, name="layers")
            layer_ids = jnp.arange(c.num_layers, dtype=jnp.int32)
            # The kernels read weights from the whole stack at layer_idx (no per-layer slice copies).
            stacked = None if self.is_initializing() else self.variables["params"].get("layers", {})
            weight_stack = ({m: stack_of(stacked, m, self.matmul_kernels) for m in ("attn", "mlp")}
                          if self.matmul_kernels and stacked and self.kernels_read_stack else None)
            (x, kv_pages), _ = layers((x, kv_pages), layer_ids, jnp.asarray(is_local), *shared, weight_stack,
                                      lora_stacks, lora_rows)

        # Only each sequence's last scheduled token needs logits; RMSNorm is per token, so
        # gathering first is exact and saves the vocab projection for every other token.
        x = RMSNorm(c.rms_norm_eps, dtype, c.norm_plus_one, self.batch_invariant,
                    name="final_norm")(x[logits_indices])  # [S, D]
        lm_head = None if c.tie_word_embeddings else self.param("lm_head", _init, (c.hidden_size, c.vocab_size), dtype)
        with jax.named_scope("lm_head"):  # names the head's ops in profiles
            if panels:
                logits = panels_head(x, panels, self.matmul_kernels)
            elif self.batch_invariant:
                logits = invariant_lm_head(x, embedding if lm_head is None else lm_head, tied=lm_head is None)
            elif lm_head is None:
                logits = tied_lm_head(x, embedding, self.vocab_major_head)
            else:
                logits = jnp.einsum("SD,DV->SV", x, lm_head, preferred_element_type=jnp.float32)
        if c.final_soft_cap is not None:
            logits = c.final_soft_cap * jnp.tanh(logits / c.final_soft_cap)
        return logits, kv_pages


# batch_invariant: the LM head's rows in tiles of exactly this many (invariant_lm_head).
HEAD_TILE = 16

# Logit rows for which XLA:CPU's dot runs faster vocabulary-major (tied_lm_head).
VOCAB_MAJOR_ROWS = (2, 64)


def tied_lm_head(x: Float[Array, "S D"], embedding: Float[Array | np.ndarray, "V D"],
                 vocab_major: bool) -> Float[Array, "S V"]:
    """float32 logits x @ embedding^T.

    vocab_major (XLA:CPU): for 2 <= S <= 64 rows the product is taken as embedding @ x^T, [V, S],
    and transposed after. XLA:CPU's dot runs this orientation 1.3-1.5x faster at 2-32 rows
    (SmolLM2's 49152 x 576 head at 16 rows: 10.2 -> 7.0 ms, benchmarks/peers/README.md); one row is
    a matrix-vector product that is faster as it is, and from ~96 rows the two are equal. The
    optimization barrier keeps XLA's simplifier from folding the transpose back into the dot.
    """
    if vocab_major and VOCAB_MAJOR_ROWS[0] <= x.shape[0] <= VOCAB_MAJOR_ROWS[1]:
        return jax.lax.optimization_barrier(jnp.einsum("VD,SD->VS", embedding, x, preferred_element_type=jnp.float32)).T
    return jnp.einsum("SD,DV->SV", x, embedding.T, preferred_element_type=jnp.float32)


def invariant_lm_head(x: Float[Array, "S D"], weight: Float[Array, "V D"] | Float[Array, "D V"], *,
                      tied: bool) -> Float[Array, "S V"]:
    """float32 logits whose row s depends on x[s] alone, bit for bit, whatever S is (batch_invariant).

    XLA's own dot changes its summation order with the number of rows (on XLA:CPU x @ W from 64 rows,
    a one-row GEMV, E @ x^T between 384 and 1024 rows of SmolLM2's head), but one compiled shape sums
    every row alike wherever it sits. So the rows go through the head in tiles of exactly HEAD_TILE
    (zero-padded; a `lax.map` over tiles, one dot shape), vocabulary-major for a tied embedding (E @
    x^T, XLA:CPU's faster orientation: tied_lm_head) and x @ W for an untied head. The optimization
    barrier keeps the simplifier from folding the transpose back into the dot.
    """
    rows = x.shape[0]
    num_tiles = -(-rows // HEAD_TILE)
    tiles = jnp.pad(x, ((0, num_tiles * HEAD_TILE - rows), (0, 0))).reshape(num_tiles, HEAD_TILE, x.shape[1])

    def tile_logits(tile):  # [HEAD_TILE, D] -> [HEAD_TILE, V]
        if tied:
            return jax.lax.optimization_barrier(
                jnp.einsum("VD,SD->VS", weight, tile, preferred_element_type=jnp.float32)).T
        return jnp.einsum("SD,DV->SV", tile, weight, preferred_element_type=jnp.float32)

    logits = jax.lax.map(tile_logits, tiles)  # [num_tiles, HEAD_TILE, V]
    return logits.reshape(num_tiles * HEAD_TILE, -1)[:rows]


def param_shapes(config: ModelConfig):
    """The parameter tree as `jax.ShapeDtypeStruct`s (`eval_shape` of the module's init: nothing runs)."""
    num_pages, page_size, num_tokens = 2, 4, 4
    kv_pages = jax.ShapeDtypeStruct(
        (config.num_layers, 2, config.num_kv_heads, num_pages, page_size, config.head_dim), config.dtype
    )
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    return jax.eval_shape(
        CausalLM(config).init, jax.random.key(0), kv_pages, ints(num_tokens), ints(num_tokens), ints(num_tokens),
        ints(1, 1), ints(1), ints(2), ints(1),
    )


def init_params(config: ModelConfig, rng: jax.Array) -> dict:
    """Random parameters (normal, std 0.02; norm scales 1) in `config.dtype`.

    Shapes come from `eval_shape` of the module's init and the arrays are drawn with numpy, so
    nothing is compiled: running Flax's init would compile the whole forward pass.
    """
    shapes = param_shapes(config)
    # numpy draws: eager jax.random would compile one kernel per distinct shape.
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):  # a typed key (jax.random.key)
        rng = jax.random.key_data(rng)
    np_rng = np.random.default_rng(np.asarray(rng).ravel())

    def draw(path, leaf):
        if path[-1].key == "scale":
            return jnp.ones(leaf.shape, leaf.dtype)
        return jnp.asarray(0.02 * np_rng.standard_normal(leaf.shape, np.float32), leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)
