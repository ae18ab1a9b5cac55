"""The GGUF-built tokenizer against Hugging Face's tokenizer for the same file, and streaming decode.

Oracle: `transformers.AutoTokenizer.from_pretrained(dir, gguf_file=name)`, which builds its
tokenizer from the same metadata with its own code. Fast suite: one real-model check.
"""

import os

import numpy as np

import pytest

from jaxpaged.models.loading import DEFAULT_MODEL_FILE, default_model_path
from jaxpaged.models.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading and   multiple   spaces  ",
    "tabs\tand\nnewlines\n\n\r\n",
    "naïve café résumé Ångström",
    "😀🚀👩‍👩‍👧‍👦 emoji with zero-width joiners",
    "日本語のテキストと中文字符",
    "한국어 텍스트",
    "def f(x):\n    return x**2  # square\n",
    "1234567890 3.14159 -42 1e-5 x=2024",
    "<|im_start|>user\nhi<|im_end|>",
    "text with <|endoftext|> inside",
    "",
    " ",
    "\u00a0no-break space and \u200bzero width",
    "Привет, мир! Ελληνικά",
    "مرحبا بالعالم",
    '{"json": [1, 2, {"a": null}]}',
    "<jupyter_code>print(1)<empty_output>",
    "a" * 50 + "b" * 3,
    "I'm sure you're right, they'll see we'd",
]
assert len(TEXTS) == 20


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_gguf(default_model_path())


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(default_model_path()), gguf_file=DEFAULT_MODEL_FILE)


def conversations(text):
    full = [
        {"role": "system", "content": "Be brief. " + text},
        {"role": "user", "content": text},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": text + "?"},
    ]
    return [full, full[1:2]]  # with a system prompt, and without (the template then adds its own)


def test_matches_hf_on_varied_text(tokenizer, hf_tokenizer):
    """Encode, decode, chat template and streaming decode all agree with HF on 20 strings."""
    for text in TEXTS:
        for add_special in (True, False):
            assert tokenizer.encode(text, add_special_tokens=add_special) == hf_tokenizer.encode(
                text, add_special_tokens=add_special
            ), text
        ids = tokenizer.encode(text)
        for skip in (True, False):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip)
        if "<|" not in text and "<jupyter" not in text:
            assert tokenizer.decode(ids) == text  # round trip where no special token is dropped
        for messages in conversations(text):
            for add_generation_prompt in (True, False):
                ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
                theirs = hf_tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=add_generation_prompt
                )
                assert ours == theirs
                assert tokenizer.encode(ours, add_special_tokens=False) == hf_tokenizer.encode(
                    theirs, add_special_tokens=False
                )
        detokenizer = tokenizer.detokenizer()
        streamed = "".join(detokenizer.step(token_id) for token_id in ids) + detokenizer.flush()
        assert streamed == tokenizer.decode(ids), text


def test_special_ids_and_sizes(tokenizer, hf_tokenizer):
    assert tokenizer.vocab_size == len(hf_tokenizer) == 49152
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<|im_start|>", 1)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert tokenizer.eos_token_id == hf_tokenizer.eos_token_id
    # SmolLM2 adds no BOS: the chat template writes <|im_start|> itself.
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)
    assert tokenizer.encode("<|im_end|>") == [2]  # a special token in text stays whole


def test_hugging_face_spellings_agree_with_hf(tokenizer, hf_tokenizer):
    """What code written against vLLM's get_tokenizer() (a Hugging Face tokenizer) calls."""
    ids = tokenizer.encode(TEXTS[9])
    assert len(tokenizer) == len(hf_tokenizer) and tokenizer.get_vocab() == hf_tokenizer.get_vocab()
    assert tokenizer.convert_ids_to_tokens(ids) == hf_tokenizer.convert_ids_to_tokens(ids)
    assert tokenizer.convert_ids_to_tokens(ids[0]) == hf_tokenizer.convert_ids_to_tokens(ids[0])
    tokens = hf_tokenizer.convert_ids_to_tokens(ids)
    assert tokenizer.convert_tokens_to_ids(tokens) == hf_tokenizer.convert_tokens_to_ids(tokens) == ids
    assert tokenizer.all_special_ids == sorted(hf_tokenizer.all_special_ids)
    assert set(tokenizer.all_special_tokens) == set(hf_tokenizer.all_special_tokens)
    assert tokenizer.pad_token_id == hf_tokenizer.pad_token_id
    assert tokenizer(TEXTS[0])["input_ids"] == hf_tokenizer(TEXTS[0])["input_ids"]
    assert tokenizer(TEXTS[:3])["input_ids"] == hf_tokenizer(TEXTS[:3])["input_ids"]
    assert tokenizer.batch_decode([ids, ids[:2]]) == hf_tokenizer.batch_decode([ids, ids[:2]], skip_special_tokens=True)


def test_streaming_holds_back_a_split_character(tokenizer):
    """An emoji spread over several byte tokens is emitted only once its last byte arrives."""
    ids = tokenizer.encode("a😀")
    detokenizer = tokenizer.detokenizer()
    out = [detokenizer.step(token_id) for token_id in ids]
    assert len(ids) >= 3, "the emoji must need several tokens for this test to mean anything"
    assert out[0] == "a"
    assert all(piece == "" for piece in out[1:-1])
    assert out[-1] == "😀"


def test_streaming_with_prompt_context_and_unfinished_tail(tokenizer):
    prompt = tokenizer.encode("Say:")
    output = tokenizer.encode(" héllo 😀")
    detokenizer = tokenizer.detokenizer(prompt)
    pieces = [detokenizer.step(token_id) for token_id in output[:-1]]  # the emoji's last byte never comes
    streamed = "".join(pieces)
    assert streamed.startswith(" héllo") and "\ufffd" not in streamed  # no prompt text, no broken char
    tail = detokenizer.flush()
    assert tail.endswith("\ufffd")  # the unfinished emoji, as `decode` renders it
    assert streamed + tail == tokenizer.decode(output[:-1])


def test_chat_template_helpers(tokenizer):
    # raise_exception is available to templates, as in Hugging Face.
    strict = Tokenizer(tokenizer.backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                       chat_template="{% if messages|length == 0 %}{{ raise_exception('no messages') }}{% endif %}"
                                     "{{ bos_token }}{{ messages[0]['content'] | tojson }}{{ eos_token }}")
    assert strict.apply_chat_template([{"role": "user", "content": "é\"x"}]) == '<|im_start|>"é\\"x"<|im_end|>'
    with pytest.raises(Exception, match="no messages"):
        strict.apply_chat_template([])
    bare = Tokenizer(tokenizer.backend, bos_token=None, eos_token=None, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.slow
def test_from_hf_directory_matches(tokenizer, hf_tokenizer, tmp_path):
    """The same tokenizer saved as a Hugging Face directory and read through `from_hf`."""
    import transformers

    hf_tokenizer.save_pretrained(tmp_path)
    from_dir = Tokenizer.from_hf(transformers.AutoTokenizer.from_pretrained(tmp_path))
    assert from_dir.eos_token_id == 2 and from_dir.chat_template == tokenizer.chat_template
    for text in TEXTS:
        assert from_dir.encode(text) == tokenizer.encode(text)
        assert from_dir.decode(tokenizer.encode(text)) == tokenizer.decode(tokenizer.encode(text))
    messages = conversations("hi")[0]
    assert from_dir.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)


def test_from_gguf_metadata_bos_merges_and_token_types():
    """A hand-made vocabulary: merges apply in order, BOS is added when the file asks, control
    tokens are special (dropped by skip_special_tokens), user-defined ones are whole but kept."""
    from tokenizers.pre_tokenizers import ByteLevel

    byte_tokens = sorted(ByteLevel.alphabet())
    tokens = ["<s>", "</s>", "<tool>"] + byte_tokens + ["ab", "abc", "Ġab"]
    types = [3, 3, 4] + [1] * (len(byte_tokens) + 3)
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": ["a b", "ab c", "Ġ ab"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}",
    }
    tok = Tokenizer.from_gguf(metadata)
    ab, abc, space_ab = tokens.index("ab"), tokens.index("abc"), tokens.index("Ġab")
    assert tok.encode("abc ab", add_special_tokens=False) == [abc, space_ab]
    assert tok.encode("abc") == [0, abc]  # BOS first
    assert tok.encode("ab<tool></s>", add_special_tokens=False) == [ab, 2, 1]
    assert tok.decode([0, ab, 2, 1]) == "ab<tool>"
    assert tok.decode([0, ab, 2, 1], skip_special_tokens=False) == "<s>ab<tool></s>"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<s>x</s>"
    with pytest.raises(ValueError, match="'llama' is not supported"):
        Tokenizer.from_gguf(dict(metadata, **{"tokenizer.ggml.model": "llama"}))


def test_byte_level_streaming_equals_decode_on_random_ids(tokenizer):
    """The byte-table detokenizer emits exactly `decode`, on any id sequence: special ids, lone
    bytes of multi-byte characters, invalid UTF-8 (rendered as U+FFFD, as `decode` does)."""
    from jaxpaged.models.detokenizer import ByteLevelDetokenizer, IncrementalDetokenizer

    rng = np.random.default_rng(0)
    detokenizer = tokenizer.detokenizer()
    assert isinstance(detokenizer, ByteLevelDetokenizer)
    single_byte_ids = [i for i, b in enumerate(tokenizer._token_bytes) if len(b) == 1 and b[0] >= 0x80]
    assert len(single_byte_ids) > 60, "the vocabulary spells every non-ASCII byte alone"
    for trial in range(200):
        ids = rng.integers(0, tokenizer.vocab_size, int(rng.integers(1, 12))).tolist()
        if trial % 2:  # mix in lone continuation / lead bytes and special tokens
            ids += rng.choice(single_byte_ids, 3).tolist() + [1, 2]
            rng.shuffle(ids)
        for skip in (True, False):
            fast = tokenizer.detokenizer(skip_special_tokens=skip)
            slow = IncrementalDetokenizer(tokenizer, [], skip)
            streamed = [fast.step(t) for t in ids]
            assert "".join(streamed) + fast.flush() == tokenizer.decode(ids, skip_special_tokens=skip), ids
            assert "".join(slow.step(t) for t in ids) + slow.flush() == tokenizer.decode(ids, skip_special_tokens=skip)
