"""The trainer's policy forward: each token's log-probability under the model, computed by the engine's
own model code and kernels, so that in batch-invariant mode it equals the sampler's bit for bit.

    token_logprobs(params, model_config, sequences [B, T], starts [B]) -> [B, T]

    rows       each row one sequence (prompt + completion, right-padded), laid out on pages of its own
               (`page_size` tokens, as the engine's pool), all T tokens one prefill chunk
    the model  models/llama.py CausalLM: the engine's step over a fresh KV buffer; on the CPU with the
               engine's kernels (dense_matmul projections, the ragged attention kernel, the invariant
               LM head), whose arithmetic for a token does not depend on the batch
    the end    log_softmax(logits / temperature) at each next token: the sampler's processed logprob
               (sample/sampler.py sample_ext, logprobs_mode="processed_logprobs"; at temperature 1, or
               for greedy rows, also "raw_logprobs")

An engine with `batch_invariant=True` computes every token of every request with this arithmetic
(device/batch_invariant.py), so `token_logprobs` of its rollouts equals the logprobs it returned:
on-policy importance ratios are exactly 1. Differentiable: the kernels' backward passes are XLA's
(ops/dense_matmul.py, ops/cpu_attention.py), the forward stays the engine's.

Off the CPU (or without the kernels) the same model code runs XLA's ops and the reference attention:
differentiable and correct, equal to the engine up to float rounding only.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.models.config import ModelConfig
from jaxpaged.models.llama import CausalLM
from jaxpaged.ops import cpu_attention, dense_matmul
from jaxpaged.ops.attention import reference_paged_attention
from jaxpaged.ops.ordered_sum import ordered_log_softmax
from jaxpaged.sample.sampler import GREEDY_TEMPERATURE


def token_logprobs(params, model_config: ModelConfig, sequences, starts, *, lengths=None, temperature: float = 1.0,
                   page_size: int = 16) -> jax.Array:
    """log p(sequences[b, t] | sequences[b, :t]) under softmax(logits / temperature), for
    starts[b] <= t < lengths[b]; 0 elsewhere.

    Args:
      params: the canonical parameter tree (`llm.params`, or a trainer's copy of it).
      model_config: the engine's model (`llm.model_config`).
      sequences: int32 [B, T], each row prompt + completion, right-padded.
      starts: int32 [B], each row's first scored position (its prompt length; >= 1).
      lengths: int32 [B] or None (T): each row's tokens; positions at or past it give 0.
      temperature: the rollouts' temperature (what "processed_logprobs" reports); below 1e-5 it is
        greedy, whose logprobs are the model's own (temperature 1), as the sampler reports them.
      page_size: the engine's page size (`llm.config.page_size`): the attention kernel sums a
        token's keys page by page, so only the engine's page size gives its bits.

    Returns float32 [B, T]. Pure and jittable (shapes static, values traced); differentiable in params.
    """
    sequences = jnp.asarray(sequences, jnp.int32)
    num_rows, num_tokens = sequences.shape
    starts = jnp.asarray(starts, jnp.int32)
    lengths = jnp.full((num_rows,), num_tokens, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    if model_config.attn_soft_cap is not None or model_config.num_experts:
        raise ValueError("token_logprobs: attention soft-capping and MoE layers are not supported "
                         "(neither is the engine's batch_invariant mode)")
    logits = _all_logits(params, model_config, sequences, page_size)  # [B, T, V] float32
    # Row b's token t is scored by the logits at t - 1 (the sampler divides, then log_softmax: the same ops).
    scale = temperature if temperature >= GREEDY_TEMPERATURE else 1.0
    logprobs = ordered_log_softmax(logits[:, :-1] / jnp.float32(scale))  # [B, T-1, V], the sampler's sums
    chosen = jnp.take_along_axis(logprobs, sequences[:, 1:, None], axis=-1)[..., 0]  # [B, T-1]
    chosen = jnp.pad(chosen, ((0, 0), (1, 0)))  # [B, T]: position 0 has no logprob
    position = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    scored = (position >= jnp.maximum(starts, 1)[:, None]) & (position < lengths[:, None])
    return jnp.where(scored, chosen, 0.0)


def _all_logits(params, config: ModelConfig, sequences, page_size: int):
    """float32 logits [B, T, V] at every position: one prefill step of all rows over a fresh KV buffer."""
    num_rows, num_tokens = sequences.shape
    pages_per_row = math.ceil(num_tokens / page_size)
    num_pages = 1 + num_rows * pages_per_row  # page 0: the padding page
    #   row b owns pages 1 + b * pages_per_row ..; token t of row b is at slot page(t // page_size) * page_size + t % page_size
    block_tables = 1 + np.arange(num_rows * pages_per_row, dtype=np.int32).reshape(num_rows, pages_per_row)
    t = np.arange(num_tokens)
    slot_mapping = (block_tables[:, t // page_size] * page_size + t % page_size).reshape(-1)  # [B * T]
    positions = np.tile(t, num_rows).astype(np.int32)
    seq_lens = np.full(num_rows, num_tokens, np.int32)
    query_start_loc = (np.arange(num_rows + 1) * num_tokens).astype(np.int32)
    logits_indices = np.arange(num_rows * num_tokens, dtype=np.int32)
    dtype = jnp.dtype(config.dtype)
    kv_pages = jnp.zeros((config.num_layers, 2, config.num_kv_heads, num_pages, page_size, config.head_dim), dtype)
    kernels = _kernels_run(config, page_size)
    model = CausalLM(config, _ragged_attention if kernels else reference_paged_attention,
                     matmul_kernels=frozenset({dense_matmul.NAME}) if kernels else frozenset(),
                     batch_invariant=True, kernels_read_stack=False)
    ints = [jnp.asarray(a, jnp.int32) for a in (positions, slot_mapping, block_tables, seq_lens, query_start_loc,
                                                logits_indices)]
    logits, _ = model.apply(params, kv_pages, sequences.reshape(-1), *ints)
    return logits.reshape(num_rows, num_tokens, -1)


def _kernels_run(config: ModelConfig, page_size: int) -> bool:
    """Whether the engine's CPU kernels compute this forward (XLA:CPU, float32, both kernels built)."""
    return (jax.default_backend() == "cpu" and jnp.dtype(config.dtype) == jnp.float32
            and page_size <= cpu_attention.MAX_PAGE_SIZE
            and config.head_dim % 16 == 0 and dense_matmul.available() and cpu_attention.available()
            and cpu_attention.RAGGED in cpu_attention.enabled_kernels())


def _ragged_attention(q, kv_pages, block_tables, seq_lens, query_start_loc, *, layer_idx, scale, sliding_window=None,
                      decode_only=False, sinks=None):
    """The engine's batch-invariant attention (the ragged kernel), called directly: its backward is the
    reference's, where the engine's wrapper would also offer XLA's chunked path (not differentiable)."""
    del decode_only  # one kernel for every token
    return cpu_attention.paged_ragged_attention(q, kv_pages, block_tables, seq_lens, query_start_loc,
                                                layer_idx=layer_idx, scale=scale, sliding_window=sliding_window,
                                                sinks=sinks).astype(q.dtype)


_ragged_attention.reads_whole_kv_buffer = True  # called with the whole buffer and a layer index (models/llama.py)
