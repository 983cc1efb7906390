"""What a generation endpoint is: fields in, a Plan of engine requests, a response or a stream out."""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Protocol, Sequence

import attrs

from ..sampling import SamplingParams
from .errors import bad_request
from .group import RequestGroup
from .outputs import Completion
from .schema import Field

MAX_REQUESTS_PER_CALL = 1024  # prompts x n of one HTTP call
MAX_TOP_LOGPROBS = 20
MAX_SEED = 2**63 - 1


@attrs.frozen
class Plan:
    """The engine requests one HTTP call makes, in choice-index order (prompt-major, then choice)."""

    requests: list[tuple[list[int], SamplingParams]]
    stream: bool
    n: int  # choices per prompt
    options: dict[str, Any]  # the parsed body, for shaping the answer
    stream_interval: int | None = None  # the request's own (native sampling_params.stream_interval), else the server's


class Endpoint(Protocol):
    path: str
    summary: str
    fields: Sequence[Field]

    def plan(self, values: dict[str, Any]) -> Plan: ...

    def response(self, plan: Plan, group: RequestGroup, completions: list[Completion]) -> Any: ...

    def stream(self, plan: Plan, group: RequestGroup) -> AsyncIterator[dict]: ...


def expand(prompts: list[list[int]], n: int, params_for_choice: Callable[[int], SamplingParams]) -> list:
    """Each prompt n times; choice j of every prompt gets params_for_choice(j)."""
    if len(prompts) * n > MAX_REQUESTS_PER_CALL:
        raise bad_request(f"{len(prompts)} prompts x n={n} is more than {MAX_REQUESTS_PER_CALL} sequences in one request", "n")
    choices = [params_for_choice(j) for j in range(n)]
    return [(ids, choices[j]) for ids in prompts for j in range(n)]


def choice_params(sampling: dict, max_new_tokens: int, seed: int | None, logprobs: int, choice: int) -> SamplingParams:
    """The SamplingParams of choice `choice` of a request (`sampling`: SamplingParams fields by their names): its
    seed, if any, offset by the choice."""
    return make_sampling_params(
        max_new_tokens=max_new_tokens, seed=None if seed is None else seed + choice, logprobs=logprobs, **sampling
    )


def make_sampling_params(**values) -> SamplingParams:
    """SamplingParams, with its own validation errors as 400s and empty stop strings refused."""
    if any(stop == "" for stop in values.get("stop") or ()):
        raise bad_request("stop strings must not be empty", "stop")
    seed = values.get("seed")
    if seed is not None:
        values["seed"] = seed % (MAX_SEED + 1)
    try:
        return SamplingParams(**values)
    except ValueError as exc:
        param = str(exc).split(" ", 1)[0]
        raise bad_request(str(exc), param) from None
