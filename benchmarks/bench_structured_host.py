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

    python -m benchmarks.bench_structured_host [--steps 200] [--gaps-ms 0.5 1 2]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--gaps-ms", type=float, nargs="*", default=[0.5, 1.0, 2.0])
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
