"""Qwen3-Next (models/qwen3_next.py, planner/state_pool.py): a tiny random Hugging Face checkpoint (2 Gated
DeltaNet + 2 gated full-attention layers, 4 experts top-2 with a shared expert) against transformers'
float32 model: logits of one forward, greedy tokens through the engine with chunked prefill,
preemption (recompute), n > 1 and batched requests of different lengths; what it cannot serve is refused."""

import dataclasses

import numpy as np
import pytest
import torch

from jaxpaged.config import EngineConfig
from jaxpaged.engine.engine import LLMEngine
from jaxpaged.models import ModelConfig, params_from_hf
from jaxpaged.models.qwen3_next import state_bytes_per_slot
from jaxpaged.ops.attention import chunked_paged_attention_from_buffer
from jaxpaged.planner.request import SamplingParams
from tp_fixtures import SilentTokenizer

MAX_TOKENS = 16
_MODEL = {}


def tiny_qwen3_next():
    """(hf_config, torch model, numpy state dict), every parameter redrawn (norm weights around 1)."""
    if not _MODEL:
        from transformers import AutoModelForCausalLM, Qwen3NextConfig

        hf_config = Qwen3NextConfig(
            vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            full_attention_interval=2, max_position_embeddings=128, tie_word_embeddings=False)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf_config).float().eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(torch.randn_like(param) * 0.1 + (1.0 if "norm" in name else 0.0))
        model.generation_config.eos_token_id = None
        _MODEL["model"] = (hf_config, model, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()})
    return _MODEL["model"]


def hf_greedy(prompts, max_tokens=MAX_TOKENS):
    _, model, _ = tiny_qwen3_next()
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]


def make_engine(**overrides):
    hf_config, _, state_dict = tiny_qwen3_next()
    config = ModelConfig.from_hf(hf_config, dtype="float32")
    num_pages = overrides.pop("num_pages", 64)
    engine_config = EngineConfig(**{
        # One shape for every engine here: the programs compile once (the persistent compilation cache).
        **dict(page_size=4, max_num_seqs=6, max_num_batched_tokens=16, max_model_len=64, num_pages=num_pages,
               warmup=False, enable_prefix_caching=False), **overrides,
    }).resolved(on_gpu=False, model_max_len=config.max_position_embeddings)
    return LLMEngine(config, params_from_hf(config, state_dict), SilentTokenizer(), engine_config,
                     num_pages=num_pages, attention_fn=chunked_paged_attention_from_buffer)


def run(engine, prompts, params):
    """Every request's samples' tokens; `params` one SamplingParams for all, or one per prompt."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(list(p), q) for p, q in zip(prompts, params)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [list(o.token_ids) for o in out.outputs]
    return [done[i] for i in ids]


def prompts_of(*lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).tolist() for n in lengths]


def greedy(max_tokens=MAX_TOKENS):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_config_reads_the_layer_pattern_and_refuses_what_it_lacks():
    hf_config, _, _ = tiny_qwen3_next()
    config = ModelConfig.from_hf(hf_config, dtype="float32")
    assert config.layer_types == ("linear_attention", "full_attention") * 2
    assert config.is_hybrid and config.num_kv_layers == 2 and config.partial_rotary_factor == 0.25
    for field, value in [("mlp_only_layers", [1]), ("decoder_sparse_step", 2), ("attention_bias", True)]:
        with pytest.raises(ValueError, match=field):
            ModelConfig.from_hf({**hf_config.to_dict(), field: value}, dtype="float32")


def test_logits_equal_hf_prefill_chunks_and_decodes():
    import jax
    import jax.numpy as jnp

    from jaxpaged.models.qwen3_next import Qwen3NextLM, zeros_linear_state

    hf_config, model, state_dict = tiny_qwen3_next()
    config = ModelConfig.from_hf(hf_config, dtype="float32")
    params = jax.tree.map(jnp.asarray, params_from_hf(config, state_dict))
    tokens = np.asarray(prompts_of(30)[0])
    with torch.no_grad():
        expected = model(torch.tensor(tokens[None])).logits[0].numpy()
    page_size, block_table = 4, np.arange(1, 9, dtype=np.int32)
    apply = jax.jit(Qwen3NextLM(config).apply)  # one program per chunk length

    def step(kv_state, start, n):  # one sequence in slot 2, tokens [start, start + n)
        pos = np.arange(start, start + n, dtype=np.int32)
        logits, kv_state = apply(
            params, kv_state, jnp.asarray(tokens[start:start + n]), jnp.asarray(pos),
            jnp.asarray(block_table[pos // page_size] * page_size + pos % page_size), jnp.asarray(block_table[None]),
            jnp.asarray([start + n], jnp.int32), jnp.asarray([0, n], jnp.int32), jnp.arange(n, dtype=jnp.int32),
            state_slots=jnp.asarray([2], jnp.int32))
        return np.asarray(logits), kv_state

    kv = jnp.zeros((config.num_kv_layers, 2, config.num_kv_heads, 12, page_size, config.head_dim))
    fresh = (kv, zeros_linear_state(config, 3))
    np.testing.assert_allclose(step(fresh, 0, 30)[0], expected, atol=2e-4)
    got, kv_state = [], fresh
    for start, n in [(0, 10), (10, 10)] + [(t, 1) for t in range(20, 30)]:  # two prefill chunks, then decodes
        logits, kv_state = step(kv_state, start, n)
        got.append(logits)
    np.testing.assert_allclose(np.concatenate(got), expected, atol=2e-4)


def test_chunked_delta_rule_equals_the_recurrent_one_on_ragged_rows():
    """Blocks of 4 over rows of 13, 1, 20, 0 and 7 tokens (several blocks, a partial last block, empty rows)."""
    import jax
    import jax.numpy as jnp

    from jaxpaged.models.qwen3_next import chunked_gated_delta_rule, gated_delta_rule

    rng = np.random.default_rng(0)
    lengths, num_tokens, heads, dk, dv = [13, 1, 20, 0, 7], 48, 3, 8, 6
    starts = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q, k, v = unit(draw(num_tokens, heads, dk)), unit(draw(num_tokens, heads, dk)), draw(num_tokens, heads, dv)
    g, beta, state0 = -jnp.abs(draw(num_tokens, heads)), jax.nn.sigmoid(draw(num_tokens, heads)), draw(5, heads, dk, dv)
    out, state = gated_delta_rule(q, k, v, g, beta, state0, starts)
    chunked_out, chunked_state = chunked_gated_delta_rule(q, k, v, g, beta, state0, starts, chunk=4)
    total = int(starts[-1])
    np.testing.assert_allclose(chunked_out[:total], out[:total], atol=1e-5)
    np.testing.assert_allclose(chunked_state, state, atol=1e-5)
    assert not np.asarray(chunked_out[total:]).any()  # padding tokens get zeros


def test_batched_requests_of_different_lengths_with_chunked_prefill_equal_hf():
    """Four prompts of 21-37 tokens against a 16-token budget: every prompt is cut into chunks (its state
    carried from chunk to chunk in its slot), decodes batched beside other rows' chunks."""
    prompts = prompts_of(23, 37, 21, 31)
    engine = make_engine()
    assert run(engine, prompts, greedy()) == [[t] for t in hf_greedy(prompts)]
    assert engine.scheduler.stats()["num_preemptions"] == 0


def test_preemption_recomputes_and_equals_hf():
    prompts = prompts_of(44, 46, 41, 43, 45, 42, seed=2)
    # 7 sequences (the last request has n = 2) of up to 62 tokens (16 pages each) in 63 usable pages (the
    # pool every engine here has, so no program compiles again): one is preempted (its slot freed) and
    # recomputed from a zero state.
    engine = make_engine()
    outputs = run(engine, prompts, [greedy()] * 5 + [dataclasses.replace(greedy(), n=2)])
    assert engine.scheduler.stats()["num_preemptions"] > 0
    expected = hf_greedy(prompts)
    assert outputs == [[t] for t in expected[:5]] + [[expected[5]] * 2]
    stats = engine.block_manager.stats()
    assert stats["num_used_pages"] == 0 and stats["num_free_state_slots"] == 6  # nothing leaked


def test_swap_preemption_moves_the_state_to_host_and_back_and_equals_hf():
    """The preemption test's batch under preemption_mode='swap': swapped sequences' states go to host state
    slots beside their host pages and come back into (other) device slots; the tokens still equal HF's."""
    prompts = prompts_of(44, 46, 41, 43, 45, 42, seed=2)
    engine = make_engine(preemption_mode="swap", swap_space_bytes=1 << 20)
    outputs = run(engine, prompts, [greedy()] * 5 + [dataclasses.replace(greedy(), n=2)])
    stats = engine.scheduler.stats()
    assert stats["num_swaps_out"] > 0 and stats["num_swaps_in"] == stats["num_swaps_out"]
    assert engine.host_states.num_bytes_in == engine.host_states.num_bytes_out > 0
    expected = hf_greedy(prompts)
    assert outputs == [[t] for t in expected[:5]] + [[expected[5]] * 2]
    block_manager = engine.block_manager  # nothing leaked: device pages and slots, host pages and state slots
    assert block_manager.stats()["num_used_pages"] == 0 and block_manager.stats()["num_free_state_slots"] == 6
    assert block_manager.swap_pool.num_free_pages == block_manager.swap_pool.num_pages
    assert block_manager.host_state_pool.num_free == block_manager.host_state_pool.num_slots
    assert not block_manager.host_state_slot
    # The host store alone, slots chosen so that no host slot equals its device slot: states come back whole.
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    runner = engine.runner
    states = [rng.standard_normal(leaf.shape).astype(leaf.dtype) for leaf in runner.linear_state]
    runner.linear_state = tuple(jnp.asarray(x) for x in states)
    engine.host_states.swap_out([(2, 3), (4, 1)])
    runner.linear_state = tuple(jnp.zeros_like(leaf) for leaf in runner.linear_state)
    engine.host_states.swap_in([(3, 5), (1, 6)])
    for leaf, want in zip(runner.linear_state, states):
        np.testing.assert_array_equal(np.asarray(leaf)[:, [5, 6]], want[:, [2, 4]])
        assert not np.asarray(leaf)[:, [0, 1, 2, 3, 4]].any()  # nothing else written


def test_n_samples_fork_the_state():
    """n = 3 greedy samples each equal HF's tokens: the children's states are copies of the parent's."""
    prompts = prompts_of(26, 22, seed=3)
    expected = hf_greedy(prompts)
    engine = make_engine()
    params = dataclasses.replace(greedy(), n=3)
    assert run(engine, prompts, params) == [[e] * 3 for e in expected]
    assert engine.block_manager.stats()["num_free_state_slots"] == 6
    # 6 slots and the padding slot, as the GPU pool sizing counts them (device/kv_cache.py)
    assert sum(x.nbytes for x in engine.runner.linear_state) == 7 * state_bytes_per_slot(engine.model_config)
    engine.sleep(level=1)  # the state arrays go with the pages and come back zeroed
    assert engine.runner.linear_state is None
    engine.wake_up()
    assert run(engine, prompts[:1], greedy()) == [[expected[0]]]


def hf_beams(prompt, beam_width, max_tokens):
    """HF's beams, best first: (generated tokens, score)."""
    _, model, _ = tiny_qwen3_next()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             num_beams=beam_width, num_return_sequences=beam_width,
                             do_sample=False, max_new_tokens=max_tokens, early_stopping=False, eos_token_id=None,
                             pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    return [(out.sequences[i, len(prompt):].tolist(), float(out.sequences_scores[i])) for i in range(beam_width)]


def test_beam_search_forks_copy_the_state_and_equal_hf():
    """Two searches of width 3 fill the 6 state slots (each holds its 3 while it lives) beside a greedy request
    that waits for a slot: every beam equals HF's beam search, and each beam's cumulative logprob equals a fresh
    full forward over its tokens (an oracle without HF's cache reordering)."""
    from jaxpaged.engine.beam_search import BeamSearchParams

    prompts = prompts_of(13, 17, 11, seed=4)
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    engine = make_engine()
    ids = [engine.add_beam_request(p, params) for p in prompts[:2]]
    greedy_id = engine.add_request(prompts[2], greedy(8))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    _, model, _ = tiny_qwen3_next()
    for request_id, prompt in zip(ids, prompts):
        got = [(beam.token_ids, beam.score) for beam in done[request_id].beams]
        want = hf_beams(prompt, 3, 8)
        assert [g[0] for g in got] == [w[0] for w in want]
        np.testing.assert_allclose([g[1] for g in got], [w[1] for w in want], rtol=1e-4, atol=1e-5)
        for beam in done[request_id].beams:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + beam.token_ids])).logits[0, len(prompt) - 1:-1]
            logprobs = torch.log_softmax(logits, -1)[torch.arange(8), torch.tensor(beam.token_ids)]
            assert beam.cumulative_logprob == pytest.approx(float(logprobs.sum()), abs=1e-4)
    assert [list(o.token_ids) for o in done[greedy_id].outputs] == [hf_greedy(prompts[2:], 8)[0]]
    stats = engine.block_manager.stats()
    assert stats["num_used_pages"] == 0 and stats["num_free_state_slots"] == 6  # nothing leaked
    assert not engine.block_manager._group_reserve and not engine.block_manager._group_of


def test_the_80b_config_reads_as_the_static_profiles_model_and_a_compile_only_runner_traces():
    """Qwen3-Next-80B-A3B's config.json (as published; written out here) reads to the shapes the H100 static
    profile compiles (static_profile MODELS, the 3 linear : 1 full pattern repeated); a compile-only (abstract)
    runner of a hybrid model holds abstract states and traces its decode step without allocating anything."""
    import jax

    from jaxpaged.device.runner import ModelRunner
    from jaxpaged.models.qwen3_next import param_shapes
    from jaxpaged.static_profile.step_profile import StepCase, model_config

    published = {
        "architectures": ["Qwen3NextForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "full_attention_interval": 4,
        "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
        "mlp_only_layers": [], "model_type": "qwen3_next", "moe_intermediate_size": 512, "norm_topk_prob": True,
        "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48,
        "num_key_value_heads": 2, "output_router_logits": False, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 10000000, "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
    config = ModelConfig.from_hf(published, dtype="bfloat16")
    profiled = model_config(StepCase("qwen3-next-80b-a3b", "pallas", "auto", 1, 128))
    assert config == dataclasses.replace(profiled, max_position_embeddings=262144)
    assert state_bytes_per_slot(config) == 36 * (3 * 8192 * 2 + 32 * 128 * 128 * 4)  # 36 linear layers

    hf_config, _, _ = tiny_qwen3_next()
    tiny = ModelConfig.from_hf(hf_config, dtype="float32")
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cpu), param_shapes(tiny))
    runner = ModelRunner(tiny, params, num_pages=9, page_size=4, max_num_seqs=2, max_num_batched_tokens=8,
                         max_model_len=16, num_state_slots=2)
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in runner.linear_state)
    assert [leaf.shape[1] for leaf in runner.linear_state] == [3, 3]  # 2 slots and the padding slot
    traced = runner.trace_step(runner.dummy_step_input(2, decode_only=True))
    logits, (kv_pages, state) = traced.out_info
    assert logits.shape == (2, tiny.vocab_size) and [x.shape for x in state] == [x.shape for x in runner.linear_state]


@pytest.mark.parametrize("field,value", [
    ("kv_cache_dtype", "int8"), ("speculative_config", {"method": "ngram",
                                                                                      "num_speculative_tokens": 2}),
])
def test_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        make_engine(**{field: value})


# ---------------------------------------------------------------- prefix caching (state snapshots)


def hit_tokens(engine, prompts, params):
    """(the requests' outputs, prefix-cache hit tokens they added), the prompts run one after another."""
    before = engine.block_manager.stats()["prefix_hit_tokens"]
    outputs = [run(engine, [p], params)[0] for p in prompts]
    return outputs, engine.block_manager.stats()["prefix_hit_tokens"] - before


def sharing(prompt, num_shared, length, seed):
    """`prompt`'s first `num_shared` tokens, then other tokens up to `length`."""
    tail = [(t + 1) % 256 if i == 0 and t == prompt[num_shared] else t
            for i, t in enumerate(prompts_of(length - num_shared, seed=seed)[0])]
    return prompt[:num_shared] + tail


def warm_engine():
    """An engine that served one 22-token prompt alone: with a 16-token budget its chunks end at 16, 20
    (cut to the page boundary) and 22, so the states at the ends of pages 3 and 4 are snapshots."""
    engine = make_engine(enable_prefix_caching=True)
    prompt = prompts_of(22, seed=5)[0]
    expected = hf_greedy([prompt])[0]
    assert run(engine, [prompt], greedy()) == [[expected]]
    stats = engine.block_manager.stats()
    assert stats["num_state_snapshots"] == 2 and stats["prefix_hit_tokens"] == 0
    return engine, prompt, expected


def test_prefix_cache_hits_up_to_the_deepest_snapshot_and_equals_hf():
    engine, a, a_out = warm_engine()
    # A prefix ending mid-page (21 tokens: pages 0-4 hit, 20 tokens); one ending inside page 4 (18: 16
    # tokens); one running past pages A filled while decoding, cached but without a snapshot (its KV could
    # hit 28 tokens, the state only 20): a hit never uses a page past its snapshot.
    prompts = [sharing(a, 21, 27, seed=6), sharing(a, 18, 23, seed=7), sharing(a + a_out, 28, 30, seed=8)]
    expected = hf_greedy(prompts)
    for prompt, want, hit in zip(prompts, expected, [20, 16, 20]):
        assert hit_tokens(engine, [prompt], greedy()) == ([[want]], hit)
    assert engine.block_manager.leaks() == []


def test_prefix_cache_with_unaligned_chunks_and_n_samples():
    """A 34-token prompt computed beside a 9-token one and its decodes under a 10-token budget (not a multiple
    of the 4-token page): its shares of the budget are cut so that its chunks end on page boundaries: 8, 16,
    24, 32 (the snapshots), then 34. Two samples of a prompt sharing its first 33 tokens then start from the
    snapshot at 32. (Its own step programs: the budget sets the token buckets.)"""
    engine = make_engine(enable_prefix_caching=True, max_num_batched_tokens=10)
    first, other = prompts_of(34, 9, seed=9)
    second = sharing(first, 33, 36, seed=10)
    expected = hf_greedy([first, other, second])
    assert run(engine, [other, first], greedy()) == [[expected[1]], [expected[0]]]
    assert engine.block_manager.stats()["num_snapshot_saves"] == 5  # the other prompt's chunk ended at 8 too
    assert hit_tokens(engine, [second], dataclasses.replace(greedy(), n=2)) == ([[expected[2]] * 2], 32)
    assert engine.block_manager.leaks() == []


def test_prefix_cache_eviction_frees_snapshots_and_preemption_recomputes():
    """Five 3-token prompts decoding 56 tokens and a 44-token one with n = 2 need more than the 63 pages:
    the last to arrive is preempted (recomputed), the warm prefix's pages are evicted and their snapshots
    freed with them (leaks() checks every snapshot's page is still cached), the tokens stay HF's."""
    engine, a, _ = warm_engine()
    prompts = prompts_of(3, 3, 3, 3, 3, 44, seed=2)
    long, forked = greedy(max_tokens=56), dataclasses.replace(greedy(), n=2)
    outputs = run(engine, prompts, [long] * 5 + [forked])
    expected = hf_greedy(prompts[:5], max_tokens=56) + hf_greedy(prompts[5:])
    assert outputs == [[t] for t in expected[:5]] + [[expected[5]] * 2]
    assert engine.scheduler.stats()["num_preemptions"] > 0
    assert engine.block_manager.stats()["num_snapshot_evictions"] > 0  # snapshots freed with their evicted pages
    assert engine.block_manager.leaks() == []
    again = sharing(a, 21, 25, seed=11)
    assert run(engine, [again], greedy()) == [[hf_greedy([again])[0]]]
    assert engine.block_manager.leaks() == []


def test_state_copies_apply_in_list_order():
    """A snapshot saved and restored in one list (slot 1 -> 7 -> 2) reaches slot 2."""
    import jax.numpy as jnp

    engine = make_engine(enable_prefix_caching=True)
    runner = engine.runner
    conv, rec = runner.linear_state
    runner.linear_state = (conv.at[:, 1].set(1.0), rec.at[:, 1].set(1.0))
    runner.copy_states([(1, 7), (7, 2)])
    assert float(jnp.min(runner.linear_state[1][:, 2])) == 1.0 and float(jnp.min(runner.linear_state[0][:, 2])) == 1.0


def test_prefix_cache_warm_under_swap_preemption_and_beams():
    """Prefix caching, swap preemption and beam search on one engine: batches sharing a warm prefix swap out
    and back (their states through host slots, their hits from snapshots); a beam search on a prompt
    sharing the prefix equals HF's; every page, slot, snapshot and host slot is accounted for after."""
    from jaxpaged.engine.beam_search import BeamSearchParams

    engine = make_engine(enable_prefix_caching=True, preemption_mode="swap", swap_space_bytes=1 << 20, num_pages=40)
    warm = prompts_of(22, seed=5)[0]
    assert run(engine, [warm], greedy()) == [[hf_greedy([warm])[0]]]
    prompts = [sharing(warm, 21, n, seed=20 + i) for i, n in enumerate((44, 46, 41, 43, 45, 42))]
    before = engine.block_manager.stats()["prefix_hit_tokens"]
    outputs = run(engine, prompts, [greedy()] * 5 + [dataclasses.replace(greedy(), n=2)])
    expected = hf_greedy(prompts)
    assert outputs == [[t] for t in expected[:5]] + [[expected[5]] * 2]
    stats = engine.scheduler.stats()
    assert stats["num_swaps_out"] > 0 and stats["num_swaps_in"] == stats["num_swaps_out"]
    assert engine.block_manager.stats()["prefix_hit_tokens"] - before >= 20
    beam_prompt = sharing(warm, 21, 25, seed=30)
    request_id = engine.add_beam_request(beam_prompt, BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert [beam.token_ids for beam in done[request_id].beams] == [w[0] for w in hf_beams(beam_prompt, 3, 6)]
    block_manager = engine.block_manager
    assert block_manager.leaks() == []
    assert block_manager.swap_pool.num_free_pages == block_manager.swap_pool.num_pages
    assert block_manager.host_state_pool.num_free == block_manager.host_state_pool.num_slots
