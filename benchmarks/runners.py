"""Runners: serve a workload's requests through one system, sampling every step.

    run_jaxpaged  the engine (continuous batching, paged KV), stepped by hand so each step is timed
    run_dense     the dense-cache baseline (benchmarks/dense_baseline.py)
    run_hf        Hugging Face `generate` in static batches (torch, the CPU peer)

Each returns a `Run` (benchmarks/common.py) that `summarize` turns into the reported figures.
"""

from __future__ import annotations

import time

from tqdm.auto import tqdm

from benchmarks.common import PHASES, CompileCounter, RequestTimes, Run, StepSample
from benchmarks.dense_baseline import DenseBaseline
from benchmarks.workloads import Request, live_tokens


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


def run_hf(model, requests: list[Request], *, batch_size: int, workload: str, capacity_tokens: int,
           bar: tqdm | None = None) -> Run:
    """Hugging Face `generate`, static batches of `batch_size` left-padded prompts, as a user would call it.

    Each batch generates as many tokens as its longest request asks for; a request keeps its own
    `max_tokens` (the rest is computed and thrown away). Per-step times come from a streamer.
    """
    import torch
    from transformers.generation.streamers import BaseStreamer

    steps: list[StepSample] = []
    times = [RequestTimes() for _ in requests]

    class StepClock(BaseStreamer):
        def __init__(self, batch: list[int], padded_len: int):
            self.batch, self.padded_len, self.num_puts = batch, padded_len, 0

        def put(self, value):
            self.num_puts += 1
            if self.num_puts == 1:  # the prompt itself
                return
            now = time.perf_counter() - t0
            step_idx = self.num_puts - 2  # tokens generated before this one
            num_out = 0
            live = 0
            for i in self.batch:
                wanted = requests[i][1].max_tokens
                if step_idx < wanted:
                    num_out += 1
                    times[i].num_output_tokens += 1
                    if times[i].first_token is None:
                        times[i].first_token = now
                    if step_idx == wanted - 1:
                        times[i].finish = now
                    else:
                        live += len(requests[i][0]) + step_idx + 1
            steps.append(StepSample(
                t=now, kind="prefill" if step_idx == 0 else "decode", num_output_tokens=num_out,
                num_computed_tokens=len(self.batch) * (self.padded_len if step_idx == 0 else 1),
                num_running=sum(1 for i in self.batch if step_idx < requests[i][1].max_tokens - 1),
                num_live_tokens=live, num_allocated_tokens=len(self.batch) * (self.padded_len + step_idx + 1),
                phases={},
            ))
            if bar is not None:
                bar.update(num_out)

        def end(self):
            pass

    with torch.inference_mode():
        t0 = time.perf_counter()
        for start in range(0, len(requests), batch_size):
            batch = list(range(start, min(start + batch_size, len(requests))))
            padded_len = max(len(requests[i][0]) for i in batch)
            input_ids = torch.zeros((len(batch), padded_len), dtype=torch.long)
            mask = torch.zeros((len(batch), padded_len), dtype=torch.long)
            for row, i in enumerate(batch):  # left padding
                prompt = requests[i][0]
                input_ids[row, padded_len - len(prompt):] = torch.tensor(prompt)
                mask[row, padded_len - len(prompt):] = 1
            new_tokens = max(requests[i][1].max_tokens for i in batch)
            temperature = requests[batch[0]][1].temperature
            sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
                dict(do_sample=False)
            model.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           pad_token_id=0, streamer=StepClock(batch, padded_len), **sampling)
        wall = time.perf_counter() - t0
    return Run(
        system="hf-transformers", workload=workload, wall_s=wall,
        num_prompt_tokens=sum(len(p) for p, _ in requests), steps=steps, requests=times,
        kv_capacity_tokens=capacity_tokens, extra={"batch_size": batch_size},
    )


# ----------------------------------------------------------------------------- building the systems
