"""The Hugging Face peer: `generate` in static batches (torch), on the same requests as jaxpaged.

jaxpaged and the dense baseline are driven by jaxpaged/baseline/drivers.py; all three return a `Run`
(jaxpaged/baseline/measure.py) that `summarize` turns into the reported figures.
"""

from __future__ import annotations

import time

from tqdm.auto import tqdm

from benchmarks.workloads import Request
from jaxpaged.baseline.measure import RequestTimes, Run, StepSample


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
