"""vLLM's tokenizer endpoints: POST /tokenize (a prompt, or chat messages through the chat template),
POST /detokenize, GET /tokenizer_info. Same request and response shapes as vLLM's."""

from __future__ import annotations

import asyncio
from typing import Any, Optional, Union

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from conveyor.server.errors import APIError
from conveyor.server.protocol import ChatMessage
from conveyor.server.serving import Serving, generation_prompt

MAX_TOKENS_TO_DECODE = 1_000_000


class TokenizePromptRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    """The chat template writes the special tokens itself (as vLLM's default)."""
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    tokens: list[int] = Field(max_length=MAX_TOKENS_TO_DECODE)


def tokenizer_routes(serving: Serving) -> APIRouter:
    router = APIRouter()

    def tokenizer() -> Any:
        if not serving.engine.is_ready:
            raise APIError(503, "the model is still loading; retry shortly", code="loading",
                           headers={"Retry-After": "2"})
        found = serving.engine.engine.tokenizer if serving.engine.engine is not None else None
        if found is None:
            raise APIError(400, "this model has no tokenizer, so it cannot tokenize or detokenize text", "model")
        return found

    @router.post("/tokenize")
    async def tokenize(body: Union[TokenizePromptRequest, TokenizeChatRequest]) -> dict[str, Any]:
        serving.check_model(body.model)
        tok = tokenizer()
        if isinstance(body, TokenizeChatRequest):
            text = serving.chat_text(body.messages, generation_prompt(body), body.continue_final_message)
        else:
            text = body.prompt
        encoded = await asyncio.to_thread(tok, text, add_special_tokens=body.add_special_tokens)
        ids = list(encoded["input_ids"])
        return {"count": len(ids), "max_model_len": serving.engine.engine.max_model_len, "tokens": ids,
                "token_strs": tok.convert_ids_to_tokens(ids) if body.return_token_strs else None}

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        serving.check_model(body.model)
        tok = tokenizer()
        vocab = serving.engine.engine.spec.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": await asyncio.to_thread(tok.decode, body.tokens)}

    @router.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        tok = tokenizer()
        return {"tokenizer_class": type(tok).__name__, "vocab_size": serving.engine.engine.spec.vocab_size,
                "model_max_length": serving.engine.engine.max_model_len,
                **{name: getattr(tok, name, None) for name in ("bos_token", "eos_token", "pad_token", "unk_token")},
                "added_tokens_decoder": {str(i): str(getattr(t, "content", t))
                                         for i, t in (getattr(tok, "added_tokens_decoder", None) or {}).items()},
                "chat_template": getattr(tok, "chat_template", None)}

    return router
