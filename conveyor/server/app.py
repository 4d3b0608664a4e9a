"""Routes of the OpenAI-compatible server (the guards in front of them: server/guard.py)."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse

from conveyor import __version__
from conveyor.outputs import RequestOutput
from conveyor.server.errors import APIError, error_response, install_error_handlers
from conveyor.server.guard import GuardMiddleware, ServerState
from conveyor.server.protocol import ChatCompletionRequest, CompletionRequest
from conveyor.server.serving import (Prepared, Serving, chat_logprobs, completion_logprobs, finish_reason, merged,
                                     new_id, now, sse, stream_error, usage)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="Conveyor", version=__version__, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    serving = Serving(state.engine, state.options.model_name, state.options.request_timeout)
    if state.options.allowed_origins:
        origins = list(state.options.allowed_origins)
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_credentials="*" not in origins,
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(GuardMiddleware, state=state)  # outermost: runs before CORS and routing

    @app.get("/health")
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

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": state.options.model_name, "object": "model", "created": now(),
                                            "owned_by": "conveyor"}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(state.engine.stats()), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        await _require_ready(state)
        prepared = await serving.prepare_completion(body)

        def choices(outputs: list[RequestOutput], tokenizer: Any) -> list[dict[str, Any]]:
            return [{"index": i * prepared.params.n + c.index, "text": c.text,
                     "logprobs": completion_logprobs(tokenizer, c.logprobs),
                     "finish_reason": finish_reason(c.finish_reason, out.error), "stop_reason": c.stop_reason}
                    for i, out in enumerate(outputs) for c in out.outputs]

        return await _respond(state, serving, request, body, prepared, "cmpl", "text_completion",
                              _stream_completion, choices)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        await _require_ready(state)
        prepared = await serving.prepare_chat(body)

        def choices(outputs: list[RequestOutput], tokenizer: Any) -> list[dict[str, Any]]:
            out = outputs[0]
            return [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                     "logprobs": chat_logprobs(tokenizer, c.logprobs),
                     "finish_reason": finish_reason(c.finish_reason, out.error), "stop_reason": c.stop_reason}
                    for c in out.outputs]

        return await _respond(state, serving, request, body, prepared, "chatcmpl", "chat.completion",
                              _stream_chat, choices)

    return app


async def _respond(state: ServerState, serving: Serving, request: Request,
                   body: CompletionRequest | ChatCompletionRequest, prepared: Prepared, id_prefix: str,
                   object_name: str, stream: Callable[..., AsyncIterator[str]],
                   choices: Callable[[list[RequestOutput], Any], list[dict[str, Any]]]) -> Response:
    """Admit a prepared request, then stream it as SSE or collect it into one response body."""
    rid, streams, tokenizer = await _admit(state, serving, prepared, id_prefix)
    if body.stream:
        return _sse(stream(streams, prepared, rid, state.options.model_name, tokenizer, _include_usage(body), state))
    outputs = await _until_disconnect(request, serving.collect(streams))
    _raise_if_failed(outputs)
    body_choices = choices(outputs, tokenizer)
    state.metrics.requests.labels("ok").inc()
    return JSONResponse({"id": rid, "object": object_name, "created": now(), "model": state.options.model_name,
                         "choices": body_choices, "usage": usage(outputs)})


async def _admit(state: ServerState, serving: Serving, prepared: Prepared,
                 prefix: str) -> tuple[str, list[AsyncIterator[RequestOutput]], Any]:
    """Admit a prepared request: its id, its output streams, and the tokenizer for logprob text."""
    rid = new_id(prefix)
    streams = await serving.admit(prepared, rid)
    state.metrics.prompt_tokens.inc(sum(len(p) for p in prepared.prompts))
    return rid, streams, state.engine.engine.tokenizer if state.engine.engine else None


def _include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


async def _require_ready(state: ServerState) -> None:
    if state.engine.is_dead:
        raise APIError(503, "the engine has stopped; restart the server", code="engine_dead")
    if not state.engine.is_ready:
        raise APIError(503, "the model is still loading; retry shortly", code="loading",
                       headers={"Retry-After": "2"})


def _raise_if_failed(outputs: list[RequestOutput]) -> None:
    for out in outputs:
        if out.error is not None:
            timed_out = "timed out" in out.error
            raise APIError(504 if timed_out else 500, out.error, code="timeout" if timed_out else "engine_error")


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


def _sse(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _stream_completion(streams: list[AsyncIterator[RequestOutput]], prepared: Prepared, rid: str, model: str,
                             tokenizer: Any, include_usage: bool, state: ServerState) -> AsyncIterator[str]:
    n = prepared.params.n
    sent_text: dict[int, int] = {}
    sent_lp: dict[int, int] = {}
    finals: dict[int, RequestOutput] = {}
    created = now()
    try:
        async for i, out in merged(streams):
            for c in out.outputs:
                index = i * n + c.index
                start, lp_start = sent_text.get(index, 0), sent_lp.get(index, 0)
                reason = finish_reason(c.finish_reason, out.error)
                if out.error is not None and c.finish_reason == "abort":
                    raise RuntimeError(out.error)
                if len(c.text) <= start and reason is None:
                    continue
                sent_text[index], sent_lp[index] = len(c.text), len(c.logprobs or [])
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": [{"index": index, "text": c.text[start:],
                                        "logprobs": completion_logprobs(tokenizer, c.logprobs, lp_start),
                                        "finish_reason": reason, "stop_reason": c.stop_reason if reason else None}]})
            if out.finished:
                finals[i] = out
        if include_usage:
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
                       "usage": usage(list(finals.values()))})
        state.metrics.requests.labels("ok").inc()
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        state.metrics.requests.labels("error").inc()
        yield stream_error(exc) if not isinstance(exc, RuntimeError) else \
            stream_error(_as_api_error(str(exc)))
    yield "data: [DONE]\n\n"


async def _stream_chat(streams: list[AsyncIterator[RequestOutput]], prepared: Prepared, rid: str, model: str,
                       tokenizer: Any, include_usage: bool, state: ServerState) -> AsyncIterator[str]:
    created = now()
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    for index in range(prepared.params.n):
        yield sse(base | {"choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}]})
    sent_text: dict[int, int] = {}
    sent_lp: dict[int, int] = {}
    final = None
    try:
        async for _, out in merged(streams):
            for c in out.outputs:
                start, lp_start = sent_text.get(c.index, 0), sent_lp.get(c.index, 0)
                reason = finish_reason(c.finish_reason, out.error)
                if out.error is not None and c.finish_reason == "abort":
                    raise RuntimeError(out.error)
                if len(c.text) <= start and reason is None:
                    continue
                sent_text[c.index], sent_lp[c.index] = len(c.text), len(c.logprobs or [])
                delta = {"content": c.text[start:]} if len(c.text) > start else {}
                yield sse(base | {"choices": [{"index": c.index, "delta": delta,
                                               "logprobs": chat_logprobs(tokenizer, c.logprobs, lp_start),
                                               "finish_reason": reason}]})
            if out.finished:
                final = out
        if include_usage and final is not None:
            yield sse(base | {"choices": [], "usage": usage([final])})
        state.metrics.requests.labels("ok").inc()
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        state.metrics.requests.labels("error").inc()
        yield stream_error(exc) if not isinstance(exc, RuntimeError) else stream_error(_as_api_error(str(exc)))
    yield "data: [DONE]\n\n"


def _as_api_error(message: str) -> APIError:
    timed_out = "timed out" in message
    return APIError(504 if timed_out else 500, message, code="timeout" if timed_out else "engine_error")
