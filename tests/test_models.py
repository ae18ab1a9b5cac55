"""The Flax decoder against Hugging Face transformers (torch, float32, CPU) on tiny random models.

Each model runs through the real device path (prepare_step_input -> ModelRunner.execute) with a
randomly permuted block table and a KV buffer that starts as all NaN, so a read of any slot that
was not written this request poisons the logits.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_HF_CONFIGS, make_scheduler_output, make_seq, tiny_hf_config

from jaxpaged.device.runner import ModelRunner
from jaxpaged.models import ModelConfig, RopeScaling, init_params, params_from_hf
from jaxpaged.models.llama import rope_inv_freq

PAGE_SIZE = 4
NUM_PAGES = 24
ATOL = 1e-4  # float32 against float32 torch

_RUNNERS = {}
# LongRoPE's factor set follows max_model_len (64 here: long) while HF's follows each forward's length,
# so short sequences differ by design; tests/test_longrope.py covers it in both regimes.
PAGED_CONFIGS = sorted(name for name in TINY_HF_CONFIGS if name != "phi3-longrope")


@pytest.fixture
def nan_runner(tiny_hf_model):
    """`nan_runner(name) -> ModelRunner` holding the HF model's weights, KV buffer all NaN."""

    def build(name: str) -> ModelRunner:
        if name not in _RUNNERS:  # one compilation per architecture for the whole module
            hf_config, _, state_dict = tiny_hf_model(name)
            config = ModelConfig.from_hf(hf_config, dtype="float32")
            _RUNNERS[name] = ModelRunner(
                config, params_from_hf(config, state_dict), num_pages=NUM_PAGES, page_size=PAGE_SIZE,
                max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, buckets=(16,),
            )
        runner = _RUNNERS[name]
        runner.kv_pages = jnp.full_like(runner.kv_pages, jnp.nan)
        return runner

    return build


def _step(runner, seqs_and_counts):
    """Schedules `(seq, num_new_tokens)` pairs, growing block tables from each seq's `pages`."""
    for seq, n in seqs_and_counts:
        seq.block_table = seq.pages[: math.ceil((seq.num_computed_tokens + n) / PAGE_SIZE)]
    out = make_scheduler_output([s for s, _ in seqs_and_counts], [n for _, n in seqs_and_counts])
    logits = np.asarray(runner.run(out))
    assert np.isfinite(logits).all(), "NaN from an unwritten page leaked into the logits"
    for seq, n in seqs_and_counts:
        seq.num_computed_tokens += n
    return logits


def _new_seq(token_ids, pages):
    seq = make_seq(token_ids)
    seq.pages = [int(p) for p in pages]
    return seq


@pytest.mark.parametrize("name", PAGED_CONFIGS)
def test_chunked_prefill_then_decode_matches_hf(name, nan_runner, hf_logits):
    runner = nan_runner(name)
    rng = np.random.default_rng(0)
    token_ids = rng.integers(0, 256, size=13 + 5)  # a 13-token prompt, then 5 decode tokens
    expected = hf_logits(name, token_ids)
    pages = rng.permutation(np.arange(1, NUM_PAGES))  # page 0 is padding, never owned
    seq = _new_seq(token_ids, pages)

    # Prefill in two chunks (8 + 5 tokens), then one token per step; the logits of each step's
    # last token must match HF's at that position.
    for n in [8, 5, 1, 1, 1, 1, 1]:
        last = seq.num_computed_tokens + n - 1
        logits = _step(runner, [(seq, n)])
        np.testing.assert_allclose(logits[0], expected[last], atol=ATOL, rtol=0, err_msg=f"position {last}")


@pytest.mark.parametrize("name", PAGED_CONFIGS)
def test_ragged_batch_of_prefill_chunk_and_decode_matches_hf(name, nan_runner, hf_logits):
    runner = nan_runner(name)
    rng = np.random.default_rng(1)
    tokens_a, tokens_b = rng.integers(0, 256, size=11), rng.integers(0, 256, size=7)
    expected_a, expected_b = hf_logits(name, tokens_a), hf_logits(name, tokens_b)
    pages = rng.permutation(np.arange(1, NUM_PAGES))
    seq_a, seq_b = _new_seq(tokens_a, pages[:6]), _new_seq(tokens_b, pages[6:12])

    _step(runner, [(seq_b, 6)])  # B's prompt, alone
    # One step: B decodes its 7th token while A prefills a 9-token chunk (spans 3 pages).
    logits = _step(runner, [(seq_b, 1), (seq_a, 9)])
    np.testing.assert_allclose(logits[0], expected_b[6], atol=ATOL, rtol=0)
    np.testing.assert_allclose(logits[1], expected_a[8], atol=ATOL, rtol=0)
    # And the cache both left behind serves the next step: A finishes its prompt, B decodes again.
    seq_b.token_ids.append(int(tokens_a[0]))  # any token: B's expectation is recomputed
    expected_b = hf_logits(name, seq_b.token_ids)
    logits = _step(runner, [(seq_a, 2), (seq_b, 1)])
    np.testing.assert_allclose(logits[0], expected_a[10], atol=ATOL, rtol=0)
    np.testing.assert_allclose(logits[1], expected_b[7], atol=ATOL, rtol=0)


def test_llama3_rope_frequencies_match_hf():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = tiny_hf_config("llama3-untied")
    config = ModelConfig.from_hf(hf_config)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    np.testing.assert_allclose(ours, expected.numpy(), rtol=1e-6)
    # The tiny config has all three bands: kept (high), interpolated, and slowed down (low).
    plain = rope_inv_freq(config.head_dim, config.rope_theta, None)
    assert (ours != plain).any() and (ours == plain).any()


def test_from_hf_reads_each_variant():
    llama3 = ModelConfig.from_hf(tiny_hf_config("llama3-untied"), dtype="float32")
    assert llama3.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 32) and llama3.rope_theta == 50000.0
    assert (llama3.tie_word_embeddings, llama3.attention_bias, llama3.qk_norm) == (False, False, False)
    assert (llama3.num_heads, llama3.num_kv_heads, llama3.head_dim) == (4, 2, 16)
    qwen2 = ModelConfig.from_hf(tiny_hf_config("qwen2-tied"), dtype="bfloat16")
    assert (qwen2.attention_bias, qwen2.o_proj_bias, qwen2.tie_word_embeddings) == (True, False, True)
    assert qwen2.dtype == "bfloat16"
    qwen3 = ModelConfig.from_hf(tiny_hf_config("qwen3-untied"))
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.attention_bias, qwen3.o_proj_bias) == (True, 32, True, True)
    assert qwen3.dtype == ("float32" if jax.default_backend() == "cpu" else "bfloat16")


def test_from_hf_rejects_what_it_cannot_run():
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
        ModelConfig.from_hf(AutoConfig.for_model("gpt2"))
    dynamic = tiny_hf_config("llama-tied")
    dynamic.rope_parameters = dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0)
    with pytest.raises(ValueError, match="rope_type='dynamic' is not supported"):
        ModelConfig.from_hf(dynamic)
    # YaRN (read for every family, as HF does): the pretrained context defaults to max_position_embeddings
    yarn = tiny_hf_config("llama-tied")
    yarn.rope_parameters = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0)
    scaling = ModelConfig.from_hf(yarn).rope_scaling
    assert (scaling.factor, scaling.original_max_position_embeddings) == (4.0, yarn.max_position_embeddings)
    for model_type, field, value in [
        ("qwen2", "use_sliding_window", True), ("qwen3_moe", "decoder_sparse_step", 2),
        ("qwen3_moe", "mlp_only_layers", [0]), ("llama", "hidden_act", "gelu"), ("llama", "mlp_bias", True),
    ]:
        with pytest.raises(ValueError, match=field):
            ModelConfig.from_hf(dict(model_type=model_type, **{field: value}))


def test_config_validates_itself():
    shape = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, head_dim=4)
    with pytest.raises(ValueError, match="num_heads=6 must be divisible by num_kv_heads=4"):
        ModelConfig(**shape, num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="dtype='float64' is not supported"):
        ModelConfig(**shape, num_heads=2, num_kv_heads=2, dtype="float64")


@pytest.mark.parametrize("name", sorted(TINY_HF_CONFIGS))
def test_params_from_hf_has_the_layout_of_init_params(name, tiny_hf_model):
    hf_config, _, state_dict = tiny_hf_model(name)
    config = ModelConfig.from_hf(hf_config)
    converted = params_from_hf(config, state_dict)
    initialised = init_params(config, jax.random.key(0))
    assert jax.tree.structure(converted) == jax.tree.structure(initialised)
    assert jax.tree.map(np.shape, converted) == jax.tree.map(np.shape, initialised)
    # Layer 1 of the stack is HF's layer 1 (stacking order), in (in, out) layout.
    layers = converted["params"]["layers"]
    if "mlp" in layers:
        np.testing.assert_array_equal(layers["mlp"]["down_proj"][1], state_dict["model.layers.1.mlp.down_proj.weight"].T)
    else:  # experts: transformers >= 5 fuses them as [E, D, F] (gpt-oss: [E, F, D]); ours is [E, F, D]
        down = state_dict["model.layers.1.mlp.experts.down_proj"]
        np.testing.assert_array_equal(layers["moe"]["expert_down"][1],
                                      down if config.moe_bias else down.transpose(0, 2, 1))


def test_params_from_hf_names_a_missing_tensor(tiny_hf_model):
    hf_config, _, state_dict = tiny_hf_model("llama-tied")
    config = ModelConfig.from_hf(hf_config)
    partial = {k: v for k, v in state_dict.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(KeyError, match="model.layers.1.self_attn.k_proj.weight"):
        params_from_hf(config, partial)


def test_bfloat16_model_stays_close_to_float32_hf(tiny_hf_model, hf_logits):
    # The accelerator default: bf16 weights, activations and KV pages, float32 logits. Rounding
    # to 8 mantissa bits costs about 1-2% of the logit range on this model; a wrong cast or a
    # broken bf16 path is far outside 0.1.
    hf_config, _, state_dict = tiny_hf_model("llama-tied")
    config = ModelConfig.from_hf(hf_config, dtype="bfloat16")
    runner = ModelRunner(
        config, params_from_hf(config, state_dict), num_pages=16, page_size=PAGE_SIZE, max_num_seqs=2,
        max_num_batched_tokens=16, max_model_len=32, buckets=(16,),
    )
    assert runner.kv_pages.dtype == jnp.bfloat16
    token_ids = np.random.default_rng(2).integers(0, 256, size=14)
    expected = hf_logits("llama-tied", token_ids)
    seq = make_seq(token_ids, block_table=[3, 1, 7, 2])
    prefill = np.asarray(runner.run(make_scheduler_output([seq], [13])))[0]
    seq.num_computed_tokens = 13
    decode = np.asarray(runner.run(make_scheduler_output([seq], [1])))[0]
    assert prefill.dtype == np.float32
    np.testing.assert_allclose(prefill, expected[12], atol=0.1, rtol=0)
    np.testing.assert_allclose(decode, expected[13], atol=0.1, rtol=0)


@pytest.mark.parametrize("rows", [1, 2, 16, 64, 65])
def test_tied_lm_head_vocab_major_is_the_same_product(rows):
    """The CPU's vocabulary-major LM head gives x @ E^T (float64 reference), and is taken exactly for
    2..64 rows: the barrier that keeps XLA from folding the transpose back is in the program."""
    from jaxpaged.models.llama import tied_lm_head

    emb = jax.random.normal(jax.random.key(0), (1000, 32), jnp.float32)
    x = jax.random.normal(jax.random.key(1), (rows, 32), jnp.float32)
    want = np.asarray(x, np.float64) @ np.asarray(emb, np.float64).T
    head = jax.jit(tied_lm_head, static_argnums=2)
    for vocab_major in (False, True):
        np.testing.assert_allclose(np.asarray(head(x, emb, vocab_major)), want, rtol=1e-5, atol=1e-5)
    program = head.lower(x, emb, True).as_text()
    assert ("optimization_barrier" in program) == (2 <= rows <= 64)
    assert "optimization_barrier" not in head.lower(x, emb, False).as_text()


def test_cpu_runner_takes_the_vocab_major_head():
    config = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=8, tie_word_embeddings=True)
    runner = ModelRunner(config, init_params(config, jax.random.key(0)), num_pages=4, page_size=4,
                         max_num_seqs=2, max_num_batched_tokens=8, max_model_len=16)
    assert runner.model.vocab_major_head and runner.decode_model.vocab_major_head


class _Projection(nn.Module):
    """One layer projection through the model's own `linear`, alone."""

    min_rows: int

    @nn.compact
    def __call__(self, x):
        from jaxpaged.models.gguf_blocks import linear

        return linear(self, "w", x, (32, 4, 8), "TD,DNH->TNH", jnp.float32, nn.initializers.normal(1.0),
                      min_rows=self.min_rows)


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_min_dot_rows_pads_the_dot_and_keeps_the_product(rows):
    """A GPU runner gives every projection's dot >= 2 rows (CausalLM.min_dot_rows): a one-row dot would
    be strength-reduced into multiply + reduce (jaxpaged/static_profile). The padded product is the
    same rows of x @ w (float64 reference), and the dot really takes 2 rows where x has 1."""
    x = jax.random.normal(jax.random.key(1), (rows, 32), jnp.float32)
    params = _Projection(1).init(jax.random.key(0), x)
    w = np.asarray(params["params"]["w"], np.float64)
    want = np.einsum("td,dnh->tnh", np.asarray(x, np.float64), w)
    for min_rows in (1, 2):
        apply = jax.jit(_Projection(min_rows).apply)
        np.testing.assert_allclose(np.asarray(apply(params, x)), want, rtol=1e-5, atol=1e-5)
        dots = [line for line in apply.lower(params, x).as_text().splitlines() if "dot_general" in line]
        assert len(dots) == 1 and f"(tensor<{max(rows, min_rows)}x32xf32>" in dots[0], dots


def test_runner_pads_one_row_dots_only_off_the_cpu():
    config = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=8)
    runner = ModelRunner(config, init_params(config, jax.random.key(0)), num_pages=4, page_size=4,
                         max_num_seqs=1, max_num_batched_tokens=8, max_model_len=16)
    assert runner.model.min_dot_rows == runner.decode_model.min_dot_rows == 1  # XLA:CPU's one-row dot is a gemv
