"""The tokenizer the engine uses: encode, decode, stream-decode, and the chat template.

One class over a `tokenizers.Tokenizer` (the Rust fast tokenizer), built from the metadata of a GGUF
file (the bundled default model ships no tokenizer.json), from a Hugging Face directory's
tokenizer.json, or from a `transformers` tokenizer object. Host side: no jax, no torch, and so no
transformers either (importing its tokenizer classes imports torch when installed).

A GGUF byte-level BPE tokenizer ("gpt2" in llama.cpp's words) is rebuilt from:
- `tokenizer.ggml.tokens`: the vocabulary, id = index, spelled in GPT-2's byte alphabet
  (byte 0x20 ' ' is 'Ġ', ...);
- `tokenizer.ggml.merges`: "a b" strings, best first;
- `tokenizer.ggml.token_type`: 3 = control (special, matched whole, dropped by skip_special_tokens),
  4 = user-defined (matched whole, kept in decoded text);
- `tokenizer.ggml.pre`: the pre-split rule; `tokenizer.chat_template`: the jinja template.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from jaxpaged.models.detokenizer import ByteLevelDetokenizer, IncrementalDetokenizer, byte_level_table
from jaxpaged.models.gguf import open_gguf, read_metadata

_CONTROL = 3  # llama.cpp token types
_USER_DEFINED = 4

# llama.cpp pre-tokenizer names whose regex isolates every digit before the GPT-2 split
# (SmolLM's tokenizer.json: Digits(individual_digits=True) then ByteLevel).
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "codeshell")


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template.

    `encode(text, add_special_tokens=True)` adds what the model's tokenizer adds (a BOS where the
    model wants one; SmolLM2 adds nothing). Special-token strings in the text (`<|im_start|>`) are
    matched whole, as Hugging Face does, so a rendered chat template encodes correctly.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None,
        extra_template_tokens: dict[str, str] | None = None,
        clean_up_tokenization_spaces: bool = False,
    ):
        self.backend = backend
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token is not None else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token is not None else None
        self.chat_template = chat_template
        self._template_tokens = {"bos_token": bos_token or "", "eos_token": eos_token or ""}
        self._template_tokens.update(extra_template_tokens or {})
        self._compiled_template = None
        self._token_bytes: list[bytes] | None = None  # built on first use by detokenizer()
        self._special_ids: frozenset[int] = frozenset()

    # ---- constructors ------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path_or_metadata) -> Tokenizer:
        """From a GGUF file path, or from its metadata dict (`gguf.read_metadata`) to read it once."""
        if isinstance(path_or_metadata, dict):
            metadata = path_or_metadata
        else:
            metadata = read_metadata(open_gguf(path_or_metadata))
        model_type = metadata.get("tokenizer.ggml.model")
        if model_type != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {model_type!r} is not supported (only byte-level BPE, 'gpt2'); "
                "use the model's Hugging Face directory, whose tokenizer.json transformers can read"
            )
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        token_types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]

        vocab = {token: token_id for token_id, token in enumerate(tokens)}
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if metadata.get("tokenizer.ggml.pre") in _DIGIT_SPLIT_PRE:
            backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            backend.pre_tokenizer = byte_level
        backend.decoder = decoders.ByteLevel()

        # A control token spelled outside the byte alphabet would be a llama.cpp mislabel; adding
        # it could not change the vocabulary size anyway since every token already has its id.
        backend.add_special_tokens(
            [
                tokenizers.AddedToken(token, special=True, normalized=False)
                for token, kind in zip(tokens, token_types)
                if kind == _CONTROL
            ]
        )
        backend.add_tokens(
            [
                tokenizers.AddedToken(token, special=False, normalized=False)
                for token, kind in zip(tokens, token_types)
                if kind == _USER_DEFINED
            ]
        )

        def token_at(key: str) -> str | None:
            token_id = metadata.get(f"tokenizer.ggml.{key}")
            return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

        bos_token = token_at("bos_token_id")
        if metadata.get("tokenizer.ggml.add_bos_token", False) and bos_token is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos_token} $A", pair=f"{bos_token} $A $B", special_tokens=[(bos_token, vocab[bos_token])]
            )
        extra = {name: tok for name, key in (("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))
                 if (tok := token_at(key)) is not None}
        return cls(
            backend,
            bos_token=bos_token,
            eos_token=token_at("eos_token_id"),
            chat_template=metadata.get("tokenizer.chat_template"),
            extra_template_tokens=extra,
        )

    @classmethod
    def from_hf_dir(cls, directory: str) -> Tokenizer:
        """From a Hugging Face model directory's `tokenizer.json` and `tokenizer_config.json`.

        Reads the files itself (no transformers, which would import torch). The chat template is
        taken from `tokenizer_config.json`, else `chat_template.jinja`, else `chat_template.json`.
        """
        tokenizer_json = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(tokenizer_json):
            raise FileNotFoundError(
                f"{directory!r} has no tokenizer.json; jaxpaged reads only fast tokenizers: save one with "
                "transformers (AutoTokenizer.from_pretrained(dir).save_pretrained(dir)) or pass a tokenizer"
            )
        backend = tokenizers.Tokenizer.from_file(tokenizer_json)
        config = _read_json(os.path.join(directory, "tokenizer_config.json"))
        special_map = _read_json(os.path.join(directory, "special_tokens_map.json"))

        def token(name: str) -> str | None:
            value = config.get(name) or special_map.get(name)
            return value.get("content") if isinstance(value, dict) else value

        template = config.get("chat_template")
        jinja_path = os.path.join(directory, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_path):
            with open(jinja_path) as f:
                template = f.read()
        if template is None:
            template = _read_json(os.path.join(directory, "chat_template.json")).get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            template = {entry["name"]: entry["template"] for entry in template}.get("default")
        extra = {name: tok for name in ("unk_token", "pad_token") if (tok := token(name)) is not None}
        return cls(
            backend,
            bos_token=token("bos_token"),
            eos_token=token("eos_token"),
            chat_template=template,
            extra_template_tokens=extra,
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        )

    @classmethod
    def from_hf(cls, hf_tokenizer) -> Tokenizer:
        """From a `transformers` fast tokenizer (e.g. `AutoTokenizer.from_pretrained(model_dir)`)."""
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(
                f"{type(hf_tokenizer).__name__} is a slow (Python) tokenizer; jaxpaged needs a fast one: "
                "add tokenizer.json to the model directory or load it with use_fast=True"
            )
        template = hf_tokenizer.chat_template
        if isinstance(template, dict):  # several named templates: the default one is the chat one
            template = template.get("default")
        extra = {name: str(getattr(hf_tokenizer, name)) for name in ("unk_token", "pad_token")
                 if getattr(hf_tokenizer, name, None) is not None}
        return cls(
            backend,
            bos_token=None if hf_tokenizer.bos_token is None else str(hf_tokenizer.bos_token),
            eos_token=None if hf_tokenizer.eos_token is None else str(hf_tokenizer.eos_token),
            chat_template=template,
            extra_template_tokens=extra,
            clean_up_tokenization_spaces=bool(getattr(hf_tokenizer, "clean_up_tokenization_spaces", False)),
        )

    # ---- encode / decode ----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (base vocabulary plus added tokens)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:  # old BERT-era option some configs still set
            for spaced, joined in _CLEAN_UP:
                text = text.replace(spaced, joined)
        return text

    # ---- Hugging Face's spellings, for code written against vLLM's get_tokenizer() ------------

    def __len__(self) -> int:
        return self.vocab_size

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> dict:
        """{"input_ids": ids} (a list of them for a list of texts), as a Hugging Face tokenizer's call."""
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}
        return {"input_ids": [self.encode(t, add_special_tokens=add_special_tokens) for t in text]}

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in sequences]

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.backend.token_to_id(tokens)
        return [self.backend.token_to_id(t) for t in tokens]

    @property
    def all_special_tokens(self) -> list[str]:
        """The named special tokens (bos, eos, unk, pad), as Hugging Face lists them."""
        named = (self._template_tokens.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token"))
        return list(dict.fromkeys(t for t in named if t and self.backend.token_to_id(t) is not None))

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self.backend.token_to_id(t) for t in self.all_special_tokens)

    @property
    def pad_token_id(self) -> int | None:
        pad = self._template_tokens.get("pad_token")
        return self.backend.token_to_id(pad) if pad else None

    def detokenizer(self, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        """A streaming decoder for one sequence's output tokens: `.step(token_id) -> str`, `.flush()`.

        A plain byte-level BPE (every GGUF tokenizer jaxpaged reads) streams through a per-token byte
        table (`ByteLevelDetokenizer`, ~20x cheaper per token); anything else decodes windows with
        the backend (`IncrementalDetokenizer`). Both emit exactly what `decode` gives.
        """
        if not self.clean_up_tokenization_spaces and isinstance(self.backend.decoder, decoders.ByteLevel):
            if self._token_bytes is None:
                self._token_bytes, self._special_ids = byte_level_table(self.backend)
            return ByteLevelDetokenizer(self._token_bytes, self._special_ids if skip_special_tokens else frozenset())
        return IncrementalDetokenizer(self, list(prompt_token_ids), skip_special_tokens)

    # ---- chat template ------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` ([{"role": "user", "content": "..."}, ...]) to the prompt text, or with
        `tokenize=True` to its token ids (encoded without adding special tokens: the template writes
        them). Unlike Hugging Face's, the defaults are text and a generation prompt; pass
        `tokenize=True` for the ids a Hugging Face / vLLM caller expects from its default.

        Same jinja environment as Hugging Face's `apply_chat_template` (trim_blocks, lstrip_blocks,
        loop controls, `raise_exception`, `strftime_now`, a non-HTML-escaping `tojson`), with the
        special-token strings (`bos_token`, `eos_token`, ...) as variables. Encode the result with
        `add_special_tokens=False` when the template writes the BOS itself. `chat_template`: a jinja
        template to use instead of the model's.
        """
        if chat_template is not None:
            if not isinstance(chat_template, str) or not chat_template.strip():
                raise ValueError("chat_template must be a jinja template string (or None for the model's own)")
            compiled = _compile_template(chat_template)
        elif not self.chat_template:
            raise ValueError(
                "this model's tokenizer has no chat template; pass a plain prompt instead of messages"
            )
        else:
            if self._compiled_template is None:
                self._compiled_template = _compile_template(self.chat_template)
            compiled = self._compiled_template
        for i, message in enumerate(messages):
            # Templates read message['content'] unguarded: without this, a missing key is a jinja
            # UndefinedError that names neither the message nor the fix. (An assistant turn that
            # carries tool_calls may leave content out, as in OpenAI's format.)
            if not isinstance(message, dict) or "role" not in message or (
                "content" not in message and "tool_calls" not in message
            ):
                raise ValueError(
                    f"chat message {i} ({message!r}) needs a 'role' and a 'content', "
                    "e.g. {'role': 'user', 'content': 'Hello'}"
                )
        variables = dict(self._template_tokens)
        variables.update(template_kwargs)
        text = compiled.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **variables
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


# Hugging Face's `clean_up_tokenization_spaces`: drop the space a word-level tokenizer put before punctuation.
_CLEAN_UP = [(" " + p, p) for p in (".", "?", "!", ",", "n't", "'m", "'s", "'ve", "'re")] + [(" ' ", "'")]


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _compile_template(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
