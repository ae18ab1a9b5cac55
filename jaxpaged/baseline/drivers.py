"""Drivers: serve a workload's requests through jaxpaged or the dense baseline, sampling every step.

    run_jaxpaged  the engine (continuous batching, paged KV), stepped by hand so each step is timed
    run_dense     the dense-cache baseline (dense_kv.py)

Both take the same requests, (prompt token ids, SamplingParams) pairs all arriving at t=0, and
return a `Run` (measure.py) that `summarize` turns into the reported figures, with each request's
tokens. `warmup_requests` is the untimed call each system gets first.
"""

from __future__ import annotations

import dataclasses
import time

from tqdm.auto import tqdm

from jaxpaged.baseline.dense_kv import DenseBaseline
from jaxpaged.baseline.measure import PHASES, CompileCounter, RequestTimes, Run, StepSample, live_tokens
from jaxpaged.planner.request import SamplingParams

Request = tuple[list[int], SamplingParams]


def warmup_requests(requests: list[Request]) -> list[Request]:
    """The untimed warm-up call: the first two requests, a few tokens each."""
    return [(p, dataclasses.replace(s, max_tokens=min(s.max_tokens, 4))) for p, s in requests[:2]]


def run_jaxpaged(engine, requests: list[Request], *, system: str, workload: str, capacity_tokens: int,
                 bar: tqdm | None = None) -> tuple[Run, list[list[int]]]:
    """Drives `engine` step by step over `requests` (all arriving at t=0), sampling its state after each step."""
    scheduler, block_manager = engine.scheduler, engine.block_manager
    page_size = block_manager.page_size
    last_schedule = {}
    schedule = scheduler.schedule

    def recording_schedule():  # keeps the step's plan, to tell prefill steps from decode steps
        out = schedule()
        last_schedule["out"] = out
        return out

    stats0, sched0, compiles0 = block_manager.stats(), scheduler.stats(), engine.runner.num_compiles
    host_bytes0 = engine.host_kv.num_bytes_out + engine.host_kv.num_bytes_in
    scheduler.schedule = recording_schedule
    steps: list[StepSample] = []
    try:
        with CompileCounter() as compiles:
            t0 = time.perf_counter()
            ids = [engine.add_request(p, s) for p, s in requests]
            times = {i: RequestTimes() for i in ids}
            tokens: dict[str, list[int]] = {}
            overhead = 0.0  # seconds spent here recording, left out of the wall time
            while engine.has_unfinished_requests():
                before = dict(engine.timings)
                outputs = engine.step()
                t_step = time.perf_counter()
                now = t_step - t0 - overhead
                num_out = 0
                for out in outputs:
                    rt, n = times[out.request_id], len(out.outputs[0].token_ids)
                    num_out += n - rt.num_output_tokens
                    if rt.first_token is None and n:
                        rt.first_token = now
                    rt.num_output_tokens = n
                    if out.finished:
                        rt.finish = now
                        tokens[out.request_id] = list(out.outputs[0].token_ids)
                plan = last_schedule["out"]
                running = scheduler.running
                steps.append(StepSample(
                    t=now, kind="decode" if max(plan.num_new_tokens, default=1) == 1 else "prefill",
                    num_output_tokens=num_out, num_computed_tokens=plan.num_batched_tokens, num_running=len(running),
                    num_live_tokens=live_tokens(running, page_size),
                    num_allocated_tokens=block_manager.stats()["num_used_pages"] * page_size,
                    phases={p: engine.timings[p] - before[p] for p in PHASES},
                ))
                if bar is not None:
                    bar.update(num_out)
                overhead += time.perf_counter() - t_step
            wall = time.perf_counter() - t0 - overhead
    finally:
        del scheduler.schedule  # back to the class's method
    stats, sched = block_manager.stats(), scheduler.stats()
    queries = stats["prefix_query_tokens"] - stats0["prefix_query_tokens"]
    hits = stats["prefix_hit_tokens"] - stats0["prefix_hit_tokens"]
    run = Run(
        system=system, workload=workload, wall_s=wall, num_prompt_tokens=sum(len(p) for p, _ in requests),
        steps=steps, requests=[times[i] for i in ids], kv_capacity_tokens=capacity_tokens,
        num_compiles=compiles.count,
        extra={
            "num_step_compiles_timed": engine.runner.num_compiles - compiles0,
            "preemptions": sched["num_preemptions"] - sched0["num_preemptions"],
            "recomputed_tokens": sched["num_recomputed_tokens"] - sched0["num_recomputed_tokens"],
            "prefix_hit_rate": round(hits / queries, 4) if queries else 0.0,
            "prefix_hit_tokens": hits,
            "prefix_hit_tokens_host": stats["prefix_hit_tokens_host"] - stats0["prefix_hit_tokens_host"],
            "swaps_out": sched["num_swaps_out"] - sched0["num_swaps_out"],
            "host_bytes_moved": engine.host_kv.num_bytes_out + engine.host_kv.num_bytes_in - host_bytes0,
        },
    )
    return run, [tokens[i] for i in ids]


def run_dense(baseline: DenseBaseline, requests: list[Request], *, system: str, workload: str,
              capacity_tokens: int, bar: tqdm | None = None) -> tuple[Run, list[list[int]]]:
    steps: list[StepSample] = []
    state = {"timings": dict(baseline.timings)}

    def on_step(step):
        now = time.perf_counter() - t0
        before, state["timings"] = state["timings"], dict(baseline.timings)
        steps.append(StepSample(
            t=now, kind=step.kind, num_output_tokens=step.num_output_tokens, num_computed_tokens=step.num_tokens,
            num_running=step.num_running, num_live_tokens=step.num_live_tokens,
            num_allocated_tokens=step.num_reserved_tokens,
            phases={p: baseline.timings[p] - before[p] for p in PHASES},
        ))
        if bar is not None:
            bar.update(step.num_output_tokens)

    compiles0 = baseline.num_compiles
    with CompileCounter() as compiles:
        t0 = time.perf_counter()
        outputs = baseline.generate([p for p, _ in requests], [s for _, s in requests], on_step=on_step)
        wall = time.perf_counter() - t0
    times = [RequestTimes(len(o.token_ids), o.first_token_time - t0, o.finish_time - t0) for o in outputs]
    run = Run(
        system=system, workload=workload, wall_s=wall, num_prompt_tokens=sum(len(p) for p, _ in requests),
        steps=steps, requests=times, kv_capacity_tokens=capacity_tokens, num_compiles=compiles.count,
        extra={"num_step_compiles_timed": baseline.num_compiles - compiles0, "preemptions": 0,
               "recomputed_tokens": 0, "prefix_hit_rate": 0.0, "batch_size": baseline.batch_size},
    )
    return run, [o.token_ids for o in outputs]
