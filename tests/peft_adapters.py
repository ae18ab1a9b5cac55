"""Random PEFT LoRA adapters over the tiny checkpoint (tests/tiny_checkpoint.py), saved as PEFT saves
them, and Hugging Face's greedy tokens under them: the oracle of the multi-LoRA tests."""

import torch
import transformers
import peft

# (name, rank, target modules, lora_alpha, use_rslora): different ranks, targets and scalings
ADAPTERS = [
    ("sql", 4, ["q_proj", "v_proj"], 8, False),
    ("poet", 8, ["o_proj", "gate_proj", "down_proj"], 16, True),
    ("chat", 2, ["k_proj", "up_proj", "q_proj"], 4, False),
]


def base_model(ckpt):
    return transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def randomized(model, seed: int, scale: float = 0.3):
    """Every LoRA factor drawn from N(0, scale^2) (PEFT's lora_B starts at zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    return model


def write_adapters(ckpt, tmp_path_factory) -> dict:
    """The ADAPTERS as PEFT directories over the checkpoint `ckpt`: {name: (directory, the PEFT model)}."""
    out = {}
    for seed, (name, r, targets, alpha, rslora) in enumerate(ADAPTERS):
        config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0)
        model = randomized(peft.get_peft_model(base_model(ckpt), config), seed=100 + seed).eval()
        directory = str(tmp_path_factory.mktemp(f"adapter_{name}"))
        model.save_pretrained(directory)
        out[name] = (directory, model)
    return out


def hf_greedy(model, tokenizer, prompt: str, num_tokens: int) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        for _ in range(num_tokens):
            next_id = model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, -num_tokens:].tolist()
