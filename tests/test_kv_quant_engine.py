"""A quantized KV cache on the bundled SmolLM2-135M: close to the float32 cache, and the flags reach it.

Measured with benchmarks/kv_quant_accuracy.py (numbers in benchmarks/results/kv_quant_accuracy_cpu.json;
int8 pages hold K/V centred (device/kv_centres.py) in a Hadamard basis (ops/kv_quant.py)). Bounds
stated and tested here:
  * prefill and first decode step, 2 chat prompts (int8; fp8 and both together in the slow suite):
    max |logit - float32-cache logit| < 0.5 for int8 (measured 0.29 on these 2 prompts, 0.36 on 12;
    0.40 on 12 before centring; per-token scales without the rotation measured 0.66 and 0.80) and < 4.0 for fp8 (measured 1.77 on
    12); logits of this model reach ~30;
  * greedy, the 12 chat prompts of tests/test_engine.py x 48 tokens (slow): int8 >= 90% of tokens
    identical up to each prompt's first divergence and 9 of 12 prompts identical throughout (the
    issue's bars; measured 91.5% and 10 of 12; 79.0% and 9 before centring, 64.2% and 5 before the
    rotation), fp8 >= 40% and 3 prompts (measured 56.8%, 4 of 12). The first divergence can be token 0 or 1: near-tied top logits flip under
    a logit error of a few tenths. A 16-bit cache (the benchmark's bfloat16/float16 rows) flips none
    of the 576 tokens, so these divergences are quantization error, not ties any cache would flip.
"""

import json
import subprocess
import sys

import numpy as np
import pytest
from kv_accuracy import agreement, cache_dtype, chat_prompts, logit_errors, mean_kl
from test_engine import QUESTIONS, SMALL

from jaxpaged import LLM, SamplingParams
from jaxpaged.entrypoints.cli import build_parser, engine_args
from jaxpaged.ops.kv_quant import QuantizedKV
from jaxpaged.models.weights import load_model

LOGIT_BOUND = {"int8": 0.5, "float8_e4m3fn": 4.0}
AGREEMENT_BOUND = {"int8": 0.9, "float8_e4m3fn": 0.4}
PROMPTS_IDENTICAL_BOUND = {"int8": 9, "float8_e4m3fn": 3}


@pytest.fixture(scope="module")
def bundled():
    model_config, params, tokenizer = load_model(None, dtype="float32")
    return model_config, params, chat_prompts(tokenizer, QUESTIONS[:2])


def _check_logits(bundled, dtypes):
    model_config, params, prompts = bundled
    for dtype, errors in logit_errors(model_config, params, prompts, dtypes).items():
        print(dtype, errors)
        assert 0 < errors["first_decode_max_abs_logit_diff"] < LOGIT_BOUND[dtype]
        assert 0 < errors["prefill_max_abs_logit_diff"] < LOGIT_BOUND[dtype]


def test_first_decode_step_logits_are_close_int8(bundled):
    _check_logits(bundled, ["int8"])


@pytest.mark.slow
def test_first_decode_step_logits_are_close_fp8(bundled):
    _check_logits(bundled, ["float8_e4m3fn"])


def test_agreement_counts_up_to_the_first_divergence():
    report = agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]])
    assert report["identical_share"] == pytest.approx(4 / 6)  # token 3 of prompt 0 matches again but counts as lost
    assert report["first_divergence"] == 2 and report["first_divergence_per_prompt"] == [2, None]


def test_mean_kl_of_the_next_token_distributions():
    reference, other = np.log([[0.5, 0.5], [0.9, 0.1]]), np.log([[0.5, 0.5], [0.5, 0.5]])
    want = (0.0 + 0.9 * np.log(0.9 / 0.5) + 0.1 * np.log(0.1 / 0.5)) / 2
    assert mean_kl(reference, other) == pytest.approx(want)
    assert mean_kl(reference + 3.0, other - 1.0) == pytest.approx(want)  # logits: a shift per row changes nothing
    assert mean_kl(reference, reference) == 0.0


def test_benchmark_16_bit_rows_round_what_the_model_writes():
    import jax.numpy as jnp

    from jaxpaged.models import llama

    pages = jnp.zeros((1, 2, 1, 2, 4, 8), jnp.float32)  # [L, 2, K, P, page_size, H]
    new_kv = jnp.linspace(-3.0, 3.0, 2 * 8, dtype=jnp.float32).reshape(1, 2, 1, 8) + 1e-3
    index = (0, slice(None), slice(None), jnp.array([1]), jnp.array([2]))
    for dtype in ("bfloat16", "float16"):
        with cache_dtype(dtype) as engine_dtype:
            assert engine_dtype == "auto"
            stored = llama.write_slots(pages, index, new_kv)[0, :, 0, 1, 2]
        assert stored.dtype == jnp.float32
        assert jnp.array_equal(stored, new_kv[0, :, 0].astype(dtype).astype(jnp.float32))
        assert not jnp.array_equal(stored, new_kv[0, :, 0])  # rounding happened
    assert jnp.array_equal(llama.write_slots(pages, index, new_kv)[0, :, 0, 1, 2], new_kv[0, :, 0])  # restored


def test_cli_flag_reaches_the_engine_and_rejects_unknown_dtypes(capsys):
    args = build_parser().parse_args(["--prompt", "hi", "--kv-cache-dtype", "float8_e4m3fn"])
    assert engine_args(args)["kv_cache_dtype"] == "float8_e4m3fn"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--prompt", "hi", "--kv-cache-dtype", "int4"])
    assert "int4" in capsys.readouterr().err


@pytest.mark.slow
def test_greedy_agreement_with_the_float_cache():
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    tokens = {}
    for dtype in ("auto", "int8", "float8_e4m3fn"):
        llm = LLM(**SMALL, kv_cache_dtype=dtype)
        assert isinstance(llm.engine.runner.kv_pages, QuantizedKV) == (dtype != "auto")
        prompts = chat_prompts(llm.tokenizer, QUESTIONS)
        tokens[dtype] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        assert llm.stats()["num_used_pages"] == 0
    for dtype in ("int8", "float8_e4m3fn"):
        report = agreement(tokens["auto"], tokens[dtype])
        print(dtype, json.dumps(report))
        assert report["identical_share"] >= AGREEMENT_BOUND[dtype]
        assert report["num_prompts_identical"] >= PROMPTS_IDENTICAL_BOUND[dtype]


@pytest.mark.slow
def test_cli_generates_with_an_int8_cache():
    proc = subprocess.run(
        [sys.executable, "-m", "jaxpaged.generate", "--prompt", "What is the capital of France?", "--max-tokens",
         "12", "--json", "--max-model-len", "256", "--max-num-seqs", "2", "--max-num-batched-tokens", "64",
         "--kv-cache-dtype", "int8"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in json.loads(proc.stdout.splitlines()[0])["text"]
