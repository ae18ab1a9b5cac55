"""Preemption (recompute and swap) for every family beside Gemma 2 (tests/test_sliding_window.py):
greedy tokens equal HF float32 `generate` while a pool too small for the batch preempts sequences.
(Mixtral and Qwen3-MoE are preempted under routed-expert recording too: tests/test_routed_experts.py.)"""

import numpy as np
import pytest
import torch

from jaxpaged.config import EngineConfig
from jaxpaged.engine.engine import LLMEngine
from jaxpaged.models import ModelConfig, params_from_hf
from jaxpaged.ops.attention import chunked_paged_attention_from_buffer
from test_sliding_window import _run as run_greedy
from tp_fixtures import SilentTokenizer

MAX_TOKENS = 24
slow = pytest.mark.slow


@pytest.mark.parametrize("name,mode", [
    # gpt-oss under recompute: also tests/test_sliding_window.py (default mode, preempted there)
    ("gemma3", "swap"), ("mistral-window", "swap"), ("gptoss", "swap"), pytest.param("gptoss", "recompute", marks=slow),
    pytest.param("mixtral-top2", "recompute", marks=slow),
    pytest.param("gemma3", "recompute", marks=slow), pytest.param("qwen3moe-top1", "swap", marks=slow),
    pytest.param("phi3-window", "recompute", marks=slow), pytest.param("qwen3-untied", "swap", marks=slow),
])
def test_greedy_equals_hf_under_preemption(name, mode, tiny_hf_model):
    hf_config, model, state_dict = tiny_hf_model(name)
    config = ModelConfig.from_hf(hf_config, dtype="float32")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, n).tolist() for n in (9, 14, 11, 6)]
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                   max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                    for p in prompts]
    # 4 sequences of up to 38 tokens (10 pages of 4 each) in a pool of 15 usable pages: some are preempted.
    # An all-local model (window 8 / 6) frees pages behind its window: 10 usable pages (one request whole).
    num_pages = 11 if config.all_layers_local else 16
    swap = {"swap_space_bytes": 1 << 20} if mode == "swap" else {}
    engine_config = EngineConfig(
        page_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=48, num_pages=num_pages,
        warmup=False, preemption_mode=mode, **swap,
    ).resolved(on_gpu=False, model_max_len=config.max_position_embeddings)
    engine = LLMEngine(config, params_from_hf(config, state_dict), SilentTokenizer(), engine_config,
                       num_pages=num_pages, attention_fn=chunked_paged_attention_from_buffer)
    outputs = run_greedy(engine, prompts, MAX_TOKENS)
    stats = engine.scheduler.stats()
    assert stats["num_preemptions"] > 0
    if mode == "swap":
        assert stats["num_swaps_out"] > 0
    assert outputs == expected
    assert engine.block_manager.stats()["num_used_pages"] == 0  # nothing leaked
