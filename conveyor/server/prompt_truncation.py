"""vLLM's truncate_prompt_tokens: keep only part of a tokenized prompt.

`truncate_prompt_tokens: k` keeps k prompt tokens: the last k (truncation_side 'left', the default: the end of a
conversation matters most), or the first k ('right'). `-1` keeps as many as the context leaves after the output:
max_model_len - max_tokens (max_model_len - 1 when max_tokens is not given, since one token must be left for the
reply). A k larger than that is refused, as vLLM does; a prompt already shorter than k is kept whole.
"""

from __future__ import annotations

from conveyor.server.error_responses import APIError


def truncate_prompt(
    ids: list[int], keep: int | None, side: str | None, max_model_len: int, max_tokens: int | None, param: str
) -> list[int]:
    """The prompt ids truncate_prompt_tokens leaves (`param`: the request's name for max_tokens, for errors)."""
    if keep is None:
        return ids
    room = max_model_len - (max_tokens if max_tokens is not None else 1)
    if keep == -1:
        keep = room
    elif keep == 0:
        raise APIError(
            400, "truncate_prompt_tokens=0 would leave no prompt; give at least 1, or -1", "truncate_prompt_tokens"
        )
    elif keep > room:
        given = f"{param}={max_tokens}" if max_tokens is not None else "the one token the reply needs at least"
        raise APIError(
            400,
            f"truncate_prompt_tokens={keep} cannot be greater than max_model_len ({max_model_len}) minus "
            f"{given}, which is {room}; ask for a smaller truncation (or -1 for that many)",
            "truncate_prompt_tokens",
        )
    if keep <= 0:
        raise APIError(
            400,
            f"{param}={max_tokens} leaves no room for the prompt in the {max_model_len}-token context; lower {param}",
            param,
        )
    if len(ids) <= keep:
        return ids
    return ids[:keep] if side == "right" else ids[-keep:]
