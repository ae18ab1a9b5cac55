"""Static per-channel centring of an int8 KV cache, calibrated once when the runner starts.

An int8 page stores `k - mu_k` and `v - mu_v` instead of k and v, with fixed vectors
`kv_centres [num_layers, 2, num_kv_heads, head_dim]` (axis 1: mu_k, mu_v). In float this changes
nothing:

    keys:    q . (k_j - mu_k) = q . k_j - q . mu_k   the same shift for every key j of a query,
             so softmax_j is unchanged (not where scores are not shift-invariant: attention logit
             soft-capping, Gemma 2; there mu_k = 0)
    values:  sum_j p_j (v_j - mu_v) + mu_v = sum_j p_j v_j   (the weights p_j sum to 1)

The model (`models/llama.py`) subtracts the centres from the step's K/V before writing and
attending, and adds mu_v back to the attention output (each query head gets its KV head's mu_v).
Backends, kernels and the page format do not change, and pages stay write-once.

What it buys: the outlier channels of post-RoPE keys (and of values) are mostly a constant
offset. Taking it out shrinks the per-token amax that sets an int8 scale, so the other channels
keep more int8 steps (measured: 79.0% -> 91.5% of greedy tokens equal to a float32 cache's,
DESIGN.md's quantized-KV section). fp8 is not centred: there it lowered the next-token KL
(a fake-quantized study of the 12 chat prompts: 1.0e-2 / 8.8e-3 at prefill / first decode, against 1.7e-2 /
1.3e-2) but also the greedy agreement (an engine run with fp8 centred: 56.8% -> 39.4%).

Calibration: the model's own K/V, from an "auto" (model-dtype) cache, on `CALIBRATION_NUM_TOKENS`
token ids drawn uniformly from the vocabulary with numpy's default_rng(CALIBRATION_SEED). It is
deterministic and needs no tokenizer. The mean skips position 0, the attention-sink token whose
K/V are far from every other token's. The centres stay fixed for the runner's life; `update_params`
keeps them, since pages written under one mu must be read under the same mu, and any mu is exact
in float.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from jaxpaged.models.config import ModelConfig
from jaxpaged.models.llama import CausalLM
from jaxpaged.ops.kv_quant import check_kv_cache_dtype

CALIBRATION_NUM_TOKENS = 256
CALIBRATION_SEED = 0
_PAGE_SIZE = 16
CENTRED_DTYPES = ("int8",)  # the kv_cache_dtypes whose pages hold centred K/V (module doc)


def calibration_token_ids(vocab_size: int) -> np.ndarray:
    return np.random.default_rng(CALIBRATION_SEED).integers(0, vocab_size, CALIBRATION_NUM_TOKENS, dtype=np.int32)


def calibration_kv(config: ModelConfig, params, reduce=lambda kv: kv) -> Float[Array, "num_layers 2 num_kv_heads ..."]:
    """The model's own post-RoPE K/V `[num_layers, 2, num_kv_heads, tokens, head_dim]` (float32) on the
    calibration tokens, position 0 (the sink) left out, passed through `reduce` in the same program.

    `params` as the runner serves them (stacked or one tree per layer; placed for tensor
    parallelism, where `config` is the model as the devices see it)."""
    c, num_tokens = config, CALIBRATION_NUM_TOKENS
    num_pages = num_tokens // _PAGE_SIZE
    # Pages 1..num_pages hold the sequence (page 0 is the padding page); [L, 2, K, 1 + P, ps, H].
    kv_pages = jnp.zeros((c.num_layers, 2, c.num_kv_heads, 1 + num_pages, _PAGE_SIZE, c.head_dim), c.dtype)
    positions = jnp.arange(num_tokens, dtype=jnp.int32)

    def forward(params, kv_pages, token_ids):
        _, kv_pages = CausalLM(c).apply(
            params, kv_pages, token_ids, positions, positions + _PAGE_SIZE,  # slot = page 1 onwards
            jnp.arange(1, 1 + num_pages, dtype=jnp.int32)[None], jnp.array([num_tokens], jnp.int32),
            jnp.array([0, num_tokens], jnp.int32), jnp.array([num_tokens - 1], jnp.int32))
        kv = kv_pages[:, :, :, 1:].reshape(c.num_layers, 2, c.num_kv_heads, num_tokens, c.head_dim)
        return reduce(kv[:, :, :, 1:].astype(jnp.float32))  # position 0 (the sink) left out

    return jax.jit(forward)(params, kv_pages, jnp.asarray(calibration_token_ids(c.vocab_size)))


def calibrate_kv_centres(config: ModelConfig, params, kv_cache_dtype: str, *, abstract: bool = False
                         ) -> Float[Array, "num_layers 2 num_kv_heads head_dim"] | None:
    """The centres for a `kv_cache_dtype` cache (float32); None for one not in CENTRED_DTYPES.

    `params` as for `calibration_kv`. `abstract`: params are jax.ShapeDtypeStructs (a compile-only
    runner) and so is the result."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype not in CENTRED_DTYPES:
        return None
    c = config
    if abstract:
        return jax.ShapeDtypeStruct((c.num_layers, 2, c.num_kv_heads, c.head_dim), jnp.float32)
    centres = calibration_kv(config, params, lambda kv: kv.mean(axis=3))
    if c.attn_soft_cap is not None:  # soft-capped scores are not shift-invariant: mu_k = 0
        centres = centres.at[:, 0].set(0.0)
    return centres
