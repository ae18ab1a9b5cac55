"""The Pallas kernels (interpret mode) with a sliding window against the reference with the same window.

Pages wholly before a sequence's window are what the planner frees (planner/sliding_window.py):
here their block-table entries point at the NaN padding page, so a kernel that reads one there
(instead of masking it or skipping its block) poisons the output. A run without the window on the
same case must differ: the window is really applied.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.ops.attention import chunked_paged_attention, reference_paged_attention
from pallas_kernels import decode_attention, paged_attention
from pallas_kernels.testing import make_case

oracle = jax.jit(reference_paged_attention, static_argnames=("scale", "soft_cap", "sliding_window"))
PAGE_SIZE, HEAD_DIM, WINDOW = 16, 64, 21  # a window boundary inside a page


def _case(seq_lens, q_lens, seed, num_padding_tokens=2):
    case = make_case(np.random.default_rng(seed), seq_lens=seq_lens, q_lens=q_lens, num_kv_heads=2, group=2,
                     head_dim=HEAD_DIM, page_size=PAGE_SIZE, dtype=np.float32, num_padding_tokens=num_padding_tokens)
    tables = case.block_tables.copy()
    for s, (n, q) in enumerate(zip(seq_lens, q_lens)):
        oldest_visible = n - q - WINDOW + 1  # of the sequence's first query token
        tables[s, : max(oldest_visible, 0) // PAGE_SIZE] = 0  # freed: the NaN padding page
    return case, tables


def _want(case, sliding_window):
    return np.asarray(oracle(case.q, case.oracle_k_pages, case.oracle_v_pages, case.oracle_block_tables,
                             case.seq_lens, case.query_start_loc, scale=HEAD_DIM**-0.5, sliding_window=sliding_window))


@pytest.mark.parametrize("soft_cap", [None, 2.0])
def test_ragged_kernel_and_chunked_reference_with_a_window(soft_cap):
    seq_lens, q_lens = [70, 5, 90, 40, 0], [1, 5, 30, 17, 0]  # decode, short prompt, long chunk, chunk
    case, tables = _case(seq_lens, q_lens, seed=0)
    want = np.asarray(oracle(case.q, case.oracle_k_pages, case.oracle_v_pages, case.oracle_block_tables,
                             case.seq_lens, case.query_start_loc, scale=HEAD_DIM**-0.5, soft_cap=soft_cap,
                             sliding_window=WINDOW))
    got = paged_attention(case.q, case.k_pages, case.v_pages, tables, case.seq_lens, case.query_start_loc,
                          scale=HEAD_DIM**-0.5, soft_cap=soft_cap, sliding_window=WINDOW, block_q=8,
                          pages_per_compute_block=1, interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
    chunked = chunked_paged_attention(*map(jnp.asarray, (case.q, case.k_pages, case.v_pages, tables, case.seq_lens,
                                                         case.query_start_loc)), scale=HEAD_DIM**-0.5, soft_cap=soft_cap,
                                      sliding_window=WINDOW, pages_per_chunk=2)
    np.testing.assert_allclose(np.asarray(chunked), want, atol=1e-5, rtol=1e-5)
    assert np.abs(want - _want(case, None)).max() > 1e-3  # the window changes the result


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_with_a_window(num_splits):
    seq_lens = [70, 5, 90, 21, 22]
    case, tables = _case(seq_lens, [1] * len(seq_lens), seed=1, num_padding_tokens=0)
    want = _want(case, WINDOW)
    got = decode_attention(case.q, case.k_pages, case.v_pages, tables, case.seq_lens, scale=HEAD_DIM**-0.5,
                           sliding_window=WINDOW, num_splits=num_splits, pages_per_compute_block=1,
                           interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
    assert np.abs(want - _want(case, None)).max() > 1e-3


@pytest.mark.slow  # interpret mode through the whole model: minutes on a shared CPU
def test_gemma2_model_on_the_pallas_backend_matches_hf(tiny_hf_model, hf_logits):
    """Local and global layers (lax.cond between a windowed and a plain kernel call), soft caps, and
    the decode kernel in a decode-only step, all through the model on the Pallas backend."""
    import pallas_kernels
    from conftest import make_scheduler_output, make_seq

    from jaxpaged.device.runner import ModelRunner
    from jaxpaged.models import ModelConfig, params_from_hf

    hf_config, _, state_dict = tiny_hf_model("gemma2")
    config = ModelConfig.from_hf(hf_config, dtype="float32")
    runner = ModelRunner(config, params_from_hf(config, state_dict), num_pages=12, page_size=4, max_num_seqs=1,
                         max_num_batched_tokens=16, max_model_len=32, buckets=(16,), decode_buckets=(1,),
                         attention_fn=pallas_kernels.paged_attention_from_buffer)
    token_ids = np.random.default_rng(4).integers(0, 256, size=15)  # window 8: the prompt is past it
    expected = hf_logits("gemma2", token_ids)
    seq = make_seq(token_ids, block_table=[3, 1, 7, 2])
    prefill = np.asarray(runner.run(make_scheduler_output([seq], [14])))[0]
    seq.num_computed_tokens = 14
    decode = np.asarray(runner.run(make_scheduler_output([seq], [1])))[0]  # decode-only: the decode kernel
    np.testing.assert_allclose(prefill, expected[13], atol=1e-4, rtol=0)
    np.testing.assert_allclose(decode, expected[14], atol=1e-4, rtol=0)
