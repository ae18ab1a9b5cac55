"""Where a batch-1 speculative step's time goes, against a plain decode step (bundled SmolLM2, CPU).

    python -m benchmarks.profile_spec_step [--k 5] [--max-tokens 128] [--repeats 20] [--prompts N]

1. Device time (blocked on the result) of the step programs the two engines ran: a plain decode step
   (decode bucket of 1 sequence) and a verification step (1 + k tokens of one sequence), replayed
   from the StepInputs each engine really built; then one sequence's step of b = 2, 3, 4, 6, 8
   tokens (all b logits rows: a verification of b - 1 proposals) against the decode step. Minimum
   over --repeats of the process's CPU time (XLA:CPU ran these single-threaded: CPU time equals the
   quiet wall time, and the machine is shared) and the median wall time.
2. Per engine step over whole batch-1 generations of the copy-heavy prompts: the engine's own
   timings (schedule incl. proposals, prepare, device wait, postprocess incl. commit/rollback), the
   n-gram lookup alone, and the wall time per step and per output token.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import jax
import numpy as np

from benchmarks.bench_spec_decode import copy_prompts
from jaxpaged import LLM, SamplingParams
from jaxpaged.spec_decode import ngram


def recorder(engine):
    """Wraps engine.runner.execute to keep every StepInput it runs."""
    seen = []
    execute = engine.runner.execute

    def wrapped(step_input, prev_tokens=None):
        seen.append(step_input)
        return execute(step_input, prev_tokens)

    engine.runner.execute = wrapped
    return seen, execute


def device_ms(execute, step_input, repeats: int) -> str:
    """'cpu X ms, wall Y ms': minimum CPU time and median wall time of the step, blocked on its result."""
    wall, cpu = [], []
    for _ in range(repeats + 2):
        c0, t0 = time.process_time(), time.perf_counter()
        jax.block_until_ready(execute(step_input))
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return f"cpu {1e3 * min(cpu[2:]):.1f} ms, wall {1e3 * statistics.median(wall[2:]):.1f} ms"


def one_sequence_step(verify, b: int, max_num_seqs: int):
    """`verify` (a one-sequence verification StepInput) as a step of b tokens of that sequence, every
    token a logits row (slots and positions kept, token ids 0: timing only)."""
    seq_len, num_seqs = int(verify.seq_lens[0]), min(b, max_num_seqs)
    first_slot = int(verify.slot_mapping[0]) - (seq_len - verify.num_tokens)
    block_tables = np.zeros((num_seqs, verify.block_tables.shape[1]), np.int32)
    block_tables[0] = verify.block_tables[0]
    seq_lens = np.zeros(num_seqs, np.int32)
    seq_lens[0] = seq_len
    query_start_loc = np.full(num_seqs + 1, b, np.int32)
    query_start_loc[0] = 0
    positions = np.arange(seq_len - b, seq_len, dtype=np.int32)
    prev = None if verify.prev_token_rows is None else np.full(b, -1, np.int32)
    return dataclasses.replace(verify, token_ids=np.zeros(b, np.int32), positions=positions,
                               slot_mapping=(first_slot + positions).astype(np.int32), block_tables=block_tables,
                               seq_lens=seq_lens, query_start_loc=query_start_loc,
                               logits_indices=np.arange(b, dtype=np.int32), prev_token_rows=prev)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--prompts", type=int, default=None, help="the first N prompts only (default: all)")
    args = p.parse_args()
    common = dict(max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=256, enable_prefix_caching=False)
    spec_config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    engines = {"plain": LLM(**common), "ngram": LLM(**common, speculative_config=spec_config)}
    prompts = copy_prompts(engines["plain"].tokenizer)[: args.prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)  # answers end at EOS, as in the bench
    lookup_s, lookups = 0.0, 0
    propose = ngram.propose_ngram

    def timed_propose(*a):
        nonlocal lookup_s, lookups
        t0 = time.perf_counter()
        out = propose(*a)
        lookup_s, lookups = lookup_s + time.perf_counter() - t0, lookups + 1
        return out

    import jaxpaged.spec_decode.speculator as speculator_module

    speculator_module.propose_ngram = timed_propose
    recorded = {}
    for name, llm in engines.items():
        engine = llm.engine
        llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=8))  # first-call costs
        seen, execute = recorder(engine)
        for key in engine.timings:
            engine.timings[key] = 0.0
        steps0, stats0 = engine._num_steps, llm.stats()
        t0 = time.perf_counter()
        per_prompt, num_tokens = [], 0
        for prompt in prompts:  # batch 1: one prompt at a time
            t1, n1 = time.perf_counter(), engine._num_steps
            num_tokens += len(llm.generate([prompt], params)[0].outputs[0].token_ids)
            per_prompt.append(f"{time.perf_counter() - t1:.2f}s/{engine._num_steps - n1}")
        wall = time.perf_counter() - t0
        steps = engine._num_steps - steps0
        stats = llm.stats()
        row = {key: round(1e3 * value / steps, 2) for key, value in engine.timings.items()}
        print(f"{name}: {steps} steps, {num_tokens} tokens, {wall:.2f} s, {1e3 * wall / steps:.2f} ms/step, "
              f"{1e3 * wall / num_tokens:.2f} ms/token; per step (ms) {row}; load {os.getloadavg()[0]:.1f}\n"
              f"  per prompt (seconds/steps): {per_prompt}")
        if name == "ngram":
            verified = stats["num_spec_verified"] - stats0["num_spec_verified"]
            drafts = stats["num_spec_draft_tokens"] - stats0["num_spec_draft_tokens"]
            accepted = stats["num_spec_accepted_tokens"] - stats0["num_spec_accepted_tokens"]
            print(f"  verification steps {verified} of {steps}; acceptance {accepted / max(1, drafts):.3f}; "
                  f"n-gram lookups {lookups}, {1e3 * lookup_s / max(1, lookups):.3f} ms each")
        recorded[name] = (seen, execute)
    seen, execute = recorded["plain"]
    decode = next(s for s in seen if s.decode_only)
    seen_spec, execute_spec = recorded["ngram"]
    verify = next(s for s in seen_spec if len(s.logits_indices) > 1 and s.num_tokens == 1 + args.k)
    plain_in_spec = next((s for s in seen_spec if s.decode_only), None)
    print(f"device: plain decode step {device_ms(execute, decode, args.repeats)} "
          f"(tokens bucket {len(decode.token_ids)}, decode_only {decode.decode_only}); "
          f"verification step {device_ms(execute_spec, verify, args.repeats)} "
          f"(bucket {len(verify.token_ids)}, {len(verify.logits_indices)} logits rows, decode_only {verify.decode_only})")
    if plain_in_spec is not None:
        print(f"  the speculative engine's step without proposals: {device_ms(execute_spec, plain_in_spec, args.repeats)} "
              f"(bucket {len(plain_in_spec.token_ids)}, decode_only {plain_in_spec.decode_only})")
    # One sequence's step of b tokens (compiles programs the engine does not have: timing only).
    for b in (1, 2, 3, 4, 6, 8):
        step = decode if b == 1 else one_sequence_step(verify, b, engines["ngram"].config.max_num_seqs)
        print(f"  one sequence, {b} tokens: {device_ms(execute_spec, step, args.repeats)}")
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
