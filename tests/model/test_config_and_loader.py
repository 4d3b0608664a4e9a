"""Engine options and model loading: bad values and missing files get errors that say what to do."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest

from conveyor import LLM, ConfigError, EngineConfig, ModelLoadError
from conveyor.config import parse_memory_size
from conveyor.model.gguf_loader import unpermute_rows


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(dtype="float64"), "dtype='float64' is not supported"),
        (dict(device="tpu"), "device='tpu'"),
        (dict(block_size=0), "block_size=0"),
        (dict(max_num_seqs=-1), "max_num_seqs=-1"),
        (dict(kv_cache_memory="lots"), "kv_cache_memory='lots'"),
        (dict(kv_cache_memory=-5), "must be positive"),
        (dict(async_batching="maybe"), "async_batching='maybe'"),
        (dict(max_model_len=1), "max_model_len=1"),
        (dict(kv_cache_memory=float("nan")), "kv_cache_memory=nan"),
        (dict(kv_cache_memory=float("inf")), "kv_cache_memory=inf"),
        (dict(kv_cache_memory="0"), "must be positive"),
        (dict(kv_cache_memory="0GiB"), "must be positive"),
        (dict(seed=-1), "seed=-1"),
        (dict(enable_prefix_caching="no"), "enable_prefix_caching='no'"),
    ],
)
def test_bad_engine_options(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig(**kwargs)
    assert fragment in str(info.value)


def test_unknown_llm_option_lists_the_options() -> None:
    with pytest.raises(ConfigError, match="unknown engine option.*kv_cache_size.*kv_cache_memory"):
        LLM(kv_cache_size="1GiB")


def test_memory_sizes() -> None:
    assert parse_memory_size("2GiB") == 2 * 2**30
    assert parse_memory_size("512 MB") == 512 * 10**6
    assert parse_memory_size(0.25) == 0.25
    assert parse_memory_size(123456) == 123456


def test_cache_too_small_for_max_model_len_is_refused_with_numbers() -> None:
    with pytest.raises(ConfigError) as info:
        LLM(kv_cache_memory="1MiB", max_model_len=2048)
    message = str(info.value)
    assert "max_model_len=2048" in message and "needs 128 blocks" in message and "raise kv_cache_memory" in message


def test_missing_model_path() -> None:
    with pytest.raises(ModelLoadError, match="no such file or folder"):
        LLM(model="/nonexistent/model.gguf")


def test_folder_without_config(tmp_path: Any) -> None:
    with pytest.raises(ModelLoadError, match="has no config.json"):
        LLM(model=str(tmp_path))


def test_unknown_architecture_lists_supported(tmp_path: Any) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError) as info:
        LLM(model=str(tmp_path))
    assert "GPT2LMHeadModel" in str(info.value) and "LlamaForCausalLM" in str(info.value)


def test_sliding_window_is_read_per_layer(tmp_path: Any) -> None:
    from conveyor.model.hf_loader import read_hf_config

    config = {
        "architectures": ["MistralForCausalLM"],
        "sliding_window": 4096,
        "vocab_size": 32,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = read_hf_config(str(tmp_path))
    assert spec.layer_windows == (4096, 4096) and spec.kv_window == 4096
    config.update(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, max_window_layers=1)
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = read_hf_config(str(tmp_path))
    assert spec.layer_windows == (None, 4096) and spec.kv_window is None
    config.update(sliding_window=0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="sliding_window=0 must be a positive number of tokens"):
        read_hf_config(str(tmp_path))


def test_folder_without_weights(tmp_path: Any) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="no \\*.safetensors files"):
        LLM(model=str(tmp_path))


def test_non_gguf_file(tmp_path: Any) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        LLM(model=str(f))


def test_corrupt_gguf(tmp_path: Any) -> None:
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"GGUF" + os.urandom(64))
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        LLM(model=str(f))


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    heads, head_dim, cols = 3, 8, 5
    w = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    # llama.cpp's converter: rows of each head reordered from [half0, half1] to interleaved pairs
    permuted = w.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(unpermute_rows(permuted, heads), w)


def test_gguf_tokenizer_cache_round_trip(default_gguf: str, tmp_path: Any, monkeypatch: Any) -> None:
    from conveyor.model.gguf_loader import load_gguf_tokenizer

    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path))
    built = load_gguf_tokenizer(default_gguf)
    cached = load_gguf_tokenizer(default_gguf)
    text = "Hello, world! Ünïcödé — 東京 🚀"
    assert built(text).input_ids == cached(text).input_ids
    assert built.chat_template == cached.chat_template and cached.chat_template
