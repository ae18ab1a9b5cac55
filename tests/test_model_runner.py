"""ModelRunner and prepare_step_input: padding and slot arithmetic, no recompilation after warmup,
donation of the KV buffer, copy-on-write page copies, weight swaps."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_scheduler_output, make_seq

from jaxpaged.device.kv_cache import num_pages_for_budget
from jaxpaged.device.runner import (
    ModelRunner,
    StepInput,
    default_buckets,
    pack_step_input,
    prepare_step_input,
)
from jaxpaged.models import ModelConfig, init_params

TINY = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
)


@pytest.fixture(scope="module")
def tiny_params():
    return init_params(TINY, jax.random.key(0))


def _runner(params, **overrides):
    kwargs = dict(num_pages=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                  buckets=(8, 16, 32))
    kwargs.update(overrides)
    return ModelRunner(TINY, params, **kwargs)


# --- prepare_step_input: the host half -----------------------------------------------------------


def test_prepare_step_input_worked_example():
    # The docstring's example: page_size 4; A has 5 tokens cached and prefills 3 more, B decodes.
    seq_a = make_seq([10, 11, 12, 13, 14, 15, 16, 17], num_computed_tokens=5, block_table=[2, 7])
    seq_b = make_seq(list(range(20, 30)), num_computed_tokens=9, block_table=[4, 9, 1])
    step = prepare_step_input(
        make_scheduler_output([seq_a, seq_b], [3, 1]),
        page_size=4, num_pages=10, pages_per_seq=4, max_num_seqs=3, buckets=(2, 8, 16),
    )
    # 4 tokens -> bucket 8 -> 8 token rows and min(8, max_num_seqs=3) = 3 sequence rows.
    np.testing.assert_array_equal(step.token_ids, [15, 16, 17, 29, 0, 0, 0, 0])
    np.testing.assert_array_equal(step.positions, [5, 6, 7, 9, 0, 0, 0, 0])
    # A: page 7 offsets 1..3 -> slots 29..31; B: position 9 -> page 1 offset 1 -> slot 5;
    # padding -> num_pages * page_size = 40, out of range.
    np.testing.assert_array_equal(step.slot_mapping, [29, 30, 31, 5, 40, 40, 40, 40])
    np.testing.assert_array_equal(step.block_tables, [[2, 7, 0, 0], [4, 9, 1, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(step.seq_lens, [8, 10, 0])
    np.testing.assert_array_equal(step.query_start_loc, [0, 3, 4, 4])
    np.testing.assert_array_equal(step.logits_indices, [2, 3, 0])
    for array in jax.tree.leaves(step):
        assert array.dtype == np.int32


def test_prepare_step_input_says_what_is_wrong():
    seq = make_seq(range(9), num_computed_tokens=0, block_table=[1, 2])  # 2 pages = 8 slots
    kwargs = dict(page_size=4, num_pages=10, pages_per_seq=4, max_num_seqs=2, buckets=(8, 16))
    with pytest.raises(ValueError, match="needs 9 slots but its block table has 2 pages"):
        prepare_step_input(make_scheduler_output([seq], [9]), **kwargs)
    seq.block_table = [1, 2, 3]
    with pytest.raises(ValueError, match="9 tokens exceed the largest bucket 8"):
        prepare_step_input(make_scheduler_output([seq], [9]), **{**kwargs, "buckets": (8,)})
    with pytest.raises(ValueError, match="3 sequences exceed max_num_seqs=2"):
        prepare_step_input(make_scheduler_output([seq] * 3, [1, 1, 1]), **kwargs)


def test_default_buckets_are_powers_of_two_up_to_the_token_budget():
    assert default_buckets(256) == (16, 32, 64, 128, 256)
    assert default_buckets(100, smallest=8) == (8, 16, 32, 64, 100)


# --- the device step -----------------------------------------------------------------------------


class _Pages:
    """Hands each sequence its own run of pages, growing its block table as it advances."""

    def __init__(self):
        self.next_page = 1

    def grow(self, seq, num_new, page_size=4):
        while len(seq.block_table) * page_size < seq.num_computed_tokens + num_new:
            seq.block_table.append(self.next_page)
            self.next_page += 1


def _run(runner, pages, pairs, copies=()):
    for seq, n in pairs:
        pages.grow(seq, n)
    logits = runner.run(make_scheduler_output([s for s, _ in pairs], [n for _, n in pairs], copies))
    for seq, n in pairs:
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == len(seq.token_ids):
            seq.token_ids.append(int(jnp.argmax(logits[[s for s, _ in pairs].index(seq)])))
    return np.asarray(logits)


def test_no_recompilation_after_warmup(tiny_params):
    runner = _runner(tiny_params)
    runner.warmup()
    # Two programs per token bucket (8, 16, 32; with and without prompt logprobs) and one per decode
    # bucket (1, 2, 4 sequences).
    assert runner.decode_buckets == (1, 2, 4)
    assert (runner.num_compiles, runner.num_copy_compiles) == (2 * len(runner.buckets) + 3, 1)
    compiled = runner.num_compiles

    pages, rng = _Pages(), np.random.default_rng(0)
    a, b, c = (make_seq(rng.integers(0, 64, size=n)) for n in (13, 20, 5))
    _run(runner, pages, [(a, 13)])  # bucket 16, one sequence
    _run(runner, pages, [(a, 1), (b, 20)])  # bucket 32, decode + long prefill
    _run(runner, pages, [(a, 1), (b, 1), (c, 5)])  # bucket 8, three sequences
    _run(runner, pages, [(c, 1), (a, 1), (b, 1)], copies=[(1, 60), (2, 61)])  # with page copies
    for _ in range(5):
        _run(runner, pages, [(a, 1), (b, 1), (c, 1)])  # context lengths grow across page boundaries
    assert (runner.num_compiles, runner.num_copy_compiles) == (compiled, 1)

    # The counter is honest: a shape outside the buckets does compile, and is counted.
    odd = runner.dummy_step_input(12)
    runner.execute(odd)
    assert runner.num_compiles == compiled + 1
    assert jax.config.jax_compilation_cache_dir  # the persistent cache is on


def test_kv_buffer_is_donated_and_never_duplicated(tiny_params):
    # A pool much bigger than everything else in the step, so that a second copy would show.
    runner = _runner(tiny_params, num_pages=4096, page_size=16, buckets=(16,), max_num_batched_tokens=16)
    buffer_bytes = runner.kv_cache_bytes()
    assert buffer_bytes == 2 * 2 * 2 * 4096 * 16 * 16 * 4  # layers, K/V, kv heads, pages, slots, head_dim, f32

    step = runner.dummy_step_input(16)
    memory = runner.trace_step(step).lower().compile().memory_analysis()
    assert memory.alias_size_in_bytes == buffer_bytes  # the output buffer is the input buffer
    assert memory.temp_size_in_bytes < buffer_bytes / 10

    old = runner.kv_pages
    runner.execute(step)
    assert old.is_deleted() and not runner.kv_pages.is_deleted()
    old = runner.kv_pages
    runner.copy_pages([(1, 2)])
    assert old.is_deleted()


def test_copy_pages_copies_whole_pages_and_nothing_else(tiny_params):
    runner = _runner(tiny_params, num_pages=8)
    before = np.arange(np.prod(runner.kv_pages.shape), dtype=np.float32).reshape(runner.kv_pages.shape)
    runner.kv_pages = jnp.asarray(before)
    copies = [(3, 5), (1, 2), (4, 6), (7, 1), (2, 7)]  # 5 copies > max_num_seqs = 4: two batches
    runner.copy_pages(copies)
    after = np.asarray(runner.kv_pages)
    expected = before.copy()
    for src, dst in copies[:4]:
        expected[:, :, :, dst] = before[:, :, :, src]
    expected[:, :, :, 7] = expected[:, :, :, 2]  # the second batch sees the first batch's result
    np.testing.assert_array_equal(after, expected)


def test_copy_on_write_before_the_step(tiny_params):
    # A prefills 6 tokens into pages [1, 2]. B forks A: it shares page 1, and its copy of the
    # half-full page 2 is page 3. B's decode must see A's K/V through the copy.
    runner = _runner(tiny_params)
    runner.kv_pages = jnp.full_like(runner.kv_pages, jnp.nan)
    prompt = [5, 9, 2, 33, 17, 8]
    a = make_seq(prompt + [40], num_computed_tokens=0, block_table=[1, 2])
    runner.run(make_scheduler_output([a], [6]))
    b = make_seq(prompt + [40], num_computed_tokens=6, block_table=[1, 3])
    logits_b = np.asarray(runner.run(make_scheduler_output([b], [1], copies=[(2, 3)])))[0]
    a.num_computed_tokens = 6
    logits_a = np.asarray(runner.run(make_scheduler_output([a], [1])))[0]
    assert np.isfinite(logits_b).all()
    np.testing.assert_allclose(logits_b, logits_a, atol=1e-6)


def test_update_params_changes_logits_without_recompiling(tiny_params):
    runner = _runner(tiny_params, buckets=(8,), max_num_batched_tokens=8)
    seq = make_seq([3, 1, 4, 1, 5], block_table=[1, 2])
    logits_before = np.asarray(runner.run(make_scheduler_output([seq], [5])))
    compiled = runner.num_compiles

    runner.update_params(init_params(TINY, jax.random.key(1)))
    logits_after = np.asarray(runner.run(make_scheduler_output([seq], [5])))
    assert runner.num_compiles == compiled
    assert np.abs(logits_after - logits_before).max() > 1e-3

    wrong = init_params(dataclasses.replace(TINY, intermediate_size=32), jax.random.key(2))
    with pytest.raises(ValueError, match=r"has shape \(.*32.*\), expected \(.*64.*\)"):
        runner.update_params(wrong)


def test_update_params_owns_a_copy_and_names_the_bad_leaf(tiny_params):
    """A training loop may delete or donate its arrays after update_params: the runner keeps its
    own copy. Bad params name their leaf and leave the current weights in place."""
    runner = _runner(tiny_params, buckets=(8,), max_num_batched_tokens=8)
    seq = make_seq([3, 1, 4, 1, 5], block_table=[1, 2])
    new = init_params(TINY, jax.random.key(1))
    reference = np.asarray(_runner(jax.tree.map(jnp.copy, new), buckets=(8,), max_num_batched_tokens=8)
                           .run(make_scheduler_output([seq], [5])))
    runner.update_params(new)
    for x in jax.tree.leaves(new):
        x.delete()  # what a donating optimizer step does to the caller's buffers
    np.testing.assert_array_equal(np.asarray(runner.run(make_scheduler_output([seq], [5]))), reference)

    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(tiny_params)[0]]
    leaves, treedef = jax.tree.flatten(tiny_params)
    as_int = jax.tree.unflatten(treedef, [x.astype(jnp.int32) if i == 1 else x for i, x in enumerate(leaves)])
    with pytest.raises(ValueError, match=rf"param {re.escape(paths[1])} has dtype int32; weights must be floating"):
        runner.update_params(as_int)
    reshaped = jax.tree.unflatten(treedef, [x[..., :1] if i == 2 else x for i, x in enumerate(leaves)])
    with pytest.raises(ValueError, match=rf"param {re.escape(paths[2])} has shape .*, expected {re.escape(str(leaves[2].shape))}"):
        runner.update_params(reshaped)
    missing = jax.tree.unflatten(treedef, leaves)
    if isinstance(missing, dict):
        missing = dict(missing)
        dropped = sorted(missing)[0]
        missing.pop(dropped)
        with pytest.raises(ValueError, match="missing"):
            runner.update_params(missing)
    np.testing.assert_array_equal(np.asarray(runner.run(make_scheduler_output([seq], [5]))), reference)


def test_num_pages_for_budget():
    per_page = 2 * 2 * 2 * 4 * 16 * 4  # layers, K/V, kv heads, page_size 4, head_dim, float32 bytes
    assert num_pages_for_budget(TINY, page_size=4, budget_bytes=10 * per_page + per_page - 1) == 10
    with pytest.raises(ValueError, match="at least 2 are needed"):
        num_pages_for_budget(TINY, page_size=4, budget_bytes=per_page)


def test_step_input_is_a_pytree_of_its_eight_arrays_and_packs_into_one():
    # Field i holds i; num_tokens = num_seqs = 2, block_tables is [num_seqs, pages_per_seq=1].
    step = StepInput(*(np.full((2, 1) if i == 3 else 2, i, np.int32) for i in range(8)))
    leaves, treedef = jax.tree.flatten(step)
    assert [int(x.flat[0]) for x in leaves] == list(range(8))
    assert jax.tree.unflatten(treedef, leaves).prev_token_rows is leaves[7]
    packed, layout = pack_step_input(step)
    assert packed.tolist() == [i for i in range(8) for _ in range(2)]
    assert [name for name, _ in layout][-1] == "prev_token_rows"
    assert [shape for _, shape in layout] == [(2,)] * 3 + [(2, 1)] + [(2,)] * 4


def test_placeholder_input_token_is_read_from_the_previous_steps_samples(tiny_params):
    # A decode whose input token is still on the device (a placeholder naming sampler row 2) must
    # give the logits of the same decode with the token known on the host.
    runner = _runner(tiny_params, buckets=(8,), max_num_batched_tokens=8)
    prompt = [5, 9, 2, 33, 17]
    logits = {}
    for name, last, prev_tokens in [("known", 40, None), ("placeholder", -1 - 2, jnp.array([7, 8, 40, 9], jnp.int32))]:
        seq = make_seq(prompt + [last], block_table=[1, 2])
        runner.run(make_scheduler_output([seq], [5]))
        seq.num_computed_tokens = 5
        step = runner.prepare(make_scheduler_output([seq], [1]))
        assert step.prev_token_rows[0] == (2 if name == "placeholder" else -1)
        logits[name] = np.asarray(runner.execute(step, prev_tokens))[0]
    np.testing.assert_array_equal(logits["placeholder"], logits["known"])
    # and a different token in that row gives different logits: the row is really read
    seq = make_seq(prompt + [-3], num_computed_tokens=5, block_table=[1, 2])
    other = runner.execute(runner.prepare(make_scheduler_output([seq], [1])), jnp.array([7, 8, 41, 9], jnp.int32))
    assert np.abs(np.asarray(other)[0] - logits["known"]).max() > 1e-4


def test_pallas_kernel_plugs_in_as_attention_fn(tiny_params):
    # The DESIGN.md attention contract end to end: the ragged Pallas kernel (interpret mode off
    # GPU) in place of the reference gives the same logits for a prefill, then a mixed step.
    pallas_kernels = pytest.importorskip("pallas_kernels")
    logits = {}
    for name, attention_fn in [("reference", None), ("pallas", pallas_kernels.paged_attention)]:
        runner = _runner(tiny_params, buckets=(16,), max_num_batched_tokens=16, attention_fn=attention_fn)
        runner.kv_pages = jnp.full_like(runner.kv_pages, jnp.nan)
        a = make_seq(range(1, 12), block_table=[5, 2, 9])
        b = make_seq(range(20, 27), block_table=[7, 3])
        first = runner.run(make_scheduler_output([b], [6]))
        b.num_computed_tokens = 6
        second = runner.run(make_scheduler_output([b, a], [1, 9]))
        logits[name] = np.asarray(first)[:1], np.asarray(second)[:2]
    for ours, reference in zip(logits["pallas"], logits["reference"]):
        assert np.isfinite(ours).all()
        np.testing.assert_allclose(ours, reference, atol=1e-5)
