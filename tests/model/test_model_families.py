"""Model families from their HF folders and from GGUF files written by llama.cpp's own converter: greedy tokens
against transformers in float32 (quantized files against transformers running the same dequantized weights)."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from conveyor import LLM, ModelLoadError, SamplingParams
from helpers.gguf_convert import (
    ConverterUnavailable,
    convert,
    convert_many,
    converter_dir,
    dequantized_reference,
    llama_cpp_quantize,
    quantization_roundtrip_reference,
    rewrite,
)
from helpers.parity import compare, hf_greedy
from helpers.tiny_models import build_tiny_model

NEW_TOKENS = 12
PROMPT_LENGTHS = (3, 40, 150)
"""Past every original context used below (64), so the rope scaling matters, and over 3x every window (16)."""

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
GEMMA3_LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention"]
LONGROPE_ORIGINAL = 64
"""The longrope families' original context: prompts 3 and 40 (+ 12 new tokens) stay within it, 150 starts past it."""


def _longrope(rotary_dim: int, partial: float = 1.0) -> dict[str, Any]:
    """Phi-3 128k / Phi-3.5 (partial 1) and Phi-4-mini (partial 0.75) style rope: short factors near 1, long ones
    up to 5, one per rotating pair, so the set used changes every token."""
    rng = random.Random(rotary_dim)
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": partial,
        "short_factor": [round(1 + rng.random() * 0.5, 3) for _ in range(rotary_dim // 2)],
        "long_factor": [round(1 + rng.random() * 4, 3) for _ in range(rotary_dim // 2)],
    }


FAMILIES: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    # name: (transformers family, config overrides, GGUF weight types written by the converter)
    "llama3.x": ("llama", dict(rope_parameters=LLAMA3_ROPE), ("f32", "q8_0")),
    "llama-linear-rope": ("llama", dict(rope_parameters=LINEAR_ROPE, attention_bias=True), ("f32",)),
    "qwen2.5-yarn": ("qwen2", dict(tie_word_embeddings=True, rope_parameters=YARN_ROPE), ("f32", "q8_0")),
    "qwen3": ("qwen3", {}, ("f32",)),
    "mistral-no-window": ("mistral", {}, ("f32",)),
    # window 16 on even layers, attention and final soft-caps, query_pre_attn_scalar, GeGLU, sandwich norms
    "gemma2": ("gemma2", {}, ("f32", "q8_0")),
    # fused qkv_proj and gate_up_proj, a window on every layer (blocks freed as it moves)
    "phi3-window": ("phi3", dict(sliding_window=16), ("f32",)),
    # longrope (short and long factors, attention factor from max_position_embeddings / original), fused qkv
    "phi3.5-longrope": (
        "phi3",
        dict(rope_parameters=_longrope(16), original_max_position_embeddings=LONGROPE_ORIGINAL),
        ("f32", "q8_0"),
    ),
    # Phi-4-mini: longrope on the first 12 of 16 dimensions per head (partial_rotary_factor 0.75)
    "phi4-mini-partial-rotary": (
        "phi3",
        dict(
            rope_parameters=_longrope(12, 0.75),
            partial_rotary_factor=0.75,
            original_max_position_embeddings=LONGROPE_ORIGINAL,
        ),
        ("f32",),
    ),
    # q/k norms, local layers with their own rope base, a global layer with linear scaling; six layers, as the
    # GGUF stores no layer pattern and llama.cpp reads Gemma 3's (five local, then one global)
    "gemma3-text": ("gemma3", dict(num_hidden_layers=6, layer_types=GEMMA3_LAYER_TYPES), ("f32", "q8_0")),
}


@pytest.fixture(scope="session")
def llama_cpp_converter() -> str:
    try:
        return converter_dir()
    except ConverterUnavailable as exc:
        pytest.skip(f"llama.cpp's converter is unavailable here: {exc}")


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def built(request: Any, tmp_path_factory: Any) -> dict[str, Any]:
    """Each family's tiny model, folder, transformers references and GGUF files, built once on first use; the
    first GGUF asked for brings every file this module's collected tests use (one converter run writes them)."""
    wanted = {pair for item in request.session.items if item.module is request.module for pair in _ggufs_used(item)}
    return {"families": {}, "wanted": wanted, "tmp": tmp_path_factory}


def _ggufs_used(item: Any) -> list[tuple[str, str]]:
    """The (family, weight type) files of llama.cpp's converter that a test of this module reads."""
    params = item.callspec.params if hasattr(item, "callspec") else {}
    test = getattr(item, "originalname", item.name)
    if test == "test_gguf_from_llama_cpp_converter_matches_transformers":
        return [(params["name"], params["outtype"])]
    if test == "test_inspect_describes_each_family_from_folder_and_gguf":
        return [(params["name"], "f32")] if FAMILIES[params["name"]][2] else []
    if test == "test_gguf_weight_types_match_transformers_on_the_same_weights":
        return [("llama3.x", "f32")]
    if test == "test_gemma3_gguf_layer_pattern_key_is_honoured_or_refused":
        return [("gemma3-text", "f32")]
    return []


def _folder(name: str, built: dict[str, Any]) -> dict[str, Any]:
    """The family's tiny model and its checkpoint folder (references come with _family)."""
    families = built["families"]
    if name not in families:
        arch, overrides, _ = FAMILIES[name]
        folder = str(built["tmp"].mktemp(name))
        model = build_tiny_model(arch, folder, **overrides)
        families[name] = dict(name=name, folder=folder, model=model, prompts=_prompts(len(name)), ggufs={})
    return families[name]


def _family(name: str, built: dict[str, Any]) -> dict[str, Any]:
    """The family with its transformers references (greedy tokens of its prompts)."""
    family = _folder(name, built)
    if "refs" not in family:
        refs = hf_greedy(family["model"], family["prompts"], NEW_TOKENS)
        assert all(len(set(r.token_ids)) > 1 for r in refs), "constant references would make parity weak"
        family["refs"] = refs
    return family


def _gguf(family: dict[str, Any], outtype: str, built: dict[str, Any]) -> str:
    """The family's GGUF file of this weight type, converted once (each file in a folder of its own: a GGUF's
    tokenizer is read with whatever tokenizer files lie beside it), together with every other file still to come
    that the collected tests use."""
    if outtype not in family["ggufs"]:
        later = {
            (name, t)
            for name, t in built["wanted"]
            if t not in built["families"].get(name, {}).get("ggufs", {}) and (name, t) != (family["name"], outtype)
        }
        pending = [(family["name"], outtype), *sorted(later)]
        jobs = []
        for name, t in pending:
            folder = built["tmp"].mktemp(f"{name}-{t}")
            jobs.append((_folder(name, built)["folder"], os.path.join(folder, f"model-{t}.gguf"), t))
        for (name, t), path in zip(pending, convert_many(jobs)):
            built["families"][name]["ggufs"][t] = path
    return family["ggufs"][outtype]


def _generate(source: str, prompts: list[list[int]], short_context: int | None = None) -> list[list[int]]:
    """Greedy tokens of each prompt. short_context (longrope models: the original context): prompts that stay
    within it run under max_model_len = short_context (short factors, as transformers uses for them), longer ones
    under 256 (long factors, as transformers uses once a sequence is past it); see conveyor/model/rope.py."""
    groups: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        short = short_context is not None and len(prompt) + NEW_TOKENS <= short_context
        groups.setdefault(short_context if short and short_context else 256, []).append(i)
    tokens: dict[int, list[int]] = {}
    for max_model_len, indices in groups.items():
        # block_size 4 and a 64-token budget: prompts span many blocks and long ones are prefilled in chunks
        llm = LLM(
            model=source,
            dtype="float32",
            block_size=4,
            max_model_len=max_model_len,
            kv_cache_memory=2**22,
            max_num_batched_tokens=64,
        )
        outs = llm.generate(
            [prompts[i] for i in indices],
            SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
        llm.engine.check_idle()
        tokens.update({i: o.outputs[0].token_ids for i, o in zip(indices, outs)})
    return [tokens[i] for i in range(len(prompts))]


def _short_context(name: str) -> int | None:
    """The original context of a longrope family (None for the others)."""
    _, overrides, _ = FAMILIES[name]
    longrope = overrides.get("rope_parameters", {}).get("rope_type") == "longrope"
    return int(overrides["original_max_position_embeddings"]) if longrope else None


@pytest.mark.parametrize("name", list(FAMILIES))
def test_hf_folder_matches_transformers(name: str, built: dict[str, Any]) -> None:
    family = _family(name, built)
    compare(
        family["refs"],
        _generate(family["folder"], family["prompts"], _short_context(name)),
        allow_ties=True,
        tie_gap=1e-3,
    )


@pytest.mark.parametrize("name, outtype", [(name, t) for name, (_, _, types) in FAMILIES.items() for t in types])
def test_gguf_from_llama_cpp_converter_matches_transformers(
    name: str, outtype: str, llama_cpp_converter: str, built: dict[str, Any]
) -> None:
    family = _family(name, built)
    path = _gguf(family, outtype, built)
    refs = (
        family["refs"]
        if outtype == "f32"
        else hf_greedy(quantization_roundtrip_reference(family["model"], path), family["prompts"], NEW_TOKENS)
    )
    compare(refs, _generate(path, family["prompts"], _short_context(name)), allow_ties=True, tie_gap=1e-3)


@pytest.mark.parametrize("weight_type", ["F16", "BF16", "Q4_0", "Q5_1"])
def test_gguf_weight_types_match_transformers_on_the_same_weights(
    weight_type: str, llama_cpp_converter: str, built: dict[str, Any], tmp_path_factory: Any
) -> None:
    """The converter's F32 file with every matrix re-encoded in another weight type by the `gguf` package:
    greedy tokens equal transformers running the same values."""
    import gguf
    import numpy as np

    family = _family("llama3.x", built)
    source = gguf.GGUFReader(_gguf(family, "f32", built))
    kind = gguf.GGMLQuantizationType[weight_type]
    tensors = {
        t.name: (gguf.quants.quantize(np.asarray(t.data, dtype=np.float32), kind), kind)
        for t in source.tensors
        if len(t.data.shape) == 2
    }
    path = rewrite(family["ggufs"]["f32"], str(tmp_path_factory.mktemp(weight_type) / "model.gguf"), tensors=tensors)
    refs = hf_greedy(quantization_roundtrip_reference(family["model"], path), family["prompts"], NEW_TOKENS)
    compare(refs, _generate(path, family["prompts"]), allow_ties=True, tie_gap=1e-3)


def test_q4_k_m_from_llama_model_quantize_matches_transformers_on_the_same_weights(
    llama_cpp_converter: str, tmp_path: Any
) -> None:
    """A Q4_K_M file made as users make them (llama.cpp's converter, then llama.cpp's own quantizer through
    llama-cpp-python): Q4_K and Q6_K matrices (a Qwen2.5 model 256 wide, as K-quants need rows of 256), greedy
    tokens equal transformers running the file's dequantized weights."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (llama.cpp's quantizer) is not installed here")
    import gguf

    folder = str(tmp_path / "qwen2.5-256")
    model = build_tiny_model("qwen2", folder, hidden_size=256, intermediate_size=512, tie_word_embeddings=True)
    for sub in ("f32", "q4km"):  # each file in a folder of its own (a GGUF's tokenizer is read from beside it)
        os.makedirs(tmp_path / sub)
    f32 = convert(folder, str(tmp_path / "f32" / "model.gguf"), "f32")
    path = llama_cpp_quantize(f32, str(tmp_path / "q4km" / "model.gguf"))
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert {"Q4_K", "Q6_K"} <= types, f"expected K-quants in the Q4_K_M file, found {types}"
    prompts = _prompts(256)
    refs = hf_greedy(dequantized_reference(model, path), prompts, NEW_TOKENS)
    compare(refs, _generate(path, prompts), allow_ties=True, tie_gap=1e-3)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_inspect_describes_each_family_from_folder_and_gguf(
    name: str, llama_cpp_converter: str, built: dict[str, Any], capsys: Any
) -> None:
    from conveyor.cli import main

    family = _folder(name, built)
    arch, overrides, gguf_types = FAMILIES[family["name"]]
    paths = [family["folder"]] + ([_gguf(family, "f32", built)] if gguf_types else [])
    assert main(["inspect", *paths]) == 0
    text = capsys.readouterr().out
    assert text.count("conveyor      runs it") == len(paths) and "hf-folder" in text
    assert ("format        gguf" in text) == bool(gguf_types)
    layers = overrides.get("num_hidden_layers", 2)
    assert text.count(f"layers        {layers}\n") == len(paths)
    assert text.count("heads         4 query, 2 key/value") == len(paths)
    rope_type = overrides.get("rope_parameters", {}).get("rope_type")
    if rope_type == "llama3":  # llama.cpp's converter stores it as per-frequency factors
        assert "scaling llama3 x8 from 64 tokens" in text and "per-frequency factors" in text
    elif rope_type is not None:
        assert text.count(f"scaling {rope_type}") == len(paths)
    if rope_type == "longrope":
        assert text.count(f"from {LONGROPE_ORIGINAL} tokens (long factors when max_model_len exceeds it") == len(paths)
    partial = overrides.get("partial_rotary_factor")
    assert text.count("(partial)") == (len(paths) if partial else 0)
    if partial:
        assert text.count(f"rotary on {int(16 * partial)} dimensions per head") == len(paths)
    if arch == "gemma3":  # the GGUF's layer pattern and local rope base read as the folder's
        assert text.count("local rope    theta 10000, scaling default") == len(paths)
        assert text.count("window        16 tokens on 5 of 6 layers; full-attention layers keep") == len(paths)


def test_inspect_refuses_an_unsupported_family_without_loading_it(tmp_path: Any, capsys: Any) -> None:
    import transformers

    from conveyor.cli import main

    config = transformers.GPTNeoXConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path))
    assert main(["inspect", str(tmp_path)]) == 1
    text = capsys.readouterr().out
    assert "GPTNeoXForCausalLM" in text and "refuses it" in text and "is not supported" in text


def test_gemma3_gguf_layer_pattern_key_is_honoured_or_refused(
    llama_cpp_converter: str, built: dict[str, Any], tmp_path_factory: Any
) -> None:
    """llama.cpp's converter writes no Gemma 3 layer pattern (llama.cpp assumes a period of 6); a file that carries
    gemma3.attention.sliding_window_pattern gets it honoured (a period, or one flag per layer), and a malformed one
    is refused by name; an attention soft-cap key (Gemma 3 has none) is refused."""
    import gguf

    from conveyor.model.gguf_loader import open_gguf, read_spec

    source = _gguf(_folder("gemma3-text", built), "f32", built)
    key = "gemma3.attention.sliding_window_pattern"
    cases = [
        ({key: (2, gguf.GGUFValueType.UINT32)}, (16, None, 16, None, 16, None)),
        ({key: ([False, True, True, False, True, True], gguf.GGUFValueType.ARRAY)}, (None, 16, 16, None, 16, 16)),
        ({key: ([True, False], gguf.GGUFValueType.ARRAY)}, "sliding_window_pattern has 2 flags for 6 layers"),
        (
            {"gemma3.attn_logit_softcapping": (50.0, gguf.GGUFValueType.FLOAT32)},
            "gemma3.attn_logit_softcapping=50.0 is not supported for gemma3",
        ),
    ]
    for i, (metadata, expected) in enumerate(cases):
        path = rewrite(source, str(tmp_path_factory.mktemp(f"gemma3-pattern-{i}") / "model.gguf"), metadata=metadata)
        reader = open_gguf(path)
        if isinstance(expected, str):
            with pytest.raises(ModelLoadError, match=expected):
                read_spec(reader, path)
        else:
            assert read_spec(reader, path).layer_windows == expected
