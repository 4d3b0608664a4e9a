"""vLLM's routes besides the OpenAI API: /ping (SageMaker's health probe), /invocations (SageMaker's one route for
generation), and the LoRA adapter routes, which say that adapters are not served yet.

/invocations routes a body by its shape: `messages` makes it a chat completion, `prompt` a completion; it is then
validated, answered and refused exactly as that endpoint's own requests are. (vLLM tries each request type in
turn and, when none validates, answers one 400 naming them all; here the error is the chosen endpoint's own,
naming the field at fault.)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Body, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from conveyor.server.error_responses import APIError
from conveyor.server.protocol import ChatCompletionRequest, CompletionRequest

M = TypeVar("M", bound=BaseModel)

LORA_MESSAGE = (
    "LoRA adapters are not supported yet: this server serves its base model only, so it cannot {verb} an adapter; "
    "send requests to the base model (see GET /v1/models)"
)


def vllm_routes(
    health: Callable[[], Awaitable[Response]],
    complete: Callable[[CompletionRequest, Request], Awaitable[Response]],
    chat: Callable[[ChatCompletionRequest, Request], Awaitable[Response]],
) -> APIRouter:
    router = APIRouter()

    @router.api_route("/ping", methods=["GET", "POST"], include_in_schema=False)  # a probe, as /health
    async def ping() -> Response:
        return await health()

    @router.post("/invocations")
    async def invocations(request: Request, body: dict[str, Any] = Body(...)) -> Response:  # noqa: B008
        if "messages" in body:
            return await chat(_validated(ChatCompletionRequest, body), request)
        if "prompt" in body:
            return await complete(_validated(CompletionRequest, body), request)
        raise APIError(
            400,
            "/invocations needs `messages` (a chat completion, as /v1/chat/completions) or `prompt` (a completion, "
            "as /v1/completions)",
        )

    # not in the OpenAPI schema: they serve nothing yet
    @router.post("/v1/load_lora_adapter", include_in_schema=False)
    async def load_lora_adapter() -> Response:
        raise APIError(400, LORA_MESSAGE.format(verb="load"), "lora_name", "lora_not_supported")

    @router.post("/v1/unload_lora_adapter", include_in_schema=False)
    async def unload_lora_adapter() -> Response:
        raise APIError(400, LORA_MESSAGE.format(verb="unload"), "lora_name", "lora_not_supported")

    return router


def _validated(model: type[M], body: dict[str, Any]) -> M:
    """The body as `model`, or the 400 FastAPI gives a body that fails the endpoint's own validation."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
