"""The data of the training primitives (`forgelab.experiments.primitives`), as Tinker's SDK types define them.

    datum = Datum(model_input=ModelInput.from_ints(tokens[:-1]),
                  loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})   # one sequence
    out = await client.forward_backward([datum], "cross_entropy")     # ForwardBackwardOutput
    out.metrics["loss:sum"], out.loss_fn_outputs[0]["logprobs"]       # a float; a float32 [N] tensor

forgelab's own dataclasses, field for field where Tinker has one (``tinker`` itself is not a dependency). A
`Datum` is one sequence: ``model_input`` its ``N`` input tokens (chunks of token ids), ``loss_fn_inputs`` its
per-token tensors, each ``[N]`` and aligned to the inputs: position ``i`` holds the values of the token that
follows input ``i`` (``target_tokens[i]``, its sampling ``logprobs[i]``, ``advantages[i]``, ``weights[i]``).
Shape letters: N tokens of one datum.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from forgelab.types import AdamParams as TrainerAdamParams

if TYPE_CHECKING:
    from vllm import SamplingParams as VSamplingParamsT

__all__ = ["ModelInput", "Datum", "AdamParams", "SamplingParams", "ForwardBackwardOutput", "SampledSequence",
           "SampleResponse", "OptimStepResponse", "VLLMSampling", "as_tensor"]

TensorLike = torch.Tensor | Sequence[float] | Sequence[int]


def as_tensor(x: object, name: str) -> torch.Tensor:
    """``x`` (a tensor, a numpy array, a list) as a 1-D CPU tensor; int64 for integers, float32 otherwise."""
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    if t.dim() != 1:
        raise ValueError(f"loss_fn_inputs[{name!r}] must be one value per token ([N]), got shape {tuple(t.shape)}")
    if t.dtype.is_floating_point:
        return t.detach().to("cpu", torch.float32)
    return t.detach().to("cpu", torch.int64)


@dataclass(frozen=True)
class ModelInput:
    """A sequence's input tokens, in chunks (Tinker's ``EncodedTextChunk``s; images are not supported)."""

    chunks: tuple[tuple[int, ...], ...]

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> "ModelInput":
        return cls((tuple(int(t) for t in tokens),))

    def to_ints(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk]

    @property
    def length(self) -> int:
        return sum(len(c) for c in self.chunks)

    def append(self, tokens: Sequence[int]) -> "ModelInput":
        """A new input with ``tokens`` as one more chunk."""
        return ModelInput((*self.chunks, tuple(int(t) for t in tokens)))


@dataclass
class Datum:
    """One sequence to train on or score: its input tokens and its per-token loss inputs (``[N]`` each)."""

    model_input: ModelInput
    loss_fn_inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        given: object = self.model_input
        if not isinstance(given, ModelInput):  # a plain list of token ids
            self.model_input = ModelInput.from_ints(cast("Sequence[int]", given))
        self.loss_fn_inputs = {k: as_tensor(v, k) for k, v in self.loss_fn_inputs.items()}
        n = self.model_input.length
        for k, v in self.loss_fn_inputs.items():
            if v.shape[0] != n:
                raise ValueError(f"Datum: loss_fn_inputs[{k!r}] has {v.shape[0]} values for {n} input tokens "
                                 "(one per input position: the values of the token that follows it)")


@dataclass(frozen=True, kw_only=True)
class AdamParams:
    """Tinker's ``AdamParams``: AdamW hyperparameters of one optimizer step (the defaults are Tinker's)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
    """Clip the global gradient norm to this; 0: no clipping."""

    def to_trainer(self) -> TrainerAdamParams:
        """The trainer's `forgelab.types.AdamParams`."""
        return TrainerAdamParams(lr=self.learning_rate, betas=(self.beta1, self.beta2), eps=self.eps,
                                 weight_decay=self.weight_decay,
                                 grad_clip=self.grad_clip_norm if self.grad_clip_norm > 0 else None)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Tinker's ``SamplingParams``. ``stop``: strings or token ids that end a sample (the model's eos always
    does); ``seed``: sample ``g`` of a call uses ``seed + g`` (None: unseeded); ``top_k`` -1: off."""

    max_tokens: int = 32
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: Sequence[str] | Sequence[int] | str | None = None

    def stop_strings(self) -> list[str]:
        if isinstance(self.stop, str):
            return [self.stop]
        return [s for s in (self.stop or ()) if isinstance(s, str)]

    def stop_token_ids(self) -> list[int]:
        if isinstance(self.stop, str):
            return []
        return [int(s) for s in (self.stop or ()) if not isinstance(s, str)]


@dataclass
class ForwardBackwardOutput:
    """One ``forward`` / ``forward_backward``: per datum ``{"logprobs": float32 [N]}`` (the target tokens'
    logprobs before any update) and the metrics as ``name:reduction`` (``loss:sum`` always)."""

    loss_fn_outputs: list[dict[str, torch.Tensor]]
    metrics: dict[str, float]
    loss_fn_output_type: str = "TensorData"


@dataclass
class OptimStepResponse:
    """One ``optim_step``: the slot's optimizer step count after it, and ``name:reduction`` metrics."""

    step: int
    metrics: dict[str, float]


@dataclass
class SampledSequence:
    """One sample: its tokens, each one's logprob under the sampler's weights (raw, temperature 1), why it ended."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    """"stop" (eos, a stop string or a stop token) or "length" (max_tokens)."""


@dataclass
class SampleResponse:
    """What ``sample`` returns: ``num_samples`` sequences (tokens, each token's logprob, why it stopped), and the
    prompt's logprobs when ``include_prompt_logprobs`` asked for them."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    """Each prompt token's logprob given the ones before it (None for the first); None unless asked for."""


def loss_inputs_of(data: Sequence[Datum], names: Mapping[str, bool]) -> None:
    """Refuse ``data`` missing a loss input ``names`` marks required (``{name: required}``), naming it."""
    for i, d in enumerate(data):
        missing = [k for k, required in names.items() if required and k not in d.loss_fn_inputs]
        if missing:
            raise ValueError(f"datum {i} lacks loss_fn_inputs {missing} (it has {sorted(d.loss_fn_inputs)})")


@dataclass(frozen=True, kw_only=True)
class VLLMSampling:
    """`SamplingParams` as the generator reads sampling settings (`forgelab.generation.SamplingSettings`, and
    ``to_vllm(seed)``), with what `forgelab.config.components.SamplingConfig` lacks: stop strings and prompt
    logprobs. Its logprobs are the raw model's, as every forgelab sample's (`forgelab.engines.generator`)."""

    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    prompt_logprobs: bool = False

    @classmethod
    def of(cls, params: SamplingParams, *, prompt_logprobs: bool = False) -> "VLLMSampling":
        return cls(max_tokens=params.max_tokens, temperature=params.temperature,
                   top_k=0 if params.top_k in (-1, 0) else params.top_k, top_p=params.top_p,
                   stop=tuple(params.stop_strings()), stop_token_ids=tuple(params.stop_token_ids()),
                   prompt_logprobs=prompt_logprobs)

    def validate(self, where: str = "SamplingParams") -> None:
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"{where}.max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"{where}.temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"{where}.top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"{where}.top_k must be -1 (off) or positive, got {self.top_k!r}")

    def to_vllm(self, seed: int | None = None) -> "VSamplingParamsT":
        """One-sample `vllm.SamplingParams` returning each sampled token's logprob (and the prompt's if asked)."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VSamplingParams(n=1, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                               max_tokens=self.max_tokens, stop=list(self.stop) or None,
                               stop_token_ids=list(self.stop_token_ids), logprobs=0,
                               prompt_logprobs=0 if self.prompt_logprobs else None,
                               output_kind=RequestOutputKind.FINAL_ONLY, seed=seed)
