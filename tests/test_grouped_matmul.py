"""The MoE's grouped matmul kernel (ops/grouped_matmul.py) against `jax.lax.ragged_dot`, in Pallas interpret mode
on the CPU; models/moe.py grouped_experts through it against its ragged_dot form (biases, expert parallelism's
offset); the GPU path choosing it; its lowering for CUDA.

The group sizes leave experts with no rows (first, middle, last), groups longer than one row tile and
ending inside one, and rows past the groups (expert parallelism's pairs for other devices), so a tile
table off by a row, a group skipped, or a mask one row too wide changes the product.
Tolerance: float32 (HIGHEST on both sides): 1e-5 of the largest |y|.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.device import runner as runner_module
from jaxpaged.models import moe
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.llama import init_params
from jaxpaged.ops import grouped_matmul as gm
from pallas_kernels.jax_compat import cuda_target

TRITON_CALL = "__gpu$xla.gpu.triton"


@pytest.mark.parametrize("m, sizes, k, n", [
    (24, [0, 5, 0, 17, 0], 32, 48),  # empty first, middle and last experts; a group over two tiles of 16
    (40, [3, 1, 0, 2, 6], 16, 16),  # rows past the groups (28 of 40): zeros, as ragged_dot's
    (9, [1, 1, 1, 1, 1, 1, 1, 1, 1], 64, 32),  # a decode step's one row an expert: nine tiles, each one row
    (150, [0, 70, 80], 48, 64),  # 50 rows an expert: BM 64, a group ending inside its second tile
])
def test_kernel_equals_ragged_dot(m, sizes, k, n):
    rng = np.random.default_rng(m)
    rows = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((len(sizes), k, n)), jnp.float32)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    want = np.asarray(jax.lax.ragged_dot(rows, w, group_sizes, precision=jax.lax.Precision.HIGHEST))
    got = np.asarray(gm.grouped_matmul(rows, w, group_sizes, interpret=True))
    assert got.shape == (m, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
    assert not got[sum(sizes):].any()


def test_tile_table_bounds_and_refusals():
    # Every group non-empty is the most tiles: 512 experts, 640 rows, BM 16 -> 8 + 512.
    assert gm.tiles(640, 512, 2048, 512) == (16, 64, 64, 520)
    assert gm.tiles(8192 * 4, 32, 2880, 2880)[0] == 64  # a prefill's 1024 rows an expert: the widest row tile
    group, first, end = (np.asarray(a) for a in gm.tile_table(jnp.asarray([0, 33, 0, 16], jnp.int32), 16, 6))
    assert group[:4].tolist() == [1, 1, 1, 3] and first[:4].tolist() == [0, 16, 32, 33]
    assert end[:4].tolist() == [16, 32, 33, 49] and (first[4:] == end[4:]).all()  # past the tiles: no rows
    with pytest.raises(ValueError, match="multiples of 16"):
        gm.grouped_matmul(jnp.zeros((4, 24)), jnp.zeros((2, 24, 16)), jnp.asarray([2, 2]), interpret=True)
    with pytest.raises(ValueError, match=r"rows must be \[M, K\]"):
        gm.grouped_matmul(jnp.zeros((4, 32)), jnp.zeros((2, 16, 16)), jnp.asarray([2, 2]), interpret=True)
    assert not gm.supports((4, 24), (2, 24, 16)) and gm.supports((4, 32), (2, 32, 16))


def _experts_inputs(seed, tokens, top_k, experts, dim, ffn):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((tokens, dim)), jnp.float32)
    w_gate, w_up = (jnp.asarray(rng.standard_normal((experts, dim, ffn)) * 0.3, jnp.float32) for _ in range(2))
    w_down = jnp.asarray(rng.standard_normal((experts, ffn, dim)) * 0.3, jnp.float32)
    # Experts 0 and experts-1 never routed to: empty first and last groups.
    logits = jnp.asarray(rng.standard_normal((tokens, experts)), jnp.float32).at[:, [0, experts - 1]].set(-1e9)
    weights, ids = moe.route(logits, top_k, True)
    biases = tuple(jnp.asarray(rng.standard_normal(s) * 0.1, jnp.float32) for s in
                   ((experts, ffn), (experts, ffn), (experts, dim)))
    return x, ids, weights, w_gate, w_up, w_down, biases


@pytest.mark.parametrize("tokens, top_k, experts, dim, ffn", [(5, 2, 8, 32, 16), (12, 4, 6, 16, 48)])
def test_grouped_experts_through_the_kernel_equals_ragged_dot(tokens, top_k, experts, dim, ffn):
    """The whole MoE MLP (silu; gpt-oss's biases and swigluoai), and expert parallelism's slices: each
    device's pairs for other devices' experts sort past its groups and must add nothing."""
    x, ids, weights, w_gate, w_up, w_down, biases = _experts_inputs(tokens, tokens, top_k, experts, dim, ffn)
    kernel = moe.experts_for("cuda")  # interpreted here: the program is lowered for the CPU
    with jax.default_matmul_precision("highest"):
        for act, extra in (("silu", {}), ("swigluoai", {"biases": biases})):
            want = np.asarray(moe.grouped_experts(x, ids, weights, w_gate, w_up, w_down, act=act, **extra))
            got = np.asarray(kernel(x, ids, weights, w_gate, w_up, w_down, act=act, **extra))
            np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
        half = experts // 2
        parts = [np.asarray(kernel(x, ids, weights, w_gate[o:o + half], w_up[o:o + half], w_down[o:o + half],
                                   act="silu", expert_offset=o)) for o in (0, half)]
        want = np.asarray(moe.grouped_experts(x, ids, weights, w_gate, w_up, w_down, act="silu"))
        assert all(np.abs(p).sum() > 0 for p in parts)
        np.testing.assert_allclose(parts[0] + parts[1], want, atol=1e-5 * np.abs(want).max(), rtol=0)


def test_the_gpu_path_chooses_the_kernel_and_the_cpu_path_ragged_dot(monkeypatch):
    """experts_for by platform; a runner as on a GPU serves its MoE through the kernel (interpreted here):
    two sequences' prefill (7 and 5 tokens), then 2 decode steps, logits equal the CPU runner's (ragged_dot)."""
    from conftest import make_scheduler_output, make_seq

    assert moe.experts_for("cpu") is moe.grouped_experts
    cuda = moe.experts_for("cuda")
    assert cuda.func is moe.grouped_experts and cuda.keywords == {"matmul": moe.gpu_ragged_matmul}
    from jaxpaged.device.runner import ModelRunner

    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    params = init_params(config, jax.random.key(0))
    kwargs = dict(num_pages=16, page_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=16,
                  buckets=(16,))
    plain = ModelRunner(config, params, **kwargs)
    assert plain.expert_fn is moe.grouped_experts
    choose = runner_module.experts_for
    monkeypatch.setattr(runner_module, "experts_for", lambda platform: choose("cuda"))
    kernel = ModelRunner(config, params, **kwargs)
    assert kernel.expert_fn.keywords["matmul"] is moe.gpu_ragged_matmul
    logits = {}
    for name, runner in (("plain", plain), ("kernel", kernel)):
        seqs = [make_seq([3, 14, 15, 9, 26, 5, 35], 0, [0, 1, 2]), make_seq([8, 9, 7, 9, 3], 0, [3, 4])]
        rows = [np.asarray(runner.run(make_scheduler_output(seqs, [7, 5])))[:2]]
        for _ in range(2):
            for seq, row in zip(seqs, rows[-1]):
                seq.num_computed_tokens = len(seq.token_ids)
                seq.token_ids.append(int(np.argmax(row)))
            rows.append(np.asarray(runner.run(make_scheduler_output(seqs, [1, 1])))[:2])
        logits[name] = np.stack(rows)
    np.testing.assert_allclose(logits["kernel"], logits["plain"], atol=1e-5 * np.abs(logits["plain"]).max(), rtol=0)


def test_lowered_for_cuda_the_experts_are_triton_kernels_and_no_all_experts_dot():
    # Qwen3-Next's expert shapes at a decode step of 64 tokens (top-10 of 512): three Triton kernels (gate, up,
    # down), no ragged_dot (XLA:GPU's dense all-experts lowering) and no dot_general at all in the program.
    tokens, top_k, experts, dim, ffn = 64, 10, 512, 2048, 512
    spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
    args = (spec(tokens, dim), spec(tokens, top_k, dtype=jnp.int32), spec(tokens, top_k, dtype=jnp.float32),
            spec(experts, dim, ffn), spec(experts, dim, ffn), spec(experts, ffn, dim))
    fn = jax.jit(lambda *a: moe.experts_for("cuda")(*a, act="silu"))
    with cuda_target():
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert TRITON_CALL in text  # gate and up share one kernel function (same shapes), called twice
    assert len(re.findall(r"call @grouped_matmul(?:_\d+)?\b", text)) == 3
    dots = lambda t: re.findall(r"(?:stablehlo|chlo)\.(?:ragged_dot|dot_general)(?=\"?[( ])", t)  # ops, not the kernel's IR
    assert dots(text) == []
    plain = jax.jit(lambda *a: moe.grouped_experts(*a, act="silu"))
    with cuda_target():
        assert dots(plain.trace(*args).lower(lowering_platforms=("cuda",)).as_text()) == ["chlo.ragged_dot"] * 3
