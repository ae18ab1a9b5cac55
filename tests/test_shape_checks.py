"""The test suite runs with jaxtyping's run-time shape checks on (pyproject addopts:
`--jaxtyping-packages=jaxpaged,pallas_kernels,beartype.beartype`). If that flag is dropped or stops
working, annotations are decoration again: these tests fail."""

import jax.numpy as jnp
import jaxtyping
import pytest

from jaxpaged.ops.attention import reference_paged_attention


def _attention_args(q_head_dim=8, num_seqs=1, num_starts=2):
    q = jnp.zeros((3, 4, q_head_dim), jnp.float32)  # num_tokens=3 num_heads=4 head_dim
    k = v = jnp.zeros((2, 5, 4, 8), jnp.float32)  # num_kv_heads=2 num_pages=5 page_size=4 head_dim=8
    block_tables = jnp.zeros((num_seqs, 2), jnp.int32)
    seq_lens = jnp.full((num_seqs,), 3, jnp.int32)
    return q, k, v, block_tables, seq_lens, jnp.array([0, 3, 3][:num_starts], jnp.int32)


def test_a_well_shaped_call_passes():
    out = reference_paged_attention(*_attention_args(), scale=1.0)
    assert out.shape == (3, 4, 8)


def test_head_dim_mismatch_between_q_and_pages_is_a_type_check_error():
    with pytest.raises(jaxtyping.TypeCheckError, match="head_dim"):
        reference_paged_attention(*_attention_args(q_head_dim=16), scale=1.0)


def test_wrong_dtype_is_a_type_check_error():
    q, k, v, block_tables, seq_lens, starts = _attention_args()
    with pytest.raises(jaxtyping.TypeCheckError, match="block_tables"):
        reference_paged_attention(q, k, v, block_tables.astype(jnp.float32), seq_lens, starts, scale=1.0)
