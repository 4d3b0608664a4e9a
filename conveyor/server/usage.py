"""A response's `usage`, and which chunks of a stream carry one (vLLM's policy).

A stream carries usage only when asked: `stream_options.include_usage` adds a last chunk with no choices and the
request's usage; `continuous_usage_stats` adds, with include_usage only, the usage so far to every chunk (the
prompt's tokens and that choice's tokens). `--enable-force-include-usage` turns both on for every stream, asked or
not. A response that is not streamed always has its usage. `--enable-prompt-tokens-details` adds
`prompt_tokens_details.cached_tokens` (prompt tokens served from the prefix cache) to each full usage: the
response's, or the stream's last chunk's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from conveyor.outputs import RequestOutput


@dataclass(frozen=True)
class UsagePolicy:
    final: bool = False
    """A stream ends with a usage-only chunk (include_usage)."""
    continuous: bool = False
    """Every chunk of a stream carries the usage so far (continuous_usage_stats, with include_usage)."""
    cached_details: bool = False
    """Full usages carry prompt_tokens_details.cached_tokens."""


def usage_policy(stream_options: Any, force: bool, cached_details: bool) -> UsagePolicy:
    """The policy of one request: its stream_options (None when it sent none), and the server's flags."""
    if force:
        return UsagePolicy(True, True, cached_details)
    final = bool(stream_options is not None and stream_options.include_usage)
    continuous = final and bool(stream_options.continuous_usage_stats)
    return UsagePolicy(final, continuous, cached_details)


def usage(
    outputs: Sequence[RequestOutput], score_only: bool = False, policy: UsagePolicy | None = None
) -> dict[str, Any]:
    """The usage of a whole request (all its prompts and choices)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = 0 if score_only else sum(len(c.token_ids) for o in outputs for c in o.outputs)
    found: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if policy is not None and policy.cached_details:
        found["prompt_tokens_details"] = {"cached_tokens": sum(o.num_cached_tokens for o in outputs)}
    return found


def running_usage(policy: UsagePolicy, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """A streamed chunk's `usage` field: one choice's usage so far, or nothing when the policy has none."""
    if not policy.continuous:
        return {}
    return {
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
    }
