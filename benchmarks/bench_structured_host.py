"""Host cost per step of structured outputs: the grammar bitmask for R constrained rows.

What the engine adds to a step with constrained rows (engine/structured_requests.py): each row's
matcher consumes the token its sequence drew last step, then the int32 [rows, ceil(vocab / 32)]
mask is filled (llguidance, its thread pool). Bundled SmolLM2 tokenizer (49152 tokens), one cached
JSON schema grammar, R in (0, 1, 16, 64) side by side in one run; each step's tokens are drawn
uniformly from the allowed ones (the device's role, not timed; the most varied states, a worst
case), sequences restart when they finish. Two ways, each timed on the engine's thread only:

    at dispatch   the whole mask computed when the sampler needs it (prefetch off)
    ahead, gap G  the engine's way: at commit, prefetch() starts the masks on a worker thread; the
                  step waits for them at dispatch. G ms of sleep stand for what runs in between
                  (output processing, scheduling, the device's forward pass: a model, stated as one).
                  Below MIN_PREFETCH_ROWS (4) rows the engine computes at dispatch anyway.

An unconstrained step does none of this: bitmask() returns None before touching llguidance.

`--engine`: the same cost inside the real engine (bundled SmolLM2 on this machine's CPU, 64 JSON
requests decoding together at temperature 1), masks ahead and at dispatch: the engine thread's ms
per step in bitmask() (of which waiting for the worker) and in prefetch(), beside the step's wall
time. On a CPU device the forward pass is long, so the masks ahead are always ready at dispatch.

    python -m benchmarks.bench_structured_host [--steps 200] [--gaps-ms 0.5 1 2] [--engine]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from jaxpaged.models.loading import default_model_path
from jaxpaged.models.tokenizer import Tokenizer
from jaxpaged.planner.request import SamplingParams
from jaxpaged.planner.sequence import Sequence, SequenceStatus
from jaxpaged.structured import StructuredOutputsParams
from jaxpaged.structured.grammar import GrammarCompiler, make_ll_tokenizer
from jaxpaged.structured.matchers import MIN_PREFETCH_ROWS, StructuredState

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "address"], "additionalProperties": False}


def _running_sequence() -> Sequence:
    seq = Sequence([1, 2, 3], SamplingParams())
    seq.status = SequenceStatus.RUNNING  # as the scheduler leaves it: prefetch() looks at running ones
    return seq


def run(num_rows: int, steps: int, tokenizer, compiler, rng, gap_ms: float | None) -> tuple[list[float], list[float]]:
    """Per step: engine-thread wall ms, and the CPU ms the masks took (every thread of this process,
    from the prefetch, or the dispatch, to the mask in hand: what other processes' load cannot
    inflate). gap_ms None: masks at dispatch, else prefetched with a gap."""
    vocab = tokenizer.vocab_size
    state = StructuredState(vocab, tokenizer.eos_token_id)
    state.sample_first = False  # every row's full mask: what this synthetic run times
    state.templates["r"] = compiler.submit(StructuredOutputsParams(json=SCHEMA)).result()
    seqs = [_running_sequence() for _ in range(num_rows)]
    times, cpu_times = [], []
    cpu0 = None  # process CPU time when the step's masks started (prefetch or dispatch)
    for _ in range(steps):
        if gap_ms is not None:
            time.sleep(gap_ms / 1e3)
        t0 = time.perf_counter()
        cpu0 = time.process_time() if cpu0 is None else cpu0
        mask = state.bitmask([(r, seq, "r") for r, seq in enumerate(seqs)], max(num_rows, 1)) if num_rows else None
        times.append((time.perf_counter() - t0) * 1e3)
        cpu_times.append((time.process_time() - cpu0) * 1e3)
        cpu0 = None
        for r, seq in enumerate(seqs):  # the device's draw, untimed
            allowed = np.flatnonzero(np.unpackbits(mask[r].view(np.uint8), bitorder="little")[:vocab])
            token = int(rng.choice(allowed))
            if token == tokenizer.eos_token_id:  # finished: a fresh sequence takes its row
                seq.status = SequenceStatus.FINISHED
                state.release({"r"})
                seqs[r] = _running_sequence()
            else:
                seq.output_token_ids.append(token)
        if gap_ms is not None and num_rows:  # the commit's part: catch-up and starting the worker
            t0 = time.perf_counter()
            cpu0 = time.process_time()
            state.prefetch()
            times[-1] += (time.perf_counter() - t0) * 1e3
    if gap_ms is not None and num_rows >= MIN_PREFETCH_ROWS:  # after the first step every row but fresh ones
        assert state.num_rows_ahead > state.num_rows_now, (state.num_rows_ahead, state.num_rows_now)
    return times, cpu_times


def run_engine(num_requests: int, max_tokens: int) -> None:
    import jaxpaged.structured.matchers as matchers
    from jaxpaged import LLM

    llm = LLM(max_model_len=256, max_num_seqs=num_requests, max_num_batched_tokens=1024, warmup=False)
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Invent a person as JSON."}], add_generation_prompt=True)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA)) for i in range(num_requests)]
    llm.generate([prompt] * num_requests, params)  # compiles the step buckets and the grammar
    print(f"engine: SmolLM2 on the CPU, {num_requests} constrained rows, {max_tokens} tokens each, "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"{'way':>12} {'steps':>6} {'step ms':>9} {'bitmask ms':>11} {'(wait ms)':>10} {'prefetch ms':>12} "
          f"{'rows ahead':>11}")
    ways = (("ahead", matchers.MIN_PREFETCH_ROWS), ("at dispatch", 1 << 30))
    for way, min_rows in ways + ways[::-1]:  # each way twice, in both orders: load drifts
        matchers.MIN_PREFETCH_ROWS = min_rows
        state, engine = llm.engine.structured.state, llm.engine
        before, steps0, ahead0, now0 = dict(state.seconds), engine.stats()["num_steps"], state.num_rows_ahead, state.num_rows_now
        t0 = time.perf_counter()
        llm.generate([prompt] * num_requests, params)
        wall = time.perf_counter() - t0
        steps = engine.stats()["num_steps"] - steps0
        per = {k: (state.seconds[k] - before[k]) * 1e3 / steps for k in before}
        ahead, now = state.num_rows_ahead - ahead0, state.num_rows_now - now0
        print(f"{way:>12} {steps:>6} {wall * 1e3 / steps:>9.1f} {per['bitmask']:>11.3f} {per['wait']:>10.3f} "
              f"{per['prefetch']:>12.3f} {ahead / max(ahead + now, 1):>11.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--gaps-ms", type=float, nargs="*", default=[0.5, 1.0, 2.0])
    parser.add_argument("--engine", action="store_true", help="also time the real engine (SmolLM2, CPU)")
    parser.add_argument("--engine-only", action="store_true", help="only the real engine")
    args = parser.parse_args()
    if args.engine_only:
        return run_engine(64, 32)
    tokenizer = Tokenizer.from_gguf(default_model_path())
    compiler = GrammarCompiler(make_ll_tokenizer(tokenizer.backend, tokenizer.vocab_size, tokenizer.eos_token_id))
    rng = np.random.default_rng(0)
    print(f"structured host cost per step, SmolLM2 tokenizer ({tokenizer.vocab_size} tokens), cached JSON schema, "
          f"{args.steps} steps, {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}")
    print("wall: the engine thread's time in bitmask() + prefetch(); cpu: the masks' CPU time, all threads")
    print(f"{'way':>14} {'rows':>5} {'wall p50 ms':>12} {'wall p90 ms':>12} {'cpu p50 ms':>11} {'cpu/row us':>11}")
    for gap_ms in [None] + args.gaps_ms:
        way = "at dispatch" if gap_ms is None else f"ahead, gap {gap_ms:g}"
        for num_rows in (0, 1, 16, 64):
            times, cpu_times = run(num_rows, args.steps, tokenizer, compiler, rng, gap_ms)
            med, cpu = statistics.median(times), statistics.median(cpu_times)
            p90 = sorted(times)[int(0.9 * len(times))]
            print(f"{way:>14} {num_rows:>5} {med:>12.3f} {p90:>12.3f} {cpu:>11.3f} {cpu * 1e3 / max(num_rows, 1):>11.1f}")
    print(f"load after: {os.getloadavg()[0]:.1f}")
    if args.engine:
        run_engine(64, 32)


if __name__ == "__main__":
    main()
