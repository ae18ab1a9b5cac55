"""Batch invariance (EngineConfig.batch_invariant, vLLM's VLLM_BATCH_INVARIANT=1): a request's tokens and
logprobs bit for bit the same whatever else runs with it.

Every float sum the step takes for one token must run in an order fixed by that token alone, never
by the step's shape. On the CPU path that holds when

    projections   ops/cpu/dense_matmul.cc          per output, k in groups of 64 split over the
                                                   threads by K only; rows never interact
    attention     ops/cpu/ragged_attention.cc      pages up to the token's own, in order, one online
                  in every step (decode included)   softmax update each; the decode kernel orders its
                                                   sums otherwise, so it is not used
    LM head       models/llama.py invariant_lm_head  XLA's dot on tiles of exactly HEAD_TILE rows (a
                                                   loop over tiles): one compiled shape, whose sums do
                                                   not depend on a row's place in the tile
    the rest      norms, RoPE, residuals: per-row reductions and elementwise ops, the same program
                  shape-independent in XLA:CPU (tests/test_batch_invariant.py checks whole steps)
    logprobs      the sampler's log_softmax sums by ops/ordered_sum.py, as the trainer's
    sampler       per-row draws from (seed, step) already (sample/sampler.py)

so a token computed in a decode step, in a prompt chunk (any chunking), recomputed after preemption,
or served from the prefix cache, is the same bits in every bucket, batch and replica. What does not
meet those conditions is refused here, with what to change, rather than run varying:
GPUs (see below), bfloat16, a
quantized KV cache or GGUF codes, tensor parallelism, MoE (`ragged_dot` sums by group sizes),
attention soft-capping (the kernels do not take it), widths the kernels do not take.

On a GPU, what is ready and what is not (interpret mode on the CPU, f32; no GPU run):
    attention   the Pallas ragged kernel (pallas_kernels/ragged.py) in every step: a row's output is
                the same bits in any batch and chunk mix (fixed key blocks from page 0; a test);
                the decode kernel is not: its splits come from the batch (decode_plan.py), and even
                at a fixed split count the combine's sum over splits changed a row between batch 1
                and 64 (measured, 1 ulp)
    GEMMs       not ready: XLA:GPU chooses cuBLAS or Triton and their tiles and split-K by the row
                count; a GEMM with tiles fixed whatever the rows (a Pallas matmul, K in fixed
                blocks) would have to run every projection and the LM head
    the rest    the ordered sums (ops/ordered_sum.py) are elementwise ops, unchecked under
                XLA:GPU's fusion; bfloat16 weights and pages are refused on every platform
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxpaged.models.config import ModelConfig


def invariant_attention_fn(backend: str, platform: str | None = None):
    """The attention backend of batch-invariant mode: on the CPU, the ragged kernel in every step.
    "pallas" with platform "cuda"/"gpu": the Pallas ragged kernel in every step (decode-only steps
    included), the attention a GPU mode would run; only the static profile compiles it, since the
    runner refuses batch_invariant on a GPU (the GEMMs, above)."""
    if backend == "pallas":
        if platform not in ("cuda", "gpu"):
            raise ValueError("batch_invariant=True with attention_backend='pallas' is the GPU's attention, compiled "
                             "for a GPU (platform='cuda'); on the CPU use 'chunked' (the trainer's forward, "
                             "jaxpaged.rl.token_logprobs, runs the CPU's ragged kernel)")
        return _pallas_ragged_every_step()
    if backend != "chunked":
        raise ValueError(f"batch_invariant=True runs the CPU's ragged attention kernel in every step; "
                         f"attention_backend={backend!r} is not batch-invariant: use 'chunked' (or 'auto' on a CPU)")
    from jaxpaged.ops import cpu_attention
    from jaxpaged.ops.attention import chunked_paged_attention_from_buffer

    kernels = cpu_attention.enabled_kernels()
    if cpu_attention.RAGGED not in kernels:
        raise ValueError("batch_invariant=True needs the CPU ragged attention kernel (ops/cpu/ragged_attention.cc): "
                         "a C++ compiler (set CXX) and JAXPAGED_CPU_KERNELS allowing ragged_attention")
    return cpu_attention.with_cpu_kernels(chunked_paged_attention_from_buffer, kernels, one_path=True)


def _pallas_ragged_every_step():
    from pallas_kernels.ragged import ragged_paged_attention_from_buffer

    def attention(q, kv_pages, block_tables, seq_lens, query_start_loc, *, layer_idx, scale, soft_cap=None,
                  sliding_window=None):
        return ragged_paged_attention_from_buffer(q, kv_pages, block_tables, seq_lens, query_start_loc,
                                                  layer_idx=layer_idx, scale=scale, soft_cap=soft_cap,
                                                  sliding_window=sliding_window, interpret=False)

    attention.reads_whole_kv_buffer = True  # the model passes the whole buffer and a layer index
    attention.one_path = True  # no decode kernel: the model never passes decode_only
    return attention


def check_batch_invariant(config: ModelConfig, *, platform: str, matmul_kernels: frozenset, one_attention_path: bool,
                          kv_cache_dtype: str, page_size: int, sharded: bool) -> None:
    """ValueError naming what keeps this runner from being batch-invariant, and what to change."""
    def refuse(what: str) -> None:
        raise ValueError(f"batch_invariant=True: {what}")

    if platform != "cpu":
        refuse(f"implemented on the CPU path only; on {platform!r} XLA picks each projection's and the LM head's "
               "GEMM (library, tiles, split-K) by the number of rows, so a token's sums change with the batch, "
               "and the Pallas decode kernel plans its context splits from the batch. Run on the CPU or leave it off")
    if sharded:
        refuse("tensor parallelism sums partial products across devices; use tensor_parallel_size=1 "
               "(data_parallel_size replicas are fine)")
    if jnp.dtype(config.dtype) != jnp.float32:
        refuse(f"the invariant kernels multiply float32; pass dtype='float32' (got {config.dtype})")
    if kv_cache_dtype != "auto":
        refuse(f"kv_cache_dtype={kv_cache_dtype!r}: the ragged kernel reads float32 pages; use 'auto'")
    if config.num_experts:
        refuse("MoE layers (ragged_dot sums by expert group sizes) are not batch-invariant yet")
    if config.attn_soft_cap is not None:
        refuse("attention soft-capping runs XLA's chunked path, whose sums depend on the step; not supported")
    if "dense_matmul" not in matmul_kernels:
        refuse("the dense_matmul CPU kernel must multiply every projection: float32 weights (no GGUF codes: "
               "quantization='dequantize' or None), a C++ compiler, JAXPAGED_CPU_KERNELS allowing dense_matmul")
    widths = {"hidden_size": config.hidden_size, "num_heads * head_dim": config.num_heads * config.head_dim,
              "num_kv_heads * head_dim": config.num_kv_heads * config.head_dim,
              "intermediate_size": config.intermediate_size, "head_dim": config.head_dim}
    odd = {name: width for name, width in widths.items() if width % 16}
    if odd:
        refuse(f"the kernels take widths that are multiples of 16; this model has {odd}")
    if page_size > 16:
        refuse(f"page_size={page_size}: the ragged kernel scores a page as one 16-lane vector; use <= 16")
    if not one_attention_path:
        refuse("the attention backend must run one kernel in every step: build it with "
               "jaxpaged.device.backends.attention_fn('chunked', batch_invariant=True)")
