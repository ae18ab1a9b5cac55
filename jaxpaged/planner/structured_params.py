"""StructuredOutputsParams: what a request's output must match (vLLM's name and fields).

Exactly one of json / json_object / regex / choice / grammar is set. Only the shape is checked here
(pure Python, at SamplingParams construction); whether a schema, regex or grammar is valid is
decided by the grammar engine at `add_request` (jaxpaged/structured/grammar.py), which raises a
ValueError naming it. A request parameter like the others of SamplingParams, so it lives with them
in the planner; jaxpaged.structured reads it, the planner never imports jaxpaged.structured.
"""

from __future__ import annotations

import dataclasses
import json as _json
from typing import Any, no_type_check

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@no_type_check  # __post_init__ raises ValueErrors that say what to do (see SamplingParams)
@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict | str | None = None  # a JSON schema (dict or its JSON text)
    json_object: bool | None = None  # any JSON object
    regex: str | None = None  # the whole output fullmatches this regex
    choice: list[str] | tuple[str, ...] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # a Lark grammar (llguidance's dialect; GBNF is converted)

    def __post_init__(self) -> None:
        set_kinds = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                f"structured_outputs sets {set_kinds or 'nothing'}; set exactly one of {', '.join(_KINDS)}"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json={self.json!r} must be a JSON schema: a dict or a JSON string")
        if isinstance(self.json, str):
            try:
                _json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON ({e}); pass a JSON schema") from None
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object={self.json_object!r} must be True or None")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs.{name}={value!r} must be a non-empty string")
        if self.choice is not None:
            if not (isinstance(self.choice, (list, tuple)) and self.choice
                    and all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(
                    f"structured_outputs.choice={self.choice!r} must be a non-empty list of non-empty strings"
                )
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal specs share one compiled grammar."""
        kind = self.kind
        value: Any = getattr(self, kind)
        if kind == "json":
            value = _json.loads(value) if isinstance(value, str) else value  # parses: checked above
            return kind, _json.dumps(value, sort_keys=True)
        if kind == "choice":
            return kind, _json.dumps(list(value))
        return kind, "" if kind == "json_object" else value

    def __hash__(self) -> int:  # json may be a dict: hash the canonical text
        return hash(self.key())
