"""What one request may ask of the server, checked before any work (tokenizing, grammar compiling,
queueing): past a limit, a 400 naming the field and the flag that raises it.

    field                                           limit (flag)
    stop: number of stop strings                    --max-stop-strings           (each is matched per token)
    stop: length of one stop string                 --max-stop-string-length     (characters)
    structured_outputs / response_format / tools    --max-structured-spec-bytes  (compiled to a grammar;
                                                                                   its JSON size)
    chat_template_kwargs                            --max-chat-template-kwargs-bytes (its JSON size)

Bounded elsewhere: the body (--max-body-bytes, 413) and its headers (--h11-max-header-count,
--h11-max-incomplete-event-size, 431: app.py), `n`
(max_num_seqs), logprobs (max_logprobs), prompt + max_tokens (max_model_len), requests in flight
(--max-waiting-requests, 503), and time in flight (--request-timeout).
"""

from __future__ import annotations

import dataclasses
import json

from jaxpaged.entrypoints.serve.common import APIError


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    max_stop_strings: int = 64
    max_stop_string_length: int = 1024  # characters
    max_structured_spec_bytes: int = 64 << 10  # JSON size of a structured-output spec (schema, regex, grammar, tools)
    max_chat_template_kwargs_bytes: int = 16 << 10  # JSON size

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field.name}={value!r} must be an int >= 1")


_FLAGS = {"max_stop_strings": "--max-stop-strings", "max_stop_string_length": "--max-stop-string-length",
          "max_structured_spec_bytes": "--max-structured-spec-bytes",
          "max_chat_template_kwargs_bytes": "--max-chat-template-kwargs-bytes"}


def _json_size(value) -> int:
    return len(json.dumps(value, ensure_ascii=False, default=str).encode("utf-8"))


def check_request_limits(body, limits: RequestLimits) -> None:
    """400 for the first field of a completions or chat body past a limit."""
    stop = getattr(body, "stop", None)
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if len(stops) > limits.max_stop_strings:
        raise APIError(400, f"{len(stops)} stop strings; this server takes at most {limits.max_stop_strings} "
                            f"({_FLAGS['max_stop_strings']})", param="stop")
    longest = max((len(s) for s in stops if isinstance(s, str)), default=0)
    if longest > limits.max_stop_string_length:
        raise APIError(400, f"a stop string of {longest} characters; this server takes at most "
                            f"{limits.max_stop_string_length} ({_FLAGS['max_stop_string_length']})", param="stop")
    for name in ("structured_outputs", "response_format", "tools"):
        value = getattr(body, name, None)
        if value is not None and (size := _json_size(value)) > limits.max_structured_spec_bytes:
            raise APIError(400, f"{name} is {size} bytes as JSON; this server compiles at most "
                                f"{limits.max_structured_spec_bytes} ({_FLAGS['max_structured_spec_bytes']})",
                           param=name)
    kwargs = getattr(body, "chat_template_kwargs", None)
    if kwargs is not None and (size := _json_size(kwargs)) > limits.max_chat_template_kwargs_bytes:
        raise APIError(400, f"chat_template_kwargs is {size} bytes as JSON; this server takes at most "
                            f"{limits.max_chat_template_kwargs_bytes} ({_FLAGS['max_chat_template_kwargs_bytes']})",
                       param="chat_template_kwargs")
