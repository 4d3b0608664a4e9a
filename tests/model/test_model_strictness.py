"""Nothing silent: every GGUF tensor / metadata key and config.json field that changes the computation is honoured
or refused by name (file, key, value, what is supported)."""

from __future__ import annotations

import json
import shutil
from typing import Any

import numpy as np
import pytest
import torch

from conveyor import LLM, ModelLoadError
from conveyor.model.gguf_loader import supported_weight_types
from conveyor.model.model_spec import RopeSpec
from conveyor.model.rope import RotaryEmbedding
from helpers.gguf_convert import ConverterUnavailable, convert, converter_dir, rewrite
from helpers.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: Any) -> str:
    folder = str(tmp_path_factory.mktemp("strict-llama"))
    build_tiny_model("llama", folder)
    return folder


@pytest.fixture(scope="module")
def tiny_gguf(tiny_folder: str, tmp_path_factory: Any) -> str:
    try:
        converter_dir()
    except ConverterUnavailable as exc:
        pytest.skip(f"llama.cpp's converter is unavailable here: {exc}")
    return convert(tiny_folder, str(tmp_path_factory.mktemp("strict-gguf") / "model.gguf"))


def _load(path: str) -> None:
    LLM(model=path, dtype="float32", max_model_len=64, kv_cache_memory=2**20)


def _variant(source: str, tmp_path: Any, **changes: Any) -> str:
    folder = tmp_path / "variant"
    folder.mkdir()
    return rewrite(source, str(folder / "model.gguf"), **changes)


def test_gguf_unknown_tensor_is_refused_by_name(tiny_gguf: str, tmp_path: Any) -> None:
    path = _variant(
        tiny_gguf, tmp_path, tensors={"blk.0.attn_mystery.weight": (np.ones((4, 64), np.float32), _type("F32"))}
    )
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_mystery\.weight.*skipping it would silently change"):
        _load(path)


def test_gguf_unknown_rope_scaling_type_is_refused_by_name(tiny_gguf: str, tmp_path: Any) -> None:
    import gguf

    path = _variant(tiny_gguf, tmp_path, metadata={"llama.rope.scaling.type": ("longrope", gguf.GGUFValueType.STRING)})
    with pytest.raises(
        ModelLoadError,
        match=r"llama\.rope\.scaling\.type='longrope' is not supported; "
        r"supported: none, linear, yarn",
    ):
        _load(path)


def test_gguf_longrope_factors_outside_phi3_and_partial_rotary_are_refused(tiny_gguf: str, tmp_path: Any) -> None:
    import gguf

    factors = np.ones(8, np.float32)
    path = _variant(
        tiny_gguf,
        tmp_path,
        tensors={
            "rope_factors_long.weight": (factors, _type("F32")),
            "rope_factors_short.weight": (factors, _type("F32")),
        },
    )
    with pytest.raises(
        ModelLoadError,
        match=r"rope_factors tensors \(\['rope_factors_long\.weight', "
        r"'rope_factors_short\.weight'\]\) with architecture 'llama'",
    ):
        _load(path)
    partial = tmp_path / "partial"
    partial.mkdir()
    path = rewrite(
        tiny_gguf, str(partial / "model.gguf"), metadata={"llama.rope.dimension_count": (8, gguf.GGUFValueType.UINT32)}
    )
    with pytest.raises(
        ModelLoadError,
        match=r"llama\.rope\.dimension_count=8 differs from the head size 16; "
        r"supported: equal, or an even part of it for phi3",
    ):
        _load(path)


def test_gguf_unknown_metadata_key_that_changes_the_computation_is_refused(tiny_gguf: str, tmp_path: Any) -> None:
    import gguf

    path = _variant(tiny_gguf, tmp_path, metadata={"llama.attn_logit_softcapping": (50.0, gguf.GGUFValueType.FLOAT32)})
    with pytest.raises(ModelLoadError, match=r"llama\.attn_logit_softcapping=50\.0 is not supported for llama"):
        _load(path)


def test_gguf_weight_type_gguf_cannot_dequantize_is_refused_by_name(tiny_gguf: str, tmp_path: Any) -> None:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[_type("Q8_1")]
    raw = np.zeros((64, 128 // block * size), dtype=np.uint8)  # blk.0.ffn_down.weight is [64 rows, 128 cols]
    path = _variant(tiny_gguf, tmp_path, tensors={"blk.0.ffn_down.weight": (raw, _type("Q8_1"))})
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.ffn_down\.weight' has weight type Q8_1"):
        _load(path)


def test_supported_weight_types_cover_the_common_ones() -> None:
    names = supported_weight_types()
    for kind in (
        "F32",
        "F16",
        "BF16",
        "Q4_0",
        "Q4_1",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "IQ4_NL",
        "IQ4_XS",
        "IQ2_XXS",
    ):
        assert kind in names
    assert "Q8_1" not in names and "I32" not in names


def _type(name: str) -> Any:
    import gguf

    return gguf.GGMLQuantizationType[name]


def _folder_variant(source: str, tmp_path: Any, config_changes: dict[str, Any], extra_tensor: str | None = None) -> str:
    folder = tmp_path / "variant"
    shutil.copytree(source, folder)
    with open(folder / "config.json") as f:
        config = json.load(f)
    config.update(config_changes)
    with open(folder / "config.json", "w") as f:
        json.dump(config, f)
    if extra_tensor is not None:
        from safetensors.torch import save_file

        save_file({extra_tensor: torch.ones(4)}, str(folder / "extra.safetensors"))
    return str(folder)


@pytest.mark.parametrize(
    "changes, fragment",
    [
        (
            dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
            "rope scaling type 'dynamic' is not supported; supported: default, linear, llama3, yarn",
        ),
        (
            dict(
                rope_scaling={
                    "rope_type": "longrope",
                    "short_factor": [1.0],
                    "long_factor": [1.0],
                    "original_max_position_embeddings": 64,
                }
            ),
            "rope scaling 'longrope' needs short_factor to be a list of 8 numbers (one per rotating pair); found 1",
        ),
        (
            dict(
                rope_scaling={"rope_type": "longrope", "long_factor": [1.0] * 8, "original_max_position_embeddings": 64}
            ),
            "rope scaling 'longrope' needs 'short_factor'",
        ),
        (
            dict(partial_rotary_factor=0.5),
            "partial_rotary_factor=0.5 (rotary on 8 of 16 dimensions per head) is "
            "not supported for llama; supported: 1.0, or an even number of rotating "
            "dimensions for phi3",
        ),
        (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported for llama"),
        (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0 is not supported for llama"),
        (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0"),
        (dict(mlp_bias=True), "mlp_bias=True"),
        (
            dict(layer_types=["sliding_attention", "full_attention"]),
            "layer_types has sliding_attention but sliding_window is not set",
        ),
        (dict(layer_types=["chunked_attention", "full_attention"]), "layer_types has ['chunked_attention']"),
    ],
)
def test_hf_config_fields_that_change_the_computation_are_refused(
    tiny_folder: str, tmp_path: Any, changes: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ModelLoadError) as info:
        _load(_folder_variant(tiny_folder, tmp_path, changes))
    assert fragment in str(info.value) and "config.json" in str(info.value)


def test_hf_folder_unknown_tensor_is_refused_by_name(tiny_folder: str, tmp_path: Any) -> None:
    from conveyor.model.inspect import inspect_model

    path = _folder_variant(tiny_folder, tmp_path, {}, extra_tensor="model.layers.0.self_attn.mystery.weight")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.self_attn\.mystery\.weight"):
        _load(path)
    summary = inspect_model(path)  # the same verdict from the headers alone
    assert not summary.runs and "model.layers.0.self_attn.mystery.weight" in summary.reason


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_tables_match_transformers_on_each_side_of_the_original_context(tmp_path: Any, partial: float) -> None:
    """Phi-3's longrope: with max_model_len within the original context, cos/sin equal transformers' for a
    sequence within it (short factors); beyond it, transformers' for a sequence past it (long factors). Partial
    rotary: ours are reordered per head (rope.partial_rotary_order), theirs cover the rotating dimensions only."""
    import transformers

    from conveyor.model.hf_loader import read_hf_config
    from conveyor.model.rope import partial_rotary_order

    rotary_dim = int(16 * partial)
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": partial,
        "short_factor": [1.0 + 0.1 * i for i in range(rotary_dim // 2)],
        "long_factor": [1.0 + 0.5 * i for i in range(rotary_dim // 2)],
    }
    build_tiny_model("phi3", str(tmp_path), rope_parameters=rope, original_max_position_embeddings=64)
    spec = read_hf_config(str(tmp_path))
    assert spec.rope.scaling_type == "longrope" and spec.rope.rotary_dim == (rotary_dim if partial != 1.0 else None)
    config = transformers.AutoConfig.from_pretrained(str(tmp_path))
    theirs = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(config)
    order = partial_rotary_order(16, rotary_dim)  # [16] our dimension -> theirs
    for max_model_len, length in ((64, 64), (300, 300)):
        ours = RotaryEmbedding(spec.rope, spec.head_dim, max_model_len, torch.device("cpu"))
        cos, sin = theirs(torch.zeros(1, length, 16), torch.arange(length)[None])  # [1, length, rotary_dim]
        full_cos = torch.cat([cos[0], torch.ones(length, 16 - rotary_dim)], dim=-1)[:, order]  # [length, 16]
        full_sin = torch.cat([sin[0], torch.zeros(length, 16 - rotary_dim)], dim=-1)[:, order]
        torch.testing.assert_close(ours.cos[:length], full_cos, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.sin[:length], full_sin, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(
        RotaryEmbedding(spec.rope, 16, 64, torch.device("cpu")).cos[:64],
        RotaryEmbedding(spec.rope, 16, 300, torch.device("cpu")).cos[:64],
    )


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
        {
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "attention_factor": 1.3,
            "truncate": False,
        },
    ],
)
def test_rope_tables_match_transformers(tiny_folder: str, tmp_path: Any, rope: dict[str, Any]) -> None:
    """cos/sin of every supported scaling type, read from config.json, equal transformers' rotary embedding."""
    import transformers

    from conveyor.model.hf_loader import read_hf_config

    folder = _folder_variant(tiny_folder, tmp_path, dict(rope_parameters=rope))
    spec = read_hf_config(folder)
    ours = RotaryEmbedding(spec.rope, spec.head_dim, 300, torch.device("cpu"))
    config = transformers.AutoConfig.from_pretrained(folder)
    theirs = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    positions = torch.arange(300)
    cos, sin = theirs(torch.zeros(1, 300, spec.head_dim), positions[None])  # [1, 300, head_dim]
    torch.testing.assert_close(ours.cos, cos[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.sin, sin[0], rtol=1e-5, atol=1e-5)
    assert isinstance(spec.rope, RopeSpec) and spec.rope.scaling_type == rope["rope_type"]
