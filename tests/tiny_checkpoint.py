"""A tiny random Llama checkpoint on disk (config.json, safetensors, tokenizer.json), for tests that
start `LLM`, the CLI or the server the way a user does: from a model path."""

import os


def write_tiny_checkpoint(directory: str, **shape) -> str:
    """Writes a 2-layer Llama (GQA 4/2, vocab 320) and a byte-level tokenizer with a chat template;
    `shape`: LlamaConfig fields that replace the tiny ones (e.g. hidden_size)."""
    import tokenizers
    import torch
    import transformers
    from tokenizers import decoders, models, pre_tokenizers

    os.makedirs(directory, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", bos_token="<bos>")
    fast.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    fast.save_pretrained(directory)
    config = transformers.LlamaConfig(**{
        **dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False),
        **shape, "eos_token_id": fast.eos_token_id, "bos_token_id": fast.bos_token_id})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # HF's init leaves norms at 1 and biases at 0: random values catch a mix-up
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * 0.2 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(directory, safe_serialization=True)
    return directory
