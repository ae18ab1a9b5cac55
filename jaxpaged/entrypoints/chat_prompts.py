"""Chat conversations as prompts, as vLLM renders them: the template's text encoded without added
special tokens (the template writes the BOS), OpenAI text content parts joined, the last message
left open (`continue_final_message`), and the template variables a caller may not set.

`chat_prompts` is what `LLM.chat` runs; the CLI and the server use the pieces.
"""

from __future__ import annotations


def chat_prompt(tokenizer, conversation: list[dict], continue_final_message: bool = False, **template_kwargs) -> dict:
    """vLLM's TokensPrompt of one conversation: the chat template's text and its token ids, encoded
    without added special tokens (the template writes the BOS itself where the model wants one; a
    tokenizer that also adds one would start the prompt with two, as vLLM avoids).

    OpenAI's content parts (`[{"type": "text", "text": ...}, ...]`) are joined into one string, as
    vLLM's "string" content format does; any other part type is refused. `continue_final_message`:
    the text ends right after the last message's content (`open_final_message`).
    """
    if not isinstance(conversation, (list, tuple)):
        raise ValueError(f"a conversation must be a list of messages, got {type(conversation).__name__}")
    messages = [flat_message(m, i) for i, m in enumerate(conversation)]
    text = tokenizer.apply_chat_template(messages, **template_kwargs)
    if continue_final_message:  # the template closed the last message: cut its end-of-turn off
        text = open_final_message(text, messages)
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def flat_message(message, i: int):
    """`message` with OpenAI content parts joined into one string (unchanged when already text)."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    texts = []
    for part in message["content"]:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"chat message {i} has a content part of type {kind!r}; this model takes text "
                             "only: pass {'type': 'text', 'text': ...} parts or a string")
    return {**message, "content": "\n".join(texts)}


def open_final_message(text: str, conversation: list[dict]) -> str:
    """vLLM's continue_final_message: `text` (the template's rendering, no generation prompt) cut right
    after the last message's content, so the model continues that (assistant) message."""
    last = conversation[-1] if conversation else None
    final = flat_message(last, len(conversation) - 1).get("content") if isinstance(last, dict) else None
    if not isinstance(last, dict) or last.get("role") != "assistant" or not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message=True needs a last message with role 'assistant' and non-empty "
                         "text content")
    for piece in (final, final.strip()):  # a template may trim the content (Llama 3's does), as HF allows
        if piece in text:
            return text[: text.rindex(piece) + len(piece)]
    raise ValueError("continue_final_message=True: the chat template's output does not contain the last message's "
                     "content, so there is no place to continue it from")


# Names a chat template's caller sets itself: chat_template_kwargs may not (vLLM refuses the same,
# and a client's own template through it would bypass the server's refusal of request templates).
RESERVED_TEMPLATE_KWARGS = ("chat_template", "tokenize", "add_generation_prompt", "continue_final_message",
                            "messages", "tools", "documents")


def check_template_kwargs(kwargs: dict | None) -> dict:
    """chat_template_kwargs, refused (ValueError) if not a dict or if it sets a reserved name."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be a dict of template variables, got {type(kwargs).__name__}")
    reserved = sorted(set(kwargs) & set(RESERVED_TEMPLATE_KWARGS))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved}: those are arguments of their own "
                         "(or, for chat_template, not accepted from a request)")
    return dict(kwargs)


def chat_prompts(tokenizer, messages, *, chat_template: str | None, add_generation_prompt: bool,
                 continue_final_message: bool, tools: list[dict] | None, chat_template_kwargs: dict | None,
                 chat_template_content_format: str) -> list[dict]:
    """`LLM.chat`'s arguments (vLLM's) as one TokensPrompt per conversation; ValueError for what it
    cannot honour."""
    if chat_template_content_format not in ("auto", "string"):
        raise ValueError(f"chat_template_content_format={chat_template_content_format!r}: this engine renders "
                         "text content as a string; pass 'auto' or 'string'")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message=True continues the last message; it needs "
                         "add_generation_prompt=False")
    if not messages or isinstance(messages, (str, dict)):
        raise ValueError(
            f"messages={messages!r}; pass a conversation [{{'role': 'user', 'content': '...'}}, ...] or a list of them")
    conversations = [messages] if isinstance(messages[0], dict) else messages
    kwargs = check_template_kwargs(chat_template_kwargs)
    if tools is not None:
        kwargs["tools"] = tools
    return [chat_prompt(tokenizer, c, continue_final_message, add_generation_prompt=add_generation_prompt,
                        chat_template=chat_template, **kwargs) for c in conversations]
