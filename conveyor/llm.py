"""LLM: the offline API — generate and chat over a batch, with a progress bar."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
from conveyor.errors import ConfigError, ConveyorError, InvalidRequestError
from conveyor.outputs import NON_FINITE_LOGITS, RequestOutput
from conveyor.params import SamplingParams
from conveyor.tools import ToolParser, ToolPlan, parser_for, plan_tools, render_conversation

if TYPE_CHECKING:
    from conveyor.data_parallel.offline import DataParallelGenerator

Prompt = str | Sequence[int] | dict[str, Any]
"""A string, token ids, or vLLM's dict forms {"prompt": str} / {"prompt_token_ids": [int, ...]}."""
Message = dict[str, Any]


class NonFiniteLogitsError(ConveyorError):
    """The model's logits held NaN or infinity for some of the prompts: LLM.generate and chat raise it once the
    batch has ended, rather than return tokens drawn from them. `outputs` holds every prompt's output in input order
    (the failed ones with finish_reason "error", their text up to the failure, and `error`)."""

    def __init__(self, message: str, outputs: list[RequestOutput]) -> None:
        super().__init__(message)
        self.outputs = outputs


def raise_if_non_finite(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """The outputs, unless any request ended because of non-finite logits: then NonFiniteLogitsError."""
    failed = [i for i, out in enumerate(outputs) if out.error_code == NON_FINITE_LOGITS]
    if not failed:
        return outputs
    first = outputs[failed[0]]
    raise NonFiniteLogitsError(
        f"{len(failed)} of {len(outputs)} prompt(s) failed (the first: prompt {failed[0]}): {first.error}; "
        f"every output is in this error's .outputs",
        outputs,
    )


class LLM:
    """`LLM()` loads the embedded SmolLM2-135M-Instruct; `LLM(model=..., **EngineConfig fields)` any other."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(
                f"unknown engine option(s) {', '.join(unknown)}; the options are {', '.join(sorted(known - {'model'}))}"
            )
        self.config = EngineConfig(model=model, **options)
        self.replicas: DataParallelGenerator | None = None
        """With data_parallel_size > 1: the Ray replicas that run the requests (there is no local engine)."""
        if self.config.data_parallel_size > 1:
            from conveyor.data_parallel.offline import DataParallelGenerator  # Ray only when asked for

            self.replicas = DataParallelGenerator(self.config)
            self.engine: Engine = None  # type: ignore[assignment]
        else:
            self.engine = Engine(self.config)

    def close(self) -> None:
        """End the engine's workers, or every replica and the Ray cluster started for them. Safe to call twice."""
        if self.replicas is not None:
            self.replicas.close()
            self.replicas = None
        elif self.engine is not None:
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _single_engine(self, what: str) -> Engine:
        if self.engine is None:
            raise ConfigError(
                f"{what} needs the model's tokenizer in this process, which data_parallel_size="
                f"{self.config.data_parallel_size} does not load (the replicas do); use generate() "
                f"with text or token-id prompts, or data_parallel_size=1"
            )
        return self.engine

    def get_tokenizer(self) -> Any:
        return self._single_engine("get_tokenizer()").tokenizer

    def _default_params(self) -> SamplingParams:
        """The model's recommended sampling settings (as in the server and vLLM)."""
        defaults = dict(self.engine.sampling_defaults)
        if "top_k" in defaults:
            defaults["top_k"] = int(defaults["top_k"])
        return SamplingParams(**defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for one prompt or many (strings, token-id lists or vLLM's prompt dicts); outputs in input
        order. Without sampling_params, the model's recommended settings apply (as in the server and vLLM)."""
        batch = _as_prompt_list(prompts)
        if self.replicas is not None:
            if sampling_params is None:
                raise ConfigError(
                    "pass sampling_params with data_parallel_size > 1 (the model's recommended "
                    "settings are read from the model, which this process does not load)"
                )
            return raise_if_non_finite(self.replicas.generate(batch, _as_params_list(sampling_params, len(batch))))
        if sampling_params is None:
            sampling_params = self._default_params()
        params = _as_params_list(sampling_params, len(batch))
        ids = []
        try:
            for prompt, p in zip(batch, params):
                ids.append(self.engine.add_request(prompt, p, final_only=True))
        except Exception:
            self.engine.abort(ids)  # all or nothing: a bad prompt leaves no half-admitted batch behind
            raise
        return raise_if_non_finite(self._run(ids, use_tqdm))

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.

        With `tools` (OpenAI's shape) the template is shown them; `tool_choice` is OpenAI's ("auto" by
        default; "required" and a named function constrain the reply to valid calls). Each completion's
        `tool_calls` then holds the calls found in it (None when it made none)."""
        self._single_engine("chat()")
        conversations = _as_conversations(messages)
        plan = plan_tools(tools, tool_choice, parallel_tool_calls)
        parser = parser_for(self.config.tool_call_parser, getattr(self.engine.tokenizer, "chat_template", None))
        prompts = [self.apply_chat_template(c, add_generation_prompt, plan, parser) for c in conversations]
        if plan.constraint is not None:
            sampling_params = [
                _constrained(p, plan.constraint)
                for p in _as_params_list(sampling_params or self._default_params(), len(prompts))
            ]
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        if plan.offers_tools:
            for out in outputs:
                for c in out.outputs:
                    if c.finish_reason == "stop":
                        _content, calls = plan.read_reply(c.text, parser)
                        c.tool_calls = calls or None
        return outputs

    def apply_chat_template(
        self,
        conversation: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: ToolPlan | None = None,
        parser: ToolParser | None = None,
    ) -> str:
        tokenizer = self._single_engine("apply_chat_template()").tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError(
                f"model {self.engine.model_source} has no chat template; use generate() with a plain prompt"
            )
        messages = [_text_message(m) for m in conversation]
        parser = parser or parser_for(self.config.tool_call_parser, tokenizer.chat_template)
        messages, template_args = render_conversation(
            messages, tools.tools if tools and tools.offers_tools else None, tokenizer.chat_template, parser
        )
        try:
            return tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_args
            )
        except Exception as exc:  # the template is the model's code: say so, not where it failed inside jinja
            raise InvalidRequestError(
                f"the model's chat template rejected this conversation ({type(exc).__name__}: {exc})"
            ) from None

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm or len(ids) < 2)
        start, tokens_before = time.perf_counter(), self.engine.num_generated_tokens()
        try:
            while len(finished) < len(ids) and self.engine.has_work():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        bar.update(1)
                if use_tqdm:
                    tokens = self.engine.num_generated_tokens() - tokens_before
                    bar.set_postfix_str(f"{tokens / max(time.perf_counter() - start, 1e-9):.1f} tok/s", refresh=False)
            if not self.engine.num_unfinished():
                self.engine.drain()  # a step launched before the last finish: its tokens are discarded
        except BaseException:
            self.engine.abort([i for i in ids if i not in finished])
            self.engine.drain()
            raise
        finally:
            bar.close()
        return [finished[i] for i in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[str | Sequence[int]]:
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    items = list(prompts)
    if not items:
        raise InvalidRequestError("no prompts given; pass a string, a list of strings or a list of token-id lists")
    token_ids = [x for x in items if isinstance(x, int) and not isinstance(x, bool)]
    if len(token_ids) == len(items):
        return [token_ids]  # one token-id list
    batch: list[str | Sequence[int]] = []
    for i, x in enumerate(items):
        if isinstance(x, dict):
            x = _from_prompt_dict(i, x)
        if not isinstance(x, str) and not (isinstance(x, (list, tuple))):
            raise InvalidRequestError(
                f"prompt {i} is a {type(x).__name__}; each prompt must be a string, a list "
                f"of token ids or a dict with 'prompt' or 'prompt_token_ids'"
            )
        batch.append(x)
    return batch


def _from_prompt_dict(i: int, prompt: dict[str, Any]) -> Any:
    """vLLM's TextPrompt {"prompt": str} / TokensPrompt {"prompt_token_ids": [...]} -> the prompt itself."""
    keys = set(prompt)
    if keys == {"prompt"}:
        return prompt["prompt"]
    if keys == {"prompt_token_ids"}:
        return prompt["prompt_token_ids"]
    raise InvalidRequestError(
        f"prompt {i} is a dict with keys {sorted(keys)}; a prompt dict must have exactly "
        f"one key, 'prompt' (a string) or 'prompt_token_ids' (a list of token ids)"
    )


def _text_message(message: Message) -> Message:
    """A message with its content as text: OpenAI's text parts are joined, None is empty."""
    if not isinstance(message, dict) or "role" not in message:
        raise InvalidRequestError(f"message {message!r:.80} must be a dict with 'role' and 'content'")
    content = message.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise InvalidRequestError(
                f"message content {content!r:.80} has parts other than text; only "
                f"{{'type': 'text', 'text': ...}} parts are supported"
            )
        content = "\n".join(p["text"] for p in content)  # as vLLM (and the server) join text parts
    elif not isinstance(content, str):
        raise InvalidRequestError(
            f"message content must be a string or a list of text parts, got a "
            f"{type(content).__name__} ({content!r:.40})"
        )
    return {**message, "content": content}


def _constrained(params: SamplingParams, constraint: dict[str, Any]) -> SamplingParams:
    if params.structured_outputs is not None:
        raise InvalidRequestError(
            "SamplingParams.structured_outputs cannot be combined with tool_choice 'required' "
            "or a named function: that tool choice already constrains the reply",
            param="structured_outputs",
        )
    return params.clone(structured_outputs=constraint)


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    items = list(params)
    if len(items) != n:
        raise InvalidRequestError(f"got {len(items)} SamplingParams for {n} prompts; give one, or one per prompt")
    for i, p in enumerate(items):
        if not isinstance(p, SamplingParams):
            raise InvalidRequestError(f"sampling_params[{i}] is a {type(p).__name__}, not SamplingParams")
    return items


def _as_conversations(messages: Sequence[Message] | Sequence[Sequence[Message]]) -> list[list[Message]]:
    if isinstance(messages, (str, dict)):
        raise InvalidRequestError(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts (or a list of "
            f"such lists), got a {type(messages).__name__}"
        )
    items: list[Any] = list(messages)  # checked below, message by message
    if not items:
        raise InvalidRequestError("no messages given; pass a list of {'role': ..., 'content': ...} dicts")
    conversations: list[list[Any]] = [items] if all(isinstance(m, dict) for m in items) else [list(c) for c in items]
    for ci, conv in enumerate(conversations):
        if not conv:
            raise InvalidRequestError(f"conversation {ci} is empty; give at least one message")
        for mi, m in enumerate(conv):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise InvalidRequestError(
                    f"conversation {ci} message {mi} is {m!r}; each message must be a dict with 'role' and 'content'"
                )
    return conversations
