"""Command line: `python -m jaxpaged.generate [--prompt TEXT ...] [options]`.

With no prompt it runs a short demo on the bundled SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from jaxpaged.config import (ATTENTION_BACKENDS, FP8_ACTIVATIONS, GGUF_ACTIVATIONS, KV_CACHE_DTYPE_ALIASES,
                             KV_CACHE_DTYPES, PREEMPTION_MODES, QUANTIZATIONS)

DEMO_PROMPT = "What is the capital of France?"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxpaged.generate",
        description="Batched generation with a paged KV cache (JAX). With no prompt, runs a short demo.",
    )
    src = p.add_argument_group("input")
    src.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    src.add_argument("--prompts-file", help="one prompt per line, or JSONL with a 'prompt' field per line")
    src.add_argument("--model", default=None,
                     help="a .gguf file, a local Hugging Face directory or a hub id (default: bundled SmolLM2-135M-Instruct)")
    src.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="apply the model's chat template (default: on when the model has one)")
    src.add_argument("--system", default=None, help="system message for --chat")

    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--min-tokens", type=int, default=0)
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-k", type=int, default=-1)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--n", type=int, default=1, help="samples per prompt")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--logprobs", type=int, nargs="?", const=0, default=None, metavar="K",
                   help="report each token's log-probability and its K most likely alternatives (0..20; bare: 0)")
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS to token ID's logit (repeatable)")
    s.add_argument("--allowed-token-ids", type=int, nargs="+", default=None, metavar="ID")
    s.add_argument("--beam-width", type=int, default=None,
                   help="beam search with this many beams (Hugging Face's semantics; sampling flags are ignored)")
    s.add_argument("--length-penalty", type=float, default=1.0, help="beam search: score = logprob / length ** this")

    add_engine_args(p)

    m = p.add_argument_group("several hosts (one process per host, all started alike; see README)")
    m.add_argument("--coordinator-address", default=None, help="host:port of process 0; turns on jax.distributed")
    m.add_argument("--num-processes", type=int, default=None)
    m.add_argument("--process-id", type=int, default=None)

    o = p.add_argument_group("output")
    o.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    o.add_argument("--json", action="store_true", help="one JSON object per output on stdout")
    o.add_argument("--verbose", action="store_true", help="log each step's scheduling decisions")
    return p


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags, shared with `python -m jaxpaged.serve`; `engine_args(args)` reads them back."""
    e = p.add_argument_group("engine")
    e.add_argument("--page-size", type=int, default=16)
    e.add_argument("--num-pages", type=int, default=None)
    e.add_argument("--max-num-seqs", type=int, default=None)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--no-async-scheduling", action="store_true",
                   help="wait for each step's tokens before planning the next (debugging)")
    e.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    e.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES + tuple(KV_CACHE_DTYPE_ALIASES), default="auto",
                   help="KV page storage: auto = the model dtype; int8 / float8_e4m3fn (vLLM's fp8, fp8_e4m3) = "
                        "quantized values plus a scale per token and KV head (about 2x the sequences of a bfloat16 "
                        "cache in the same memory)")
    e.add_argument("--quantization", "-q", choices=[q for q in QUANTIZATIONS if q], default=None,
                   help="gguf (a .gguf model's default, as in vLLM): keep its Q4_0 / Q4_1 / Q8_0 projections as their block "
                        "codes, dequantized layer by layer in each step to the same float values (0.75 bytes per weight "
                        "read for Q4, 1.25 for Q8_0); dequantize: a .gguf's weights dequantized at load (float weight updates); "
                        "fp8, compressed-tensors, awq, gptq: a Hugging Face checkpoint's own method (read from its "
                        "quantization_config when left out)")
    e.add_argument("--fp8-activations", choices=FP8_ACTIVATIONS, default=None,
                   help="FP8 checkpoints: float = W8A16 (the CPU's default), fp8 = W8A8 (the GPU's)")
    e.add_argument("--gguf-activations", choices=GGUF_ACTIVATIONS, default="float32",
                   help="a .gguf model's codes on the CPU: float32 activations (float32's tokens), or q8_1: each activation "
                        "row quantized to Q8_1 blocks and integer products summed (GGUF's own arithmetic, as vLLM's "
                        "GGUF kernels on a GPU and llama.cpp; 2.0-2.7x the float32 matmul rate, not float32's tokens)")
    e.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto")
    e.add_argument("--logprobs-mode", choices=["raw_logprobs", "processed_logprobs"], default="raw_logprobs",
                   help="logprobs of the model's distribution, or of the one each token was drawn from")
    e.add_argument("--tensor-parallel-size", type=int, default=1, help="devices to split the model over")
    e.add_argument("--data-parallel-size", type=int, default=1, help="whole-engine replicas, requests balanced")
    e.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default="recompute",
                   help="out of KV pages: recompute a victim later, or swap its pages to host memory and back")
    e.add_argument("--swap-space", type=float, default=None, metavar="GIB",
                   help="host memory for swapped pages in GiB, as vLLM's flag (with --preemption-mode swap; "
                        "default 4, at most 40%% of host memory)")
    e.add_argument("--host-cache-bytes", type=int, default=None, metavar="BYTES",
                   help="keep prefix-cache pages evicted from the device in this much host memory")
    e.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="default sampling parameters: auto = the model's generation_config.json, vllm = none, or "
                        "a directory holding a generation_config.json (a request's own values always win)")
    e.add_argument("--max-logprobs", type=int, default=20, metavar="K",
                   help="the most logprobs a request may ask for (vLLM's flag; at most 20)")
    e.add_argument("--override-generation-config", type=_json_object, default=None, metavar="JSON",
                   help='generation keys applied on top of --generation-config, Hugging Face names, e.g. '
                        '\'{"temperature": 0.5, "max_new_tokens": 64}\'')
    e.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_max": 4}\' or \'{"method": "draft_model", "model": PATH_OR_ID, '
                        '"num_speculative_tokens": 3}\' (optional "disable_by_batch_size": N)')
    e.add_argument("--structured-outputs-config", type=_json_object, default=None, metavar="JSON",
                   help='vLLM\'s flag: JSON schemas are strict by default (as vLLM\'s xgrammar: an object takes only '
                        'the keys it names unless additionalProperties says otherwise); \'{"backend": "guidance"}\' '
                        'lets objects take extra keys unless "disable_additional_properties": true')
    e.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (vLLM's flag; PEFT checkpoints)")
    e.add_argument("--max-loras", type=int, default=1, help="adapters on the device at once (one step mixes this many)")
    e.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank accepted")
    e.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept loaded on the host (default: --max-loras)")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}); pass a JSON object") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("pass a JSON object, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 3}'")
    return value


def engine_args(args) -> dict:
    """`LLM(args.model, **engine_args(args))`: the keyword arguments the engine flags stand for."""
    return dict(
        page_size=args.page_size, num_pages=args.num_pages, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend, async_scheduling=not args.no_async_scheduling,
        tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
        preemption_mode=args.preemption_mode, swap_space_bytes=None if args.swap_space is None else int(args.swap_space * (1 << 30)), host_cache_bytes=args.host_cache_bytes,
        logprobs_mode=args.logprobs_mode,
        speculative_config=args.speculative_config, generation_config=args.generation_config,
        override_generation_config=args.override_generation_config, max_logprobs=args.max_logprobs,
        quantization=args.quantization, gguf_activations=args.gguf_activations, fp8_activations=args.fp8_activations,
        structured_outputs_config=args.structured_outputs_config,
        enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
    )


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                if line.lstrip().startswith("{"):
                    try:
                        prompts.append(json.loads(line)["prompt"])
                    except (json.JSONDecodeError, KeyError) as err:
                        raise SystemExit(f"{args.prompts_file}:{line_no}: expected a JSON object with a 'prompt' field ({err})")
                else:
                    prompts.append(line)
    return prompts or [DEMO_PROMPT]


def configure_logging(verbose: bool) -> None:
    """Warnings from everyone; with --verbose, DEBUG from jaxpaged's logger only (not absl, orbax,
    jax's cache and compiler loggers, which would bury the planner's lines)."""
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s", stream=sys.stderr)
    log = logging.getLogger("jaxpaged")
    if verbose:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.propagate = False  # its own handler: the root stays at WARNING
        log.setLevel(logging.DEBUG)
    else:
        log.setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
    try:
        prompts = read_prompts(args)  # before the model loads: a bad file costs no load
    except OSError as err:
        print(f"error: cannot read --prompts-file: {err}", file=sys.stderr)
        return 2
    from jaxpaged.entrypoints.cli_checks import check_flags

    try:
        params, config, beam = check_flags(args, engine_args(args))  # the flags alone: no jax yet
    except ValueError as err:
        return _error(err)
    if args.coordinator_address:  # before anything starts a jax backend; every process runs this program
        import jax

        jax.distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
        if jax.process_index() != 0:  # one copy of the output, from process 0
            sys.stdout = open(os.devnull, "w")
    try:
        formatted = _check_prompts(args, prompts, config, beam)
    except (ValueError, OSError) as err:
        return _error(err)

    from jaxpaged.entrypoints.llm import LLM  # after the checks: importing and loading take a while

    try:
        t_load = time.perf_counter()
        llm = LLM(args.model, **engine_args(args))
        load_s = time.perf_counter() - t_load
        t0 = time.perf_counter()
        if beam is not None:
            return _beam_search(llm, prompts, formatted, beam, args, t0)
        if args.stream:
            outputs = _stream(llm, prompts, formatted, params, args)
        else:
            outputs = llm.generate(formatted, params, use_tqdm=not args.json and sys.stderr.isatty())
        elapsed = time.perf_counter() - t0
    except (ValueError, OSError) as err:  # what only the loaded engine can tell (e.g. too few devices)
        return _error(err)

    if not args.stream:  # --stream printed each completion as it came
        for prompt, out in zip(prompts, outputs):
            for c in out.outputs:
                print(json.dumps(_record(prompt, out, c, args), ensure_ascii=False) if args.json
                      else _completion_text(prompt, c, args))

    stats = llm.stats()
    num_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    hit = stats.get("prefix_hit_rate", 0.0)
    print(
        f"{len(outputs)} prompts, {num_tokens} tokens in {elapsed:.2f} s ({num_tokens / max(elapsed, 1e-9):.1f} tok/s); "
        f"prefix-cache hit rate {hit:.1%}, preemptions {stats.get('num_preemptions', 0)}; "
        f"load + compile {load_s:.1f} s",
        file=sys.stderr,
    )
    return 0


def _check_prompts(args, prompts: list[str], config, beam) -> list[str]:
    """The prompts as the model reads them (chat template applied), each checked against the limits
    the engine will have, using the model's config and tokenizer read from its files without the
    weights (seconds, not a load). ValueError / OSError otherwise."""
    from jaxpaged.entrypoints.cli_checks import check_requests
    from jaxpaged.models.config import ModelConfig
    from jaxpaged.entrypoints.chat_prompts import chat_prompt
    from jaxpaged.models.loading import load_model_files

    files = load_model_files(args.model, weights=False)
    tokenizer = files.tokenizer
    use_chat = args.chat if args.chat is not None else tokenizer.chat_template is not None
    if use_chat and tokenizer.chat_template is None:
        raise ValueError(f"--chat: the model {files.source.source_id!r} has no chat template; use --no-chat")
    if use_chat:
        def conversation(text):
            system = [{"role": "system", "content": args.system}] if args.system else []
            return system + [{"role": "user", "content": text}]

        formatted = [chat_prompt(tokenizer, conversation(p)) for p in prompts]  # text and ids (no second BOS)
    else:
        formatted = prompts
    model_config = ModelConfig.from_hf(files.hf_config, dtype=config.dtype or "float32")
    import jax  # the platform decides the defaults (max_model_len, max_num_seqs)

    lengths = [len(p["prompt_token_ids"]) if use_chat else len(tokenizer.encode(p)) for p in formatted]
    check_requests(lengths, config, model_config, tokenizer.eos_token_id,
                   max_tokens=args.max_tokens, beam=beam, on_gpu=jax.default_backend() == "gpu")
    return formatted


def _error(err: BaseException) -> int:
    print("error: " + " ".join(str(err).split()), file=sys.stderr)  # one line, whatever the library wrote
    return 2


def _record(prompt: str, out, c, args) -> dict:
    """The --json object of one finished completion."""
    record = {"prompt": prompt, "index": c.index, "text": c.text, "token_ids": c.token_ids,
              "finish_reason": c.finish_reason, "num_prompt_tokens": len(out.prompt_token_ids),
              "num_cached_tokens": out.num_cached_tokens}
    if args.logprobs is not None:
        record["logprobs"] = [[{"token_id": t, **lp._asdict()} for t, lp in entry.items()] for entry in c.logprobs]
    return record


def _beam_search(llm, prompts, formatted, params, args, t0) -> int:
    """--beam-width: every prompt's beams, best first, with their cumulative logprob and score."""
    outputs = llm.beam_search(formatted, params)
    elapsed = time.perf_counter() - t0
    for prompt, out in zip(prompts, outputs):
        if not args.json:
            print(f">>> {prompt}")
        for rank, beam in enumerate(out.beams):
            if args.json:
                print(json.dumps({"prompt": prompt, "beam": rank, "text": beam.text, "token_ids": beam.token_ids,
                                  "cumulative_logprob": beam.cumulative_logprob, "score": beam.score,
                                  "finish_reason": beam.finish_reason}, ensure_ascii=False))
            else:
                print(f"[beam {rank}] (logprob {beam.cumulative_logprob:.3f}, score {beam.score:.3f}, "
                      f"{beam.finish_reason}) {beam.text}")
    print(f"{len(outputs)} prompts, beam width {args.beam_width}, in {elapsed:.2f} s", file=sys.stderr)
    return 0


def _completion_text(prompt: str, c, args) -> str:
    """One completion for a reader: the prompt, the sample's index if n > 1, the text, logprobs."""
    tag = f"[{c.index}] " if args.n > 1 else ""
    return f">>> {prompt}\n{tag}{c.text}\n{_logprobs_line(c, args)}"


def _logprobs_line(c, args) -> str:
    if args.logprobs is None or c.logprobs is None:
        return ""
    chosen = [entry[t].logprob for entry, t in zip(c.logprobs, c.token_ids)]
    values = " ".join(f"{x:.3f}" for x in chosen)
    return f"logprobs (sum {sum(chosen):.3f} over {len(chosen)} tokens): {values}\n"


def _stream(llm, prompts, formatted, params, args):
    """--stream. One prompt and n = 1: its header, then tokens as they come. Several prompts or
    samples would interleave token by token, so each completion is printed whole when it finishes.
    With --json: one object per new piece of text as it comes ({"prompt", "index", "delta_text",
    "delta_token_ids"}), then each completion's --json object when it finishes."""
    live = len(prompts) == 1 and args.n == 1 and not args.json
    final = {}
    order = []
    finished_samples = set()  # (request id, sample index) whose --json object is out
    if live:
        sys.stdout.write(f">>> {prompts[0]}\n")
    texts = [p["prompt"] if isinstance(p, dict) else p for p in formatted]
    for out in llm.stream(formatted, params):
        if out.request_id not in final:
            order.append(out.request_id)
        final[out.request_id] = out
        prompt = prompts[texts.index(out.prompt)]  # the text this request was given
        if live:
            sys.stdout.write(out.outputs[0].delta_text)
        for c in out.outputs if args.json else ():
            if c.delta_token_ids or c.delta_text:
                print(json.dumps({"prompt": prompt, "index": c.index, "delta_text": c.delta_text,
                                  "delta_token_ids": c.delta_token_ids}, ensure_ascii=False))
            if c.finish_reason is not None and (out.request_id, c.index) not in finished_samples:
                finished_samples.add((out.request_id, c.index))
                print(json.dumps(_record(prompt, out, c, args), ensure_ascii=False))
        if not live and not args.json and out.finished:
            for c in out.outputs:
                print(_completion_text(prompt, c, args))
        sys.stdout.flush()
    if live:
        sys.stdout.write("\n" + _logprobs_line(final[order[0]].outputs[0], args))
    by_id = {r: final[r] for r in order}
    return [by_id[r] for r in sorted(by_id, key=int)]


if __name__ == "__main__":
    sys.exit(main())
