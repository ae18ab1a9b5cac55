"""Converts a llama-family GGUF into a float32 Hugging Face directory that vLLM can load.

Run with the vLLM venv's python (it has torch and transformers; the project's env need not):

    .peers/vllm-venv/bin/python benchmarks/peers/convert_gguf.py MODEL.gguf OUT_DIR

transformers dequantizes the GGUF tensors (here Q4_1) to float32 on load, so the written weights are
exactly the values the quantized file encodes; jaxpaged dequantizes the same file, so both engines
run the same numbers.
"""

import os
import sys


def convert(gguf_path: str, out_dir: str) -> None:
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"GGUF not found: {gguf_path}; pass the path of SmolLM2-135M-Instruct.Q4_1.gguf")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers dequantizes GGUF tensors at load: every parameter must be a plain float32 tensor now.
    odd = [n for n, t in model.state_dict().items() if t.dtype != torch.float32]
    if odd:
        raise ValueError(f"tensors not dequantized to float32: {odd[:5]}; this transformers keeps them quantized")
    # Its GGUF "quantizer" only marks the model as loaded from GGUF, and refuses save_pretrained.
    model.hf_quantizer = None
    config = model.config
    # vLLM picks its model class from `architectures`; a GGUF-born config may leave it unset.
    config.architectures = [type(model).__name__]
    # The weights are dequantized now; a leftover quantization config would make vLLM expect GGUF tensors.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch.float32
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    print(f"[convert_gguf] wrote {out_dir}: {config.architectures[0]}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, float32")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: convert_gguf.py MODEL.gguf OUT_DIR")
    convert(sys.argv[1], sys.argv[2])
