"""vLLM's tokenizer endpoints: POST /tokenize (a prompt, or chat messages through the chat template),
POST /detokenize, GET /tokenizer_info. Same request and response shapes as vLLM's."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from pydantic import Field, model_validator

from conveyor.server.error_responses import APIError
from conveyor.server.protocol import ChatMessage
from conveyor.server.serving import Serving
from conveyor.server.strict_body import StrictBody
from conveyor.server.template_kwargs import template_kwargs
from conveyor.server.vllm_extras import generation_prompt
from conveyor.tools.choice import ToolRequestError, plan_tools

MAX_TOKENS_TO_DECODE = 1_000_000


class TokenizeRequest(StrictBody):
    """vLLM's two forms in one: a `prompt`, or chat `messages` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    """Default: true for a prompt; false for messages (the chat template writes them), as vLLM."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    """Messages only: tools offered to the model, rendered as a chat completion with them renders them."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Messages only: more variables for the chat template (server/template_kwargs.py)."""

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError(
                "send either `prompt` (text) or `messages` (a chat), not "
                + ("both" if self.prompt is not None else "neither")
            )
        if self.messages is None:
            extra = [name for name in ("tools", "chat_template_kwargs") if getattr(self, name) is not None]
            if extra:
                raise ValueError(f"{extra[0]} applies to `messages` only, and this request tokenizes a `prompt`")
        return self


class DetokenizeRequest(StrictBody):
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_TOKENS_TO_DECODE)


def tokenizer_routes(serving: Serving) -> APIRouter:
    router = APIRouter()

    def tokenizer() -> Any:
        if not serving.engine.is_ready:
            raise APIError(
                503, "the model is still loading; retry shortly", code="loading", headers={"Retry-After": "2"}
            )
        found = serving.engine.info.tokenizer if serving.engine.info is not None else None
        if found is None:
            raise APIError(400, "this model has no tokenizer, so it cannot tokenize or detokenize text", "model")
        return found

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        serving.check_model(body.model)
        tok = tokenizer()
        if body.messages is not None:
            add_generation_prompt = generation_prompt(body)
            extra = template_kwargs(body.chat_template_kwargs, add_generation_prompt, body.continue_final_message)
            try:
                tools = plan_tools(body.tools, None).tools or None
            except ToolRequestError as exc:
                raise APIError(400, str(exc), exc.param) from None
            text = serving.chat_text(
                body.messages, add_generation_prompt, body.continue_final_message, tools, extra=extra
            )
        else:
            text = body.prompt or ""
        special = body.add_special_tokens if body.add_special_tokens is not None else body.messages is None
        encoded = await asyncio.to_thread(tok, text, add_special_tokens=special)
        ids = list(encoded["input_ids"])
        return {
            "count": len(ids),
            "max_model_len": serving.max_model_len,
            "tokens": ids,
            "token_strs": tok.convert_ids_to_tokens(ids) if body.return_token_strs else None,
        }

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        serving.check_model(body.model)
        tok = tokenizer()
        vocab = serving.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": await asyncio.to_thread(tok.decode, body.tokens)}

    @router.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        tok = tokenizer()
        return {
            "tokenizer_class": type(tok).__name__,
            "vocab_size": serving.vocab_size,
            "model_max_length": serving.max_model_len,
            **{name: getattr(tok, name, None) for name in ("bos_token", "eos_token", "pad_token", "unk_token")},
            "added_tokens_decoder": {
                str(i): str(getattr(t, "content", t))
                for i, t in (getattr(tok, "added_tokens_decoder", None) or {}).items()
            },
            "chat_template": getattr(tok, "chat_template", None),
        }

    return router
