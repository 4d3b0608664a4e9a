"""A pure-decode step's layers in one native call (model/decode_stack.py, csrc/decode_layers.cpp): the same bits
as LlamaModel.forward's Python loop, taken only where every layer is the plain Llama kind."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.model.decode_stack import DecodeStack
from helpers.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def amx(native_kernels: Any) -> Any:
    if not native_kernels.bf16_amx_available():
        pytest.skip("this CPU (or kernel) offers no AMX-BF16 tiles; the decode stack needs the AMX-packed weights")
    return native_kernels


def _generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    llm.engine.reset_prefix_cache()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [(o.outputs[0].token_ids, [lp.top[0][1] for lp in o.outputs[0].logprobs or []]) for o in outputs]


@pytest.mark.parametrize(("num_threads", "kv_cache_dtype"), [(None, "auto"), (1, "auto"), (3, "auto"), (None, "int8")])
def test_the_decode_stack_gives_the_python_loops_tokens_and_logprobs(
    num_threads: int | None, kv_cache_dtype: str, tmp_path: Any, amx: Any
) -> None:
    """Several requests at once (their decode steps are pure decodes in one group), greedy with logprobs: the
    native stack against the Python loop over the same loaded weights, bit for bit; the stack did run. With plain
    caches the stack runs as one team of threads (one, torch's default, or more threads than cores), with an int8
    cache op by op."""
    folder = str(tmp_path / "tiny")
    build_tiny_model("llama", folder)
    threads_before = torch.get_num_threads()
    llm = LLM(
        model=folder,
        dtype="bfloat16",
        kernels="native",
        kv_cache_memory="16MiB",
        max_model_len=256,
        num_threads=num_threads,
        kv_cache_dtype=kv_cache_dtype,
    )
    model = llm.engine.runner.model
    stack = model.decode_stack
    assert stack is not None
    calls = []

    def counted(*args: Any) -> torch.Tensor:
        calls.append(args[0].shape[0])
        return DecodeStack.__call__(stack, *args)

    model.decode_stack = counted
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 512, size=n).tolist() for n in (3, 9, 30, 61, 17)]
    got = _generate(llm, prompts)
    assert calls and max(calls) == len(prompts)  # every row of the busiest steps went through the stack
    model.decode_stack = None
    expected = _generate(llm, prompts)
    torch.set_num_threads(threads_before)
    assert got == expected
    llm.engine.check_idle()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma2"])
def test_other_layer_kinds_keep_the_python_loop(arch: str, tmp_path: Any, amx: Any) -> None:
    """Biases (Qwen2), per-head norms (Qwen3), soft caps, windows and sandwich norms (Gemma 2): no decode stack in
    bfloat16 on AMX."""
    folder = str(tmp_path / arch)
    build_tiny_model(arch, folder)
    llm = LLM(model=folder, dtype="bfloat16", kernels="native", kv_cache_memory="8MiB", max_model_len=128)
    assert llm.engine.runner.model.decode_stack is None


def test_a_float32_llama_keeps_the_python_loop(tmp_path: Any, amx: Any) -> None:
    folder = str(tmp_path / "llama")
    build_tiny_model("llama", folder)
    llm = LLM(model=folder, dtype="float32", kernels="native", kv_cache_memory="8MiB", max_model_len=128)
    assert llm.engine.runner.model.decode_stack is None


def test_the_decode_stack_refuses_a_block_or_slot_outside_the_cache(tmp_path: Any, amx: Any) -> None:
    """The stack checks every operand before its one parallel region (nothing may raise inside it): a block id or a
    slot outside the cache, or a context longer than its block table, raises a clear error instead of reading or
    writing memory that is not the cache's; the same call with valid ids runs."""
    folder = str(tmp_path / "tiny")
    build_tiny_model("llama", folder)
    llm = LLM(model=folder, dtype="bfloat16", kernels="native", kv_cache_memory="8MiB", max_model_len=128)
    model = llm.engine.runner.model
    stack = model.decode_stack
    assert stack is not None
    spec = model.spec
    num_blocks, block_size = 4, 16
    caches = [
        torch.zeros(num_blocks, block_size, spec.num_kv_heads, spec.head_dim, dtype=torch.bfloat16)
        for _ in range(2 * spec.num_layers)
    ]

    def run(block_tables: list[list[int]], slots: list[int], context_lens: list[int]) -> torch.Tensor:
        hidden = torch.randn(2, spec.hidden_size).to(torch.bfloat16)  # [tokens, hidden]
        return stack.kernels.decode_layers(
            hidden,
            stack.input_norms,
            stack.qkv_tiles,
            stack.o_tiles,
            stack.post_norms,
            stack.gate_up_tiles,
            stack.down_tiles,
            caches[0::2],
            caches[1::2],
            model.rotary.cos,
            model.rotary.sin,
            torch.tensor([0, 0]),
            torch.tensor(slots),
            torch.tensor(block_tables),
            torch.tensor(context_lens),
            stack.heads,
            stack.kv_heads,
            stack.head_dim,
            stack.inner,
            stack.eps,
            stack.scale,
        )

    assert run([[0], [1]], [0, 16], [1, 1]).shape == (2, spec.hidden_size)
    with pytest.raises(RuntimeError, match=r"block_tables\[1\]\[0\] is 7"):
        run([[0], [7]], [0, 16], [1, 1])
    with pytest.raises(RuntimeError, match="slot 64 is outside the cache"):
        run([[0], [1]], [0, 64], [1, 1])
    with pytest.raises(RuntimeError, match=r"context_lens\[0\] is 17"):
        run([[0], [1]], [0, 16], [17, 1])
