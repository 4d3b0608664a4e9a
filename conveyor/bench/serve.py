"""`conveyor bench serve --url ...`: load an OpenAI-compatible server with concurrent streaming clients.

Each client sends streaming /v1/completions requests back to back (random-token prompts,
EOS ignored) until its share of requests or the duration is used up. Reports TTFT, time
per output token (TPOT), inter-token latency (ITL) and end-to-end latency at p50/p90/p99,
throughput, failures, and, with --server-pid, the server's resident memory over time.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class RequestRecord:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "mean": float("nan")}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": pick(0.50), "p90": pick(0.90), "p99": pick(0.99), "mean": statistics.fmean(ordered)}


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]) -> RequestRecord:
    start = time.perf_counter()
    last = None
    record = RequestRecord(ok=False)
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                record.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return record
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.error = chunk["error"]["message"]
                    return record
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if last is None:
                        record.ttft = now - start
                    else:
                        record.itl.append(now - last)
                    last = now
        record.e2e = time.perf_counter() - start
        record.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record


async def run_load(
    url: str,
    concurrency: int,
    duration_s: float | None,
    num_requests: int | None,
    input_len: tuple[int, int],
    output_len: int,
    api_key: str | None,
    model: str | None,
    seed: int = 0,
    server_pid: int | None = None,
) -> dict[str, Any]:
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    records: list[RequestRecord] = []
    rss: list[tuple[float, int]] = []
    stop_at = time.perf_counter() + duration_s if duration_s else None
    budget = [num_requests if num_requests is not None else 10**9]

    def body() -> dict[str, Any]:
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(*input_len))]
        b: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if model:
            b["model"] = model
        return b

    async def client_loop(client: httpx.AsyncClient) -> None:
        while budget[0] > 0 and (stop_at is None or time.perf_counter() < stop_at):
            budget[0] -= 1
            records.append(await _one(client, url, body(), headers))

    async def sample_rss() -> None:
        import psutil

        proc = psutil.Process(server_pid)
        while True:
            rss.append((time.perf_counter(), proc.memory_info().rss))
            await asyncio.sleep(2.0)

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    start = time.perf_counter()
    sampler = asyncio.create_task(sample_rss()) if server_pid else None
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    if sampler:
        sampler.cancel()
    ok = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    result: dict[str, Any] = {
        "url": url,
        "concurrency": concurrency,
        "seconds": elapsed,
        "requests": len(records),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "output_tokens_per_s": tokens / elapsed,
        "requests_per_s": len(ok) / elapsed,
        "ttft_s": percentiles([r.ttft for r in ok]),
        "tpot_s": percentiles(tpot),
        "itl_s": percentiles([x for r in ok for x in r.itl]),
        "e2e_s": percentiles([r.e2e for r in ok]),
        "input_len": list(input_len),
        "output_len": output_len,
        "e2e_values": [r.e2e for r in ok],
    }
    if rss:
        mib = [v / 2**20 for _, v in rss]
        third = max(1, len(mib) // 3)
        result["server_rss_mib"] = {
            "first_third_mean": statistics.fmean(mib[:third]),
            "last_third_mean": statistics.fmean(mib[-third:]),
            "max": max(mib),
            "samples": len(mib),
        }
    return result


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| concurrency | requests | failed | output tok/s | TTFT p50 / p99 (s) | ITL p50 / p99 (s) | "
        "TPOT p50 (s) | e2e p50 / p99 (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['concurrency']} | {r['requests']} | {r['failed']} | {r['output_tokens_per_s']:.1f} | "
            f"{r['ttft_s']['p50']:.3f} / {r['ttft_s']['p99']:.3f} | {r['itl_s']['p50']:.3f} / "
            f"{r['itl_s']['p99']:.3f} | {r['tpot_s']['p50']:.3f} | {r['e2e_s']['p50']:.2f} / "
            f"{r['e2e_s']['p99']:.2f} |"
        )
    return "\n".join(lines)
