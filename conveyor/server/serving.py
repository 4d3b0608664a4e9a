"""Turn OpenAI requests into engine requests, and engine outputs into OpenAI responses / SSE chunks."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from conveyor.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from conveyor.engine.info import EngineInfo
from conveyor.errors import InvalidRequestError
from conveyor.outputs import CompletionOutput, RequestOutput
from conveyor.params import SamplingParams
from conveyor.server.error_responses import APIError, param_of, sse_error
from conveyor.server.logprobs import Entry, TokenBytes, chat_logprobs, completion_logprobs, echoed, generated
from conveyor.server.prompt_truncation import truncate_prompt
from conveyor.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from conveyor.server.request_constraints import chat_constraint, request_constraint
from conveyor.server.state import ServerOptions
from conveyor.server.template_kwargs import template_kwargs
from conveyor.server.vllm_extras import (
    ResponseExtras,
    choice_token_ids,
    extras_of,
    generation_prompt,
    no_streamed_prompt_logprobs,
    prompt_fields,
)
from conveyor.tools import ToolParser, ToolPlan, parser_for, render_conversation


@dataclass
class Prepared:
    prompts: list[list[int]]
    texts: list[str | None]
    params: SamplingParams
    echo: list[str] | None = None
    """/v1/completions with echo: the text each prompt is echoed as, before its completion."""
    score_only: bool = False
    """echo with max_tokens=0: the prompt (and its logprobs) only; the one token generated is dropped."""
    extras: ResponseExtras = field(default_factory=ResponseExtras)
    """What vLLM's request fields add to the response (vllm_extras.py)."""
    tools: ToolPlan | None = None
    """Chat with tools: how replies become tool calls."""
    parser: ToolParser | None = None
    constraint_param: str | None = None
    """The request field the output constraint came from (named in errors about it)."""


class Serving:
    def __init__(self, engine: AsyncEngine, options: ServerOptions) -> None:
        self.engine = engine
        self.options = options
        self.model_name = options.model_name
        self.request_timeout = options.request_timeout
        self._token_bytes: TokenBytes | None = None

    @property
    def token_bytes(self) -> TokenBytes | None:
        """Token text and bytes for logprobs (None for a model without a tokenizer)."""
        if self._token_bytes is None and self._core.tokenizer is not None:
            self._token_bytes = TokenBytes(self._core.tokenizer)
        return self._token_bytes

    @property
    def _core(self) -> EngineInfo:
        """The ready engine's model facts (routes that reach here have checked readiness)."""
        info = self.engine.info
        if info is None:
            raise APIError(
                503, "the model is still loading; retry shortly", code="loading", headers={"Retry-After": "2"}
            )
        return info

    @property
    def max_model_len(self) -> int:
        return self._core.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._core.vocab_size

    # ---- request -> engine ------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r} (see GET /v1/models)",
                "model",
                "model_not_found",
            )

    def _params(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        constraint: tuple[dict[str, Any] | None, str | None] = (None, None),
    ) -> SamplingParams:
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        defaults = self._core.sampling_defaults  # the model's recommended settings fill what is left out
        temperature = body.temperature if body.temperature is not None else defaults.get("temperature", 1.0)
        top_p = body.top_p if body.top_p is not None else defaults.get("top_p", 1.0)
        top_k = body.top_k if "top_k" in body.model_fields_set else int(defaults.get("top_k", 0))
        try:
            return SamplingParams(
                n=body.n,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                min_p=body.min_p,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                seed=body.seed,
                stop=stop,
                stop_token_ids=body.stop_token_ids or [],
                include_stop_str_in_output=body.include_stop_str_in_output,
                ignore_eos=body.ignore_eos,
                min_tokens=body.min_tokens,
                logprobs=logprobs,
                logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()},
                skip_special_tokens=body.skip_special_tokens,
                prompt_logprobs=prompt_logprobs,
                structured_outputs=constraint[0],
            )
        except InvalidRequestError as exc:
            param = param_of(exc)
            raise APIError(400, str(exc), constraint[1] if param == "structured_outputs" else param) from None

    async def _tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tokenizer = self._core.tokenizer
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send token ids as the prompt", "prompt")
        encoded = await asyncio.to_thread(tokenizer, text, add_special_tokens=add_special_tokens)
        return list(encoded["input_ids"])

    def _check_lengths(self, prompts: list[list[int]], max_tokens: int | None, param: str) -> None:
        limit = self._core.max_model_len
        vocab = self._core.vocab_size
        for ids in prompts:
            if not ids:
                raise APIError(400, "the prompt is empty (0 tokens)", "prompt")
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"prompt token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
            if len(ids) >= limit:
                raise APIError(
                    400,
                    f"the prompt has {len(ids)} tokens, but this model's context is {limit} tokens "
                    f"(max_model_len) and at least one must be left for output; shorten the "
                    f"prompt",
                    "prompt",
                    "context_length_exceeded",
                )
            if max_tokens is not None and len(ids) + max_tokens > limit:
                raise APIError(
                    400,
                    f"{param}={max_tokens} is too large: the prompt has {len(ids)} tokens and the "
                    f"context is {limit} tokens, so at most {limit - len(ids)} can be generated; "
                    f"lower {param} (or omit it)",
                    param,
                    "context_length_exceeded",
                )

    async def prepare_completion(self, body: CompletionRequest) -> Prepared:
        self.check_model(body.model)
        if body.suffix is not None:
            raise APIError(400, "suffix is not supported", "suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of other than n is not supported", "best_of")
        raw = body.prompt
        if isinstance(raw, str):
            items: list[Any] = [raw]
        elif raw and all(isinstance(x, int) for x in raw):
            items = [raw]
        else:
            items = list(raw)
        if not items:
            raise APIError(400, "prompt is empty; give a string, a list of strings or token ids", "prompt")
        if len(items) * body.n > 64:
            raise APIError(400, f"{len(items)} prompts x n={body.n} is more than 64 completions per request", "prompt")
        score_only = body.max_tokens == 0
        if score_only and not body.echo:
            raise APIError(
                400,
                "max_tokens must be at least 1 (got 0); 0 is allowed only with echo=true, to score "
                "the prompt without generating",
                "max_tokens",
            )
        prompts = [await self._tokenize(x) if isinstance(x, str) else list(x) for x in items]
        max_tokens = 1 if score_only else body.max_tokens
        kept = [self._truncate(ids, body, max_tokens, "max_tokens") for ids in prompts]
        texts = [x if isinstance(x, str) and len(k) == len(ids) else None for x, k, ids in zip(items, kept, prompts)]
        prompts = kept
        self._check_lengths(prompts, max_tokens, "max_tokens")
        echo = None
        if body.echo:
            tokenizer = self._core.tokenizer
            echo = [
                t if t is not None else tokenizer.decode(ids) if tokenizer is not None else ""
                for t, ids in zip(texts, prompts)
            ]
        no_streamed_prompt_logprobs(body, completions=True)
        wanted = [n for n in (body.logprobs if body.echo else None, body.prompt_logprobs) if n is not None]
        constraint = request_constraint(body)
        params = self._params(body, max_tokens, body.logprobs, max(wanted) if wanted else None, constraint)
        extras = extras_of(body, self.options)
        return Prepared(prompts, texts, params, echo, score_only, extras, constraint_param=constraint[1])

    async def prepare_chat(self, body: ChatCompletionRequest) -> Prepared:
        self.check_model(body.model)
        add_generation_prompt = generation_prompt(body)
        extra = template_kwargs(body.chat_template_kwargs, add_generation_prompt, body.continue_final_message)
        tools, constraint, source = chat_constraint(body)
        parser = self.tool_parser()
        text = self.chat_text(
            body.messages,
            add_generation_prompt,
            body.continue_final_message,
            tools.tools if tools.offers_tools else None,
            parser,
            extra,
        )
        full = await self._tokenize(text, add_special_tokens=False)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        ids = self._truncate(full, body, max_tokens, param)
        self._check_lengths([ids], max_tokens, param)
        top = body.top_logprobs if body.top_logprobs is not None else 0
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        no_streamed_prompt_logprobs(body, completions=False)
        last = body.messages[-1]
        role = "assistant" if add_generation_prompt else last.role  # as vLLM: the role whose turn it is
        extras = extras_of(body, self.options, role, last.text() if body.echo and last.role == role else "")
        params = self._params(
            body, max_tokens, top if body.logprobs else None, body.prompt_logprobs, (constraint, source)
        )
        texts: list[str | None] = [text if len(ids) == len(full) else None]
        return Prepared([ids], texts, params, extras=extras, tools=tools, parser=parser, constraint_param=source)

    def _truncate(
        self, ids: list[int], body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None, param: str
    ) -> list[int]:
        return truncate_prompt(
            ids, body.truncate_prompt_tokens, body.truncation_side, self._core.max_model_len, max_tokens, param
        )

    def tool_parser(self) -> ToolParser:
        """The tool-call format of this model (--tool-call-parser, else read from its chat template)."""
        tokenizer = self._core.tokenizer
        return parser_for(self.engine.config.tool_call_parser, getattr(tokenizer, "chat_template", None))

    def chat_text(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        parser: ToolParser | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """The conversation rendered by the model's chat template (400 when it has none or refuses), tool
        calls and tool results included; `tools` are offered to the model, `extra` are more template variables
        (chat_template_kwargs, checked by template_kwargs.py)."""
        tokenizer = self._core.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
        rendered, template_args = render_conversation(
            [m.as_dict() for m in messages], tools, tokenizer.chat_template, parser or self.tool_parser()
        )
        try:
            text: str = tokenizer.apply_chat_template(
                rendered,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(extra or {}),
                **template_args,
            )
        except Exception as exc:
            raise APIError(
                400, f"the chat template rejected these messages: {type(exc).__name__}", "messages"
            ) from None
        return text

    # ---- engine -> responses ----------------------------------------------------------
    async def admit(self, prepared: Prepared, base_id: str) -> list[AsyncIterator[RequestOutput]]:
        """Admit every prompt of the request, or none: refusal maps to an HTTP error."""
        streams: list[AsyncIterator[RequestOutput]] = []
        try:
            for i, ids in enumerate(prepared.prompts):
                streams.append(await self.engine.submit(ids, prepared.params, f"{base_id}-{i}", self.request_timeout))
        except BaseException as exc:
            for stream in streams:
                await stream.aclose()  # type: ignore[attr-defined]
            if isinstance(exc, QueueFullError):
                raise APIError(503, str(exc), code="queue_full", headers={"Retry-After": "1"}) from None
            if isinstance(exc, EngineDeadError):
                raise APIError(503, "the engine has stopped; restart the server", code="engine_dead") from None
            if isinstance(exc, InvalidRequestError):
                param = param_of(exc)
                raise APIError(
                    400, str(exc), prepared.constraint_param if param == "structured_outputs" else param
                ) from None
            raise
        return streams

    @staticmethod
    async def collect(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
        async def last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
            final = None
            async for out in stream:
                final = out
            assert final is not None
            return final

        return list(await asyncio.gather(*(last(s) for s in streams)))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def finish_reason(reason: str | None, error: str | None, score_only: bool = False) -> str | None:
    if reason == "abort":
        return "error" if error else "abort"
    return "length" if score_only and reason is not None else reason


def completion_entries(
    prepared: Prepared, out: RequestOutput, c: CompletionOutput, with_echo: bool, start: int = 0
) -> list[Entry]:
    """A completion choice's logprob positions: the prompt's when it is echoed here, then the generated
    tokens from `start` on (none when only scoring the prompt)."""
    assert c.logprobs is not None
    entries = echoed(out.prompt_token_ids, out.prompt_logprobs, prepared.params.logprobs) if with_echo else []
    return entries if prepared.score_only else entries + generated(c.logprobs[start:])


def completion_choice(
    prepared: Prepared, prompt_index: int, out: RequestOutput, c: CompletionOutput, tokens: TokenBytes | None
) -> dict[str, Any]:
    """One choice of a /v1/completions response: the echoed prompt (when asked), then the completion."""
    echo = prepared.echo[prompt_index] if prepared.echo is not None else ""
    logprobs = None
    if c.logprobs is not None:
        logprobs = completion_logprobs(tokens, completion_entries(prepared, out, c, prepared.echo is not None))
    return (
        {
            "index": prompt_index * prepared.params.n + c.index,
            "text": echo + ("" if prepared.score_only else c.text),
            "logprobs": logprobs,
            "finish_reason": finish_reason(c.finish_reason, out.error, prepared.score_only),
            "stop_reason": None if prepared.score_only else c.stop_reason,
        }
        | prompt_fields(prepared.extras, out)
        | choice_token_ids(prepared.extras, c, len(c.token_ids) if prepared.score_only else 0, nulls=True)
    )


def chat_choice(
    out: RequestOutput, c: CompletionOutput, tokens: TokenBytes | None, prepared: Prepared | None = None
) -> dict[str, Any]:
    """One choice of a /v1/chat/completions response: the reply, or the tool calls read from it."""
    extras = prepared.extras if prepared is not None else ResponseExtras()
    message: dict[str, Any] = {"role": extras.role, "content": extras.chat_echo + c.text}
    reason = finish_reason(c.finish_reason, out.error)
    plan = prepared.tools if prepared is not None else None
    if plan is not None and plan.offers_tools and prepared is not None and prepared.parser is not None:
        read = plan.read_reply(c.text, prepared.parser) if reason == "stop" else None
        if read is None and reason == "length":
            read = plan.read_cut_reply(c.text)  # tool_choice required: the calls completed, no content
            if read is not None:
                message = {"role": extras.role, "content": read[0]}
        if read is not None and read[1]:
            message = {"role": extras.role, "content": read[0], "tool_calls": [call.to_openai() for call in read[1]]}
            reason = "tool_calls" if reason == "stop" else reason
    return {
        "index": c.index,
        "message": message,
        "logprobs": chat_logprobs(tokens, generated(c.logprobs)) if c.logprobs is not None else None,
        "finish_reason": reason,
        "stop_reason": c.stop_reason,
    } | choice_token_ids(extras, c, nulls=True)


async def merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as their items arrive; cancels the rest on exit."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
            await queue.put((i, None))
        except BaseException as exc:  # includes cancellation
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except BaseException:
                pass


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def stream_error(exc: BaseException) -> str:
    if isinstance(exc, APIError):
        return sse_error(exc.status, exc.message, exc.param, exc.code)
    if isinstance(exc, InvalidRequestError):
        return sse_error(400, str(exc), param_of(exc))
    if isinstance(exc, QueueFullError):
        return sse_error(503, str(exc))
    if isinstance(exc, EngineDeadError):
        return sse_error(503, "the engine has stopped; the request could not be completed")
    return sse_error(500, "internal server error; the request was not completed")


def now() -> int:
    return int(time.time())
