"""What generation returns: vLLM's `RequestOutput` / `CompletionOutput` shapes, which users know."""

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request (a request with `n=4` has four)."""

    index: int  # which of the request's n samples
    text: str  # detokenized output so far (stop string excluded)
    token_ids: list[int]  # generated token ids so far
    finish_reason: str | None = None  # "stop" | "length" | "abort", None while running
    logprobs: list[float] | None = None  # log p(chosen token) per token, if SamplingParams.logprobs
    delta_text: str = ""  # text added since the previous streamed update
    delta_token_ids: list[int] = field(default_factory=list)  # tokens added since the previous update

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)
