"""POST /v1/completions: prompts (text or token ids, one or a list) in, their completions out, streamed or whole.

A list of prompts gives one choice per prompt (n per prompt: choice index = prompt index * n + j),
as OpenAI does. `echo=true` puts the prompt before the output, and with `logprobs` the prompt's
tokens and their logprobs before the output's (the engine's prompt_logprobs); `max_tokens=0` (echo
only) returns the prompt alone: how lm-eval scores loglikelihoods.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from jaxpaged.entrypoints.serve import rl_routes
from jaxpaged.entrypoints.serve.common import (
    APIError, EngineStreamResponse, base_request_id, check_model, check_unsupported, collect, deltas_to_send, sampling_params,
    server_state, sse, start, truncated_prompt,
)
from jaxpaged.entrypoints.serve.logprobs_format import completion_logprobs
from jaxpaged.entrypoints.serve.limits import RequestLimits, check_request_limits
from jaxpaged.entrypoints.serve.protocol import UNSUPPORTED_COMPLETION_FIELDS, CompletionRequest
from jaxpaged.entrypoints.serve.tools import structured_spec

router = APIRouter()


def _prompts(tokenizer, prompt, add_special_tokens: bool = True) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) of each prompt of the request."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty; send some text or token ids", param="prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            if not p:
                raise APIError(400, "a prompt is empty; send some text", param="prompt")
            out.append((p, tokenizer.encode(p, add_special_tokens=add_special_tokens)))
        else:
            out.append((None, list(p)))
    return out


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = server_state(request)
    lora = check_model(state, body.model)  # a LoRA adapter's name runs the request under it
    check_unsupported(body, UNSUPPORTED_COMPLETION_FIELDS)
    check_request_limits(body, state.limits or RequestLimits())
    tokenizer = state.tokenizer
    prompts = [(text, truncated_prompt(ids, body, state))
               for text, ids in _prompts(tokenizer, body.prompt, body.add_special_tokens)]
    if body.truncate_prompt_tokens is not None:  # the text no longer stands for the prompt
        prompts = [(None, ids) for _, ids in prompts]
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens=0 generates nothing; use it with echo=true (prompt logprobs) or ask "
                            "for >= 1 token", param="max_tokens")
    if body.max_tokens == 0 and body.stream:
        raise APIError(400, "max_tokens=0 cannot be streamed; set stream=false", param="stream")
    prompt_only = body.max_tokens == 0  # one token is generated and dropped
    want_prompt_logprobs = body.logprobs if body.echo else None
    rid, created = f"cmpl-{base_request_id(request, body.request_id)}", int(time.time())
    model = body.model if lora is not None else state.served_model_name
    streams = []
    try:
        for p, (_, token_ids) in enumerate(prompts):
            params = sampling_params(state, body, len(token_ids), 1 if prompt_only else body.max_tokens,
                                     logprobs=body.logprobs, prompt_param="prompt",
                                     prompt_logprobs=want_prompt_logprobs, structured_outputs=structured_spec(body))
            # vLLM's external id of prompt p is "<rid>-<p>"; the response's id names all its prompts
            streams.append(await start(state, token_ids, params, body.cache_salt, lora,
                                       external_ids=(f"{rid}-{p}", rid)))
    except BaseException:
        for stream in streams:
            stream.close()
        raise

    def ids_of(p: int, token_ids, first: bool) -> dict:  # vLLM's return_token_ids
        if not body.return_token_ids:
            return {}
        return {"token_ids": list(token_ids), **({"prompt_token_ids": prompts[p][1]} if first else {})}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def echo_text(p: int) -> str:
        text, token_ids = prompts[p]
        return text if text is not None else tokenizer.decode(token_ids)

    def logprobs_of(p, output, token_ids, entries, echo: bool):
        if body.logprobs is None:
            return None
        if echo:
            prompt_ids = prompts[p][1]
            prompt_entries = output.prompt_logprobs or [None] * len(prompt_ids)
            token_ids, entries = prompt_ids + list(token_ids), list(prompt_entries) + list(entries)
        return completion_logprobs(tokenizer, token_ids, entries)

    def usage_of(finals) -> dict:
        num_prompt = sum(len(f.prompt_token_ids) for f in finals)
        num_completion = 0 if prompt_only else sum(len(c.token_ids) for f in finals for c in f.outputs)
        return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
                "total_tokens": num_prompt + num_completion}

    def chunk(choices, usage_=None):
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": choices, **({"usage": usage_} if include_usage else {})}

    if body.stream:
        async def events():
            finals = []
            for p, stream in enumerate(streams):  # prompt by prompt; all run in the engine together
                final, done, echoed = None, set(), set()
                async for output in stream:
                    final = output
                    choices = []
                    for c, new_lps in deltas_to_send(output, done):
                        echo = body.echo and c.index not in echoed
                        if not (c.delta_text or echo or c.finish_reason is not None or body.logprobs is not None
                                or (body.return_token_ids and c.delta_token_ids)):
                            continue  # tokens whose text is held back, and no ids asked for: nothing to send yet
                        first = c.index not in echoed
                        echoed.add(c.index)
                        choices.append({
                            "index": p * body.n + c.index, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason, "text": (echo_text(p) if echo else "") + c.delta_text,
                            **ids_of(p, c.delta_token_ids, first),
                            "logprobs": logprobs_of(p, output, c.delta_token_ids, new_lps, echo)})
                    if choices:
                        yield sse(chunk(choices, None))
                if final is not None:
                    finals.append(final)
            if include_usage and finals:
                yield sse(chunk([], usage_of(finals)))
            yield "data: [DONE]\n\n"

        return EngineStreamResponse(events(), _AllStreams(streams))

    finals = []
    for stream in streams:
        final = await collect(stream, request)
        if final is None or not final.finished:
            for other in streams:
                other.close()
            return Response(status_code=499)  # the client is gone; nobody reads this
        finals.append(final)
    choices = []
    for p, final in enumerate(finals):
        for c in final.outputs:
            token_ids, entries, text = c.token_ids, c.logprobs or [], c.text
            if prompt_only:
                token_ids, entries, text = [], [], ""
            choices.append({
                "index": p * body.n + c.index, "finish_reason": "length" if prompt_only else c.finish_reason,
                "stop_reason": None if prompt_only else c.stop_reason, **ids_of(p, token_ids, True),
                "text": (echo_text(p) if body.echo else "") + text,
                "logprobs": logprobs_of(p, final, token_ids, entries, body.echo)})
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage_of(finals), **rl_routes.response_fields(finals)}


class _AllStreams:
    """The request streams of one response, closed together when it ends."""

    def __init__(self, streams):
        self.streams = streams

    def close(self) -> None:
        for stream in self.streams:
            stream.close()
