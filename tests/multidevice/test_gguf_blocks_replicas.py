"""quantization="gguf" on two data-parallel replicas: each replica's one-device mesh places the block
codes (uint8) and their float32 scales and mins with their own dtypes (device/sharding.py
`place_params`), multiplies them with the CPU kernels as a single engine does (one device: no
sharding rule needed), and the replicas serve the tokens one float engine serves."""

import numpy as np

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine.data_parallel import DataParallelEngine

ENGINE = dict(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32, warmup=False)
PROMPTS = ["The capital of France is", "def fib(n):", "1, 2, 3, 4,", "Once upon a time", "Water boils at"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_gguf_codes_on_two_replicas_serve_the_float_engines_tokens():
    expected = [o.outputs[0].token_ids for o in LLM(quantization="dequantize", **ENGINE).generate(PROMPTS, GREEDY)]
    llm = LLM(quantization="gguf", data_parallel_size=2, **ENGINE)
    assert isinstance(llm.engine, DataParallelEngine)
    single = LLM(quantization="gguf", **ENGINE).engine.runner.matmul_kernels
    for replica in llm.engine.engines:
        assert replica.runner.matmul_kernels == single and "gguf_panels" in single  # the kernels (as built here)
        attn = replica.runner.served_params["params"]["layers"]["attn"]
        assert attn["q_proj_panels"].dtype == np.uint8 and attn["q_proj_panel_scales"].dtype == np.float32
        assert replica.runner.served_params["params"]["embedding_codes"].dtype == np.uint8  # the tied head's panels
    assert len({next(iter(r.runner.served_params["params"]["embedding_codes"].devices())) for r in llm.engine.engines}) == 2
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
