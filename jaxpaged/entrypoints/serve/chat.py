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
from jaxpaged.entrypoints.serve.tools import parse_tool_calls, render_messages, structured_spec, tool_mode

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = server_state(request)
    check_model(state, body.model)
    check_unsupported(body, UNSUPPORTED_CHAT_FIELDS)
    tokenizer = state.tokenizer
    mode, tool_name = tool_mode(body)
    try:
        messages = [{"role": m.role, "content": m.text(),
                     **{k: v for k in ("tool_calls", "tool_call_id", "name") if (v := getattr(m, k)) is not None}}
                    for m in body.messages]
        text = render_messages(tokenizer, messages, body.tools, mode)
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
                             prompt_param="messages", structured_outputs=structured_spec(body, mode, tool_name))
    calls_tools = mode in ("auto", "required", "named")
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
                if calls_tools:  # the text is held until a choice finishes (see _delta)
                    choices = [{"index": c.index, "logprobs": logprobs_of(c.token_ids, c.logprobs or []),
                                **_delta(c, mode, tool_name)}
                               for c, _ in deltas_to_send(output, done) if c.finish_reason is not None]
                else:
                    # Never an empty delta: a choice goes out with new text, its finish, or (asked
                    # for) the logprobs of tokens whose text is still held back ("content": "").
                    choices = [{"index": c.index, "delta": {"content": c.delta_text},
                                "logprobs": logprobs_of(c.delta_token_ids, new_lps), "finish_reason": c.finish_reason}
                               for c, new_lps in deltas_to_send(output, done)
                               if c.delta_text or c.finish_reason is not None or body.logprobs]
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
        "choices": [{"index": c.index, **_message(c, mode, tool_name),
                     "logprobs": logprobs_of(c.token_ids, c.logprobs or [])} for c in final.outputs],
        "usage": usage(final),
    }


def _message(c, mode: str, tool_name: str | None) -> dict:
    """A finished choice's message and finish_reason; tool calls when the output holds whole ones."""
    content, calls = (c.text, []) if c.finish_reason != "stop" else parse_tool_calls(c.text, mode, tool_name)
    if not calls:
        return {"message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason}
    return {"message": {"role": "assistant", "content": content, "tool_calls": calls}, "finish_reason": "tool_calls"}


def _delta(c, mode: str, tool_name: str | None) -> dict:
    """A streamed choice of a request with tools: its text is held until it finishes, then sent as
    one delta: the tool calls (each whole, as the last chunk of OpenAI's stream carries them) or
    the content."""
    message = _message(c, mode, tool_name)
    delta = {k: v for k, v in message["message"].items() if k != "role" and v is not None}
    if "tool_calls" in delta:
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
    return {"delta": delta, "finish_reason": message["finish_reason"]}
