"""The agent door's sampling settings: `SamplingConfig` plus what an OpenAI request may ask for (stop strings,
top logprobs, prompt logprobs). Sent to the generator process with each request, so this module imports no web
framework."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from forgelab.config.components import SamplingConfig

if TYPE_CHECKING:
    from vllm import SamplingParams

__all__ = ["DoorSampling"]


@dataclass(kw_only=True)
class DoorSampling(SamplingConfig):
    """`SamplingConfig` with an OpenAI request's extras (the generator calls `to_vllm` and `validate`)."""

    stop: list[str] | None = None
    """Strings that end a completion (not included in its text; the tokens that produced them stay in its ids)."""
    top_logprobs: int = 0
    """Alternatives per completion token returned (`Completion.top_logprobs`); 0: the sampled token's only."""
    prompt_logprobs: bool = False
    """Return each prompt token's logprob (`Completion.prompt_logprobs`), and its `top_logprobs` alternatives
    (`Completion.prompt_top_logprobs`): ``echo`` of /v1/completions."""

    def validate(self, where: str = "DoorSampling") -> None:
        super().validate(where)
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"{where}.stop must be a list of non-empty strings, got {self.stop!r}")
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"{where}.top_logprobs must be an integer in [0, 20], got {self.top_logprobs!r}")

    def to_vllm(self, seed: int | None = None) -> SamplingParams:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=1, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, max_tokens=self.max_tokens,
            stop=list(self.stop or []), stop_token_ids=list(self.stop_token_ids or []), min_tokens=self.min_tokens,
            logit_bias=dict(self.logit_bias) if self.logit_bias else None, logprobs=self.top_logprobs,
            prompt_logprobs=self.top_logprobs if self.prompt_logprobs else None, output_kind=RequestOutputKind.FINAL_ONLY, seed=seed)
