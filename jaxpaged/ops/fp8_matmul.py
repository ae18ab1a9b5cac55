"""x @ W for a weight kept as float8_e4m3fn values and float32 scales (FP8 checkpoints: models/hf_quant.py).

    w       float8_e4m3fn [K, N]     the weight, in first (K input features, N output features)
    scale   float32 [G, N]           G = 1 (per tensor, per output channel) or K / B (B-row blocks of K)
    W[k, n] = float(w[k, n]) * scale[k // (K / G), n]

A per-tensor scale is stored as one row repeated over N, a block one (Hugging Face's
`weight_block_size` [128, 128]) with its column blocks repeated over their 128 columns: one layout for
every granularity, G * N * 4 bytes beside the weight's K * N (3% at 128-row blocks).

Two arithmetics, `activations`:

- "float" (W8A16, the CPU's default): the weight dequantized to x's dtype, then one dot.
- "fp8" (W8A8, vLLM's on a GPU): x quantized to float8_e4m3fn too, products of the FP8 values summed in
  float32, then scaled. The scale of x: `input_scale` where the checkpoint has one (activation_scheme
  "static", one per layer), else dynamic: max |x| / 448 per token (G = 1) or per token and block of
  K (G > 1, vLLM's per-token-group quantization of block-FP8 checkpoints).

On a GPU XLA lowers the FP8 x FP8 dot to its FP8 GEMM; the weight stays float8 in HBM either way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
ACTIVATIONS = ("float", "fp8")
# A projection `name` kept as FP8 in a parameter tree (models/hf_quant.py fp8_leaves): `name_fp8` [L, K, N],
# `name_fp8_scale` [L, G, N] and, with a static activation scheme, `name_input_scale` [L].
SUFFIXES = ("_fp8", "_fp8_scale", "_input_scale")
# In a runner's matmul kernels (models/gguf_blocks.py linear): FP8 weights multiply FP8 activations (W8A8).
W8A8 = "fp8_activations"
TINY = 1e-12  # the smallest activation scale: an all-zero row quantizes to zeros, not NaN


def dequantize(w, scale, dtype=jnp.float32) -> jax.Array:
    """W [K, N] in `dtype`: the FP8 values times their scales, in float32 (exact: 4 + 24 bits)."""
    (k, n), groups = w.shape, scale.shape[0]
    weight = w.astype(jnp.float32).reshape(groups, k // groups, n) * scale[:, None, :]
    return weight.reshape(k, n).astype(dtype)


def quantize_fp8(x, scale) -> jax.Array:
    """x / scale rounded to float8_e4m3fn (clipped to its finite range first: no infinities)."""
    return jnp.clip(x.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)


def fp8_matmul(x, w, scale, input_scale=None, *, activations: str = "float", dtype=None) -> jax.Array:
    """x [M, K] @ W [K, N] -> [M, N] in `dtype` (default x's), W as in the module docstring.

    `input_scale`: a float32 scalar (activation_scheme "static") or None (dynamic); read only with
    activations "fp8"."""
    dtype = dtype or x.dtype
    if x.ndim != 2 or w.ndim != 2 or scale.ndim != 2 or x.shape[1] != w.shape[0] or scale.shape[1] != w.shape[1] \
            or w.shape[0] % scale.shape[0]:
        raise ValueError(f"fp8_matmul: x [M, K], w [K, N] and scale [G, N] with G dividing K; got {x.shape}, "
                         f"{w.shape}, {scale.shape}")
    if activations not in ACTIVATIONS:
        raise ValueError(f"fp8_matmul: activations={activations!r} must be one of {ACTIVATIONS}")
    if activations == "float":
        return jnp.dot(x, dequantize(w, scale, x.dtype), preferred_element_type=jnp.float32).astype(dtype)
    (m, k), (groups, n) = x.shape, scale.shape
    if groups == 1:
        if input_scale is None:  # dynamic, per token
            x_scale = jnp.maximum(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1, keepdims=True) / FP8_MAX, TINY)
        else:
            x_scale = jnp.reshape(input_scale, (1, 1)).astype(jnp.float32)
        y = jnp.dot(quantize_fp8(x, x_scale), w, preferred_element_type=jnp.float32)
        return (y * x_scale * scale).astype(dtype)
    # Blocks of K: each token's block of K has its own scale (dynamic only: models/hf_quant.py refuses static).
    blocks = x.astype(jnp.float32).reshape(m, groups, k // groups)
    x_scale = jnp.maximum(jnp.max(jnp.abs(blocks), axis=2) / FP8_MAX, TINY)  # [M, G]
    partial = jnp.einsum("MGB,GBN->MGN", quantize_fp8(blocks, x_scale[..., None]), w.reshape(groups, k // groups, n),
                         preferred_element_type=jnp.float32)
    return jnp.einsum("MGN,MG,GN->MN", partial, x_scale, scale).astype(dtype)


def reference(x, w, scale, input_scale=None, *, activations: str = "float"):
    """The plain form in float32, one token at a time (numpy-like loops, no shared reduction): tests."""
    import numpy as np

    x, w, scale = (np.asarray(a, np.float32) for a in (x, w, scale))
    (m, k), (groups, n) = x.shape, scale.shape
    weight = (w.reshape(groups, k // groups, n) * scale[:, None, :]).reshape(k, n)
    if activations == "float":
        return x @ weight
    out = np.zeros((m, n), np.float32)
    for row in range(m):
        for g in range(groups):
            part = x[row, g * (k // groups):(g + 1) * (k // groups)]
            s = np.float32(input_scale) if input_scale is not None else max(np.abs(part).max() / FP8_MAX, TINY)
            q = np.clip(part / s, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).astype(np.float32)
            rows = w[g * (k // groups):(g + 1) * (k // groups)]
            out[row] += (q @ rows) * s * scale[g]
    return out
