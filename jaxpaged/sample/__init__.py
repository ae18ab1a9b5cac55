"""Sampling: the one home of how a step turns logits into tokens (vLLM v1's vllm/v1/sample/).

How a step's rows flow through the pieces:

    scheduled sequences (planner)
         │  step_sampler.StepSampler.sample: one row per token drawn (n > 1 fan-out: n rows)
         ▼
    rows.row_spec ──► RowSpec per row ──sampler.make_sampling_arrays──► SamplingArrays (numpy, padded)
         │                             penalties.TokenSlots.slot_of ──► PenaltyArrays (penalized rows only)
         ▼
    logits [rows, vocab] ──► no logprobs, no penalties: rows.sample_padded ──► sampler.sample
                         └─► otherwise:                  sampler.sample_ext  (penalties.apply_penalties,
                                                         logprobs.token_logprobs, penalties.add_tokens)
                               each draws through: grammar mask ─► banned ids ─► greedy | temperature,
                               top-k, top-p, min-p ─► inverse_cdf (one uniform per row from (seed, step))
         ▼
    tokens int32 [num_out] (stay on the device) + logprobs arrays ──► engine commit:
                         logprobs.HostLogprobs.entry ──► {token_id: Logprob} per position

    sampler.py      the jitted sampler: sample, sample_ext (logprobs, penalties), sampling_logits,
                    apply_token_bitmask, beam_candidates
    inverse_cdf.py  one uniform per row -> one token (the blocked draw on the CPU)
    penalties.py    TokenState (device rows of counts, prompt mask, bias) and TokenSlots (which
                    sequence owns which row)
    rows.py         a step's RowSpecs, the padded calls (structured outputs' sample first and
                    redraw), row counts and warm-up
    logprobs.py     token_logprobs (device) and the host's HostLogprobs, TokenDecoder, prompt
                    targets and Logprob
    step_sampler.py StepSampler: a step's rows and which sampler runs

The model runner is never imported here: the functions that need it (rows.warmup_sampler,
StepSampler) take it as an argument.
"""
