"""chat_template_kwargs: more variables for the chat template, as vLLM passes them.

Qwen3's `enable_thinking`, a template's `documents` or any variable a template reads: they reach the template as
given, and what it does with them (or that it ignores one it does not read) is the template's business. Refused,
each with a 400 naming it: the arguments of the render call the server itself sets (`tokenize` and
`chat_template`, as vLLM refuses them; `tools`, which must be the request's own field; the render's output
options), and `add_generation_prompt` / `continue_final_message` when they disagree with the request's fields of
those names (vLLM lets the request's field win silently).
"""

from __future__ import annotations

from typing import Any

from conveyor.server.error_responses import APIError

SET_BY_THE_SERVER = frozenset(
    {
        "tokenize",
        "chat_template",
        "conversation",
        "tools",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "padding",
        "truncation",
        "max_length",
    }
)
"""apply_chat_template's own arguments that the server sets (or that would change what the render returns)."""
REQUEST_FIELDS = ("add_generation_prompt", "continue_final_message")


def template_kwargs(
    given: dict[str, Any] | None, add_generation_prompt: bool, continue_final_message: bool
) -> dict[str, Any]:
    """The variables to pass to the chat template besides the server's own, or an APIError naming the key."""
    if not given:
        return {}
    for key in given:
        if key in SET_BY_THE_SERVER:
            hint = "send tools as the request's `tools` field" if key == "tools" else "the server sets it"
            raise APIError(400, f"chat_template_kwargs.{key} cannot be given: {hint}", f"chat_template_kwargs.{key}")
    effective = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}
    for key in REQUEST_FIELDS:
        if key in given and given[key] != effective[key]:
            raise APIError(
                400,
                f"chat_template_kwargs.{key}={given[key]!r} disagrees with the request's {key} "
                f"({effective[key]!r}); set the request's {key} field instead",
                f"chat_template_kwargs.{key}",
            )
    return {k: v for k, v in given.items() if k not in REQUEST_FIELDS}
