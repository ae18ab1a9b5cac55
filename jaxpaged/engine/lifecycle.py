"""A request's life after it is added: its sequences advance at dispatch and its tokens land at commit.

    LLMEngine.add_request ─► Scheduler.add (waiting, or waiting for its grammar)
                          ─► OutputProcessor.add_request (text state; a request is n samples)
    advance(step)  at dispatch: the scheduled tokens count as computed, sampled tokens become
                   placeholders, an n > 1 request's first token forks its sequence n - 1 times
                   (the children join the request as its samples and take their token-state slots)
    commit(step)   the step's tokens land (waits for the device):
                     features' before_commit           (read back what they dispatched; roll back)
                     Scheduler.commit                   placeholders filled, token-level stop rules
                                                        (planner/request.py), prefix-cache pages
                     features' amend_update             (tokens they appended, sequences they ended)
                     OutputProcessor.process            text, logprobs, stop strings, RequestOutputs
                     Scheduler.finish(stopped)          sequences a stop string ended
                     features' after_commit             (outputs they complete: beam searches)

Host only: the device arrays of a StepResult are read through numpy.
"""

from __future__ import annotations

import time

from jaxpaged.engine.output_processor import OutputProcessor
from jaxpaged.planner.scheduler import Scheduler
from jaxpaged.sample.logprobs import HostLogprobs


class RequestLifecycle:
    def __init__(self, scheduler: Scheduler, processor: OutputProcessor, sampler, features: list, timings: dict):
        self.scheduler, self.processor = scheduler, processor
        self.sampler = sampler  # sample/step_sampler.py: fan-out children take their token-state slots
        self.features = features  # engine/features.py, called in order
        self.timings = timings  # seconds per phase, shared with the engine ("device", "postprocess")
        self.num_generated_tokens = 0

    def advance(self, step) -> None:
        """At dispatch, after the step's sampler was called: Scheduler.advance and the forked samples."""
        t0 = time.perf_counter()
        out, entries = step.out, step.entries
        children = self.scheduler.advance(out, entries)
        owner = self.processor.owner
        forks = iter(children)
        for seq, entry in zip(out.seqs, entries):
            if isinstance(entry, list):  # an n > 1 request's first token: children 1..n-1, in order
                request, _ = owner[seq.seq_id]
                for _ in entry[1:]:
                    self.processor.add_sample(request, next(forks))
        if step.fan_out_slots:
            self.sampler.assign_children(out, entries, step.fan_out_slots, children)
        self.timings["postprocess"] += time.perf_counter() - t0

    def commit(self, step, only_finished: bool) -> list:
        """Reads a dispatched step's tokens back (waiting for the device) and applies them; returns the
        outputs that became known (only for finished requests with `only_finished`)."""
        t0 = time.perf_counter()
        tokens = step.read_tokens()  # waits for the device
        logprobs = HostLogprobs.read(step.logprobs) if step.logprobs is not None else None
        for feature in self.features:
            feature.before_commit(step)
        if step.prompt_chunks:
            self.processor.add_prompt_logprobs(HostLogprobs.read(step.prompt_logprobs), step.prompt_chunks)
        t1 = time.perf_counter()
        self.timings["device"] += t1 - t0

        update = self.scheduler.commit(step.out, tokens)
        for feature in self.features:
            feature.amend_update(step, update)
        self.num_generated_tokens += len(update.appended)
        outputs, stopped = self.processor.process(update.appended, update.rows, logprobs, only_finished=only_finished)
        for seq in stopped:
            self.scheduler.finish(seq, "stop")
        for feature in self.features:
            outputs += feature.after_commit(step)
        self.timings["postprocess"] += time.perf_counter() - t1
        return outputs
