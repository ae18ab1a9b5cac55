"""Quantized KV cache: int8 / float8_e4m3fn pages with one float32 scale per (token, KV head).

    kv_cache_dtype="auto":  kv_pages is one array [num_layers, 2, num_kv_heads, num_pages, page_size, head_dim]
    "int8" | "float8_e4m3fn": kv_pages is QuantizedKV(
        pages  [num_layers, 2, num_kv_heads, num_pages, page_size, head_dim]  int8 / fp8 (as uint8 bits)
        scales [num_layers, 2, num_kv_heads, num_pages, page_size]            float32
    )

Every leaf keeps the leading axes `[num_layers, 2, num_kv_heads, num_pages]` (page axis 3), so code
that copies or moves pages (`apply_page_copies`, swap) `jax.tree.map`s over the leaves and the
sharding table splits both leaves on `num_kv_heads`.

Why a scale per token and head: pages are written once, token by token (a decode appends one slot,
a prefill chunk fills slots); a per-token scale is fixed the moment its token is written, so no
earlier token is ever re-quantized, and a copy-on-write copy or a swap moves a page's scales as
plain data. A per-page scale would have to grow with the page's amax (re-quantizing the tokens
already there, or clipping the newcomer). The cost: 4 bytes per (token, head) next to head_dim
bytes of K or V (64 for SmolLM2: 68 bytes instead of 256 in float32 or 128 in bfloat16).

    scale = amax(|x|) / QMAX over head_dim   (QMAX: 127 for int8, 448 for float8_e4m3fn)
    q     = round(x / scale) clipped to [-127, 127] (int8) | clip(x / scale, -448, 448) (fp8)
    x~    = q * scale
An all-zero vector (amax = 0) gets scale 1 (q = 0, exact).

int8 pages hold K and V in a Hadamard basis (`rotate`, QuaRot's fix for outlier channels). Llama-
family keys carry a few channels ~10x larger than the rest (SmolLM2: up to 20 against a median of
~3): a per-token scale set by them leaves the other channels a few int8 steps. The orthonormal,
symmetric head_dim x head_dim Hadamard H spreads every channel over all of them, so the per-token
amax falls towards the vector's rms. The model stores k H and v H, attends with q H (scores are
unchanged: qH . kH = q . k) and turns the output back (out = (sum_i p_i v_i H) H). The kernels,
the chunked backend and the reference read the pages as before: the basis change lives in the model
(`models/llama.py`), no page format or kernel changes, and pages stay write-once. fp8 is not rotated:
its error is relative to each element (3 mantissa bits) and the amax element is exact, so spreading
an outlier over every channel makes its scores worse (measured: benchmarks/kv_quant_accuracy.py).

float8_e4m3fn values are *stored as their bits* in a uint8 array (`lax.bitcast_convert_type`, free)
and bitcast back as they are read. XLA's CPU backend has no native fp8 arithmetic and upcasts fp8
operations (the step's in-place scatter included) through a float16 copy of the whole operand: a
measured 8.7 MB of scratch for a 5 MB pool and a step many times slower. A uint8 buffer is only
ever gathered and scattered as bytes, so it stays in place on every backend.
"""

from typing import NamedTuple

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Shaped

from jaxpaged.config import KV_CACHE_DTYPES

_QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}
SCALE_DTYPE = jnp.float32


class QuantizedKV(NamedTuple):
    """The quantized KV state (a pytree of two leaves, page axis 3 in both)."""

    pages: Shaped[Array, "num_layers 2 num_kv_heads num_pages page_size head_dim"]
    scales: Float[Array, "num_layers 2 num_kv_heads num_pages page_size"]

    @property
    def shape(self):  # the pages' shape: what code that reads `kv_pages.shape` wants
        return self.pages.shape

    @property
    def dtype(self):  # the stored values' dtype (int8, or uint8 holding float8_e4m3fn bits)
        return self.pages.dtype

    @property
    def ndim(self):
        return self.pages.ndim

    @property
    def nbytes(self) -> int:
        return self.pages.nbytes + self.scales.nbytes


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: use one of {KV_CACHE_DTYPES} "
                         "('auto' stores K/V in the model dtype)")


def is_quantized(kv_cache_dtype: str) -> bool:
    check_kv_cache_dtype(kv_cache_dtype)
    return kv_cache_dtype != "auto"


def storage_dtype(kv_cache_dtype: str, model_dtype) -> jnp.dtype:
    """The dtype of the page values' array (fp8 values are kept as uint8 bits)."""
    if not is_quantized(kv_cache_dtype):
        return jnp.dtype(model_dtype)
    return jnp.dtype(jnp.uint8) if kv_cache_dtype == "float8_e4m3fn" else jnp.dtype(kv_cache_dtype)


def bytes_per_token_head(kv_cache_dtype: str, model_dtype, head_dim: int) -> int:
    """Bytes of one token's K (or V) of one KV head, its scale included."""
    values = head_dim * storage_dtype(kv_cache_dtype, model_dtype).itemsize
    return values + (jnp.dtype(SCALE_DTYPE).itemsize if is_quantized(kv_cache_dtype) else 0)


def zeros_kv_cache(shape, model_dtype, kv_cache_dtype: str, zeros=jnp.zeros):
    """An empty KV state: a plain array for "auto", else QuantizedKV. `zeros(shape, dtype)` allocates."""
    if not is_quantized(kv_cache_dtype):
        return zeros(shape, model_dtype)
    return QuantizedKV(zeros(shape, storage_dtype(kv_cache_dtype, None)), zeros(tuple(shape[:-1]), SCALE_DTYPE))


def quantize(x: Float[Array, "... head_dim"], dtype) -> tuple[Shaped[Array, "... head_dim"], Float[Array, "..."]]:
    """`(values, scale)` with `values * scale[..., None] ~= x`, one scale per vector of the last axis.

    `dtype` "int8" gives int8 values, "float8_e4m3fn" fp8 values as uint8 bits (see the module doc);
    `dequantize` reads either."""
    dtype = jnp.dtype(dtype)
    qmax = _QMAX[dtype.name]
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    amax = jnp.where(jnp.isnan(x).any(axis=-1), jnp.nan, amax)  # XLA's CPU max may drop NaN; keep it
    scale = jnp.where(amax == 0, 1.0, amax / qmax)  # a NaN vector keeps a NaN scale: poison stays poison
    scaled = x / scale[..., None]
    if dtype == jnp.int8:
        scaled = jnp.round(scaled)
    values = jnp.clip(scaled, -qmax, qmax).astype(dtype)
    if dtype == jnp.float8_e4m3fn:
        values = lax.bitcast_convert_type(values, jnp.uint8)
    return values, scale.astype(SCALE_DTYPE)


def rotates(kv_pages) -> bool:
    """True for a KV state whose pages hold K/V in the Hadamard basis (an int8 cache; module doc)."""
    return isinstance(kv_pages, QuantizedKV) and kv_pages.pages.dtype == jnp.int8


def hadamard(head_dim: int) -> np.ndarray:
    """The orthonormal, symmetric [head_dim, head_dim] basis change (H @ H = I): Sylvester's Hadamard
    of the largest power of two b dividing head_dim, / sqrt(b), repeated on the diagonal (head_dim 96:
    three 32 x 32 blocks)."""
    block = head_dim & -head_dim  # the largest power of two dividing head_dim
    h = np.ones((1, 1))
    while h.shape[0] < block:
        h = np.block([[h, h], [h, -h]])
    return np.kron(np.eye(head_dim // block), h / np.sqrt(block)).astype(np.float32)


def rotate(x: Float[Array, "... head_dim"]) -> Float[Array, "... head_dim"]:
    """`x @ H` in float32, back in x's dtype; its own inverse (module doc)."""
    basis = jnp.asarray(hadamard(x.shape[-1]))
    return jnp.einsum("...h,hd->...d", x.astype(jnp.float32), basis).astype(x.dtype)


def values_as_float(values: Shaped[Array, "..."]) -> Float[Array, "..."]:
    """Stored values as float32: int8 converted, uint8 read as float8_e4m3fn bits."""
    if values.dtype == jnp.uint8:
        values = lax.bitcast_convert_type(values, jnp.float8_e4m3fn)
    return values.astype(jnp.float32)


def dequantize(values: Shaped[Array, "... head_dim"], scale: Float[Array, "..."], dtype=jnp.float32):
    """`values * scale` in `dtype` (float32 math)."""
    return (values_as_float(values) * scale[..., None].astype(jnp.float32)).astype(dtype)


def layer_pools(kv_pages, layer_idx):
    """Layer `layer_idx`'s K and V pools `[num_kv_heads, num_pages, page_size, head_dim]` as arrays
    (plain) or as QuantizedKV pools (pages and scales), for backends of the per-layer contract."""
    if isinstance(kv_pages, QuantizedKV):
        return (QuantizedKV(kv_pages.pages[layer_idx, 0], kv_pages.scales[layer_idx, 0]),
                QuantizedKV(kv_pages.pages[layer_idx, 1], kv_pages.scales[layer_idx, 1]))
    return kv_pages[layer_idx, 0], kv_pages[layer_idx, 1]


def dequantize_pool(pool, dtype=jnp.float32):
    """A per-layer pool as a float array (a QuantizedKV pool is dequantized; a float one passes)."""
    if isinstance(pool, QuantizedKV):
        return dequantize(pool.pages, pool.scales, dtype)
    return pool


def write_slots(kv_pages, index, new_kv: Float[Array, "num_tokens 2 num_kv_heads head_dim"]):
    """`kv_pages.at[index].set(new_kv, mode="drop")`, quantizing first if the cache is quantized.

    `index` selects [T, 2, K] slots (and the whole head_dim) of the pages."""
    if isinstance(kv_pages, QuantizedKV):
        values, scales = quantize(new_kv, "int8" if kv_pages.pages.dtype == jnp.int8 else "float8_e4m3fn")
        return QuantizedKV(kv_pages.pages.at[index].set(values, mode="drop"),
                           kv_pages.scales.at[index].set(scales, mode="drop"))
    return kv_pages.at[index].set(new_kv.astype(kv_pages.dtype), mode="drop")


def tree_bytes(kv_pages) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(kv_pages))
