"""bfloat16: the oneDNN-packed projection against F.linear, and the embedded model against transformers in bfloat16."""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from parity import Reference, compare, hf_greedy

from conveyor import LLM, SamplingParams
from conveyor.model.layers import Projection, _onednn_bf16_available

BF16_TIE_GAP = 0.25
"""bfloat16 logits of magnitude ~16 are spaced 0.125 apart, and attention or GEMM blocking that
differs from transformers' moves them by about that much: a divergence is only accepted where
the reference's own top-2 gap is within two such steps."""

NEW_TOKENS = 32


@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_projection_bf16_equals_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    weight = (torch.randn(96, 48) / 7).to(torch.bfloat16)  # [out, in]
    b = torch.randn(96).to(torch.bfloat16) if bias else None  # [out]
    x = torch.randn(rows, 48).to(torch.bfloat16)  # [rows, in]
    proj = Projection(weight, b)
    assert (proj.packed is not None) == _onednn_bf16_available()
    assert torch.equal(proj(x), F.linear(x, weight, b))


def test_projection_packs_on_a_bf16_cpu() -> None:
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if "avx512_bf16" not in flags and "amx_bf16" not in flags:
        pytest.skip("this CPU has no native bfloat16; packing is off by design")
    assert _onednn_bf16_available()


@pytest.fixture(scope="module")
def hf_bf16(hf_default_model: Any) -> Any:
    return copy.deepcopy(hf_default_model).to(torch.bfloat16).eval()


def test_default_model_bf16_matches_transformers_bf16(hf_bf16: Any, default_llm: Any) -> None:
    tok = default_llm.get_tokenizer()
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
                 "Why is the sky blue?"]
    raw = ["1, 2, 3, 4,", "The quick brown fox", "def fibonacci(n):\n",
           "Once upon a time, in a small village by the mountains, there lived an old clockmaker who"]
    chat = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in questions]
    prompts = [tok(p).input_ids for p in chat + raw]
    refs: list[Reference] = hf_greedy(hf_bf16, prompts, NEW_TOKENS)
    llm = LLM(dtype="bfloat16", kv_cache_memory="64MiB", max_model_len=512)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    ties = compare(refs, [o.outputs[0].token_ids for o in outs], allow_ties=True, tie_gap=BF16_TIE_GAP)
    print(f"bfloat16: {ties} of {len(prompts)} sequences diverged at a reference near-tie")
    assert ties <= 2, f"{ties} near-tie divergences: more than bfloat16 noise explains"
    llm.engine.check_idle()
