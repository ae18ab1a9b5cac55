"""Sliding-window attention end to end: the engine's greedy tokens against HF float32 (Mistral,
Gemma 2 local/global, gpt-oss sliding/full with sinks, Phi-3) well past the window, under prefix caching,
chunked prefill and preemption; and the planner freeing pages behind the window of an all-local model."""

import dataclasses

import jax
import numpy as np
import pytest
from conftest import tiny_hf_config

from jaxpaged.config import EngineConfig
from jaxpaged.engine.engine import LLMEngine
from jaxpaged.models import ModelConfig, init_params, params_from_hf
from jaxpaged.ops.attention import chunked_paged_attention_from_buffer
from jaxpaged.planner.request import SamplingParams
from jaxpaged.planner.sequence import Sequence
from jaxpaged.planner.sliding_window import SlidingWindowBlockManager
from tp_fixtures import SilentTokenizer

PAST_WINDOW = 64
# Pool sizes in pages of 4. A request must fit the pool whole (preemption by recompute re-admits
# all its tokens at once), i.e. 24 pages here. With a global layer (Gemma 2) sequences keep every
# page and the last two prompts (23 + 24 pages) preempt each other; an all-local model (Mistral, Phi-3)
# holds <= 4 pages per sequence after its prefill, so nothing is preempted there.
NUM_PAGES = {True: 25, False: 26}


def _engine(config, params, **overrides):
    engine_config = EngineConfig(**{
        "page_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 16, "max_model_len": 128, **overrides,
    }).resolved(on_gpu=False, model_max_len=config.max_position_embeddings)
    return LLMEngine(config, params, SilentTokenizer(), engine_config, num_pages=engine_config.num_pages,
                     attention_fn=chunked_paged_attention_from_buffer)


def _run(engine, prompts, max_tokens, on_step=None):
    ids = [engine.add_request(list(p), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
           for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        if on_step is not None:
            on_step(engine)
    return [done[i] for i in ids]


@pytest.mark.parametrize("name", ["mistral-window", "gemma2", "gptoss", pytest.param("phi3-window", marks=pytest.mark.slow)])
def test_greedy_matches_hf_past_the_window_with_prefix_cache_chunking_and_preemption(name, tiny_hf_model):
    import torch

    hf_config, model, state_dict = tiny_hf_model(name)
    config = ModelConfig.from_hf(hf_config, dtype="float32")
    window = config.sliding_window
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 256, 12).tolist()
    # Two prompts share 3 pages (prefix cache hits), the third is longer than the 16-token budget
    # (chunked prefill); the pool cannot hold the last two at full length, so one is preempted.
    prompts = [shared + rng.integers(0, 256, 3).tolist(), shared + rng.integers(0, 256, 5).tolist(),
               rng.integers(0, 256, 21).tolist()]
    max_tokens = window + PAST_WINDOW
    model.generation_config.eos_token_id = None  # the engine ignores EOS (Gemma's eos is token 1)
    with torch.no_grad():
        expected = [
            model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
            for p in prompts
        ]
    engine = _engine(config, params_from_hf(config, state_dict), num_pages=NUM_PAGES[config.all_layers_local])
    got = _run(engine, prompts[:1], max_tokens) + _run(engine, prompts[1:], max_tokens)  # 2nd hits the 1st's pages
    assert got == expected
    assert engine.scheduler.block_manager.num_prefix_hit_tokens >= len(shared)
    assert (engine.scheduler.stats()["num_preemptions"] > 0) != config.all_layers_local
    assert isinstance(engine.scheduler.block_manager, SlidingWindowBlockManager) == config.all_layers_local


@pytest.mark.parametrize("num_new", [600, pytest.param(4000, marks=pytest.mark.slow)])
def test_pages_held_stay_within_the_window_on_a_long_generation(num_new):
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_position_embeddings=4200, sliding_window=16)
    params = jax.tree.map(np.asarray, init_params(config, jax.random.key(0)))
    page_size, num_seqs = 4, 3
    # The pool fits one request whole (admission requires it) but not three: without freeing, the
    # three would preempt each other; with it, each holds <= window/page_size + 2 pages.
    num_pages = 1 + -(-(num_new + 10) // page_size)
    engine = _engine(config, params, num_pages=num_pages, max_num_seqs=num_seqs, max_model_len=num_new + 16,
                     page_size=page_size)
    held = []

    def count(engine):
        held.extend(sum(1 for page_id in seq.block_table if page_id != 0) for seq in engine.scheduler.running)

    prompts = [list(range(i, i + 10)) for i in range(num_seqs)]
    outputs = _run(engine, prompts, num_new, on_step=count)
    assert [len(t) for t in outputs] == [num_new] * num_seqs and len(held) >= num_seqs * (num_new - 1)
    bound = config.sliding_window // page_size + 2
    assert max(held) <= bound, (max(held), bound)
    assert engine.scheduler.stats()["num_preemptions"] == 0
    assert engine.scheduler.block_manager.num_window_frees >= num_seqs * (num_new // page_size - bound)
    # A model with a global layer (Gemma-like) keeps every page: the plain BlockManager.
    mixed = dataclasses.replace(config, layer_types=("sliding_attention", "full_attention"))
    assert not isinstance(_engine(mixed, params, num_pages=13, max_num_seqs=1, max_model_len=64,
                                  page_size=page_size).scheduler.block_manager, SlidingWindowBlockManager)


@pytest.mark.parametrize("num_computed,num_freed", [(17, 2), (18, 2), (19, 3)])
def test_the_page_holding_the_oldest_visible_key_is_kept(num_computed, num_freed):
    """W 8, page 4: after c computed tokens the next query (position c) sees keys c - 7 .. c. With
    c = 18 the oldest visible key is slot 11, page 2's LAST slot: page 2 stays, pages 0 and 1 go;
    with c = 19 the oldest is slot 12 and page 2 goes too."""
    manager = SlidingWindowBlockManager(num_pages=12, page_size=4, enable_prefix_caching=False, sliding_window=8)
    seq = Sequence(list(range(24)))
    manager.allocate(seq)  # 6 pages for 24 prompt tokens
    pages = list(seq.block_table)
    free_before = manager.num_free_pages
    seq.num_computed_tokens = num_computed
    assert manager.release_out_of_window(seq) == num_freed
    assert seq.block_table[:num_freed] == [0] * num_freed  # freed entries become the padding page
    assert seq.block_table[num_freed:] == pages[num_freed:]
    assert manager.num_free_pages == free_before + num_freed
