"""Structured outputs and tool calling on the server: request fields -> a grammar, outputs -> tool_calls.

    response_format {"type": "json_object"}                 -> StructuredOutputsParams(json_object=True)
    response_format {"type": "json_schema", "json_schema":  -> json=schema (the output always follows
                     {"schema": ..., "strict": ...}}           the schema, strict or not)
    structured_outputs {...} (vLLM's extra field)           -> StructuredOutputsParams(**it)
    tools + tool_choice "none"                              -> no constraint, tools not shown to the model
                        "auto" (default with tools)         -> tools in the prompt; Hermes/Qwen
                                                               `<tool_call>{"name", "arguments"}</tool_call>`
                                                               blocks parsed out of the output
                        "required"                          -> json: [{"name": one of the tools,
                                                               "arguments": its parameters}, ...] (1+;
                                                               1 with parallel_tool_calls=false; "auto"
                                                               then keeps the first call)
                        {"type": "function", "function": {"name": N}} -> json: N's parameters

Templates that know `tools` / `tool_calls` (Qwen, Hermes, Llama 3.1) get them as template
variables; others (SmolLM2's) get the Hermes format written into the messages: the tool list in a
system message, an assistant's calls as `<tool_call>` blocks, tool results as `<tool_response>`.
"""

from __future__ import annotations

import json
import re
import uuid

from jaxpaged.entrypoints.chat_prompts import open_final_message
from jaxpaged.entrypoints.serve.common import APIError
from jaxpaged.structured import StructuredOutputsParams

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def _functions(tools) -> dict[str, dict]:
    functions = {}
    for i, tool in enumerate(tools or ()):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                                "'parameters': {...}}}}", param="tools")
        functions[function["name"]] = function
    return functions


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def tool_mode(body) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named function or None)."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, f"tool_choice={choice!r} needs tools; pass tools or drop tool_choice",
                           param="tool_choice")
        return "none", None
    if choice is None or choice in ("auto", "none", "required"):
        return choice or "auto", None
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if name not in _functions(body.tools):
        raise APIError(400, f"tool_choice={choice!r} names no function of tools ({sorted(_functions(body.tools))}); "
                            "use 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
                       param="tool_choice")
    return "named", name


def structured_spec(body, mode: str = "none", name: str | None = None) -> StructuredOutputsParams | None:
    """The request's one output constraint, or None; 400 when two fields ask for different ones."""
    specs = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "json_object":
            specs.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif kind == "json_schema":
            schema = (response_format.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise APIError(400, "response_format json_schema needs json_schema.schema (a JSON schema object)",
                               param="response_format")
            specs.append(("response_format", _spec("response_format", json=schema)))
        elif kind != "text":
            raise APIError(400, f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema'",
                           param="response_format")
    if body.structured_outputs is not None:
        if not isinstance(body.structured_outputs, dict):
            raise APIError(400, "structured_outputs must be an object, e.g. {'regex': '[0-9]+'}",
                           param="structured_outputs")
        fields = {k: v for k, v in body.structured_outputs.items() if v is not None}
        specs.append(("structured_outputs", _spec("structured_outputs", **fields)))
    if mode == "required":
        calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": _parameters(f)},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for n, f in _functions(body.tools).items()]
        one = {} if getattr(body, "parallel_tool_calls", True) else {"maxItems": 1}
        specs.append(("tool_choice", _spec("tool_choice", json={"type": "array", "minItems": 1, **one,
                                                                "items": {"anyOf": calls}})))
    elif mode == "named":
        specs.append(("tool_choice", _spec("tool_choice", json=_parameters(_functions(body.tools)[name]))))
    if len(specs) > 1:
        raise APIError(400, f"{specs[0][0]} and {specs[1][0]} both constrain the output; use one",
                       param=specs[1][0])
    return specs[0][1] if specs else None


def _spec(param: str, **fields) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except (TypeError, ValueError) as err:
        raise APIError(400, f"{param}: {err}", param=param) from None


def render_messages(tokenizer, messages: list[dict], tools, mode: str, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **template_kwargs) -> str:
    """The prompt text: tools shown unless mode is "none", through the template or in Hermes form;
    `template_kwargs` (vLLM's chat_template_kwargs) are the template's variables;
    `continue_final_message` ends it right after the last message's content."""
    text = _rendered(tokenizer, messages, tools, mode, add_generation_prompt, template_kwargs)
    return open_final_message(text, messages) if continue_final_message else text


def _rendered(tokenizer, messages: list[dict], tools, mode: str, add_generation_prompt: bool,
              template_kwargs: dict) -> str:
    template = tokenizer.chat_template or ""
    shown = [t for t in (tools or ()) if mode != "none"]
    if "tool_calls" in template and "tools" in template:  # the template renders tools itself
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             **template_kwargs, **({"tools": shown} if shown else {}))
    rendered = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": _arguments(c)})
                              + "\n</tool_call>" for c in m["tool_calls"])
            rendered.append({"role": "assistant", "content": ((m.get("content") or "") + "\n" + calls).strip()})
        elif m["role"] == "tool":
            rendered.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            rendered.append({"role": m["role"], "content": m.get("content") or ""})
    if shown:
        listing = "\n".join(json.dumps(t) for t in shown)
        system = ("You may call one or more functions to assist with the user query. Function signatures are "
                  f"within <tools></tools>:\n<tools>\n{listing}\n</tools>\nFor each function call, return a JSON "
                  'object with the function name and arguments within <tool_call></tool_call> tags:\n<tool_call>\n'
                  '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": rendered[0]["content"] + "\n\n" + system}
        else:
            rendered.insert(0, {"role": "system", "content": system})
    return tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt, **template_kwargs)


def _arguments(call: dict) -> object:
    arguments = call["function"].get("arguments", "{}")
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return arguments


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments) -> dict:
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


def parse_tool_calls(text: str, mode: str, name: str | None, parallel: bool = True) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished output; ([], text) when it holds no parseable call.
    parallel=False (parallel_tool_calls): the first call only."""
    content, calls = _parse_tool_calls(text, mode, name)
    return content, calls if parallel else calls[:1]


def _parse_tool_calls(text: str, mode: str, name: str | None) -> tuple[str | None, list[dict]]:
    if mode == "named":
        return None, [_call(name, text)]
    if mode == "required":
        try:
            return None, [_call(c["name"], c["arguments"]) for c in json.loads(text)]
        except (ValueError, TypeError, KeyError):
            return text, []  # cut by max_tokens: not a whole call
    if mode != "auto" or "<tool_call>" not in text:
        return text, []
    calls = []
    for block in _TOOL_CALL.findall(text):
        try:
            call = json.loads(block)
            calls.append(_call(call["name"], call.get("arguments", {})))
        except (ValueError, TypeError, KeyError):
            return text, []  # not a well-formed call: the text goes out as content
    content = text[: text.index("<tool_call>")].strip()
    return content or None, calls
