"""Logprobs in OpenAI's two wire formats, from the engine's `{token_id: Logprob}` per position.

    chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}] x k}]}
    completions: {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}], "text_offset": [...]}

In completions the top dict holds the chosen token and the k most likely (k + 1 entries when the
chosen one is not among them), as vLLM's server does; with echo the prompt's tokens come first, the
first of them with null logprobs (nothing predicts it).
"""

from __future__ import annotations


def _piece(tokenizer, cache: dict, token_id: int) -> str:
    text = cache.get(token_id)
    if text is None:
        text = cache[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
    return text


def chat_logprobs(tokenizer, token_ids, entries, top_n: int) -> dict:
    """OpenAI chat `logprobs` of generated tokens: each with its `top_n` most likely (by rank)."""
    cache: dict[int, str] = {}
    content = []
    for token_id, entry in zip(token_ids, entries):
        token = _piece(tokenizer, cache, token_id)
        top = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank is not None and lp.rank <= top_n)
        content.append({
            "token": token, "logprob": entry[token_id].logprob, "bytes": list(token.encode()),
            "top_logprobs": [{"token": (piece := _piece(tokenizer, cache, t)), "logprob": lp,
                              "bytes": list(piece.encode())} for _, t, lp in top],
        })
    return {"content": content}


def completion_logprobs(tokenizer, token_ids, entries, text_offset0: int = 0) -> dict:
    """OpenAI completions `logprobs`; an entry None (the first prompt token under echo) gives nulls."""
    cache: dict[int, str] = {}
    tokens = [_piece(tokenizer, cache, t) for t in token_ids]
    offsets, offset = [], text_offset0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e[t].logprob for t, e in zip(token_ids, entries)],
        "top_logprobs": [None if e is None else {_piece(tokenizer, cache, t): lp.logprob for t, lp in e.items()}
                         for e in entries],
        "text_offset": offsets,
    }
