"""POST /v1/chat/completions: a conversation through the model's chat template, streamed or whole."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from jaxpaged.entrypoints.serve.common import (
    APIError, EngineStreamResponse, check_model, check_unsupported, collect, deltas_to_send, sampling_params,
    server_state, sse, start, usage,
)
from jaxpaged.entrypoints.serve.logprobs_format import chat_logprobs
from jaxpaged.entrypoints.serve.protocol import UNSUPPORTED_CHAT_FIELDS, ChatCompletionRequest

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = server_state(request)
    check_model(state, body.model)
    check_unsupported(body, UNSUPPORTED_CHAT_FIELDS)
    tokenizer = state.tokenizer
    try:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ValueError as err:
        raise APIError(400, str(err), param="messages") from None
    except Exception as err:  # the template raised (e.g. roles out of order)
        raise APIError(400, f"the chat template rejected these messages: {err}", param="messages") from None
    token_ids = tokenizer.encode(text)
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, f"top_logprobs={body.top_logprobs} needs logprobs=true", param="top_logprobs")
    top_n = body.top_logprobs or 0
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = sampling_params(state, body, len(token_ids), max_tokens, logprobs=top_n if body.logprobs else None,
                             prompt_param="messages")
    stream = await start(state, token_ids, params, body.cache_salt)
    rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), state.served_model_name
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def logprobs_of(token_ids, lps):
        return chat_logprobs(tokenizer, token_ids, lps, top_n) if body.logprobs else None

    def chunk(choices, usage_=None):
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": choices, **({"usage": usage_} if include_usage else {})}

    if body.stream:
        async def events():
            yield sse(chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for j in range(body.n)]))
            final, done = None, set()  # done: choices whose finish_reason was sent
            async for output in stream:
                final = output
                choices = [{"index": c.index, "delta": {"content": c.delta_text} if c.delta_text else {},
                            "logprobs": logprobs_of(c.delta_token_ids, new_lps), "finish_reason": c.finish_reason}
                           for c, new_lps in deltas_to_send(output, done)]
                if choices:
                    yield sse(chunk(choices))
            if include_usage and final is not None:
                yield sse(chunk([], usage(final)))
            yield "data: [DONE]\n\n"

        return EngineStreamResponse(events(), stream)

    final = await collect(stream, request)
    if final is None or not final.finished:
        return Response(status_code=499)
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                     "logprobs": logprobs_of(c.token_ids, c.logprobs or []), "finish_reason": c.finish_reason}
                    for c in final.outputs],
        "usage": usage(final),
    }
