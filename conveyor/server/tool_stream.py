"""SSE chunks of a chat completion that offers tools: content while it cannot be part of a call,
then the calls as OpenAI's `tool_calls` deltas (a header with id and name, then the arguments)
and finish_reason "tool_calls".

With tool_choice "auto" the text is streamed up to where the parser's start marker (e.g.
"<tool_call>") begins, or could begin; with "required" or a named function the reply is the
calls themselves and goes out once complete. A "required" reply cut short (max_tokens) sends the calls it
completed, no content, and finish_reason "length", as vLLM does."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from conveyor.outputs import RequestOutput
from conveyor.server.error_responses import as_api_error, raise_if_ended_by_error
from conveyor.server.logprobs import TokenBytes, chat_logprobs, generated
from conveyor.server.serving import Prepared, finish_reason, merged, now, sse
from conveyor.server.usage import running_usage, usage


def _safe_end(text: str, marker: str) -> int:
    """How much of `text` is surely content: up to the marker, or up to a tail that could begin it."""
    at = text.find(marker)
    if at >= 0:
        return at
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


async def tool_chat_chunks(
    streams: list[AsyncIterator[RequestOutput]],
    prepared: Prepared,
    rid: str,
    model: str,
    tokens: TokenBytes | None,
) -> AsyncIterator[str]:
    assert prepared.tools is not None and prepared.parser is not None
    plan, parser = prepared.tools, prepared.parser
    policy = prepared.extras.usage
    prompt_len = len(prepared.prompts[0])
    base: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": now(), "model": model}
    generated_so_far: dict[int, int] = {}  # tokens of each choice so far, for continuous usage

    def chunk(index: int, delta: dict[str, Any], reason: str | None = None, logprobs: Any = None) -> str:
        return sse(
            base
            | {"choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}
            | running_usage(policy, prompt_len, generated_so_far.get(index, 0))
        )

    for index in range(prepared.params.n):
        yield chunk(index, {"role": prepared.extras.role, "content": ""})
    sent: dict[int, int] = {}
    sent_lp: dict[int, int] = {}
    ended: set[int] = set()
    final = None
    async for _, out in merged(streams):
        for c in out.outputs:
            if c.index in ended:
                continue
            reason = finish_reason(c.finish_reason, out.error)
            if out.error is not None and c.finish_reason == "abort":
                raise as_api_error(out)
            start = sent.get(c.index, 0)
            generated_so_far[c.index] = len(c.token_ids)
            logprobs = None
            if c.logprobs is not None:
                logprobs = chat_logprobs(tokens, generated(c.logprobs[sent_lp.get(c.index, 0) :]))
                sent_lp[c.index] = len(c.logprobs)
            if reason is None:
                end = _safe_end(c.text, parser.start_marker) if plan.mode == "auto" else 0
                if end > start:
                    sent[c.index] = end
                    yield chunk(c.index, {"content": c.text[start:end]}, logprobs=logprobs)
                elif logprobs is not None and logprobs.get("content"):
                    yield chunk(c.index, {}, logprobs=logprobs)
                continue
            ended.add(c.index)
            cut = plan.read_cut_reply(c.text) if reason == "length" else None
            content, calls = plan.read_reply(c.text, parser) if reason == "stop" else cut or (c.text, [])
            if not calls:
                rest = "" if cut is not None else c.text[start:]
                yield chunk(c.index, {"content": rest} if rest else {}, reason, logprobs)
                raise_if_ended_by_error(out, c)
                continue
            leftover = (content or "")[start:] if content and len(content) > start else ""
            if leftover:
                yield chunk(c.index, {"content": leftover})
            for i, call in enumerate(calls):
                yield chunk(
                    c.index,
                    {
                        "tool_calls": [
                            {
                                "index": i,
                                "id": call.id,
                                "type": "function",
                                "function": {"name": call.name, "arguments": ""},
                            }
                        ]
                    },
                )
                yield chunk(c.index, {"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
            yield chunk(c.index, {}, "tool_calls" if reason == "stop" else reason, logprobs)
        if out.finished:
            final = out
    if policy.final and final is not None:
        yield sse(base | {"choices": [], "usage": usage([final], policy=policy)})
