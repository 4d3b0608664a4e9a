"""`conveyor bench soak`: N clients for T seconds against one server, mixing well-formed requests (streams, n > 1,
logprobs, stops, seeds, structured output, long prompts, clients that leave mid-stream) with malformed ones; then
the checks that say the server held up:

- every well-formed request completed (a 200 whose every choice has a finish reason; a stream that ends with its
  choices' finish reasons and [DONE]), or was left by its client on purpose;
- every malformed one got a 4xx with a JSON error body; no 5xx at all; no request lost (a timeout, a reset
  connection, a stream cut short);
- afterwards /metrics shows 0 running, 0 waiting and no KV block held by a request;
- the server's resident memory grew by at most the bound (`rss_bound_mib`) from the end of the warm-up to the end;
- a greedy request gives the same token ids before the load and after it.

Each client keeps one keep-alive connection and sends its requests back to back on it, good and bad mixed, so an
error that left a connection unusable shows as the client's next request failing.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx

from conveyor.bench.soak_bodies import CHAT, SENTENCE, SoakMix, SoakRequest
from conveyor.bench.soak_server import parse_metrics, read_rss

GREEDY = {
    "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    "max_tokens": 32,
    "temperature": 0.0,
    "return_token_ids": True,
}
FINISHED = ("stop", "length", "tool_calls")
RSS_BOUND_MIB = 64.0
"""Default bound on the server's resident-memory growth over the second half of the load: the RSS at the end
(every request done) against the highest RSS of the first half of the load's wall time. The weights and the KV
cache are allocated at start, and by half-time the server has run every kind of request at full concurrency, so its
working set (the largest steps' activations, which glibc keeps for reuse: conveyor/host_memory.py) has been
reached; what may still grow is allocator fragmentation and the bounded caches filling (the detokenizer's token-text
LRU, the step timeline's ring, the tokenizers' caches): a few MiB to tens of MiB. Memory that grows with the
number of requests or steps (a leak) keeps growing in the second half and passes the bound once it leaks more than
that over it. The growth from the start is reported too, for information: it includes the working set, which is not
a leak."""


@dataclass
class Outcome:
    kind: str
    well_formed: bool
    result: str
    """completed | left (the client disconnected on purpose) | refused (4xx, JSON body: right for a malformed one)
    | 5xx | lost (timeout, connection error, a stream cut short) | wrong (anything else: a 200 for a malformed
    request, a 4xx for a well-formed one, a body of the wrong shape)."""
    status: int | None = None
    detail: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        if self.well_formed:
            return self.result in ("completed", "left")
        return self.result == "refused"


@dataclass
class SoakConfig:
    url: str
    clients: int = 48
    duration_s: float = 600.0
    seed: int = 0
    server_pid: int | None = None
    max_body_bytes: int = 4 * 2**20
    max_model_len: int = 4096
    long_tokens: int = 3000
    rss_bound_mib: float = RSS_BOUND_MIB
    request_timeout_s: float = 900.0
    settle_timeout_s: float = 120.0


@dataclass
class _Run:
    outcomes: list[Outcome] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)


def _choices_finished(data: dict[str, Any]) -> str | None:
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        return f"no choices in {str(data)[:200]}"
    unfinished = [c.get("finish_reason") for c in choices if c.get("finish_reason") not in FINISHED]
    return f"choices ended with {unfinished}" if unfinished else None


def _error_shape(response: httpx.Response) -> str | None:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"not a JSON error body: {response.text[:200]!r}"
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"} or not error["message"]:
        return f"not OpenAI's error shape: {error!r:.200}"
    return None


async def _read_stream(response: httpx.Response, request: SoakRequest, n: int) -> Outcome:
    done, finished, chunks = False, set(), 0
    async for line in response.aiter_lines():
        if not line:
            continue
        if line == "data: [DONE]":
            done = True
            continue
        data = json.loads(line.removeprefix("data: "))
        if "error" in data:
            return Outcome(request.kind, True, "wrong", 200, f"error event: {data['error'].get('message', '')[:200]}")
        chunks += 1
        for choice in data.get("choices", []):
            if choice.get("finish_reason") is not None:
                finished.add(choice["index"])
        if request.leave_after_chunks is not None and chunks >= request.leave_after_chunks:
            return Outcome(request.kind, True, "left", 200)  # leaving the block closes the connection mid-stream
    if not done or len(finished) < n:
        return Outcome(request.kind, True, "lost", 200, f"stream ended without [DONE] or finish reasons ({finished})")
    return Outcome(request.kind, True, "completed", 200)


async def send(client: httpx.AsyncClient, url: str, request: SoakRequest) -> Outcome:
    """One request, classified (see Outcome.result)."""
    headers = {"Content-Type": "application/json"}
    try:
        async with client.stream("POST", url + request.route, content=request.content(), headers=headers) as r:
            if r.status_code >= 500:
                await r.aread()
                return Outcome(request.kind, request.well_formed, "5xx", r.status_code, r.text[:300])
            if not request.well_formed:
                await r.aread()
                if r.status_code < 400:
                    return Outcome(request.kind, False, "wrong", r.status_code, "a malformed request was accepted")
                problem = _error_shape(r)
                return Outcome(request.kind, False, "wrong" if problem else "refused", r.status_code, problem or "")
            if r.status_code != 200:
                await r.aread()
                return Outcome(request.kind, True, "wrong", r.status_code, r.text[:300])
            if request.stream:
                body = request.body if isinstance(request.body, dict) else {}
                return await _read_stream(r, request, int(body.get("n", 1)))
            await r.aread()
            problem = _choices_finished(r.json())
            return Outcome(request.kind, True, "wrong" if problem else "completed", 200, problem or "")
    except httpx.TimeoutException as exc:
        return Outcome(request.kind, request.well_formed, "lost", None, f"timeout: {type(exc).__name__}")
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return Outcome(request.kind, request.well_formed, "lost", None, f"{type(exc).__name__}: {exc}")


async def _timed(client: httpx.AsyncClient, url: str, request: SoakRequest) -> Outcome:
    start = time.perf_counter()
    outcome = await send(client, url, request)
    outcome.seconds = round(time.perf_counter() - start, 3)
    return outcome


async def _greedy(client: httpx.AsyncClient, url: str) -> tuple[list[int], str]:
    r = await client.post(url + CHAT, json=GREEDY)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return list(choice.get("token_ids") or []), str(choice["message"]["content"])


async def _settle(client: httpx.AsyncClient, url: str, timeout_s: float) -> dict[str, float]:
    """The server's metrics once nothing runs or waits (or as they are at the timeout)."""
    deadline = time.perf_counter() + timeout_s
    while True:
        metrics = parse_metrics((await client.get(url + "/metrics")).text)
        idle = metrics.get("conveyor_num_requests_running") == 0 and metrics.get("conveyor_num_requests_waiting") == 0
        if (idle and metrics.get("conveyor_kv_cache_usage_ratio") == 0) or time.perf_counter() > deadline:
            return metrics
        await asyncio.sleep(0.5)


async def _tokens_per_sentence(client: httpx.AsyncClient, url: str) -> float:
    r = await client.post(url + "/tokenize", json={"prompt": SENTENCE * 20, "add_special_tokens": False})
    r.raise_for_status()
    return max(1.0, r.json()["count"] / 20)


async def run_soak(config: SoakConfig) -> dict[str, Any]:
    """Run the soak against the server at config.url; returns the report (report["passed"] says it held up)."""
    url = config.url.rstrip("/")
    rng = random.Random(config.seed)
    run = _Run()
    timeout = httpx.Timeout(config.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout) as control:
        openapi = (await control.get(url + "/openapi.json")).json()
        mix = SoakMix(
            openapi,
            await _tokens_per_sentence(control, url),
            config.max_model_len,
            config.max_body_bytes,
            config.long_tokens,
        )
        before = await _greedy(control, url)
        rss_start = read_rss(config.server_pid) if config.server_pid else None
        start = time.perf_counter()
        stop_at = start + config.duration_s

        first = mix.every_kind(rng)

        async def client_loop(index: int, seed: int) -> None:
            client_rng = random.Random(seed)
            limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
            async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
                for request in first[index :: config.clients]:
                    run.outcomes.append(await _timed(client, url, request))
                while time.perf_counter() < stop_at:
                    run.outcomes.append(await _timed(client, url, mix.draw(client_rng)))

        async def sample_rss() -> None:
            while config.server_pid:
                value = read_rss(config.server_pid)
                if value is not None:
                    run.rss.append((time.perf_counter() - start, value))
                await asyncio.sleep(2.0)

        sampler = asyncio.create_task(sample_rss())
        await asyncio.gather(*(client_loop(i, rng.getrandbits(32)) for i in range(config.clients)))
        load_s = time.perf_counter() - start
        metrics = await _settle(control, url, config.settle_timeout_s)
        sampler.cancel()
        after = await _greedy(control, url)
        rss_end = read_rss(config.server_pid) if config.server_pid else None
    return report(config, run, load_s, metrics, before, after, rss_start, rss_end)


def report(
    config: SoakConfig,
    run: _Run,
    load_s: float,
    metrics: dict[str, float],
    before: tuple[list[int], str],
    after: tuple[list[int], str],
    rss_start: int | None,
    rss_end: int | None,
) -> dict[str, Any]:
    table: dict[str, Counter[str]] = defaultdict(Counter)
    for o in run.outcomes:
        table[("" if o.well_formed else "bad:") + o.kind][o.result] += 1
    failures = [o for o in run.outcomes if not o.ok]
    server_errors = sum(o.result == "5xx" for o in run.outcomes)
    lost = sum(o.result == "lost" for o in run.outcomes)
    end = {
        "running": metrics.get("conveyor_num_requests_running"),
        "waiting": metrics.get("conveyor_num_requests_waiting"),
        "kv_cache_usage_ratio": metrics.get("conveyor_kv_cache_usage_ratio"),
        "non_finite_requests": metrics.get("conveyor_non_finite_requests_total"),
    }
    idle = end["running"] == 0 and end["waiting"] == 0 and end["kv_cache_usage_ratio"] == 0
    rss = _rss_summary(config, run.rss, load_s, rss_start, rss_end)
    greedy_same = before == after and bool(before[0])
    passed = not failures and idle and greedy_same and rss.get("within_bound", True)
    return {
        "passed": passed,
        "clients": config.clients,
        "duration_s": config.duration_s,
        "load_s": round(load_s, 1),
        "requests": len(run.outcomes),
        "well_formed": sum(o.well_formed for o in run.outcomes),
        "malformed": sum(not o.well_formed for o in run.outcomes),
        "server_errors_5xx": server_errors,
        "lost": lost,
        "failures": len(failures),
        "first_failures": [vars(o) for o in failures[:10]],
        "by_kind": {kind: dict(counts) for kind, counts in sorted(table.items())},
        "end_metrics": end,
        "idle_at_end": idle,
        "greedy_identical": greedy_same,
        "greedy_text": before[1],
        "rss": rss,
        "completed_latency_s": _latency(run.outcomes),
        "slowest": [(o.kind, o.seconds) for o in sorted(run.outcomes, key=lambda o: -o.seconds)[:5]],
    }


def _rss_summary(
    config: SoakConfig, samples: list[tuple[float, int]], load_s: float, start: int | None, end: int | None
) -> dict[str, Any]:
    if start is None or end is None or not samples:
        return {}
    half = [value for t, value in samples if t <= load_s / 2] or [samples[0][1]]
    mib = 2**20
    growth = (end - max(half)) / mib
    return {
        "start_mib": round(start / mib, 1),
        "first_half_max_mib": round(max(half) / mib, 1),
        "max_mib": round(max(v for _, v in samples) / mib, 1),
        "end_mib": round(end / mib, 1),
        "growth_second_half_mib": round(growth, 1),
        "growth_from_start_mib": round((end - start) / mib, 1),
        "bound_mib": config.rss_bound_mib,
        "within_bound": growth <= config.rss_bound_mib,
    }


def _latency(outcomes: list[Outcome]) -> dict[str, float]:
    done = sorted(o.seconds for o in outcomes if o.well_formed and o.result == "completed")
    if not done:
        return {}
    return {"p50": done[len(done) // 2], "p99": done[min(len(done) - 1, int(0.99 * len(done)))], "max": done[-1]}


def text_report(result: dict[str, Any]) -> str:
    """The figures, for people."""
    lines = [
        f"soak: {result['clients']} clients, {result['load_s']} s of load, {result['requests']} requests "
        f"({result['well_formed']} well-formed, {result['malformed']} malformed)",
        f"{'kind':<22} outcomes",
    ]
    for kind, counts in result["by_kind"].items():
        lines.append(f"{kind:<22} " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    end = result["end_metrics"]
    lines += [
        f"5xx: {result['server_errors_5xx']}; lost: {result['lost']}; failures: {result['failures']}",
        f"at the end: running {end['running']}, waiting {end['waiting']}, KV cache usage {end['kv_cache_usage_ratio']}",
        f"greedy request identical before and after: {result['greedy_identical']} ({result['greedy_text']!r:.80})",
    ]
    latency = result["completed_latency_s"]
    if latency:
        lines.append(
            f"completed requests' latency: p50 {latency['p50']} s, p99 {latency['p99']} s, max {latency['max']} s"
        )
    rss = result["rss"]
    if rss:
        lines.append(
            f"server RSS: start {rss['start_mib']} MiB, first half's max {rss['first_half_max_mib']} MiB, max "
            f"{rss['max_mib']} MiB, end {rss['end_mib']} MiB: growth over the second half "
            f"{rss['growth_second_half_mib']} MiB (bound {rss['bound_mib']} MiB), from the start "
            f"{rss['growth_from_start_mib']} MiB"
        )
    for failure in result["first_failures"]:
        lines.append(f"  failed: {failure}")
    lines.append("PASSED" if result["passed"] else "FAILED")
    return "\n".join(lines)
