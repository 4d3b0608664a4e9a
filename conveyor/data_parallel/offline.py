"""LLM(data_parallel_size=M): the offline API's batch spread over M replicas by the prefix-affinity router.

Each prompt goes to one replica as JSON (SamplingParams as its own JSON form) and comes back as a
RequestOutput's JSON; a replica that is unreachable before answering gets the request again elsewhere.
"""

from __future__ import annotations

import asyncio
import hmac
import uuid
from collections.abc import Sequence
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from conveyor.config import EngineConfig
from conveyor.data_parallel.replicas import ReplicaSet
from conveyor.data_parallel.router import PrefixAffinityRouter
from conveyor.engine.async_engine import AsyncEngine
from conveyor.errors import ConveyorError, InvalidRequestError
from conveyor.outputs import CompletionOutput, RequestOutput
from conveyor.params import SamplingParams

MAX_IN_FLIGHT_PER_REPLICA = 256
REQUEST_TIMEOUT_S = 3600.0
OFFLINE_ROUTE = "/conveyor/v1/generate"
"""LLM.generate's route to a replica: SamplingParams in, RequestOutput out, both as JSON."""
APP_FACTORY = "conveyor.data_parallel.offline:build_offline_app"


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str | list[int] = Field(union_mode="left_to_right")
    params: dict[str, Any]


def output_as_json(out: RequestOutput) -> dict[str, Any]:
    """The parts of a RequestOutput that travel (logprobs are refused before sending)."""
    return {
        "request_id": out.request_id,
        "prompt": out.prompt,
        "prompt_token_ids": list(out.prompt_token_ids),
        "num_cached_tokens": out.num_cached_tokens,
        "error": out.error,
        "error_code": out.error_code,
        "outputs": [
            {
                "index": c.index,
                "text": c.text,
                "token_ids": list(c.token_ids),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in out.outputs
        ],
    }


def output_from_json(data: dict[str, Any]) -> RequestOutput:
    outputs = [
        CompletionOutput(
            index=c["index"],
            text=c["text"],
            token_ids=list(c["token_ids"]),
            finish_reason=c["finish_reason"],
            stop_reason=c["stop_reason"],
        )
        for c in data["outputs"]
    ]
    return RequestOutput(
        request_id=data["request_id"],
        prompt=data["prompt"],
        prompt_token_ids=list(data["prompt_token_ids"]),
        outputs=outputs,
        finished=True,
        num_cached_tokens=data["num_cached_tokens"],
        error=data["error"],
        error_code=data["error_code"],
    )


def build_offline_app(engine: AsyncEngine, model_name: str, api_key: str) -> FastAPI:
    """A replica's app for LLM: GET /health and POST OFFLINE_ROUTE, open only to the bearer key."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def key(request: Request, call_next: Any) -> Any:
        if not hmac.compare_digest(request.headers.get("authorization", "").encode(), expected):
            return JSONResponse({"error": {"message": "missing or invalid key"}}, status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse(
            {"status": "ok"} if engine.is_ready else {"status": "loading"}, status_code=200 if engine.is_ready else 503
        )

    @app.post(OFFLINE_ROUTE)
    async def generate(body: GenerateBody) -> JSONResponse:
        try:
            params = SamplingParams.model_validate(body.params)
            last: RequestOutput | None = None
            async for out in engine.generate(body.prompt, params, f"llm-{uuid.uuid4().hex[:24]}"):
                last = out
        except (ConveyorError, ValueError) as exc:
            return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
        assert last is not None and last.finished
        return JSONResponse(output_as_json(last))

    return app


class DataParallelGenerator:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.replicas = ReplicaSet(config, APP_FACTORY, model_name="offline")
        self.router = PrefixAffinityRouter(config.data_parallel_size, config.block_size)

    def generate(self, prompts: Sequence[str | Sequence[int]], params: Sequence[SamplingParams]) -> list[RequestOutput]:
        for p in params:
            if p.logprobs is not None or p.prompt_logprobs is not None:
                raise InvalidRequestError(
                    f"logprobs / prompt_logprobs are not carried back from data-parallel "
                    f"replicas yet (data_parallel_size={self.config.data_parallel_size}); "
                    f"use data_parallel_size=1 for them"
                )
        return asyncio.run(self._generate_all(list(prompts), list(params)))

    async def _generate_all(
        self, prompts: list[str | Sequence[int]], params: list[SamplingParams]
    ) -> list[RequestOutput]:
        limit = asyncio.Semaphore(MAX_IN_FLIGHT_PER_REPLICA * len(self.replicas.replicas))
        headers = {"Authorization": f"Bearer {self.replicas.api_key}"}
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, headers=headers) as client:
            tasks = [asyncio.ensure_future(self._one(client, limit, prompt, p)) for prompt, p in zip(prompts, params)]
            try:
                return list(await asyncio.gather(*tasks))
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

    async def _one(
        self, client: httpx.AsyncClient, limit: asyncio.Semaphore, prompt: str | Sequence[int], params: SamplingParams
    ) -> RequestOutput:
        token_ids = None if isinstance(prompt, str) else [int(t) for t in prompt]
        body = {
            "prompt": prompt if token_ids is None else token_ids,
            "params": params.model_dump(mode="json"),
        }
        # text prompts are routed by load alone (the front has no tokenizer); token prompts by prefix too
        ids = [] if token_ids is None else list(token_ids)
        async with limit:
            tried: set[int] = set()
            while True:
                healthy = [i for i in self.replicas.healthy if i not in tried]
                if not healthy:
                    raise ConveyorError(
                        f"no data-parallel replica could take the request (tried replicas "
                        f"{sorted(tried)}; none other is up)"
                    )
                route = self.router.route(
                    ids, params.max_tokens or 0, unavailable=set(range(len(self.replicas.replicas))) - set(healthy)
                )
                address = self.replicas.replicas[route.replica].address
                if address is None:  # went down since `healthy` was read
                    self.router.finished(route)
                    tried.add(route.replica)
                    continue
                try:
                    response = await client.post(f"http://{address}{OFFLINE_ROUTE}", json=body)
                except httpx.TransportError:
                    self.replicas.mark_down(route.replica)
                    tried.add(route.replica)
                    continue  # nothing came back: the request runs again on another replica
                finally:
                    self.router.finished(route)
                if response.status_code != 200:
                    message = response.json().get("error", {}).get("message", response.text)
                    raise InvalidRequestError(message)
                return output_from_json(response.json())

    def close(self) -> None:
        self.replicas.close()
