"""Data parallelism on Ray (conveyor/data_parallel), offline: LLM(data_parallel_size=2) gives each request the
tokens it gets alone, refuses what it cannot carry, keeps Ray calls to plain values, and leaves no process
behind (Ray's gcs_server / raylet / workers and the replicas' TP workers included)."""

from __future__ import annotations

import ast
import pathlib
import random
import time
from typing import Any

import pytest

pytest.importorskip(
    "ray", reason="data parallelism needs Ray: pip install 'conveyor[ray]' (scripts/setup.sh test installs it)"
)
psutil = pytest.importorskip("psutil")

from conveyor import LLM, ConfigError, InvalidRequestError, SamplingParams  # noqa: E402
from helpers.tiny_models import build_tiny_model  # noqa: E402

SMALL = dict(dtype="float32", kv_cache_memory=2**20, max_model_len=128, block_size=4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: Any) -> str:
    folder = str(tmp_path_factory.mktemp("tiny-dp"))
    build_tiny_model("llama", folder)
    return folder


def _alive(procs: list[Any]) -> list[str]:
    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {p.name()}")
        except psutil.NoSuchProcess:
            pass
    return left


def wait_gone(procs: list[Any], timeout_s: float = 20.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while _alive(procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _alive(procs)


def test_dp2_gives_each_request_the_tokens_it_gets_alone_and_leaves_no_process(tiny: str) -> None:
    rng = random.Random(11)
    shared = [rng.randrange(2, 500) for _ in range(12)]  # three full blocks some prompts share
    prompts = [
        (shared if i % 3 == 0 else []) + [rng.randrange(2, 500) for _ in range(rng.randrange(3, 30))] for i in range(12)
    ]
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(max_tokens=9, temperature=0.8, top_k=40, seed=100 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    with LLM(model=tiny, **SMALL) as alone:
        expected = [alone.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    llm = LLM(model=tiny, data_parallel_size=2, **SMALL)
    try:
        started = [p for p in me.children(recursive=True) if p.pid not in before]
        names = " ".join(p.name() for p in started)
        assert "raylet" in names and "gcs_server" in names, f"expected Ray's processes among {names}"
        assert llm.replicas is not None
        _assert_msgpack_only([v for r in llm.replicas.replicas.replicas for v in r.args])
        got = llm.generate(prompts, params, use_tqdm=False)
        assert all(n > 0 for n in llm.replicas.router.routed), "both replicas should have taken requests"
        with pytest.raises(InvalidRequestError, match="logprobs"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logprobs=1), use_tqdm=False)
        with pytest.raises(ConfigError, match="data_parallel_size=2"):
            llm.chat([{"role": "user", "content": "hi"}])
    finally:
        llm.close()
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in got] == [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in expected
    ]
    assert [o.prompt_token_ids for o in got] == [list(p) for p in prompts]
    left = wait_gone(started)
    assert not left, f"processes left after LLM.close(): {left}"


def _assert_msgpack_only(values: list[Any]) -> None:
    """Ray's serializer writes these without a pickle (XLANG: msgpack alone; PYTHON: a pickle inside)."""
    import ray
    from ray._private import ray_constants
    from ray._private.serialization import SerializationContext

    context = SerializationContext(ray._private.worker.global_worker)
    assert context.serialize(object()).metadata == ray_constants.OBJECT_METADATA_TYPE_PYTHON  # the check can fail
    for value in values:
        assert context.serialize(value).metadata == ray_constants.OBJECT_METADATA_TYPE_CROSS_LANGUAGE, value


def test_data_parallel_options_are_checked_by_name() -> None:
    with pytest.raises(ConfigError, match="data_parallel_size=0"):
        LLM(data_parallel_size=0)
    with pytest.raises(ConfigError, match="ray_address"):
        LLM(ray_address="127.0.0.1:6379")  # meaningless without replicas: refused, not ignored
    from conveyor.cli import main
    from conveyor.config import EngineConfig
    from conveyor.engine.engine import Engine

    with pytest.raises(ConfigError, match="Engine runs one replica"):
        Engine(EngineConfig(data_parallel_size=2))  # never one engine silently standing in for two
    for command in ("generate", "chat"):
        assert main([command, "--data-parallel-size", "2", *(["hello"] if command == "generate" else [])]) == 2


def test_ray_calls_carry_plain_values_and_nothing_on_the_dp_path_pickles() -> None:
    """Ray pickles what msgpack cannot encode; our control values are strings and integers, which it encodes
    with msgpack (the replicas' real constructor arguments are checked in the DP=2 test above), and the
    distributed package imports no pickle and uses no object store."""
    from conveyor.data_parallel import replicas

    root = pathlib.Path(replicas.__file__).parent
    paths = sorted(root.rglob("*.py"))
    assert any(p.name == "front.py" for p in paths) and any(p.name == "replica_app.py" for p in paths)
    for path in paths:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                assert not any(n and any(bad in n for bad in ("pickle", "multiprocessing", "dill")) for n in names), (
                    f"{path.name} imports {names}"
                )
            if isinstance(node, ast.Attribute):
                assert node.attr not in ("put", "get_actor"), f"{path.name} uses ray.{node.attr} (object store)"
    _assert_msgpack_only(['{"model": "x", "tensor_parallel_size": 2}', 1, "127.0.0.1:8000", "ready", None])
    with pytest.raises(TypeError, match="only plain values"):
        replicas.control(type("FakeRay", (), {"get": staticmethod(lambda ref, timeout: object())}), None)
