"""`conveyor serve --tensor-parallel-size 2 --data-parallel-size 2` on a tiny model, through the openai client:
32 concurrent streams with the right tokens, prefix affinity seen in /metrics, a replica killed mid-run
(every request ends, the replica comes back, later requests succeed), and SIGTERM leaving no process.
One server for the module; its last test stops it."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip(
    "ray", reason="data parallelism needs Ray: pip install 'conveyor[ray]' (scripts/setup.sh test installs it)"
)
psutil = pytest.importorskip("psutil")
openai = pytest.importorskip("openai")

from test_data_parallel import wait_gone  # noqa: E402

from helpers.server_process import ServerProcess  # noqa: E402
from helpers.tiny_models import build_tiny_model  # noqa: E402

MODEL = "tiny-dp-server"
ENGINE = dict(dtype="float32", kv_cache_memory=4 * 2**20, max_model_len=512)
TIMEOUT = 60.0  # seconds: a number, as every openai client takes it (openai 3.x runs on httpx2, not httpx)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: Any) -> str:
    path = str(tmp_path_factory.mktemp("dp") / MODEL)
    build_tiny_model("llama", path)
    return path


@pytest.fixture(scope="module")
def server(folder: str) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--model",
        folder,
        "--dtype",
        "float32",
        "--tensor-parallel-size",
        "2",
        "--data-parallel-size",
        "2",
        "--kv-cache-memory",
        "4MiB",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "2",  # requests queue on a replica, so a kill finds some mid-stream
        "--shutdown-timeout",
        "5",
    )
    try:
        proc.wait_ready(timeout=240)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def reference(folder: str) -> Iterator[Any]:
    from conveyor import LLM

    with LLM(model=folder, **ENGINE) as llm:
        yield llm


def _expected(reference: Any, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    from conveyor import SamplingParams

    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    return [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]


async def _stream(client: Any, prompt: list[int], max_tokens: int) -> tuple[list[int], str | None]:
    stream = await client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    tokens: list[int] = []
    finish = None
    async for chunk in stream:
        for choice in chunk.choices:
            tokens += getattr(choice, "token_ids", None) or []
            finish = choice.finish_reason or finish
    return tokens, finish


def _parse(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def _metrics(server: ServerProcess) -> dict[str, float]:
    return _parse(httpx.get(server.url + "/metrics", timeout=10).text)


def test_tp2_dp2_32_concurrent_streams_get_their_tokens(server: ServerProcess, reference: Any) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 500) for _ in range(rng.randrange(3, 60))] for _ in range(32)]
    max_tokens = [rng.randrange(4, 24) for _ in range(32)]

    async def run() -> list[tuple[list[int], str | None]]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
        try:
            return await asyncio.gather(*(_stream(client, p, m) for p, m in zip(prompts, max_tokens)))
        finally:
            await client.close()

    got = asyncio.run(run())
    assert [len(t) for t, _ in got] == max_tokens
    assert all(f == "length" for _, f in got)
    assert [t for t, _ in got] == _expected(reference, prompts, max_tokens)
    m = _metrics(server)
    assert (
        m['conveyor_dp_requests_routed_total{replica="0"}'] > 0
        and m['conveyor_dp_requests_routed_total{replica="1"}'] > 0
    ), "the router should use both replicas"
    assert (
        m["conveyor_generation_tokens_total"]
        == m['conveyor_generation_tokens_total{replica="0"}'] + m['conveyor_generation_tokens_total{replica="1"}']
    )


def test_requests_sharing_a_256_token_prefix_go_to_one_replica(server: ServerProcess, reference: Any) -> None:
    rng = random.Random(9)
    prefix = [rng.randrange(2, 500) for _ in range(256)]  # 16 full blocks of 16
    prompts = [prefix + [rng.randrange(2, 500) for _ in range(rng.randrange(1, 12))] for _ in range(8)]
    before = _metrics(server)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
    outs = []
    for p in prompts:  # one after another, so load never outweighs the affinity
        outs.append(
            client.completions.create(
                model=MODEL,
                prompt=p,
                max_tokens=4,
                temperature=0.0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
        )
    assert [o.choices[0].token_ids for o in outs] == _expected(reference, prompts, [4] * len(prompts))
    after = _metrics(server)
    routed = {
        r: after[f'conveyor_dp_requests_routed_total{{replica="{r}"}}']
        - before[f'conveyor_dp_requests_routed_total{{replica="{r}"}}']
        for r in "01"
    }
    assert sorted(routed.values()) == [0, len(prompts)], f"prefix requests were split across replicas: {routed}"
    owner = max(routed, key=lambda r: routed[r])
    hits = (
        after[f'conveyor_dp_prefix_affinity_hits_total{{replica="{owner}"}}']
        - before[f'conveyor_dp_prefix_affinity_hits_total{{replica="{owner}"}}']
    )
    assert hits == len(prompts) - 1
    assert after[f'conveyor_prefix_cache_hit_rate{{replica="{owner}"}}'] > 0  # the replica's cache served them


def _replica_processes(server: ServerProcess) -> list[int]:
    found = []
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if "ReplicaServer" in " ".join(p.cmdline()):
                found.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def test_a_killed_replica_ends_its_requests_comes_back_and_later_requests_succeed(
    server: ServerProcess, reference: Any
) -> None:
    """16 streams; once one has tokens, its replica's process is killed: streams with tokens on it end with an
    error event, the others complete (on either replica, retried if they had no byte yet), all within 30 s."""
    pids = {r["replica"]: r["pid"] for r in httpx.get(server.url + "/health", timeout=5).json()["replicas"]}
    assert sorted(pids.values()) == sorted(_replica_processes(server))
    rng = random.Random(13)
    prompts = [[rng.randrange(2, 500) for _ in range(rng.randrange(3, 30))] for _ in range(16)]
    max_tokens = 200
    killed: list[tuple[int, float]] = []
    progress: dict[int, tuple[int, int]] = {}  # stream -> (replica, tokens so far)
    degraded: list[int] = []
    before = _metrics(server)

    async def one(client: httpx.AsyncClient, i: int, prompt: list[int]) -> tuple[str, float, int]:
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        count, error = 0, None
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            replica = int(response.headers["x-conveyor-replica"])
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                    continue
                count += sum(len(c.get("token_ids") or []) for c in event["choices"])
                progress[i] = (replica, count)
        if error is not None:
            assert "replica" in error["message"] and error["code"] == "replica_lost", (
                error
            )  # tokens or not: no [DONE] came
            return "error event", time.monotonic(), replica
        assert count == max_tokens, f"a stream that ended without an error had {count} tokens"
        return "completed", time.monotonic(), replica

    async def kill_a_busy_replica(client: httpx.AsyncClient) -> None:
        """Kill the replica of the first stream with tokens (with --max-num-seqs 2, most of the 16 requests
        still wait in the replicas' queues then, so it is surely computing); then watch /health say degraded."""
        while not killed:
            started = [r for r, n in progress.values() if n > 0]
            if started:
                os.kill(pids[started[0]], signal.SIGKILL)  # the replica's process (its TP worker follows it)
                killed.append((started[0], time.monotonic()))
            await asyncio.sleep(0.01)
        while not degraded:
            degraded.extend([1] if (await client.get("/health")).json().get("status") == "degraded" else [])
            await asyncio.sleep(0.05)

    async def run() -> list[tuple[str, float, int]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
            streams = asyncio.gather(*(one(client, i, p) for i, p in enumerate(prompts)))
            await asyncio.wait_for(kill_a_busy_replica(client), 30)
            return await asyncio.wait_for(streams, 90)

    ends = asyncio.run(run())
    victim, killed_at = killed[0]
    assert len(ends) == 16 and all(t - killed_at <= 30 for _, t, _ in ends), [
        round(t - killed_at, 1) for _, t, _ in ends
    ]
    errors = [r for kind, _, r in ends if kind == "error event"]
    assert set(errors) <= {victim}, ends  # only the killed replica's streams fail
    after_kill = _metrics(server)
    assert after_kill["conveyor_dp_streams_lost_total"] - before["conveyor_dp_streams_lost_total"] == len(errors)
    retried = after_kill["conveyor_dp_requests_retried_total"] - before["conveyor_dp_requests_retried_total"]
    assert len(errors) + retried >= 1, "the kill should have hit a request in flight"
    deadline = time.monotonic() + 120
    health: dict[str, Any] = {}
    while time.monotonic() < deadline:
        health = httpx.get(server.url + "/health", timeout=5).json()
        if health.get("status") == "ok" and health["replicas"][victim]["restarts"] >= 1:
            break
        time.sleep(0.3)
    assert health.get("status") == "ok" and health["replicas"][victim]["restarts"] >= 1, health
    new_pid = health["replicas"][victim]["pid"]
    assert new_pid != pids[victim] and sorted(_replica_processes(server)) == sorted([new_pid, pids[1 - victim]]), (
        "Ray should have restarted the killed replica in a new process"
    )
    later = [[rng.randrange(2, 500) for _ in range(10)] for _ in range(6)]

    async def after() -> list[tuple[list[int], str | None]]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
        try:
            return await asyncio.gather(*(_stream(client, p, 8) for p in later))
        finally:
            await client.close()

    assert [t for t, _ in asyncio.run(after())] == _expected(reference, later, [8] * len(later))
    assert (
        _metrics(server)[f'conveyor_dp_requests_routed_total{{replica="{victim}"}}']
        > after_kill[f'conveyor_dp_requests_routed_total{{replica="{victim}"}}']
    ), "the restarted replica takes work"


def test_sigterm_ends_every_process_including_rays(server: ServerProcess) -> None:
    descendants = psutil.Process(server.proc.pid).children(recursive=True)
    names = " ".join(p.name() for p in descendants)
    assert "raylet" in names and "gcs_server" in names, names
    assert server.stop() == 0
    left = wait_gone(descendants)
    assert not left, f"processes left after SIGTERM: {left}"
