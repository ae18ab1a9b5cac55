"""Tool calls streamed as OpenAI streams them: a call's first chunk carries its index, id, type and
function name (arguments ""), later chunks `function.arguments` fragments as they are generated.

    mode "named"     the whole output is the arguments:     {"city": "Oslo", ...}
    mode "required"  a JSON array of calls (the grammar's):  [{"name": "f", "arguments": {...}}, ...]
    mode "auto"      Hermes blocks after optional content:   text <tool_call>{"name": ..., "arguments": ...}</tool_call>

`ToolCallStream.feed(text)` takes a choice's whole text so far (it only grows) and returns what is
new: (content delta, tool-call deltas). The fragments of a call concatenate to the raw text of its
arguments value; in "auto" mode content is held back while it could be the start of `<tool_call>`
(and trailing whitespace, which the whole response strips before a block).
A call's header waits until its name is known. The finish (tools.parse_tool_calls on the whole
text) is the response's: a choice whose blocks turn out malformed sends its unsent text as content.
"""

from __future__ import annotations

import json

from jaxpaged.entrypoints.serve.tools import new_call_id

_OPEN = "<tool_call>"


def scan_call(text: str, start: int) -> tuple[str | None, int | None, int | None, int | None]:
    """Scans the JSON object `{"name": ..., "arguments": ...}` starting at or after text[start]
    (whitespace first); it may be unfinished. Returns (name once its string closed, start of the
    arguments value, its end, end of the object), each None while not yet seen.

        {"name": "f", "arguments": {"a": [1, 2]}}
                                   ^args_start     ^args_end  ^obj_end (exclusive)
    """
    name = args_start = args_end = None
    depth, in_string, escaped = 0, False, False
    key = string_start = value_key = None  # the depth-1 key being read / whose value is being read
    expect_key = True
    i = start
    while i < len(text):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                literal = text[string_start: i + 1]
                if depth == 1 and expect_key:
                    key = json.loads(literal)
                elif depth == 1 and value_key == "name":
                    name = json.loads(literal)
        elif ch == '"':
            in_string, string_start = True, i
            if depth == 1 and not expect_key and value_key == "arguments" and args_start is None:
                args_start = i
        elif ch in "{[":
            if depth == 1 and value_key == "arguments" and args_start is None:
                args_start = i
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 1 and value_key == "arguments" and args_end is None and args_start is not None:
                args_end = i + 1
            if depth == 0:
                if value_key == "arguments" and args_end is None and args_start is not None:
                    args_end = i  # a scalar value ends at the object's brace
                return name, args_start, args_end, i + 1
        elif depth == 1 and ch == ":":
            expect_key, value_key = False, key
        elif depth == 1 and ch == ",":
            if value_key == "arguments" and args_end is None and args_start is not None:
                args_end = i
            expect_key, value_key = True, None
        elif depth == 1 and not ch.isspace() and value_key == "arguments" and args_start is None:
            args_start = i  # a number, true, false or null
        i += 1
    return name, args_start, args_end, None


class ToolCallStream:
    """One choice's tool-call deltas, fed its growing text."""

    def __init__(self, mode: str, name: str | None, parallel: bool = True):
        self.mode, self.name = mode, name
        self.max_calls = None if parallel else 1  # parallel_tool_calls=false: the first call only
        self.calls: list[list] = []  # per call: [id, arguments characters sent]
        self.content_sent = 0  # characters of text sent as content ("auto")

    def _call_deltas(self, index: int, name: str | None, arguments: str) -> list[dict]:
        if name is None or (self.max_calls is not None and index >= self.max_calls):
            return []
        if index == len(self.calls):  # its first chunk: the header, with what is known of the arguments
            self.calls.append([new_call_id(), len(arguments)])
            return [{"index": index, "id": self.calls[index][0], "type": "function",
                     "function": {"name": name, "arguments": arguments}}]
        new = arguments[self.calls[index][1]:]
        self.calls[index][1] = len(arguments)
        return [{"index": index, "function": {"arguments": new}}] if new else []

    def _objects(self, text: str, start: int, separator: str):
        """Yields (name, arguments so far) of each call object from `start`, the next found after
        `separator` (e.g. "," between array items, "<tool_call>" between Hermes blocks)."""
        while True:
            brace = text.find("{", start)
            if brace < 0:
                return
            name, args_start, args_end, obj_end = scan_call(text, brace)
            arguments = "" if args_start is None else text[args_start: args_end if args_end is not None else len(text)]
            yield name, arguments
            if obj_end is None:
                return
            start = text.find(separator, obj_end)
            if start < 0:
                return

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.mode == "named":
            return "", self._call_deltas(0, self.name, text)
        deltas: list[dict] = []
        if self.mode == "required":
            objects = self._objects(text, 0, ",") if text.lstrip().startswith("[") else iter(())
            for index, (name, arguments) in enumerate(objects):
                deltas += self._call_deltas(index, name, arguments)
            return "", deltas
        first = text.find(_OPEN)  # "auto": content up to the first block, then the blocks
        end = len(text[: first if first >= 0 else len(text) - _held_back(text)].rstrip())  # spaces wait too
        content = text[self.content_sent: end] if end > self.content_sent else ""
        self.content_sent = max(self.content_sent, end)
        if first >= 0:
            for index, (name, arguments) in enumerate(self._objects(text, first + len(_OPEN), _OPEN)):
                deltas += self._call_deltas(index, name, arguments)
        return content, deltas

    def unsent_text(self, text: str) -> str:
        """At the finish of an "auto" choice whose blocks did not parse: the text not yet sent."""
        return text[self.content_sent:]


def _held_back(text: str) -> int:
    """Length of the longest suffix of text that starts `<tool_call>` (it may become a block)."""
    for n in range(min(len(_OPEN) - 1, len(text)), 0, -1):
        if _OPEN.startswith(text[-n:]):
            return n
    return 0
