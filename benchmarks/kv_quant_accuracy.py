"""How far a quantized KV cache moves the bundled model: greedy agreement and logit error vs float32.

    PYTHONPATH=$PWD python benchmarks/kv_quant_accuracy.py [--max-tokens 48] [--out FILE.json]

Prompts: the chat prompts of tests/test_engine.py (QUESTIONS, chat template applied). For each of
int8 and float8_e4m3fn, against a float32 cache (the model in float32 on the CPU):

  * greedy agreement: all prompts in one batch, `max_tokens` greedy tokens each (ignore_eos); the
    share of identical tokens, compared position by position up to each prompt's first divergence
    (after a divergence the two continuations condition on different text, so later positions are
    not comparable and count as different), and the earliest first divergence over the prompts;
  * logits: max |logit difference| over the vocabulary and the prompts at the prefill step (whose
    attention already reads the quantized K/V it just wrote) and at the first decode step (both
    caches fed the same float-cache greedy token); and the mean over the prompts of KL(float32
    cache || this cache) of the next-token distribution at both steps (smoother than the agreement
    share, which a few flipped near-ties move by several points).

Rows "bfloat16" and "float16" are a 16-bit cache for scale: each K/V value is rounded to that dtype
as it is written and read back as float32 (numerically a 16-bit cache; the engine has no 16-bit
cache under a float32 model, so the benchmark wraps the model's page write). A divergence that a
16-bit cache also causes is a near-tie in the float32 model, not a quantization defect.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the measure and the prompts are the tests' own

from kv_accuracy import ROUNDED, agreement, cache_dtype, chat_prompts, logit_errors  # noqa: E402

QDTYPES = ("int8", "float8_e4m3fn")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dtypes", nargs="+", default=[*QDTYPES, *ROUNDED], choices=[*QDTYPES, *ROUNDED],
                        help="caches compared with the float32 one (default: all)")
    args = parser.parse_args(argv)
    dtypes = tuple(args.dtypes)

    from test_engine import QUESTIONS, SMALL

    from jaxpaged import LLM, SamplingParams
    from jaxpaged.models.weights import load_model

    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    tokens, prompts = {}, None
    for dtype in ("auto", *dtypes):
        with cache_dtype(dtype) as engine_dtype:
            llm = LLM(**SMALL, kv_cache_dtype=engine_dtype)
            prompts = prompts or chat_prompts(llm.tokenizer, QUESTIONS)
            tokens[dtype] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        del llm
    model_config, params, _ = load_model(None, dtype="float32")
    report = {"num_prompts": len(prompts), "max_tokens": args.max_tokens}
    errors = logit_errors(model_config, params, prompts, dtypes)
    for dtype in dtypes:
        report[dtype] = {**agreement(tokens["auto"], tokens[dtype]), **errors[dtype]}
        print(dtype, json.dumps({k: v for k, v in report[dtype].items() if k != "first_divergence_per_prompt"}))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
