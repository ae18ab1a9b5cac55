"""POST /v1/chat/completions: a conversation through the model's chat template, streamed or whole."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from jaxpaged.entrypoints.serve import rl_routes
from jaxpaged.entrypoints.serve.common import (
    APIError, EngineStreamResponse, base_request_id, check_model, check_unsupported, collect, deltas_to_send, sampling_params,
    server_state, sse, start, truncated_prompt, usage,
)
from jaxpaged.entrypoints.chat_prompts import check_template_kwargs
from jaxpaged.entrypoints.serve.logprobs_format import chat_logprobs
from jaxpaged.entrypoints.serve.limits import RequestLimits, check_request_limits
from jaxpaged.entrypoints.serve.protocol import UNSUPPORTED_CHAT_FIELDS, ChatCompletionRequest
from jaxpaged.entrypoints.serve.tool_stream import ToolCallStream
from jaxpaged.entrypoints.serve.tools import parse_tool_calls, render_messages, structured_spec, tool_mode

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = server_state(request)
    lora = check_model(state, body.model)  # a LoRA adapter's name runs the request under it
    check_unsupported(body, UNSUPPORTED_CHAT_FIELDS)
    check_request_limits(body, state.limits or RequestLimits())
    tokenizer = state.tokenizer
    mode, tool_name = tool_mode(body)
    try:
        template_kwargs = check_template_kwargs(body.chat_template_kwargs)
    except ValueError as err:
        raise APIError(400, str(err), param="chat_template_kwargs") from None
    if body.continue_final_message and body.add_generation_prompt:
        raise APIError(400, "continue_final_message=true continues the last message; it needs "
                            "add_generation_prompt=false", param="continue_final_message")
    try:
        messages = [{"role": m.role, "content": m.text(),
                     **{k: v for k in ("tool_calls", "tool_call_id", "name") if (v := getattr(m, k)) is not None}}
                    for m in body.messages]
        text = render_messages(tokenizer, messages, body.tools, mode, add_generation_prompt=body.add_generation_prompt,
                               continue_final_message=body.continue_final_message, **template_kwargs)
    except ValueError as err:
        raise APIError(400, str(err), param="messages") from None
    except Exception as err:  # the template raised (e.g. roles out of order)
        raise APIError(400, f"the chat template rejected these messages: {err}", param="messages") from None
    # The template writes the BOS: encoded without special tokens unless asked (vLLM's default).
    token_ids = truncated_prompt(tokenizer.encode(text, add_special_tokens=body.add_special_tokens), body, state)
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, f"top_logprobs={body.top_logprobs} needs logprobs=true", param="top_logprobs")
    top_n = body.top_logprobs or 0
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = sampling_params(state, body, len(token_ids), max_tokens, logprobs=top_n if body.logprobs else None,
                             prompt_param="messages", structured_outputs=structured_spec(body, mode, tool_name))
    calls_tools = mode in ("auto", "required", "named")
    tool_how = (mode, tool_name, body.parallel_tool_calls)
    rid, created = f"chatcmpl-{base_request_id(request, body.request_id)}", int(time.time())
    model = body.model if lora is not None else state.served_model_name
    stream = await start(state, token_ids, params, body.cache_salt, lora, external_ids=(rid,))
    ids_of = (lambda ids: {"token_ids": list(ids)}) if body.return_token_ids else (lambda ids: {})
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def logprobs_of(token_ids, lps):
        return chat_logprobs(tokenizer, token_ids, lps, top_n) if body.logprobs else None

    def chunk(choices, usage_=None):
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": choices, **({"usage": usage_} if include_usage else {})}

    if body.stream:
        async def events():
            first = chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for j in range(body.n)])
            yield sse({**first, "prompt_token_ids": token_ids} if body.return_token_ids else first)
            final, done = None, set()  # done: choices whose finish_reason was sent
            tool_streams = {j: ToolCallStream(*tool_how) for j in range(body.n)} if calls_tools else None
            async for output in stream:
                final = output
                if calls_tools:  # content and tool-call fragments as they are generated (tool_stream.py)
                    choices = [{"index": c.index, "logprobs": logprobs_of(c.delta_token_ids, new_lps),
                                **_tool_delta(c, tool_streams[c.index], tool_how), "stop_reason": c.stop_reason,
                                **ids_of(c.delta_token_ids)}
                               for c, new_lps in deltas_to_send(output, done)]
                    choices = [c for c in choices if c["delta"] or c["logprobs"] or c["finish_reason"] is not None
                               or c.get("token_ids")]
                else:
                    # Never an empty delta: a choice goes out with new text, its finish, or (asked
                    # for) the logprobs or ids of tokens whose text is still held back ("content": "").
                    choices = [{"index": c.index, "delta": {"content": c.delta_text},
                                "logprobs": logprobs_of(c.delta_token_ids, new_lps), "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason, **ids_of(c.delta_token_ids)}
                               for c, new_lps in deltas_to_send(output, done)
                               if c.delta_text or c.finish_reason is not None or body.logprobs
                               or (body.return_token_ids and c.delta_token_ids)]
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
        "choices": [{"index": c.index, **_message(c, *tool_how), "stop_reason": c.stop_reason,
                     "logprobs": logprobs_of(c.token_ids, c.logprobs or []), **ids_of(c.token_ids)}
                    for c in final.outputs],
        "usage": usage(final), **({"prompt_token_ids": token_ids} if body.return_token_ids else {}),
        **rl_routes.response_fields([final]),
    }


def _message(c, mode: str, tool_name: str | None, parallel: bool) -> dict:
    """A finished choice's message and finish_reason; tool calls when the output holds whole ones.
    As OpenAI and vLLM: finish_reason "tool_calls" for "auto" and "required" calls, the output's own
    ("stop", "length") for a named tool_choice, whose output is always the call's arguments."""
    if mode == "named":
        _, calls = parse_tool_calls(c.text, mode, tool_name)  # one call
        message = {"role": "assistant", "content": None, "tool_calls": calls}
        return {"message": message, "finish_reason": c.finish_reason}
    content, calls = (c.text, []) if c.finish_reason != "stop" else parse_tool_calls(c.text, mode, tool_name, parallel)
    if not calls:
        return {"message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason}
    return {"message": {"role": "assistant", "content": content, "tool_calls": calls}, "finish_reason": "tool_calls"}


def _tool_delta(c, tool_stream: ToolCallStream, tool_how: tuple) -> dict:
    """A streamed choice of a request with tools: new content and tool-call fragments; at its
    finish, the finish_reason _message gives (and, for "auto" blocks that did not parse, the text
    not yet sent, as content)."""
    content, calls = tool_stream.feed(c.text)
    delta = {**({"content": content} if content else {}), **({"tool_calls": calls} if calls else {})}
    if c.finish_reason is None:
        return {"delta": delta, "finish_reason": None}
    finish = _message(c, *tool_how)["finish_reason"]
    if tool_how[0] == "auto" and finish != "tool_calls" and not tool_stream.calls:
        unsent = content + tool_stream.unsent_text(c.text)
        delta = {"content": unsent} if unsent else {}
    return {"delta": delta, "finish_reason": finish}
