"""What `LLM.generate` / `stream` / `beam_search` take as prompts, turned into token ids.

A prompt is text, a list of token ids, an integer numpy / JAX array (1-D: one prompt, 2-D: one
row per prompt), or vLLM's prompt dicts: `{"prompt": text}` (TextPrompt) and
`{"prompt_token_ids": ids}` (TokensPrompt, whose optional "prompt" text is kept as the prompt's
text); `prompts` is one prompt or a list of them. Every error says what to pass instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

Prompts = (str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]] | np.ndarray | jax.Array
           | Sequence[np.ndarray | jax.Array])


def normalize_prompts(prompts, tokenizer) -> list[tuple[str | None, list[int]]]:
    """(the text, or None for token ids; the token ids) of every prompt, in order."""
    result = []
    for i, prompt in enumerate(_prompt_list(prompts)):
        if isinstance(prompt, dict):
            result.append(_prompt_dict(prompt, i, tokenizer))
        elif isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is an empty string; give some text")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as err:  # a lone surrogate, e.g. half of a badly split emoji
                raise ValueError(
                    f"prompt {i} is not valid Unicode: {err.object[err.start:err.end]!r} at character "
                    f"{err.start} is a lone surrogate; fix the text (e.g. decode it with errors='replace')"
                ) from None
            result.append((prompt, tokenizer.encode(prompt)))
        else:
            result.append((None, _token_id_list(prompt, i)))
    return result


_PROMPTS_HELP = ("pass a string, a list of strings, a list of token ids, a list of token-id lists, "
                 "a 1-D / 2-D integer numpy or JAX array of token ids, or vLLM's {'prompt': text} / "
                 "{'prompt_token_ids': ids} dicts")
_DICT_KEYS = ("prompt", "prompt_token_ids")


def _prompt_dict(prompt: dict, i: int, tokenizer) -> tuple[str | None, list[int]]:
    """vLLM's TextPrompt / TokensPrompt. Keys this engine does not serve are refused, never dropped."""
    unknown = sorted(set(prompt) - set(_DICT_KEYS))
    if unknown:
        raise ValueError(f"prompt {i} has {', '.join(map(repr, unknown))}, which LLM.generate does not take "
                         f"(multimodal data, per-prompt cache salts and processor kwargs are not supported); "
                         f"pass only 'prompt' (text) or 'prompt_token_ids'")
    text = prompt.get("prompt")
    if text is not None and not isinstance(text, str):
        raise ValueError(f"prompt {i}'s 'prompt' is a {type(text).__name__}; it must be text "
                         f"(token ids go in 'prompt_token_ids')")
    if "prompt_token_ids" in prompt:
        return text, _token_id_list(prompt["prompt_token_ids"], i)
    if text is None:
        raise ValueError(f"prompt {i} is a dict without 'prompt' or 'prompt_token_ids'; {_PROMPTS_HELP}")
    return normalize_prompts(text, tokenizer)[0]


def _is_array(x) -> bool:
    return isinstance(x, (np.ndarray, jax.Array))


def _prompt_list(prompts) -> list:
    """One list entry per prompt: a str, or something `_token_id_list` takes."""
    if prompts is None:
        raise ValueError(f"prompts is None; {_PROMPTS_HELP}")
    if isinstance(prompts, (bytes, bytearray)):
        raise ValueError(f"prompts is {type(prompts).__name__}; decode it to str first, or {_PROMPTS_HELP}")
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if _is_array(prompts):
        if prompts.ndim == 1:
            return [prompts]
        if prompts.ndim == 2:
            return list(prompts)  # one row per prompt
        raise ValueError(f"a token-id array must be 1-D (one prompt) or 2-D (one row per prompt), got shape {prompts.shape}")
    prompts = list(prompts)
    if not prompts:
        raise ValueError(f"no prompts given; {_PROMPTS_HELP}")
    first = prompts[0]
    if isinstance(first, (int, np.integer)) or (_is_array(first) and first.ndim == 0):
        return [prompts]  # one prompt of token ids
    return prompts


def _token_id_list(prompt, i: int) -> list[int]:
    """Prompt `i`, given as token ids (a list, tuple or 1-D integer array), as a list of Python ints."""
    if isinstance(prompt, (bytes, bytearray)):
        raise ValueError(f"prompt {i} is {type(prompt).__name__}; decode it to str first, or {_PROMPTS_HELP}")
    if _is_array(prompt):
        if prompt.ndim != 1:
            raise ValueError(f"prompt {i} is an array of shape {prompt.shape}; a prompt of token ids must be 1-D")
        array = np.asarray(prompt)
    elif isinstance(prompt, (list, tuple)):
        for t in prompt:
            if isinstance(t, bool) or not (isinstance(t, (int, np.integer)) or _is_array(t) and t.ndim == 0):
                raise ValueError(f"prompt {i} holds {t!r} ({type(t).__name__}); token ids must be ints")
            if _is_array(t) and not np.issubdtype(t.dtype, np.integer):
                raise ValueError(f"prompt {i} holds {t!r}; token ids must be integers")
        array = np.asarray([int(t) for t in prompt], dtype=np.int64)
    else:
        raise ValueError(f"prompt {i} is a {type(prompt).__name__}; {_PROMPTS_HELP}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"prompt {i} has dtype {array.dtype}; token ids must be integers")
    return array.tolist()
