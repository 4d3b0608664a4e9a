"""Server-sent event streams of /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from conveyor.outputs import RequestOutput
from conveyor.server.error_responses import as_api_error, raise_if_ended_by_error
from conveyor.server.logprobs import TextOffsets, TokenBytes, chat_logprobs, completion_logprobs, generated
from conveyor.server.serving import Prepared, completion_entries, finish_reason, merged, now, sse, stream_error
from conveyor.server.state import ServerState
from conveyor.server.usage import running_usage, usage
from conveyor.server.vllm_extras import choice_token_ids


def sse_response(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        body, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


async def _terminated(chunks: AsyncIterator[str], state: ServerState) -> AsyncIterator[str]:
    """The chunks, then exactly one end: `[DONE]`, after an SSE error event when the stream failed."""
    try:
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]  # its requests are aborted, whatever ended us
        state.metrics.requests.labels("ok").inc()
    except (asyncio.CancelledError, GeneratorExit):  # the client went away: nothing more to send
        state.metrics.requests.labels("abort").inc()
        raise
    except BaseException as exc:
        state.metrics.requests.labels("error").inc()
        yield stream_error(exc)
    yield "data: [DONE]\n\n"


def stream_completion(
    streams: list[AsyncIterator[RequestOutput]],
    prepared: Prepared,
    rid: str,
    model: str,
    tokens: TokenBytes | None,
    state: ServerState,
) -> AsyncIterator[str]:
    return _terminated(_completion_chunks(streams, prepared, rid, model, tokens), state)


def stream_chat(
    streams: list[AsyncIterator[RequestOutput]],
    prepared: Prepared,
    rid: str,
    model: str,
    tokens: TokenBytes | None,
    state: ServerState,
) -> AsyncIterator[str]:
    if prepared.tools is not None and prepared.tools.offers_tools:
        from conveyor.server.tool_stream import tool_chat_chunks

        return _terminated(tool_chat_chunks(streams, prepared, rid, model, tokens), state)
    return _terminated(_chat_chunks(streams, prepared, rid, model, tokens), state)


async def _completion_chunks(
    streams: list[AsyncIterator[RequestOutput]],
    prepared: Prepared,
    rid: str,
    model: str,
    tokens: TokenBytes | None,
) -> AsyncIterator[str]:
    """Chunks of every choice as they grow. A choice's first chunk carries the echoed prompt (with its
    logprobs) when asked; text_offset counts the characters of the choice sent before."""
    n = prepared.params.n
    offsets: dict[int, TextOffsets] = {}  # per choice; present once its first chunk went out
    sent_text: dict[int, int] = {}  # characters of each completion's text sent so far
    sent_lp: dict[int, int] = {}
    sent_ids: dict[int, int] = {}  # tokens of each completion whose ids went out (return_token_ids)
    ended: set[int] = set()  # choices whose finish_reason was sent (later outputs still list them)
    finals: dict[int, RequestOutput] = {}
    extras = prepared.extras
    created = now()
    async for i, out in merged(streams):
        for c in out.outputs:
            index = i * n + c.index
            if index in ended:
                continue
            reason = finish_reason(c.finish_reason, out.error, prepared.score_only)
            if out.error is not None and c.finish_reason == "abort":
                raise as_api_error(out)
            echoing = index not in offsets and prepared.echo is not None
            if echoing and not c.token_ids and reason is None:
                continue  # the echo (and the prompt's logprobs) goes out once the prompt is computed
            echo = prepared.echo[i] if echoing and prepared.echo is not None else ""
            start = sent_text.get(index, 0)
            text = "" if prepared.score_only else c.text[start:]
            if not echoing and not text and reason is None:
                continue
            first = index not in offsets
            counter = offsets.setdefault(index, TextOffsets())
            logprobs = None
            if c.logprobs is not None:
                entries = completion_entries(prepared, out, c, echoing, sent_lp.get(index, 0))
                logprobs = completion_logprobs(tokens, entries, counter)
            ids = choice_token_ids(extras, c, len(c.token_ids) if prepared.score_only else sent_ids.get(index, 0))
            sent_text[index], sent_lp[index], sent_ids[index] = len(c.text), len(c.logprobs or []), len(c.token_ids)
            if reason is not None:
                ended.add(index)
            prompt_ids = {"prompt_token_ids": list(out.prompt_token_ids)} if first and extras.return_token_ids else {}
            yield sse(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": index,
                            "text": echo + text,
                            "logprobs": logprobs,
                            "finish_reason": reason,
                            "stop_reason": c.stop_reason if reason and not prepared.score_only else None,
                        }
                        | prompt_ids
                        | ids
                    ],
                }
                | running_usage(extras.usage, len(out.prompt_token_ids), 0 if prepared.score_only else len(c.token_ids))
            )
            raise_if_ended_by_error(out, c)
        if out.finished:
            finals[i] = out
    if extras.usage.final:
        yield sse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage(list(finals.values()), prepared.score_only, extras.usage),
            }
        )


async def _chat_chunks(
    streams: list[AsyncIterator[RequestOutput]],
    prepared: Prepared,
    rid: str,
    model: str,
    tokens: TokenBytes | None,
) -> AsyncIterator[str]:
    created = now()
    base: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    extras = prepared.extras
    prompt_len = len(prepared.prompts[0])
    for index in range(prepared.params.n):
        opening = {"prompt_token_ids": list(prepared.prompts[0])} if index == 0 and extras.return_token_ids else {}
        yield sse(
            base
            | opening
            | {
                "choices": [
                    {
                        "index": index,
                        "delta": {"role": extras.role, "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            }
            | running_usage(extras.usage, prompt_len, 0)
        )
    for index in range(prepared.params.n if extras.chat_echo else 0):  # echo: the last message, then the reply
        yield sse(
            base
            | {
                "choices": [
                    {"index": index, "delta": {"content": extras.chat_echo}, "logprobs": None, "finish_reason": None}
                ]
            }
            | running_usage(extras.usage, prompt_len, 0)
        )
    sent_text: dict[int, int] = {}
    sent_lp: dict[int, int] = {}
    sent_ids: dict[int, int] = {}
    ended: set[int] = set()  # choices whose finish_reason was sent (later outputs still list them)
    final = None
    async for _, out in merged(streams):
        for c in out.outputs:
            if c.index in ended:
                continue
            start, lp_start = sent_text.get(c.index, 0), sent_lp.get(c.index, 0)
            reason = finish_reason(c.finish_reason, out.error)
            if out.error is not None and c.finish_reason == "abort":
                raise as_api_error(out)
            if len(c.text) <= start and reason is None:
                continue
            ids = choice_token_ids(extras, c, sent_ids.get(c.index, 0))
            sent_text[c.index], sent_lp[c.index], sent_ids[c.index] = (
                len(c.text),
                len(c.logprobs or []),
                len(c.token_ids),
            )
            if reason is not None:
                ended.add(c.index)
            delta = {"content": c.text[start:]} if len(c.text) > start else {}
            logprobs = chat_logprobs(tokens, generated(c.logprobs[lp_start:])) if c.logprobs is not None else None
            yield sse(
                base
                | {"choices": [{"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason} | ids]}
                | running_usage(extras.usage, prompt_len, len(c.token_ids))
            )
            raise_if_ended_by_error(out, c)
        if out.finished:
            final = out
    if extras.usage.final and final is not None:
        yield sse(base | {"choices": [], "usage": usage([final], policy=extras.usage)})
