"""POST /v1/completions: one prompt (text or token ids) in, its completions out, streamed or whole."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from jaxpaged.entrypoints.serve.common import (
    APIError, EngineStreamResponse, check_model, collect, deltas_to_send, sampling_params, server_state, sse, start,
    text_offsets, token_strings, usage,
)
from jaxpaged.entrypoints.serve.protocol import CompletionRequest
from jaxpaged.entrypoints.serve.tools import structured_spec

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = server_state(request)
    check_model(state, body.model)
    tokenizer = state.tokenizer
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"{len(prompt)} prompts in one request; send one prompt per request",
                           param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt is empty; send some text", param="prompt")
        token_ids = tokenizer.encode(prompt)
    else:
        token_ids = list(prompt)
    if body.logprobs is not None and body.logprobs > 1:
        raise APIError(400, f"logprobs={body.logprobs}: only the chosen token's log-probability is available; "
                            "use logprobs=0 or 1", param="logprobs")
    if body.echo:
        raise APIError(400, "echo is not supported; drop it", param="echo")
    params = sampling_params(state, body, len(token_ids), body.max_tokens, logprobs=body.logprobs is not None,
                             prompt_param="prompt", structured_outputs=structured_spec(body))
    stream = await start(state, token_ids, params, body.cache_salt)
    rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), state.served_model_name
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def logprobs_of(token_ids, lps, text_offset0: int):
        if body.logprobs is None:
            return None
        tokens = token_strings(tokenizer, token_ids)
        offsets = text_offsets([len(t) for t in tokens], text_offset0)
        return {"tokens": tokens, "token_logprobs": lps, "text_offset": offsets,
                "top_logprobs": [{t: lp} for t, lp in zip(tokens, lps)] if body.logprobs else None}

    def chunk(choices, usage_=None):
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": choices, **({"usage": usage_} if include_usage else {})}

    if body.stream:
        async def events():
            final, done = None, set()  # done: choices whose finish_reason was sent
            async for output in stream:
                final = output
                choices = [{"index": c.index, "text": c.delta_text, "finish_reason": c.finish_reason,
                            "logprobs": logprobs_of(c.delta_token_ids, new_lps, 0)}
                           for c, new_lps in deltas_to_send(output, done)]
                if choices:
                    yield sse(chunk(choices, None))
            if include_usage and final is not None:
                yield sse(chunk([], usage(final)))
            yield "data: [DONE]\n\n"

        return EngineStreamResponse(events(), stream)

    final = await collect(stream, request)
    if final is None or not final.finished:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                     "logprobs": logprobs_of(c.token_ids, c.logprobs or [], 0)} for c in final.outputs],
        "usage": usage(final),
    }
