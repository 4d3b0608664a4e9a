"""Logprobs (raw model distribution) against log_softmax of a transformers float32 forward."""

from __future__ import annotations

from typing import Any

import torch

from conveyor import SamplingParams


def test_logprobs_match_transformers_forward(default_llm: Any, hf_default_model: Any) -> None:
    tok = default_llm.get_tokenizer()
    prompt = tok("The three primary colors are red, blue and").input_ids
    out = default_llm.generate(
        [prompt],
        SamplingParams(max_tokens=12, temperature=0.7, seed=3, logprobs=5, prompt_logprobs=3, ignore_eos=True),
        use_tqdm=False,
    )[0]
    completion = out.outputs[0]
    ids = prompt + completion.token_ids
    with torch.no_grad():
        ref = hf_default_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [len, vocab]
    assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
    for j, (token, lp) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[len(prompt) - 1 + j]
        assert lp.token_id == token
        assert abs(lp.logprob - row[token].item()) < 1e-4
        assert (
            lp.rank == int((row > row[token]).sum()) + 1
            or abs(row.sort(descending=True).values[lp.rank - 1] - row[token]) < 1e-4
        )
        top_values = row.topk(5).values.tolist()
        assert len(lp.top) == 5
        assert all(abs(a - b) < 1e-4 for (_, a), b in zip(lp.top, top_values))
        assert all(abs(row[t].item() - v) < 1e-4 for t, v in lp.top)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert entry is not None and entry.token_id == prompt[i] and len(entry.top) == 3
        assert abs(entry.logprob - ref[i - 1, prompt[i]].item()) < 1e-4
    assert completion.cumulative_logprob is not None
    assert abs(completion.cumulative_logprob - sum(lp.logprob for lp in completion.logprobs)) < 1e-9
