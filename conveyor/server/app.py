"""Routes of the OpenAI-compatible server (the guards in front of them: server/guard.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from conveyor import __version__
from conveyor.outputs import RequestOutput
from conveyor.server.error_responses import APIError, as_api_error, error_response, install_error_handlers
from conveyor.server.guard import GuardMiddleware
from conveyor.server.logprobs import TokenBytes
from conveyor.server.protocol import ChatCompletionRequest, CompletionRequest
from conveyor.server.request_id import RequestIdMiddleware, response_id
from conveyor.server.root_path import RootPathMiddleware
from conveyor.server.serving import Prepared, Serving, chat_choice, completion_choice, new_id, now
from conveyor.server.state import ServerState
from conveyor.server.streaming import sse_response, stream_chat, stream_completion
from conveyor.server.tokenizer_routes import tokenizer_routes
from conveyor.server.ui import mount_ui
from conveyor.server.usage import usage
from conveyor.server.vllm_extras import TokenIdNames, prompt_fields
from conveyor.server.vllm_routes import vllm_routes


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="Conveyor", version=__version__, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    serving = Serving(state.engine, state.options)
    if state.options.allowed_origins:
        origins = list(state.options.allowed_origins)
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_credentials="*" not in origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
        )
    app.add_middleware(GuardMiddleware, state=state)  # runs before CORS and routing
    app.add_middleware(RequestIdMiddleware)  # every response, refusals too, carries X-Request-Id
    if state.options.root_path:
        app.add_middleware(RootPathMiddleware, root_path=state.options.root_path)  # outermost
    app.include_router(tokenizer_routes(serving))  # /tokenize, /detokenize, /tokenizer_info (as vLLM)

    created = now()

    @app.api_route("/health", methods=["GET", "HEAD"], include_in_schema=False)  # a probe, not part of the API
    async def health() -> Response:
        engine = state.engine
        if engine.is_dead:
            return error_response(503, "the engine has stopped", code="engine_dead")
        if state.draining:
            return error_response(503, "the server is shutting down", code="draining")
        if not engine.is_ready:
            return error_response(503, "the model is still loading", code="loading")
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    def model_card() -> dict[str, Any]:
        return {"id": state.options.model_name, "object": "model", "created": created, "owned_by": "conveyor"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        serving.check_model(model_id)
        return model_card()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(state.engine.stats()), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await complete(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat_complete(body, request)

    async def complete(body: CompletionRequest, request: Request) -> Response:
        await _require_ready(state)
        prepared = await serving.prepare_completion(body)

        def choices(outputs: list[RequestOutput], tokens: TokenBytes | None) -> list[dict[str, Any]]:
            return [
                completion_choice(prepared, i, out, c, tokens) for i, out in enumerate(outputs) for c in out.outputs
            ]

        return await _respond(
            state, serving, request, body, prepared, "cmpl", "text_completion", stream_completion, choices
        )

    async def chat_complete(body: ChatCompletionRequest, request: Request) -> Response:
        await _require_ready(state)
        prepared = await serving.prepare_chat(body)

        def choices(outputs: list[RequestOutput], tokens: TokenBytes | None) -> list[dict[str, Any]]:
            return [chat_choice(outputs[0], c, tokens, prepared) for c in outputs[0].outputs]

        return await _respond(
            state, serving, request, body, prepared, "chatcmpl", "chat.completion", stream_chat, choices
        )

    app.include_router(vllm_routes(health, complete, chat_complete))  # /ping, /invocations, LoRA adapter routes
    mount_ui(app, state, serve_page=state.options.ui)
    return app


async def _respond(
    state: ServerState,
    serving: Serving,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    prepared: Prepared,
    id_prefix: str,
    object_name: str,
    stream: Callable[..., AsyncIterator[str]],
    choices: Callable[[list[RequestOutput], TokenBytes | None], list[dict[str, Any]]],
) -> Response:
    """Admit a prepared request, then stream it as SSE or collect it into one response body."""
    streams = await serving.admit(prepared, new_id(id_prefix))  # the engine's ids stay unique
    rid = response_id(request, id_prefix)
    state.metrics.prompt_tokens.inc(sum(len(p) for p in prepared.prompts))
    wants_logprobs = prepared.params.logprobs is not None or prepared.params.prompt_logprobs is not None
    tokens = await asyncio.to_thread(lambda: serving.token_bytes) if wants_logprobs else None  # built once
    if prepared.extras.tokens_as_ids:
        tokens = TokenIdNames(tokens)
    if body.stream:
        return sse_response(stream(streams, prepared, rid, state.options.model_name, tokens, state))
    try:
        outputs = await _until_disconnect(request, serving.collect(streams))
        _raise_if_failed(outputs)
        body_choices = choices(outputs, tokens)
    except BaseException as exc:
        gone = isinstance(exc, asyncio.CancelledError) or (isinstance(exc, APIError) and exc.status == 499)
        state.metrics.requests.labels("abort" if gone else "error").inc()
        raise
    state.metrics.requests.labels("ok").inc()
    return JSONResponse(
        {
            "id": rid,
            "object": object_name,
            "created": now(),
            "model": state.options.model_name,
            "choices": body_choices,
            "usage": usage(outputs, prepared.score_only, prepared.extras.usage),
        }
        | (prompt_fields(prepared.extras, outputs[0]) if object_name == "chat.completion" else {})
    )


async def _require_ready(state: ServerState) -> None:
    if state.engine.is_dead:
        raise APIError(503, "the engine has stopped; restart the server", code="engine_dead")
    if not state.engine.is_ready:
        raise APIError(503, "the model is still loading; retry shortly", code="loading", headers={"Retry-After": "2"})


def _raise_if_failed(outputs: list[RequestOutput]) -> None:
    for out in outputs:
        if out.error is not None:
            raise as_api_error(out)


async def _until_disconnect(request: Request, work: Any) -> Any:
    """Race the work against the client's http.disconnect message; a disconnect cancels the work
    (whose streams then abort their requests)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except BaseException:
            pass
        raise APIError(499, "client disconnected")
    finally:
        watcher.cancel()
