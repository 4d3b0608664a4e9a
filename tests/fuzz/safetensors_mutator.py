"""Seeded, structure-aware mutations of a Hugging Face folder (config.json + model.safetensors): the header size,
each header entry's dtype, shape, offsets and name, entries removed or added, __metadata__, the JSON itself
(truncated, nested, repeated names), the tensor data, the file's length, and config.json's fields (values, types,
removals, additions, broken JSON). Tags as in gguf_mutator: structure, value, data, and `nonfinite`."""

from __future__ import annotations

import json
import math
import random
import struct
from dataclasses import dataclass
from typing import Any

SAME_SIZE_FLOATS = {"F16": "BF16", "BF16": "F16"}
OTHER_DTYPES = ("F32", "F16", "BF16", "F64", "I32", "U32", "I64", "I8", "U8", "BOOL", "F8_E4M3", "Q4", "")


@dataclass(frozen=True)
class FolderMutation:
    files: dict[str, bytes]
    """Every file of the folder (config.json, model.safetensors)."""
    tag: str
    what: str
    nonfinite: bool = False


class SafetensorsMutator:
    def __init__(self, config: bytes, weights: bytes) -> None:
        self.config_bytes, self.weights = config, weights
        self.config = json.loads(config)
        (n,) = struct.unpack_from("<Q", weights, 0)
        self.header: dict[str, Any] = json.loads(weights[8 : 8 + n])
        self.body = weights[8 + n :]
        self.names = [k for k in self.header if k != "__metadata__"]
        self.operators = [
            (2, self.header_size),
            (4, self.dtype),
            (5, self.shape),
            (5, self.offsets),
            (3, self.names_and_entries),
            (1, self.metadata),
            (3, self.json_damage),
            (4, self.tensor_data),
            (3, self.nonfinite_weight),
            (2, self.truncate_or_append),
            (8, self.config_field),
        ]

    def mutate(self, rng: random.Random) -> FolderMutation:
        weights = [w for w, _ in self.operators]
        while True:
            _, operator = rng.choices(self.operators, weights)[0]
            mutation = operator(rng)
            if mutation is not None:
                return mutation

    # ---- helpers --------------------------------------------------------------------------------------------
    def folder(self, weights: bytes | None = None, config: bytes | None = None) -> dict[str, bytes]:
        return {
            "config.json": self.config_bytes if config is None else config,
            "model.safetensors": self.weights if weights is None else weights,
        }

    def with_header(self, header: dict[str, Any] | str, body: bytes | None = None) -> dict[str, bytes]:
        text = header if isinstance(header, str) else json.dumps(header, separators=(",", ":"))
        raw = text.encode()
        raw += b" " * (-len(raw) % 8)
        return self.folder(struct.pack("<Q", len(raw)) + raw + (self.body if body is None else body))

    def copy(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.header))

    # ---- operators ------------------------------------------------------------------------------------------
    def header_size(self, rng: random.Random) -> FolderMutation:
        (n,) = struct.unpack_from("<Q", self.weights, 0)
        value = rng.choice([0, 1, n - 1, n + 1, n + 8, len(self.weights), 2**32, 2**63, 2**64 - 1])
        data = struct.pack("<Q", value) + self.weights[8:]
        return FolderMutation(self.folder(data), "structure", f"header size {n} -> {value}")

    def dtype(self, rng: random.Random) -> FolderMutation:
        name = rng.choice(self.names)
        header = self.copy()
        old = header[name]["dtype"]
        new = SAME_SIZE_FLOATS[old] if old in SAME_SIZE_FLOATS and rng.random() < 0.4 else rng.choice(OTHER_DTYPES)
        if new == old:
            new = "I32"
        header[name]["dtype"] = new
        tag = "data" if SAME_SIZE_FLOATS.get(old) == new else "structure"
        return FolderMutation(self.with_header(header), tag, f"{name} dtype {old} -> {new}")

    def shape(self, rng: random.Random) -> FolderMutation:
        name = rng.choice(self.names)
        header = self.copy()
        shape = header[name]["shape"]
        old = list(shape)
        choice = rng.randrange(6)
        if choice == 0 and len(shape) > 1:
            shape.reverse()
        elif choice == 1:
            shape.append(1)
        elif choice == 2 and shape:
            shape.pop()
        elif choice == 3:
            shape[rng.randrange(len(shape))] = rng.choice([0, -1, 1.5, "8", None, 2**63, 10**30])
        else:
            i = rng.randrange(len(shape))
            shape[i] = max(0, shape[i] + rng.choice([-1, 1, shape[i]]))
        return FolderMutation(self.with_header(header), "structure", f"{name} shape {old} -> {shape}")

    def offsets(self, rng: random.Random) -> FolderMutation:
        name = rng.choice(self.names)
        header = self.copy()
        begin, end = header[name]["data_offsets"]
        other = header[rng.choice(self.names)]["data_offsets"]
        new = rng.choice(
            [
                [begin + 4, end + 4],
                [begin - 4, end - 4],
                [begin, end + 4],
                [end, begin],
                list(other),
                [0, end - begin],
                [begin, 2**63],
                [-1, end],
                [begin],
                [begin, end, 0],
                "x",
            ]
        )
        header[name]["data_offsets"] = new
        return FolderMutation(self.with_header(header), "structure", f"{name} data_offsets {[begin, end]} -> {new}")

    def names_and_entries(self, rng: random.Random) -> FolderMutation:
        name = rng.choice(self.names)
        header = self.copy()
        action = rng.randrange(4)
        if action == 0:  # rename
            chars = list(name)
            i = rng.randrange(len(chars))
            chars[i] = rng.choice(["x", "1", "é", "."])
            header = {("".join(chars) if k == name else k): v for k, v in header.items()}
            return FolderMutation(self.with_header(header), "structure", f"{name} renamed {''.join(chars)!r}")
        if action == 1:  # remove the entry and its bytes (a consistent file without that tensor)
            begin, end = header.pop(name)["data_offsets"]
            for entry in header.values():
                if isinstance(entry, dict) and "data_offsets" in entry and entry["data_offsets"][0] >= end:
                    entry["data_offsets"] = [o - (end - begin) for o in entry["data_offsets"]]
            body = self.body[:begin] + self.body[end:]
            return FolderMutation(self.with_header(header, body), "structure", f"{name} removed")
        if action == 2:  # add a tensor (its bytes appended)
            extra = rng.choice(
                [
                    "model.layers.0.self_attn.mystery.weight",
                    "model.layers.9.mlp.up_proj.weight",
                    "model.rotary_emb.inv_freq",
                    "lm_head.bias",
                ]
            )
            end = len(self.body)
            header[extra] = {"dtype": "F32", "shape": [4], "data_offsets": [end, end + 16]}
            return FolderMutation(self.with_header(header, self.body + bytes(16)), "structure", f"{extra} added")
        text = json.dumps(header, separators=(",", ":"))  # a name twice, as raw JSON
        entry = json.dumps({name: header[name]}, separators=(",", ":"))[1:-1]
        return FolderMutation(self.with_header(text[:-1] + "," + entry + "}"), "structure", f"{name} repeated")

    def metadata(self, rng: random.Random) -> FolderMutation:
        header = self.copy()
        value = rng.choice([{"format": "pt"}, {"format": 1}, [], "x", {"a": {"b": "c"}}])
        header["__metadata__"] = value
        ok = isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
        return FolderMutation(self.with_header(header), "value" if ok else "structure", f"__metadata__ -> {value}")

    def json_damage(self, rng: random.Random) -> FolderMutation:
        text = json.dumps(self.header, separators=(",", ":"))
        choice = rng.randrange(5)
        if choice == 0:
            text = text[: rng.randrange(len(text))]
        elif choice == 1:
            at = rng.randrange(len(text))
            text = text[:at] + rng.choice(["]", "{", "\x00", "NaN", '"', "\\"]) + text[at:]
        elif choice == 2:
            text = "[" * 100_000 + "]" * 100_000
        elif choice == 3:
            text = text.replace('"shape":[', '"shape":[' + "9" * 5000 + ",", 1)
        else:
            text = '["not", "an", "object"]'
        return FolderMutation(self.with_header(text), "structure", f"header JSON damaged ({choice})")

    def tensor_data(self, rng: random.Random) -> FolderMutation:
        name = rng.choice(self.names)
        begin, end = self.header[name]["data_offsets"]
        body = bytearray(self.body)
        for _ in range(rng.randint(1, 8)):
            body[begin + rng.randrange(end - begin)] = rng.randrange(256)
        return FolderMutation(self.with_header(self.header, bytes(body)), "data", f"{name} data bytes changed")

    def nonfinite_weight(self, rng: random.Random) -> FolderMutation:
        name = rng.choice(self.names)
        entry = self.header[name]
        begin, end = entry["data_offsets"]
        value = rng.choice([math.nan, math.inf, -math.inf])
        packed = {
            "F32": struct.pack("<f", value),
            "F16": struct.pack("<e", value),
            "BF16": struct.pack("<f", value)[2:],
        }[entry["dtype"]]
        at = begin + len(packed) * rng.randrange((end - begin) // len(packed))
        body = bytearray(self.body)
        body[at : at + len(packed)] = packed
        return FolderMutation(
            self.with_header(self.header, bytes(body)), "data", f"{name}: {value} at {at - begin}", True
        )

    def truncate_or_append(self, rng: random.Random) -> FolderMutation:
        if rng.random() < 0.7:
            cut = rng.randrange(len(self.weights))
            return FolderMutation(self.folder(self.weights[:cut]), "structure", f"safetensors truncated at {cut}")
        return FolderMutation(self.folder(self.weights + rng.randbytes(8)), "structure", "8 bytes appended")

    def config_field(self, rng: random.Random) -> FolderMutation:
        config = json.loads(self.config_bytes)
        key = rng.choice([*config, "sliding_window", "rope_scaling", "attention_bias", "head_dim", "mlp_bias"])
        old = config.get(key)
        choice = rng.randrange(10)
        if choice == 0:
            config.pop(key, None)
            return FolderMutation(self.folder(config=json.dumps(config).encode()), "value", f"config {key} removed")
        if choice == 1:
            raw = json.dumps(config).encode()
            return FolderMutation(self.folder(config=raw[: rng.randrange(len(raw))]), "structure", "config.json cut")
        if choice == 2:  # another JSON type
            config[key] = rng.choice(["8", [8], None, {"a": 1}, True, 1.5])
            return FolderMutation(
                self.folder(config=json.dumps(config).encode()), "structure", f"config {key} {old!r} -> {config[key]!r}"
            )
        if key == "rope_scaling" and (choice == 3 or old is None):
            config[key] = rng.choice(
                [
                    {"rope_type": "linear", "factor": rng.choice([2.0, math.nan, -1.0, 0.0])},
                    {"rope_type": "dynamic", "factor": 2.0},
                    {"rope_type": "yarn"},
                ]
            )
            nonfinite = any(isinstance(v, float) and not math.isfinite(v) for v in config[key].values())
            return FolderMutation(
                self.folder(config=json.dumps(config).encode()), "value", f"config {key} -> {config[key]}", nonfinite
            )
        new: Any
        if isinstance(old, bool):
            new = not old
        elif isinstance(old, int):
            new = rng.choice([0, -1, old + 1, old - 1, old * 2, 2**31, 10**30])
        elif isinstance(old, float):
            new = rng.choice([math.nan, math.inf, -math.inf, 0.0, -old, old * 2, 1e300])
        elif isinstance(old, str):
            new = rng.choice(["", "gelu", "LlamaForCausalLM", "x" * 1000])
        elif isinstance(old, list):
            new = rng.choice([[], ["GPT2LMHeadModel"], [1, 2]])
        else:
            new = rng.choice([0, 1, 4096, -1, 1.5])
        config[key] = new
        nonfinite = isinstance(new, float) and not math.isfinite(new)
        raw = json.dumps(config).encode()  # NaN and Infinity as JSON's common extension, which Python reads
        return FolderMutation(self.folder(config=raw), "value", f"config {key} {old!r} -> {new!r}", nonfinite)
