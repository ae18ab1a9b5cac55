"""A tiny random model and a greedy run through the engine, shared by the tensor- and
data-parallel tests (some run in subprocesses, so these are plain functions, not fixtures)."""

import jax
import numpy as np

from jaxpaged.ops.attention import chunked_paged_attention_from_buffer
from jaxpaged.engine.engine import LLMEngine
from jaxpaged.config import EngineConfig
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.llama import init_params
from jaxpaged.planner.request import SamplingParams

TINY = ModelConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=4,
    head_dim=16, max_position_embeddings=256, attention_bias=True,
)
NUM_PAGES, PAGE_SIZE = 48, 8
# One bucket (16 tokens) keeps each engine to one step compilation.
ENGINE = dict(page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)


class SilentTokenizer:
    """What the engine needs from a tokenizer when a test only looks at token ids."""

    eos_token_id = None

    class _Detokenizer:
        def __getattr__(self, name):  # add / step / flush ...: no text
            return lambda *args, **kwargs: ""

    def detokenizer(self, *args, **kwargs):
        return self._Detokenizer()

    incremental_detokenizer = detokenizer

    def decode(self, token_ids, **kwargs):  # beam search's outputs, logprobs' decoded tokens
        return ""


def tiny_params():
    return jax.tree.map(np.asarray, init_params(TINY, jax.random.key(0)))  # host arrays, as a loader gives


def prompts():
    rng = np.random.default_rng(0)
    # Lengths around the page size and past the 16-token budget (chunked prefill).
    return [rng.integers(0, TINY.vocab_size, n).tolist() for n in (1, 7, 8, 9, 23, 40)]


def make_engine(params, *, mesh=None, attention_fn=chunked_paged_attention_from_buffer, draft_model=None, **overrides):
    config = EngineConfig(**{**ENGINE, **overrides}).resolved(on_gpu=False, model_max_len=TINY.max_position_embeddings)
    return LLMEngine(TINY, params, SilentTokenizer(), config, num_pages=config.num_pages, attention_fn=attention_fn,
                     mesh=mesh, draft_model=draft_model)


def run_greedy(engine, prompt_list, max_tokens=8):
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
           for p in prompt_list]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[i] for i in ids]


def greedy(params, prompt_list, **engine_args):
    engine = make_engine(params, **engine_args)
    return run_greedy(engine, prompt_list), engine
