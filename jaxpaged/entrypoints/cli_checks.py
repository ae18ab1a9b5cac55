"""What `python -m jaxpaged.generate` checks before it loads the model (seconds, not a load and compile).

    check_flags(args, engine_args)      the flags alone (no jax): values, and combinations that cannot work
    check_requests(token_counts, ...)   the prompts, tokenized with the model's tokenizer (read with its
                                        config, without the weights): each fits max_model_len and an
                                        explicit pool; a beam search fits max_num_seqs and the pool

Each check calls the same rule the engine applies later (SamplingParams, EngineConfig,
check_prompt_fits, check_fits_pool, check_beam_request), so a request refused here is one the engine
would refuse after loading. All raise ValueError; the CLI prints it as one `error:` line, exit 2.
"""

from __future__ import annotations

from jaxpaged.config import EngineConfig
from jaxpaged.engine.beam_search import BeamSearchParams, check_beam_request
from jaxpaged.planner.request import SamplingParams, check_fits_pool, check_prompt_fits

# Sampling flags a beam search does not use, with their defaults: any other value is refused.
_BEAM_UNUSED = {"n": 1, "temperature": 0.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0, "seed": None, "stop": [],
                "logprobs": None, "min_tokens": 0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                "repetition_penalty": 1.0, "logit_bias": [], "allowed_token_ids": None}


def check_flags(args, engine_args: dict) -> tuple[SamplingParams, EngineConfig, BeamSearchParams | None]:
    """The sampling params, engine config and beam params the flags describe; ValueError for any
    flag or combination that can be refused without the model."""
    sampling = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
        max_tokens=args.max_tokens, min_tokens=args.min_tokens, stop=args.stop, ignore_eos=args.ignore_eos,
        n=args.n, logprobs=args.logprobs, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
        logit_bias=logit_bias(args.logit_bias), allowed_token_ids=args.allowed_token_ids,
    )
    config = EngineConfig(**engine_args)
    beam = None
    if args.beam_width is not None:
        beam = BeamSearchParams(args.beam_width, args.max_tokens, length_penalty=args.length_penalty,
                                ignore_eos=args.ignore_eos)
        if args.stream:
            raise ValueError("--stream does not apply to beam search (beams are known only at the end); drop one")
        if config.speculative_config is not None:
            raise ValueError("--beam-width cannot run with --speculative-config; drop one")
        set_flags = [f"--{name.replace('_', '-')}" for name, default in _BEAM_UNUSED.items()
                     if getattr(args, name) != default]
        if set_flags:
            many = len(set_flags) > 1
            raise ValueError(f"{', '.join(set_flags)} {'do' if many else 'does'} not apply to beam search "
                             f"(--beam-width); drop {'them' if many else 'it'}, or drop --beam-width to sample")
    elif args.length_penalty != 1.0:
        raise ValueError("--length-penalty applies only to beam search; add --beam-width K or drop it")
    if args.system is not None and args.chat is False:
        raise ValueError("--system is a chat message, but --no-chat turns the chat template off; drop one")
    if args.coordinator_address is None and (args.num_processes is not None or args.process_id is not None):
        raise ValueError("--num-processes and --process-id need --coordinator-address (several hosts); "
                         "drop them for one host")
    return sampling, config, beam


def logit_bias(items: list[str]) -> dict[int, float] | None:
    """--logit-bias ID=BIAS flags as a dict (ValueError names the bad one)."""
    bias = {}
    for item in items:
        token_id, _, value = item.partition("=")
        try:
            bias[int(token_id)] = float(value)
        except ValueError:
            raise ValueError(f"--logit-bias {item!r} must be ID=BIAS, e.g. 50256=-100") from None
    return bias or None


def check_requests(formatted_token_counts: list[int], config: EngineConfig, model_config, eos_token_id,
                   *, max_tokens: int, beam: BeamSearchParams | None, on_gpu: bool) -> None:
    """Every prompt (its token count after the chat template) against the limits the engine will
    have: max_model_len, and with an explicit --num-pages the pool."""
    config = config.resolved(on_gpu=on_gpu, model_max_len=model_config.max_position_embeddings)
    num_usable_pages = config.num_pages - 1 if config.num_pages is not None else None
    for num_prompt_tokens in formatted_token_counts:
        check_prompt_fits(num_prompt_tokens, config.max_model_len)
        if beam is not None:
            check_beam_request(beam, num_prompt_tokens, config, model_config.vocab_size,
                               num_usable_pages if num_usable_pages is not None else 1 << 62, eos_token_id)
        elif num_usable_pages is not None:
            check_fits_pool(min(num_prompt_tokens + max_tokens, config.max_model_len), config.page_size,
                            num_usable_pages)
