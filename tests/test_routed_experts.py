"""Routed experts per token (`enable_return_routed_experts`, engine/routed_experts.py): every fed
token's top-k expert ids per layer equal HF's router top-k on the same tokens, for tokens the
sequence computed itself, prefix-cache hits, a fork's shared prompt, and preempted sequences; with the
flag off the step program has no extra output."""

import jax
import numpy as np
import pytest
import torch

from jaxpaged.config import EngineConfig
from jaxpaged.engine.engine import LLMEngine
from jaxpaged.models import ModelConfig, init_params, params_from_hf
from jaxpaged.ops.attention import chunked_paged_attention_from_buffer
from jaxpaged.planner.request import SamplingParams
from tp_fixtures import SilentTokenizer


def _engine(config, params, **overrides):
    engine_config = EngineConfig(**{
        "page_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 16, "max_model_len": 64, "num_pages": 32,
        "warmup": False,
        "enable_return_routed_experts": True, **overrides,
    }).resolved(on_gpu=False, model_max_len=config.max_position_embeddings)
    return LLMEngine(config, params, SilentTokenizer(), engine_config, num_pages=engine_config.num_pages,
                     attention_fn=chunked_paged_attention_from_buffer)


def _hf_routing(model, top_k, token_ids):
    """HF's router top-k ([len, L, k]) and greedy next tokens for one causal forward over `token_ids`."""
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_router_logits=True)
    ids = [torch.topk(torch.softmax(r.float(), -1), top_k, dim=-1).indices for r in out.router_logits]
    return torch.stack(ids, 1).numpy(), out.logits[0].argmax(-1).numpy()


@pytest.mark.parametrize("name,preemption", [("mixtral-top2", "recompute"), ("qwen3moe-top1", "swap")])
def test_routed_experts_equal_hf_router_top_k(name, preemption, tiny_hf_model):
    hf_config, model, state_dict = tiny_hf_model(name)
    config = ModelConfig.from_hf(hf_config, dtype="float32")
    rng = np.random.default_rng(7)
    shared = rng.integers(0, 256, 8).tolist()
    # 1: alone; 2: hits 1's two full pages in the prefix cache; 3: n=2 (children share its prompt
    # pages); the 16-page pool cannot hold 2, 3 and 3's child at full length, so one is preempted.
    first = shared + rng.integers(0, 256, 5).tolist()
    later = [shared + rng.integers(0, 256, 6).tolist(), rng.integers(0, 256, 11).tolist()]
    swap = {"swap_space_bytes": 1 << 20} if preemption == "swap" else {}
    engine = _engine(config, params_from_hf(config, state_dict), num_pages=17, preemption_mode=preemption, **swap)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=24, ignore_eos=True)
    requests = [(first, greedy)]
    outputs = {}

    def run(batch):
        for prompt, params in batch:
            outputs[engine.add_request(prompt, params)] = prompt
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = (outputs[out.request_id], out)

    run(requests)
    run([(later[0], greedy), (later[1], sampled)])
    assert engine.block_manager.num_prefix_hit_tokens >= 8
    assert engine.scheduler.stats()["num_preemptions"] > 0
    for prompt, out in outputs.values():
        for completion in out.outputs:
            fed = prompt + list(completion.token_ids)[:-1]  # the last token was never fed
            expected, argmax = _hf_routing(model, config.num_experts_per_tok, fed)
            assert completion.routed_experts.dtype == np.int16
            assert completion.routed_experts.shape == (len(fed), config.num_layers, config.num_experts_per_tok)
            np.testing.assert_array_equal(completion.routed_experts, expected)
            if len(out.outputs) == 1:  # greedy: the tokens are HF's too
                assert list(completion.token_ids) == argmax[len(prompt) - 1:].tolist()
    assert engine.routed.rows == {}  # forgotten with their requests


def test_flag_off_step_has_no_extra_output_and_dense_models_are_refused(tiny_hf_model):
    hf_config, _, state_dict = tiny_hf_model("qwen3moe-top1")
    config = ModelConfig.from_hf(hf_config, dtype="float32")
    params = params_from_hf(config, state_dict)
    on, off = (_engine(config, params, enable_return_routed_experts=flag) for flag in (True, False))
    step = on.runner.dummy_step_input(16)
    outs = [jax.tree.leaves(e.runner.trace_step(step).out_info) for e in (on, off)]
    assert len(outs[0]) == len(outs[1]) + 1
    assert (outs[0][1].shape, outs[0][1].dtype) == ((16, config.num_layers, 1), np.int16)
    assert off.routed is None and on.runner.return_routed_experts and not off.runner.return_routed_experts
    dense = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        _engine(dense, init_params(dense, jax.random.key(0)))
    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig(enable_return_routed_experts=True, speculative_config={"method": "ngram",
                                                                           "num_speculative_tokens": 2})


def test_rows_follow_their_pages_out_to_the_host_and_back_in():
    """Host-only: sequence 1 computes a page's 4 tokens on device page 2; the page is swapped out
    to host page 0, its device page overwritten by sequence 2, then swapped back in to device page
    5. Sequence 3, whose block table names page 5 (a prefix-cache hit of the swapped-in copy), reads
    sequence 1's rows there, not sequence 2's."""
    from types import SimpleNamespace

    from jaxpaged.engine.routed_experts import RoutedExpertsRecorder

    ps, layers, k = 4, 2, 1
    recorder = RoutedExpertsRecorder(num_pages=8, num_host_pages=2, page_size=ps, num_layers=layers, top_k=k,
                                     num_experts=8)

    def step(seq, slots, ids, swap_out=(), swap_in=()):
        out = SimpleNamespace(seqs=[seq], num_new_tokens=[len(slots)], copies=[], swap_out=list(swap_out),
                              swap_in=list(swap_in))
        recorder.after_schedule(out)
        ids = jax.numpy.asarray(np.asarray(ids, np.int16).reshape(len(slots), layers, k))
        _, planned = recorder.plan(out, np.asarray(slots), ("logits", ids))
        recorder.commit(planned)

    first = [[1, 2], [3, 4], [5, 6], [7, 0]]
    step(SimpleNamespace(seq_id=1, num_computed_tokens=0, block_table=[2]), [8, 9, 10, 11], first)
    step(SimpleNamespace(seq_id=2, num_computed_tokens=0, block_table=[2]), [8, 9, 10, 11], [[6, 6]] * 4,
         swap_out=[(2, 0)])  # page 2 leaves for host page 0 before sequence 2 writes into it
    reader = SimpleNamespace(seq_id=3, num_computed_tokens=4, block_table=[5, 6])
    step(reader, [24], [[4, 4]], swap_in=[(0, 5)])  # computes position 4; positions 0..3 come from page 5
    np.testing.assert_array_equal(recorder.rows_of(3, 5)[:4], np.asarray(first, np.int16).reshape(4, layers, k))
    np.testing.assert_array_equal(recorder.rows_of(2, 4), np.full((4, layers, k), 6, np.int16))
