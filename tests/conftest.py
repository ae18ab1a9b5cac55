"""Shared fixtures: tiny random Hugging Face models (the float32 torch oracle) and stand-in
scheduler outputs for the device side."""

import os
import types

import numpy as np
import pytest


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need a CUDA GPU: skipped wherever JAX's backend is not one."""
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import jax

    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU; JAX's backend here is {jax.default_backend()!r}")
    for item in gpu_items:
        item.add_marker(skip)

# XLA:CPU maps every compiled program's machine code into the process, several memory mappings each,
# and JAX's caches keep the programs of finished tests' engines alive. Over the ~700 tests of one
# process that reached the kernel's limit (vm.max_map_count, 65530 here) and the next compile or
# cache load died inside XLA (a segfault in CI; lowering the limit to 3000 reproduces it in one test).
# So after a test module (its module fixtures gone), once the process holds more than
# CLEAR_ABOVE_MAPPINGS, JAX's caches are cleared: the count drops to ~650. Not after every module: with
# a cold persistent cache (CI) each clear costs recompiles. A module's own engines add up to ~26,000
# (tests/test_spec_decode.py), so the count stays below ~46,000.
CLEAR_ABOVE_MAPPINGS = 20_000


def _num_memory_mappings() -> int | None:
    try:
        with open("/proc/self/maps") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux
        return None


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    yield
    num_mappings = _num_memory_mappings()
    if num_mappings is None or num_mappings <= CLEAR_ABOVE_MAPPINGS:
        return
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
    num_mappings = _num_memory_mappings()
    if num_mappings > CLEAR_ABOVE_MAPPINGS:
        pytest.fail(f"{num_mappings} memory mappings remain after this module with JAX's caches cleared (limit "
                    f"{CLEAR_ABOVE_MAPPINGS}): something keeps compiled programs or engines alive past their "
                    "tests, and the suite will reach vm.max_map_count", pytrace=False)


# tests/multidevice/ needs 8 forced host devices, fixed when jax is first imported: it runs in its
# own process (tests/test_tensor_parallel.py starts it with JAXPAGED_MULTIDEVICE=1), never in this one.
collect_ignore = [] if os.environ.get("JAXPAGED_MULTIDEVICE") else ["multidevice"]

# Tiny configs, one per supported variant. Every one has GQA (4 query heads per 2 KV heads) and
# 2 layers, so the layer scan really loops.
_COMMON = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
)
TINY_HF_CONFIGS = {
    # Llama 3.x: llama3 RoPE scaling whose bands all fall inside head_dim 16 with a short
    # original context, so scaled, interpolated and untouched frequencies are all exercised.
    "llama3-untied": ("llama", dict(
        tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", rope_theta=50000.0, factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=32),
    )),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),  # SmolLM2-like
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True, use_sliding_window=False)),  # q/k/v bias
    # Qwen3: q/k RMSNorm, head_dim 32 != hidden_size / num_heads, and attention_bias, which in
    # Qwen3 (as in Llama) puts a bias on the output projection too.
    "qwen3-untied": ("qwen3", dict(tie_word_embeddings=False, head_dim=32, attention_bias=True)),
    # Sliding windows of 8 tokens: shorter than the tests' prompts, and not a multiple of... nothing:
    # two pages of 4, so a window boundary falls inside a page as the context grows.
    "mistral-window": ("mistral", dict(sliding_window=8, tie_word_embeddings=False)),
    "phi3-window": ("phi3", dict(sliding_window=6, pad_token_id=0, tie_word_embeddings=False)),  # fused qkv/gate_up
    # Phi-3 LongRoPE: an original context of 16 extended to 64 (attention factor sqrt(1 + ln 4 / ln 16)),
    # a different divisor per frequency (head_dim 16: 8 of each).
    "phi3-longrope": ("phi3", dict(pad_token_id=0, tie_word_embeddings=False, original_max_position_embeddings=16,
                                   max_position_embeddings=64, rope_parameters=dict(
                                       rope_type="longrope", rope_theta=10000.0,
                                       short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
                                       long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0]))),
    # MoE: top-2 of 4 (Mixtral renormalises) and top-1 of 8 (Qwen3-MoE without norm_topk_prob, q/k norm).
    "mixtral-top2": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)),
    "qwen3moe-top1": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=1, moe_intermediate_size=32,
                                         norm_topk_prob=False, head_dim=32, tie_word_embeddings=False)),
    # Gemma 2: layer 0 local, layer 1 global; caps low enough to bite on these activations.
    "gemma2": ("gemma2", dict(sliding_window=8, head_dim=16, query_pre_attn_scalar=24,
                              attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    # Gemma 3: one local (base 10k) and one global (base 1M) layer, q/k norm, no caps.
    "gemma3": ("gemma3_text", dict(sliding_window=8, head_dim=16, query_pre_attn_scalar=16,
                                   layer_types=["sliding_attention", "full_attention"])),
    # gpt-oss: layer 0 sliding (window 8), layer 1 full; per-head sinks, q/k/v/o bias, top-2 of 4 experts with
    # router and expert biases and the clamped SwiGLU, YaRN over an original context of 32 (factor 4 to 128, no
    # truncation: the released models' setting): the ramp falls inside head_dim 16's 8 frequencies.
    "gptoss": ("gpt_oss", dict(head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                               sliding_window=8, tie_word_embeddings=False, rope_parameters=dict(
                                   rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                   truncate=False, original_max_position_embeddings=32))),
}
# Redrawn parameters' std beyond 0.1, by a substring of their name: gpt-oss's gate/up projections large enough
# that the SwiGLU's clamps at +-7 bite, its sinks large enough to take a real share of the softmax.
PARAM_STD = {"gptoss": {"experts.gate_up_proj": 1.0, "sinks": 1.0}}


def tiny_hf_config(name: str):
    from transformers import AutoConfig

    model_type, overrides = TINY_HF_CONFIGS[name]
    return AutoConfig.for_model(model_type, **{**_COMMON, **overrides})


_HF_CACHE = {}


@pytest.fixture
def tiny_hf_model():
    """`tiny_hf_model(name) -> (hf_config, torch model, numpy state dict)`, float32, eval mode.

    HF initialises biases to 0 and norm weights to 1, which would hide a missing bias or norm:
    every parameter is redrawn at random (norm weights around 1).
    """
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    def build(name: str):
        if name not in _HF_CACHE:
            hf_config = tiny_hf_config(name)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(hf_config).float().eval()
            with torch.no_grad():
                for param_name, param in model.named_parameters():
                    offset = 1.0 if "norm" in param_name else 0.0
                    std = next((v for k, v in PARAM_STD.get(name, {}).items() if k in param_name), 0.1)
                    param.copy_(torch.randn_like(param) * std + offset)
            state_dict = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
            _HF_CACHE[name] = (hf_config, model, state_dict)
        return _HF_CACHE[name]

    return build


@pytest.fixture
def hf_logits(tiny_hf_model):
    """`hf_logits(name, token_ids) -> [len, vocab] float32 numpy`: one full causal forward."""
    import torch

    def run(name: str, token_ids):
        _, model, _ = tiny_hf_model(name)
        with torch.no_grad():
            return model(torch.tensor([list(token_ids)])).logits[0].float().numpy()

    return run


def make_seq(token_ids, num_computed_tokens=0, block_table=()):
    """A stand-in for `jaxpaged.planner.sequence.Sequence`, with only what `prepare_step_input` reads."""
    return types.SimpleNamespace(
        token_ids=list(token_ids), num_computed_tokens=num_computed_tokens, block_table=list(block_table)
    )


def make_scheduler_output(seqs, num_new_tokens, copies=()):
    """A stand-in for `jaxpaged.planner.scheduler.SchedulerOutput`."""
    return types.SimpleNamespace(
        seqs=list(seqs), num_new_tokens=list(num_new_tokens), copies=list(copies),
        num_batched_tokens=int(np.sum(num_new_tokens)),
    )


@pytest.fixture
def fake_step():
    """`(make_seq, make_scheduler_output)`: stand-ins for Sequence and SchedulerOutput."""
    return make_seq, make_scheduler_output
