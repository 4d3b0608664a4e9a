"""Tensor parallelism (conveyor/tensor_parallel): TP=2 against TP=1 token for token on tiny random models, the
plan's wire format, refused sizes, and no worker left behind."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from conveyor import LLM, ConfigError, SamplingParams
from conveyor.core.plan import SamplingSpec, ScheduledSeq, StepPlan
from conveyor.tensor_parallel.plan_wire import decode_plan, encode_plan
from conveyor.tensor_parallel.shard import check_tensor_parallel, working_sizes
from helpers import PACKAGE_ROOT
from helpers.tiny_models import build_tiny_model

SHAPES = {
    "kv-split": dict(num_attention_heads=4, num_key_value_heads=2),  # heads and KV heads split 2 ways
    "kv-replicated": dict(num_attention_heads=4, num_key_value_heads=1),  # one KV head, replicated on both ranks
}
PRESSURE = dict(
    block_size=4, max_model_len=96, kv_cache_memory=28 * 4 * 512, max_num_batched_tokens=16, dtype="float32"
)
"""A cache small enough to force preemption and a budget small enough to force chunked prefill."""


@pytest.fixture(scope="module", params=list(SHAPES))
def tiny(request: Any, tmp_path_factory: Any) -> str:
    folder = str(tmp_path_factory.mktemp(f"tiny-tp-{request.param}"))
    build_tiny_model("llama", folder, **SHAPES[request.param])
    return folder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for its parent's wait() is gone for our purposes
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _run(folder: str, tp: int, async_batching: bool, **options: Any) -> tuple[list[Any], Any, list[int]]:
    rng = random.Random(7)
    prompts = [[rng.randrange(2, 512) for _ in range(rng.randrange(3, 40))] for _ in range(10)]
    # penalties and n > 1 too: every rank keeps the block tables and penalty histories from the plans' deltas
    params = [
        [
            SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=i, ignore_eos=True, logprobs=2),
            SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.4, ignore_eos=True),
            SamplingParams(n=2, max_tokens=10, temperature=0.9, seed=i, frequency_penalty=0.8, ignore_eos=True),
        ][i % 4]
        for i in range(len(prompts))
    ]
    llm = LLM(model=folder, tensor_parallel_size=tp, async_batching=async_batching, **{**PRESSURE, **options})
    pids: list[int] = []
    try:
        if tp > 1:
            pids = llm.engine.runner.workers.pids
            assert len(pids) == tp - 1 and all(_alive(p) for p in pids)
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.stats()
        # async batching still overlaps: later steps' inputs were placeholders filled from the step before
        assert (llm.engine.runner.num_placeholder_tokens > 0) is async_batching
        llm.engine.check_idle()
    finally:
        llm.engine.close()
    tokens = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]
    return tokens, stats, pids


@pytest.mark.parametrize("async_batching", [True, False])
def test_tp2_matches_tp1_with_chunked_prefill_and_preemption(tiny: str, async_batching: bool) -> None:
    ref, ref_stats, _ = _run(tiny, 1, async_batching)
    got, stats, pids = _run(tiny, 2, async_batching)
    assert got == ref
    for s in (ref_stats, stats):
        assert s.num_preemptions > 0, "the small cache was meant to force preemption"
        assert s.num_partial_prefills > 0, "the small budget was meant to force chunked prefill"
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), f"worker processes {pids} outlived engine.close()"


def test_tp2_matches_tp1_on_the_int8_kv_cache(tiny: str) -> None:
    """Each rank quantizes its own KV heads' rows the way one process does: the same tokens, under the same
    pressure (the cache sized for int8 rows: head_dim 16 codes + a 4-byte scale, against float32's 64 bytes)."""
    int8 = dict(kv_cache_dtype="int8", kv_cache_memory=PRESSURE["kv_cache_memory"] * 20 // 64)
    ref, ref_stats, _ = _run(tiny, 1, False, **int8)
    got, stats, _ = _run(tiny, 2, False, **int8)
    assert got == ref
    assert ref_stats.num_preemptions > 0 and stats.num_preemptions > 0


BF16_TP_LOGPROB_NOISE = 0.25
"""How far a bfloat16 TP=2 logprob may sit from TP=1's for the same token (nats). Each rank rounds its partial
O and down projections to bfloat16 before the all-reduce sums them, so from the second layer on the ranks'
activations differ from TP=1's in the last bits (attention itself gives a head the same bits either way:
tests/model/test_attention.py). Seen on this tiny model: at most 0.08; a wrong shard is off by whole nats."""


def test_int4_shards_use_the_int4_kernels_and_match_tp1(tmp_path: pathlib.Path) -> None:
    """A shard is just a smaller linear: int4 weights (bfloat16 activations; groups of 32 fall on the same input
    columns, since MLP width / 2 = 64) quantize per rank and give TP=1's tokens on this tiny model, with logprobs
    within bfloat16 noise. The all-reduce rounds differently from one big product (see BF16_TP_LOGPROB_NOISE), so
    a sequence may part ways only at a near-tie: each run's pick is the other's runner-up, both within the noise."""
    from conveyor.model.quant import Int4Projection

    folder = str(tmp_path / "m")
    build_tiny_model("llama", folder)
    prompts = [[5, 6, 7, 8, 9] * 3, [11, 12, 13], [40, 41, 42, 43, 44, 45, 46]]
    results = []
    for tp in (1, 2):
        llm = LLM(model=folder, tensor_parallel_size=tp, quantization="int4", kv_cache_memory=2**20, max_model_len=128)
        try:
            layer = llm.engine.runner.model.layers[0]
            assert isinstance(layer.down, Int4Projection) and isinstance(layer.qkv, Int4Projection)
            assert layer.down.dense.in_features == 128 // tp
            outs = llm.generate(
                prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2), use_tqdm=False
            )
        finally:
            llm.engine.close()
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    diverged = 0
    for i, ((ref, ref_lp), (got, got_lp)) in enumerate(zip(*results)):
        assert ref_lp is not None and got_lp is not None and len(got) == len(ref) == 10
        split = next((j for j in range(len(ref)) if ref[j] != got[j]), len(ref))
        for j in range(split):
            drift = abs(ref_lp[j][ref[j]].logprob - got_lp[j][got[j]].logprob)
            assert drift < BF16_TP_LOGPROB_NOISE, f"prompt {i} token {j}: logprob {drift:.3f} nats from TP=1's"
        if split < len(ref):
            diverged += 1
            a, b = ref[split], got[split]
            assert b in ref_lp[split] and a in got_lp[split], (
                f"prompt {i} parts at token {split} ({a} vs {b}), not between the two runs' top-2"
            )
            gaps = (
                ref_lp[split][a].logprob - ref_lp[split][b].logprob,
                got_lp[split][b].logprob - got_lp[split][a].logprob,
            )
            assert max(gaps) < BF16_TP_LOGPROB_NOISE, f"prompt {i} parts at token {split}, top-2 gaps {gaps}"
    assert diverged < len(prompts), f"every prompt parted ways: {results}"


def test_sizes_that_do_not_divide_the_model_are_refused_with_the_ones_that_do(tiny: str) -> None:
    with pytest.raises(ConfigError) as info:
        LLM(model=tiny, tensor_parallel_size=3, **PRESSURE)
    message = str(info.value)
    assert "tensor_parallel_size=3" in message and "4 attention heads" in message
    assert "sizes that work for this model: 1, 2, 4" in message


def test_default_model_divides_by_1_and_3_only() -> None:
    from conveyor.model.model_spec import ModelSpec, RopeSpec

    spec = ModelSpec(
        "llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope=RopeSpec(1e5),
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    assert working_sizes(spec) == [1, 3]
    with pytest.raises(ConfigError, match="9 attention heads.*sizes that work for this model: 1, 3"):
        check_tensor_parallel(spec, 2, "SmolLM2")


def test_bad_tensor_parallel_size_values_are_config_errors() -> None:
    for bad in (0, -1, 2.0, True, "2"):
        with pytest.raises(ConfigError, match="tensor_parallel_size"):
            LLM(model="unused", tensor_parallel_size=bad)


def test_plan_travels_as_json_and_comes_back_equal() -> None:
    spec = SamplingSpec(
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        seed=2**62 + 3,
        output_index=4,
        min_p=0.1,
        presence_penalty=0.5,
        repetition_penalty=1.2,
        logit_bias=((3, 2.0), (9, -1.5)),
        suppress_token_ids=(1, 2),
        history_tail=(5, 7),
        history_start=3,
        num_history_placeholders=1,
        num_prompt_tokens=2,
        logprobs=3,
    )
    plan = StepPlan(
        step_id=17,
        num_preempted=2,
        block_copies=[(3, 4)],
        dropped_ids=["d", "e\u00e9"],
        seqs=[
            ScheduledSeq(
                "a",
                [5, 6, -1],
                4,
                [1, 2],
                1,
                spec,
                prompt_logprob_targets=[6, -1, -1],
                num_prompt_logprobs=2,
                arrival_index=3,
            ),
            ScheduledSeq(
                "b", [], 0, [7], 0, dataclasses.replace(spec, history_tail=None), sample_from="a", arrival_index=4
            ),
            ScheduledSeq("c\u00e9", [8, 9], 0, [5], 0, None),
        ],
    )
    data = encode_plan(plan)
    json.loads(data)  # plain JSON: numbers, strings, lists; nothing a pickle loader would read
    assert not data.startswith(b"\x80")  # a pickle stream starts with its PROTO opcode
    assert decode_plan(data) == plan


def test_no_pickle_on_the_wire_path() -> None:
    """The modules that move data between ranks import neither pickle nor multiprocessing (which pickles
    its arguments), and never call torch.distributed's *_object collectives (which pickle)."""
    root = PACKAGE_ROOT
    files = [*list((root / "tensor_parallel").glob("*.py")), root / "runtime" / "tp_executor.py"]
    assert root / "tensor_parallel" / "plan_wire.py" in files
    for path in files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                for name in names:
                    assert name is None or not any(bad in name for bad in ("pickle", "multiprocessing", "dill")), (
                        f"{path.name} imports {name}"
                    )
            if isinstance(node, ast.Attribute):
                assert not node.attr.endswith("_object") and not node.attr.endswith("_object_list"), (
                    f"{path.name} uses {node.attr}"
                )


def test_workers_die_with_a_killed_engine_process(tmp_path: pathlib.Path) -> None:
    """SIGKILL of the engine (no close, no atexit) still leaves no worker behind."""
    folder = str(tmp_path / "m")
    build_tiny_model("llama", folder)
    script = (
        "import sys, time\nfrom conveyor import LLM\n"
        f"llm = LLM(model={folder!r}, tensor_parallel_size=2, dtype='float32', kv_cache_memory=2**20, "
        "max_model_len=64)\n"
        "print(*llm.engine.runner.workers.pids, flush=True)\ntime.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert pids and all(_alive(p) for p in pids), f"no live workers reported: {line!r}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), f"workers {pids} outlived their engine process"
    finally:
        proc.kill()
        proc.wait()


def test_structured_output_is_refused_at_admission_and_the_engine_keeps_serving(tmp_path: pathlib.Path) -> None:
    from conveyor import InvalidRequestError
    from conveyor.structured.constraint import StructuredOutputs

    folder = str(tmp_path / "m")
    build_tiny_model("llama", folder)
    llm = LLM(model=folder, tensor_parallel_size=2, dtype="float32", kv_cache_memory=2**20, max_model_len=64)
    try:
        with pytest.raises(InvalidRequestError, match="structured output.*tensor_parallel_size=2"):
            llm.engine.add_request(
                [3, 4, 5], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(choice=("a", "b")))
            )
        out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        llm.engine.check_idle()
    finally:
        llm.engine.close()


def test_a_dead_worker_turns_into_an_error_not_a_hang(tmp_path: pathlib.Path) -> None:
    folder = str(tmp_path / "m")
    build_tiny_model("llama", folder)
    llm = LLM(
        model=folder,
        tensor_parallel_size=2,
        dtype="float32",
        kv_cache_memory=2**20,
        max_model_len=64,
        async_batching=False,
    )
    try:
        pid = llm.engine.runner.workers.pids[0]
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        start = time.monotonic()
        with pytest.raises(Exception, match="worker|Connection|closed|reset|peer"):
            llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        assert time.monotonic() - start < 30
    finally:
        with contextlib.suppress(RuntimeError):  # close() finishes the failed step first: the same error again
            llm.engine.close()
    assert not any(_alive(p) for p in llm.engine.runner.workers.pids)


def test_scaling_model_arithmetic() -> None:
    """One cell by hand: Llama-8B (hidden 4096, 32 layers), TP=2, one sequence, bf16, 100 Gb/s with 5 us hops:
    64 all-reduces x (2 * 1/2 * 8192 B at 100 Gb/s = 0.655 us + 2 hops x 5 us) = 0.682 ms per step."""
    from conveyor.bench.tp import scaling_model

    row = next(r for r in scaling_model(2, 1) if r["model"] == "llama-8b" and r["link_gbps"] == 100)
    assert row["all_reduces_per_step"] == 64 and row["bytes_per_all_reduce"] == 8192
    assert row["all_reduce_ms_per_step"] == pytest.approx(64 * (8192 * 8 / 100e9 * 1e6 + 10) / 1e3, rel=1e-3)


@pytest.mark.slow
def test_default_model_tp3_matches_tp1() -> None:
    """SmolLM2-135M (9 query / 3 KV heads, MLP 1536, vocabulary 49152: only 1 and 3 divide them all), float32,
    greedy and seeded sampling, with chunked prefill."""
    prompts = [[1] + [(97 * i + 31 * j) % 40000 + 50 for j in range(20 + 9 * i)] for i in range(4)]
    params = [
        SamplingParams(max_tokens=16, temperature=0.8 if i % 2 else 0.0, seed=i, ignore_eos=True) for i in range(4)
    ]
    results = []
    for tp in (1, 3):
        llm = LLM(
            tensor_parallel_size=tp,
            dtype="float32",
            max_model_len=256,
            kv_cache_memory="64MiB",
            max_num_batched_tokens=32,
        )
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert llm.engine.stats().num_partial_prefills > 0
        finally:
            llm.engine.close()
        results.append([o.outputs[0].token_ids for o in outs])
    assert results[0] == results[1]


def _children(pid: int) -> list[int]:
    found = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.parametrize("model", ["tiny-tp2", pytest.param("default-tp3", marks=pytest.mark.slow)])
def test_server_streams_concurrent_requests_and_sigterm_leaves_no_worker(model: str, tmp_path: pathlib.Path) -> None:
    """`conveyor serve` under tensor parallelism, through the openai client: concurrent streamed requests each
    get their max_tokens; SIGTERM ends the server and every worker. The tiny model (no tokenizer) takes token-id
    prompts; the default model at TP=3 (about a minute to start on 2 busy cores) takes text."""
    import concurrent.futures

    import openai

    from helpers.server_process import running_server

    if model == "tiny-tp2":
        folder = str(tmp_path / "m")
        build_tiny_model("llama", folder)
        args, name, tp = ["--model", folder, "--tensor-parallel-size", "2"], "m", 2
    else:
        args, name, tp = ["--tensor-parallel-size", "3"], "SmolLM2-135M-Instruct", 3
    with running_server(*args, "--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "256") as server:
        workers = _children(server.proc.pid)
        assert len(workers) == tp - 1, f"expected {tp - 1} worker processes under the server, found {workers}"
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")

        def stream(i: int) -> int:
            prompt: Any = [5 + i, 6, 7, 8] if model == "tiny-tp2" else f"Count to {i}:"
            chunks = client.completions.create(
                model=name,
                prompt=prompt,
                max_tokens=6 + i % 3,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            usage = [c.usage for c in chunks if c.usage is not None]
            return usage[-1].completion_tokens

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            counts = list(pool.map(stream, range(8)))
        assert counts == [6 + i % 3 for i in range(8)]
    assert server.proc.returncode is not None
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in workers), f"workers {workers} outlived the server"
