"""What AsyncEngine observes of its requests' timings and ends, for the server's metrics (server/metrics.py and
server/vllm_series.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.outputs import RequestOutput
from conveyor.params import SamplingParams


@dataclass(frozen=True)
class FinishedRequest:
    """One request that ended (stop, length, abort or error), for the server's per-request metrics."""

    prompt_tokens: int
    generation_tokens: int
    """Over all its samples."""
    n: int
    max_tokens: int
    """What it asked for, or what the context left it when it asked for no limit."""
    finish_reasons: tuple[str, ...]
    """One per sample."""
    queue_s: float | None = None
    """From arrival until first scheduled; None when it never was."""
    prefill_s: float | None = None
    """From first scheduled to its first token; None when it had none."""
    decode_s: float | None = None
    """From its first token to its last."""


@dataclass
class StreamTimings:
    """Latency observations the server turns into metrics."""

    ttft: list[float] = field(default_factory=list)
    inter_token: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)


def finished_request(
    out: RequestOutput,
    params: SamplingParams,
    first_token_time: float | None,
    last_token_time: float | None,
    max_model_len: int,
) -> FinishedRequest:
    """A finished request's record: its output, its parameters, when its first and last tokens reached the server
    (time.perf_counter()) and the context, which bounds a request that set no max_tokens."""
    prompt = len(out.prompt_token_ids)
    queued = out.metrics.get("queued_s")
    ttft = out.metrics.get("ttft_s")
    decode = None
    if first_token_time is not None and last_token_time is not None:
        decode = last_token_time - first_token_time
    return FinishedRequest(
        prompt_tokens=prompt,
        generation_tokens=sum(len(c.token_ids) for c in out.outputs),
        n=params.n,
        max_tokens=params.max_tokens if params.max_tokens is not None else max(0, max_model_len - prompt),
        finish_reasons=tuple(c.finish_reason or "abort" for c in out.outputs),
        queue_s=queued,
        prefill_s=None if queued is None or ttft is None else max(0.0, ttft - queued),
        decode_s=decode,
    )
