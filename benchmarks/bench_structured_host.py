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

The synthetic run times full masks only (sample first off): what a row costs when its mask is needed.

`--engine`: the cost inside the real engine (bundled SmolLM2 on this machine's CPU, 64 JSON requests
decoding together, greedy and at temperature 1), two ways side by side, each twice in both orders:

    always masked   every constrained row's full mask before the draw (prefetched at commit)
    sample first    the engine's way for greedy / plain-temperature rows (structured/matchers.py):
                    draw, check the token (the forced token where the grammar forces one, else
                    validate_tokens, or a bit of the mask filled ahead for temperature rows), put
                    in the forced token of a rejected forced row or the first allowed of a
                    rejected row's candidates, mask and redraw the rows with neither
    first, lazy masks   the same with masks_ahead off: a rejected temperature row's mask is
                    computed after the draw, on the engine thread, as greedy rows' always are
    first, no candidates    sample first with candidates off: every rejected row the grammar does
                    not force is redrawn on the device (the way before candidates)

Per step: the engine thread's host ms of structured work (step_mask(), prefetch(), checking and the
redraw's dispatch; not the wait for the device's first draw) and, of it, the wait for the mask
worker; the share of constrained rows rejected, forced, checked (accepted or rejected) and masked.
Written to benchmarks/results/structured_host_cpu.json (--out).

    python -m benchmarks.bench_structured_host [--steps 200] [--gaps-ms 0.5 1 2] [--engine | --engine-only]
        [--temperatures 0 1]
"""

from __future__ import annotations

import argparse
import json
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


def run_first(num_rows: int, steps: int, tokenizer, compiler, rng, gap_ms: float, reject: float,
              masks_ahead: bool = True):
    """Sample first, synthetic: per step the engine thread's wall ms (step_mask() + check() +
    prefetch()) and the CPU ms of all threads from the prefetch to the checked tokens in hand (the
    worker's catch-up and forced tokens, llguidance's masks of rejected rows), less the untimed
    draw. The draw: each row's token is a disallowed one with probability `reject` (what
    the engine measures: 22% greedy, 29% at temperature 1), else an allowed one; rejected rows take
    an allowed token from check()'s mask. Not counted: the device's redraw call."""
    vocab, eos = tokenizer.vocab_size, tokenizer.eos_token_id
    state = StructuredState(vocab, eos)
    state.masks_ahead = masks_ahead
    state.templates["r"] = compiler.submit(StructuredOutputsParams(json=SCHEMA)).result()
    seqs = [_running_sequence() for _ in range(num_rows)]
    times, cpu_times = [], []
    cpu0 = time.process_time()
    for _ in range(steps):
        time.sleep(gap_ms / 1e3)
        t0 = time.perf_counter()
        step = state.step_mask([(r, seq, "r", True) for r, seq in enumerate(seqs)], num_rows)
        wall = time.perf_counter() - t0
        state._join()  # the device's draw, untimed (its matcher use must not race the worker)
        u0 = time.process_time()
        drawn = np.empty(num_rows, np.int64)
        for r, seq in enumerate(seqs):
            words = np.zeros(state.num_words, np.int32)
            matcher = state._matcher(seq, "r")
            matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            state.allow_eos_where_empty(words[None], [0])
            allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab].astype(bool)
            drawn[r] = rng.choice(np.flatnonzero(~allowed if rng.random() < reject else allowed))
        untimed = time.process_time() - u0
        t0 = time.perf_counter()
        fix = step.check(drawn)
        wall += time.perf_counter() - t0
        cpu_times.append((time.process_time() - cpu0 - untimed) * 1e3)
        for r, seq in enumerate(seqs):
            token = int(drawn[r])
            if fix is not None and fix.mask is not None and fix.rejected[r]:  # the device's redraw
                token = int(rng.choice(np.flatnonzero(np.unpackbits(fix.mask[r].view(np.uint8), bitorder="little")[:vocab])))
            elif fix is not None:  # a forced token put in (no candidates here), or the token drawn
                token = int(fix.tokens[r])
            if token == eos:
                seq.status = SequenceStatus.FINISHED
                state.release({"r"})
                seqs[r] = _running_sequence()
            else:
                seq.output_token_ids.append(token)
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        state.prefetch()
        times.append((wall + time.perf_counter() - t0) * 1e3)
    return times, cpu_times, state.num_rows_rejected / max(state.num_rows_checked + state.num_rows_forced, 1)


def run_engine(num_requests: int, max_tokens: int, out_path: str | None = None,
               temperatures: tuple[float, ...] = (0.0, 1.0)) -> list[dict]:
    """The real engine, each way twice in both orders (load drifts), greedy and temperature 1."""
    from jaxpaged import LLM

    llm = LLM(max_model_len=256, max_num_seqs=num_requests, max_num_batched_tokens=1024, warmup=False)
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Invent a person as JSON."}], add_generation_prompt=True)

    def params(temperature: float) -> list[SamplingParams]:
        return [SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens, ignore_eos=True,
                               structured_outputs=StructuredOutputsParams(json=SCHEMA)) for i in range(num_requests)]

    for temperature in temperatures:  # compiles the step buckets, the samplers and the grammar
        llm.generate([prompt] * num_requests, params(temperature))
    engine, state = llm.engine, llm.engine.structured.state
    print(f"engine: SmolLM2 on the CPU, {num_requests} constrained rows, {max_tokens} tokens each, "
          f"{os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}")
    print("host ms: the engine thread's structured work per step (mask or forced token, the worker's hand-off, "
          "checking the drawn tokens and the redraw's dispatch); wait: of it, waiting for the mask worker")
    print("of it: step_mask() (masks before the draw), prefetch() (hand-off), check (with the rejected rows' "
          "masks), dispatch (the redraw's arrays and call); rmask: of check, the rejected free rows' masks")
    print("cpu ms: the process's CPU ms per step, every thread; worker: the mask worker's wall ms per step (its thread)")
    print("rej f/free: rejected rows per step the grammar forces / does not force; lazy: of the free ones, masks "
          "computed in check; redraws / puts: share of steps with a device redraw / with every rejected row fixed "
          "on the host (forced tokens, candidates); cand: rejected free rows per step that took a candidate")
    print(f"{'way':>27} {'steps':>6} {'step ms':>8} {'cpu ms':>7} {'worker':>7} {'host ms':>8} {'(wait)':>7} {'mask':>6} "
          f"{'pref':>6} {'check':>6} {'disp':>6} {'rmask':>6} {'rejected':>9} {'forced':>7} {'checked':>8} {'masked':>7} "
          f"{'rej f/free':>10} {'lazy':>5} {'redraws':>7} {'puts':>5} {'cand':>5}")
    ways = (("always masked", False, True, True), ("first, lazy masks", True, False, True),
            ("first, no candidates", True, True, False), ("sample first", True, True, True))
    results = []
    for temperature in temperatures:
        for way, sample_first, masks_ahead, candidates in ways + ways[::-1]:
            state.sample_first, state.masks_ahead, state.candidates = sample_first, masks_ahead, candidates
            counters = ("num_rows_ahead", "num_rows_now", "num_rows_checked", "num_rows_rejected", "num_rows_forced",
                        "num_rows_rejected_forced", "num_redraws", "num_puts", "num_rows_rejected_lazy",
                        "num_rows_candidate")
            before, steps0 = dict(state.seconds), engine.stats()["num_steps"]
            counts0 = [getattr(state, c) for c in counters]
            t0, cpu0 = time.perf_counter(), time.process_time()
            llm.generate([prompt] * num_requests, params(temperature))
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            steps = engine.stats()["num_steps"] - steps0
            per = {k: (state.seconds[k] - before[k]) * 1e3 / steps for k in before}
            ahead, now, checked, rejected, forced, rejected_forced, redraws, puts, lazy, taken = (
                getattr(state, c) - c0 for c, c0 in zip(counters, counts0))
            rows = ahead + now + checked + forced  # constrained rows drawn
            host = per["bitmask"] + per["prefetch"] + per["redraw"]
            row = {"way": way, "temperature": temperature, "steps": steps, "step_ms": wall * 1e3 / steps,
                   "step_cpu_ms": cpu * 1e3 / steps, "worker_ms": per["worker"],
                   "host_ms": host, "wait_ms": per["wait"], "device_wait_ms": per["device"],
                   "step_mask_ms": per["bitmask"], "prefetch_ms": per["prefetch"], "check_ms": per["check"],
                   "redraw_dispatch_ms": per["redraw"] - per["check"], "reject_masks_ms": per["reject_masks"],
                   "rejected_forced_per_step": rejected_forced / steps,
                   "rejected_free_per_step": (rejected - rejected_forced) / steps, "redraws_per_step": redraws / steps,
                   "puts_per_step": puts / steps, "rejected_lazy_per_step": lazy / steps,
                   "candidates_taken_per_step": taken / steps,
                   "rejected_share": rejected / max(rows, 1), "forced_share": forced / max(rows, 1),
                   "checked_share": checked / max(rows, 1), "masked_share": (ahead + now) / max(rows, 1),
                   "constrained_rows_per_step": rows / steps, "load": os.getloadavg()[0]}
            results.append(row)
            print(f"{way + f', T={temperature:g}':>27} {steps:>6} {row['step_ms']:>8.1f} {row['step_cpu_ms']:>7.1f} "
                  f"{per['worker']:>7.2f} {host:>8.3f} "
                  f"{per['wait']:>7.3f} {per['bitmask']:>6.2f} {per['prefetch']:>6.2f} {per['check']:>6.2f} "
                  f"{row['redraw_dispatch_ms']:>6.2f} {per['reject_masks']:>6.2f} {row['rejected_share']:>9.1%} "
                  f"{row['forced_share']:>7.1%} {row['checked_share']:>8.1%} {row['masked_share']:>7.1%} "
                  f"{row['rejected_forced_per_step']:>4.1f}/{row['rejected_free_per_step']:<5.1f} {lazy / steps:>5.1f} "
                  f"{redraws / steps:>7.2f} {puts / steps:>5.2f} {taken / steps:>5.1f}")
    state.sample_first = state.masks_ahead = state.candidates = True
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"benchmark": "bench_structured_host --engine", "model": "bundled SmolLM2-135M Q4_1 GGUF",
                       "device": "cpu", "cpus": os.cpu_count(), "num_requests": num_requests,
                       "max_tokens": max_tokens, "schema": SCHEMA, "results": results}, f, indent=1)
        print(f"wrote {out_path}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--gaps-ms", type=float, nargs="*", default=[0.5, 1.0, 2.0])
    parser.add_argument("--engine", action="store_true", help="also time the real engine (SmolLM2, CPU)")
    parser.add_argument("--engine-only", action="store_true", help="only the real engine")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="the engine run's")
    parser.add_argument("--first-only", action="store_true", help="only the synthetic sample-first rows")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "structured_host_cpu.json"),
                        help="the engine run's JSON")
    args = parser.parse_args()
    if args.engine_only:
        run_engine(64, 32, args.out, tuple(args.temperatures))
        return
    tokenizer = Tokenizer.from_gguf(default_model_path())
    compiler = GrammarCompiler(make_ll_tokenizer(tokenizer.backend, tokenizer.vocab_size, tokenizer.eos_token_id))
    rng = np.random.default_rng(0)
    print(f"structured host cost per step, SmolLM2 tokenizer ({tokenizer.vocab_size} tokens), cached JSON schema, "
          f"{args.steps} steps, {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}")
    print("wall: the engine thread's time in bitmask() + prefetch(); cpu: the masks' CPU time, all threads")
    print(f"{'way':>21} {'rows':>5} {'wall p50 ms':>12} {'wall p90 ms':>12} {'cpu p50 ms':>11} {'cpu/row us':>11}")
    for gap_ms in [] if args.first_only else [None] + args.gaps_ms:
        way = "at dispatch" if gap_ms is None else f"ahead, gap {gap_ms:g}"
        for num_rows in (0, 1, 16, 64):
            times, cpu_times = run(num_rows, args.steps, tokenizer, compiler, rng, gap_ms)
            med, cpu = statistics.median(times), statistics.median(cpu_times)
            p90 = sorted(times)[int(0.9 * len(times))]
            print(f"{way:>21} {num_rows:>5} {med:>12.3f} {p90:>12.3f} {cpu:>11.3f} {cpu * 1e3 / max(num_rows, 1):>11.1f}")
    for reject, masks_ahead in ((0.22, False), (0.29, False), (0.22, True), (0.29, True)):
        times, cpu_times, share = run_first(64, args.steps, tokenizer, compiler, rng, 1.0, reject, masks_ahead)
        med, cpu = statistics.median(times), statistics.median(cpu_times)
        way = f"first, {share:.0%} rej" + (", ahead" if masks_ahead else "")
        print(f"{way:>21} {64:>5} {med:>12.3f} {sorted(times)[int(0.9 * len(times))]:>12.3f} "
              f"{cpu:>11.3f} {cpu * 1e3 / 64:>11.1f}")
    print(f"load after: {os.getloadavg()[0]:.1f}")
    if args.engine:
        run_engine(64, 32, args.out, tuple(args.temperatures))


if __name__ == "__main__":
    main()
