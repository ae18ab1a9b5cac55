"""The attention backend an engine runs, chosen by name (EngineConfig.attention_backend).

    "reference"  plain jnp, reads every slot a block table can address (the oracle; ops/attention.py)
    "chunked"    jnp over the pages the batch's longest context needs (the CPU default)
    "pallas"     the Triton-backend Pallas kernels over the whole KV buffer (the GPU default)
    "mosaic"     the Hopper (wgmma/TMA) Mosaic GPU kernels, bfloat16 pages only

The Pallas kernels run compiled when the step is lowered for a GPU and in Pallas's interpreter
when lowered for anything else: the target decides, not the host (pallas_kernels._common.by_target).
"""

from __future__ import annotations


def attention_fn(backend: str):
    if backend == "reference":
        from jaxpaged.ops.attention import reference_paged_attention

        return reference_paged_attention
    if backend == "chunked":
        from jaxpaged.ops.attention import chunked_paged_attention_from_buffer

        return chunked_paged_attention_from_buffer
    if backend == "mosaic":  # Hopper wgmma/TMA kernels, whole-buffer form; GPU interpret mode elsewhere
        from pallas_kernels.mosaic import paged_attention_from_buffer

        return paged_attention_from_buffer  # the decode kernel in decode-only steps, else the ragged one
    if backend == "pallas":
        import pallas_kernels

        # The whole-buffer kernels (no per-layer pool copies), the decode kernel in decode-only steps;
        # interpret=None: compiled on a GPU, interpreted elsewhere.
        return pallas_kernels.paged_attention_from_buffer
    raise ValueError(f"attention_backend={backend!r}: resolve 'auto' first (EngineConfig.resolved)")
