"""Writes tests/data/json_schemas.json: 60 JSON schemas of varied shape for structured-output tests.

    python tests/data/make_json_schemas.py

Shapes: nested objects, arrays with min/max items, enums, consts, integers and numbers with bounds,
string patterns and lengths, anyOf, optional fields, booleans and nulls. Every schema is finite
enough for a random model to finish well inside 200 tokens (strings have maxLength or a bounded
pattern, arrays maxItems, objects additionalProperties: false), so a test can demand that 100% of
the outputs complete, parse and validate. Seeded: the same file every run.
"""

import json
import os
import random

LEAVES = [
    lambda r: {"type": "string", "maxLength": r.randint(1, 6)},
    lambda r: {"type": "string", "minLength": 1, "maxLength": r.randint(2, 5)},
    lambda r: {"type": "string", "enum": r.sample(["red", "green", "blue", "cyan", "x y", "Ünï"], r.randint(2, 4))},
    lambda r: {"type": "string", "pattern": r.choice(["^[a-z]{2,5}$", "^\\d{3}-\\d{2}$", "^(ab|cd){1,3}x?$"])},
    lambda r: {"type": "string", "pattern": "^[A-Z][a-z]{0,3}$"},
    lambda r: {"type": "integer", "minimum": (lo := r.randint(-50, 50)), "maximum": lo + r.randint(0, 200)},
    lambda r: {"type": "integer", "exclusiveMinimum": 0, "maximum": 9},
    lambda r: {"type": "number", "minimum": -2.5, "maximum": 7.25},
    lambda r: {"type": "boolean"},
    lambda r: {"type": "null"},
    lambda r: {"enum": [1, "one", None, True]},
    lambda r: {"const": r.choice(["fixed", 42])},
]


def leaf(r):
    return r.choice(LEAVES)(r)


def value(r, depth):
    kind = r.random()
    if depth <= 0 or kind < 0.45:
        return leaf(r)
    if kind < 0.65:
        lo = r.randint(0, 2)
        return {"type": "array", "items": value(r, depth - 1), "minItems": lo, "maxItems": lo + r.randint(0, 2)}
    if kind < 0.8:
        return {"anyOf": [value(r, depth - 1), leaf(r)]}
    return obj(r, depth - 1)


def obj(r, depth):
    names = r.sample(["id", "name", "tags", "score", "ok", "meta", "kind", "items", "note", "x"], r.randint(1, 4))
    props = {n: value(r, depth) for n in names}
    required = [n for n in names if r.random() < 0.6]  # the rest are optional fields
    schema = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema


def schemas(count=60, seed=0):
    r = random.Random(seed)
    out = [obj(r, r.randint(0, 2)) for _ in range(count - 6)]
    out += [  # a few top-level non-objects
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 4},
        {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "integer", "minimum": 0, "maximum": 5}]},
        {"type": "string", "enum": ["alpha", "beta"]},
        {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
            "c": {"type": "integer", "minimum": 1, "maximum": 3}}, "required": ["c"], "additionalProperties": False}},
            "required": ["b"], "additionalProperties": False}}, "required": ["a"], "additionalProperties": False},
        {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}, "minItems": 2,
         "maxItems": 2},
        {"type": "object", "properties": {"n": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["n"],
         "additionalProperties": False},
    ]
    return out


if __name__ == "__main__":
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "json_schemas.json")
    with open(path, "w") as f:
        json.dump(schemas(), f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {path}")
