"""A Request and its SamplingParams: the plain objects the scheduler moves between queues.

No torch here: the scheduler and the KV manager import this module.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class SamplingParams(BaseModel):
    """How to pick tokens for one request (OpenAI / vLLM names and meanings).

    temperature 0 means greedy. Unknown keys are an error.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(16, ge=1)
    min_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    top_k: int = Field(0, ge=0)  # 0 (or -1 on the wire) disables
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)  # top-n logprobs of each sampled position
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    skip_special_tokens: bool = True
    # speculative decoding (engine started with a proposer): tokens proposed per step for this
    # request; None = the engine's default, 0 = no speculation for this request
    num_speculative_tokens: int | None = Field(None, ge=0, le=16)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_tuple(cls, v: object) -> object:
        if v is None:
            return ()
        if isinstance(v, str):
            return (v,)
        return v

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids_nonneg(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if any(t < 0 for t in v):
            raise ValueError("stop_token_ids must be >= 0")
        return v

    @model_validator(mode="after")
    def _min_le_max(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"  # stop token, EOS or stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or the context length
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self.value.startswith("finished")

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


@dataclass
class Request:
    """One generation: prompt, parameters, and the progress the scheduler tracks.

    `num_computed_tokens` counts tokens whose K/V sit in the cache; `all_token_ids` is the prompt
    followed by the sampled outputs. A request needs a model step while
    `num_computed_tokens < num_tokens`.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_s: float = 0.0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at the last admission
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    spec_token_ids: list[int] = field(default_factory=list)  # proposals to verify in the next step

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: the prompt is empty; give at least one token")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        n = self.num_prompt_tokens
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        return self.all_token_ids[start:stop]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
