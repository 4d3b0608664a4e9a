"""Weight and KV-cache memory: a checkpoint is read through its memory map, no second copy of it stays resident,
and the default KV cache is sized by the rule in EngineConfig.kv_cache_memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conveyor.config import EngineConfig
from conveyor.model import runner
from conveyor.runtime.async_mode import DeviceInfo
from helpers import REPO_ROOT

CPU = DeviceInfo(torch.device("cpu"), False, "cpu")


def _bf16_checkpoint(folder: Path, hidden: int = 64, intermediate: int = 128, layers: int = 2, vocab: int = 512) -> int:
    """A random-weight Llama saved in bfloat16 (as real checkpoints are); returns its tensor bytes."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=1,
        bos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _mapped(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's memory maps of `path`."""
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(str(path)):
                low, high = line.split()[0].split("-")
                ranges.append((int(low, 16), int(high, 16)))
    return ranges


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps (Linux)")
def test_checkpoint_is_mapped_not_copied(tmp_path: Path) -> None:
    """Each weight matrix is either repacked (then nothing keeps the file mapped, so none of its pages stay
    resident beside the packed copy) or used in place as a view of the map (no copy at all)."""
    from conveyor import LLM
    from conveyor.model.layers import native_bf16_cpu

    _bf16_checkpoint(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="bfloat16", max_model_len=128, kv_cache_memory="1MiB")
    model = llm.engine.runner.model
    ranges = _mapped(tmp_path / "model.safetensors")

    def in_map(t: torch.Tensor) -> bool:
        return any(low <= t.data_ptr() < high for low, high in ranges)

    assert not in_map(model.embed), "the embedding (kept as it is) must not pin the checkpoint's map"
    if native_bf16_cpu():
        assert ranges == [], "every bfloat16 matrix is repacked for oneDNN, yet the checkpoint is still mapped"
    else:
        for layer in model.layers:  # o_proj and down are not fused: used in place
            for proj in (layer.o_proj, layer.down):
                assert proj.weight is not None and in_map(proj.weight), "a matrix used as stored was copied"
    out = llm.generate([[3, 4, 5]], use_tqdm=False)[0]  # the model still runs once the map is gone
    assert len(out.outputs[0].token_ids) > 0


_RSS_SCRIPT = """
import gc, json, sys
import torch
from conveyor import LLM
from conveyor.model.native import NativeUnavailable, load_kernels

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

try:
    load_kernels()
except NativeUnavailable:
    pass
torch.zeros(64, 64, dtype=torch.bfloat16) @ torch.zeros(64, 64, dtype=torch.bfloat16)  # oneDNN's start-up
before = rss()
llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=128, kv_cache_memory="1MiB")
gc.collect()
print(json.dumps({"growth": rss() - before}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux)")
def test_resident_memory_after_load_is_one_copy_of_the_weights(tmp_path: Path) -> None:
    """Loading an 84 MB bfloat16 checkpoint grows the resident set by at most 1.1x its tensor bytes + the KV
    cache + 32 MiB. Before the map was released, the packed weights and the file's pages were both resident (2x)."""
    weight_bytes = _bf16_checkpoint(tmp_path, hidden=512, intermediate=2048, layers=8, vocab=8192)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    growth = json.loads(done.stdout.strip().splitlines()[-1])["growth"]
    assert growth <= 1.1 * weight_bytes + 2**20 + 32 * 2**20, (
        f"resident memory grew by {growth / 2**20:.0f} MiB for {weight_bytes / 2**20:.0f} MiB of weights"
    )


def _plan(monkeypatch: pytest.MonkeyPatch, free: int, **options: object) -> int:
    monkeypatch.setattr(runner, "available_memory", lambda info: free)
    config = EngineConfig(**options)  # type: ignore[arg-type]
    max_model_len = int(options.get("max_model_len") or 2048)  # type: ignore[call-overload]
    plan = runner.plan_kv_cache(config, CPU, 32 * 2**10, max_model_len)  # a 1B Llama: 32 KiB per token
    return plan.num_token_slots


def test_default_kv_cache_holds_max_num_seqs_typical_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """24 GB machine, 1B Llama: 128 sequences x 256 tokens (1 GiB), not the 2 GiB cap."""
    assert _plan(monkeypatch, 22 * 2**30, max_model_len=2048) == 128 * runner.DEFAULT_TOKENS_PER_SEQ
    assert _plan(monkeypatch, 22 * 2**30, max_model_len=2048, max_num_seqs=8) == 2048  # one full-length request
    assert _plan(monkeypatch, 22 * 2**30, max_model_len=4096, max_num_seqs=4) == 4096


def test_default_kv_cache_is_capped_by_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _plan(monkeypatch, 2 * 2**30, max_model_len=2048) == int(0.2 * 2 * 2**30) // (32 * 2**10) // 16 * 16
    assert _plan(monkeypatch, 64 * 2**30, max_model_len=2048, max_num_seqs=1024) == runner.DEFAULT_CPU_CAP // (
        32 * 2**10
    )


def test_explicit_kv_cache_memory_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _plan(monkeypatch, 22 * 2**30, max_model_len=2048, kv_cache_memory="3GiB") == 3 * 2**30 // (32 * 2**10)
