"""How far a KV cache dtype moves the bundled model from the float32 cache: greedy agreement, logit
error and KL divergence. The measure of tests/test_kv_quant_engine.py and of the benchmark
benchmarks/kv_quant_accuracy.py (which reports it for every dtype).

A ROUNDED dtype (bfloat16, float16) is a 16-bit cache simulated under a float32 model: each K/V
value is rounded to that dtype as it is written (`cache_dtype` wraps the model's page write).
"""

import contextlib
import types

import numpy as np

ROUNDED = ("bfloat16", "float16")  # 16-bit caches, simulated


@contextlib.contextmanager
def cache_dtype(dtype: str):
    """(engine kv_cache_dtype, context): a ROUNDED dtype runs "auto" with every written K/V rounded."""
    if dtype not in ROUNDED:
        yield dtype
        return
    import jax.numpy as jnp

    from jaxpaged.models import llama

    write = llama.write_slots

    def rounded_write(kv_pages, index, new_kv):
        return write(kv_pages, index, new_kv.astype(jnp.dtype(dtype)).astype(new_kv.dtype))

    llama.write_slots = rounded_write
    try:
        yield "auto"
    finally:
        llama.write_slots = write


def chat_prompts(tokenizer, questions):
    ids = []
    for question in questions:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        ids.append(tokenizer.encode(text, add_special_tokens=False))
    return ids


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """Share of positions equal before each prompt's first divergence; earliest divergence (None: none)."""
    same, total, first = 0, 0, []
    for ref, got in zip(reference, other):
        diverge = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
        same += len(ref) if diverge is None else diverge
        total += len(ref)
        first.append(diverge)
    diverged = [d for d in first if d is not None]
    return dict(identical_share=same / total, first_divergence=min(diverged) if diverged else None,
                first_divergence_per_prompt=first, num_prompts_identical=first.count(None))


def _step(seqs, num_new):  # the runner reads these fields of a SchedulerOutput
    return types.SimpleNamespace(seqs=seqs, num_new_tokens=num_new, copies=[], num_batched_tokens=sum(num_new))


def logit_errors(model_config, params, prompts, kv_cache_dtypes, page_size: int = 16) -> dict:
    """{kv dtype: max |logits - float32-cache logits| at the prefill step and at the first decode step}."""
    from jaxpaged.device.runner import ModelRunner

    pages_per_seq = -(-(max(map(len, prompts)) + 2) // page_size)
    tables = [list(range(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq)) for i in range(len(prompts))]
    total = sum(map(len, prompts))
    bucket = 1 << (total - 1).bit_length()
    results = {}
    for dtype in ("auto", *kv_cache_dtypes):
        with cache_dtype(dtype) as engine_dtype:
            runner = ModelRunner(model_config, params, num_pages=1 + len(prompts) * pages_per_seq,
                                 page_size=page_size, max_num_seqs=len(prompts), max_num_batched_tokens=bucket,
                                 max_model_len=pages_per_seq * page_size, buckets=(bucket,), decode_buckets=(),
                                 kv_cache_dtype=engine_dtype)
            seqs = [types.SimpleNamespace(token_ids=list(p), num_computed_tokens=0, block_table=t)
                    for p, t in zip(prompts, tables)]
            prefill = np.asarray(runner.run(_step(seqs, [len(p) for p in prompts])))[: len(prompts)]
            if dtype == "auto":
                first_tokens = prefill.argmax(-1)
            for seq, token in zip(seqs, first_tokens):
                seq.token_ids.append(int(token))
                seq.num_computed_tokens = len(seq.token_ids) - 1
            decode = np.asarray(runner.run(_step(seqs, [1] * len(seqs))))[: len(prompts)]
        results[dtype] = (prefill, decode)
    ref_prefill, ref_decode = results["auto"]
    return {dtype: dict(prefill_max_abs_logit_diff=float(np.abs(results[dtype][0] - ref_prefill).max()),
                        first_decode_max_abs_logit_diff=float(np.abs(results[dtype][1] - ref_decode).max()),
                        prefill_mean_kl=mean_kl(ref_prefill, results[dtype][0]),
                        first_decode_mean_kl=mean_kl(ref_decode, results[dtype][1]),
                        logit_scale=float(np.abs(ref_decode).max()))
            for dtype in kv_cache_dtypes}


def mean_kl(reference: np.ndarray, other: np.ndarray) -> float:
    """Mean over rows of KL(softmax(reference) || softmax(other)), in float64."""
    def log_softmax(x):
        x = x.astype(np.float64) - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    log_p, log_q = log_softmax(reference), log_softmax(other)
    return float((np.exp(log_p) * (log_p - log_q)).sum(-1).mean())
