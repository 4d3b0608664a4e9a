"""Seeded, structure-aware mutations of a GGUF file: every field of the header, the metadata entries (keys, types,
values, string and array lengths, whole entries removed, repeated or added), the tensor table (names, ranks,
dimensions, types, offsets) and the tensor data, plus truncation, appended bytes and bit flips anywhere in the
header.

Each mutation carries a tag the fuzzer's oracle judges it by:
  structure  the file no longer says what it said: it must be refused, or load computing exactly the original;
  value      a metadata value replaced by another of its type, or an entry removed or added (a file that may be a
             valid one of another model): it may load, but never with a NaN or an infinity in it;
  data       tensor bytes changed (or a tensor type swapped for one of the same byte size: the same bytes read as
             other weights): it may load;
and `nonfinite` when it puts a NaN or an infinity where the loader must refuse it (a weight, a scale, a float key).
"""

from __future__ import annotations

import bisect
import math
import random
import struct
from dataclasses import dataclass, field

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_SCALAR_CODES = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<B",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_SCALE_BYTES = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
INSERTED_KEYS = (
    "{arch}.context_length",
    "{arch}.rope.freq_base",
    "{arch}.attention.layer_norm_rms_epsilon",
    "{arch}.attention.head_count_kv",
    "{arch}.rope.scaling.type",
    "{arch}.rope.scaling.factor",
    "{arch}.attn_logit_softcapping",
    "{arch}.expert_count",
    "{arch}.vocab_size",
    "general.alignment",
    "general.comment",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.whatever",
    "split.count",
    "zzz.unknown",
)
"""Keys an added metadata entry gets ({arch} filled in): honoured, neutral, unknown."""


@dataclass
class Entry:
    """One metadata entry: where its parts are."""

    start: int
    key: str
    key_at: int
    type_at: int
    value_type: int
    value_at: int
    end: int
    element_type: int | None = None
    count_at: int | None = None
    count: int = 0


@dataclass
class Info:
    """One tensor-table entry."""

    start: int
    name: str
    ndims_at: int
    dims: list[int]
    type_at: int
    ggml_type: int
    offset_at: int
    offset: int
    end: int


@dataclass
class Layout:
    data: bytes
    entries: list[Entry]
    infos: list[Info]
    infos_end: int
    alignment: int
    data_start: int
    arch: str
    fields: list[tuple[int, int, bool]] = field(default_factory=list)
    """(start, end, is_value) of every field of the header, for bit flips."""


@dataclass(frozen=True)
class Mutation:
    data: bytes | bytearray
    """The mutant (a bytearray where a copy of the seed was patched: one copy of a 100 MB file, not two)."""
    tag: str
    what: str
    nonfinite: bool = False


def parse(data: bytes) -> Layout:
    """The layout of a valid GGUF file (a seed), with the offset of every field."""
    _, _, n_tensors, n_kv = struct.unpack_from("<IIQQ", data, 0)
    fields: list[tuple[int, int, bool]] = [(0, 24, False)]
    at, entries = 24, []
    for _ in range(n_kv):
        start = at
        (length,) = struct.unpack_from("<Q", data, at)
        key = data[at + 8 : at + 8 + length].decode()
        type_at = at + 8 + length
        (value_type,) = struct.unpack_from("<I", data, type_at)
        entry = Entry(start, key, at + 8, type_at, value_type, type_at + 4, 0)
        fields += [(start, type_at + 4, False)]
        entry.end = _skip_value(data, entry, fields)
        entries.append(entry)
        at = entry.end
    infos = []
    for _ in range(n_tensors):
        start = at
        (length,) = struct.unpack_from("<Q", data, at)
        name = data[at + 8 : at + 8 + length].decode()
        ndims_at = at + 8 + length
        (ndims,) = struct.unpack_from("<I", data, ndims_at)
        dims = list(struct.unpack_from(f"<{ndims}Q", data, ndims_at + 4))
        type_at = ndims_at + 4 + 8 * ndims
        ggml_type, offset = struct.unpack_from("<IQ", data, type_at)
        infos.append(Info(start, name, ndims_at, dims, type_at, ggml_type, type_at + 4, offset, type_at + 12))
        fields.append((start, type_at + 12, False))
        at = type_at + 12
    alignment = 32
    arch = ""
    for e in entries:
        if e.key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", data, e.value_at)
        if e.key == "general.architecture":
            (length,) = struct.unpack_from("<Q", data, e.value_at)
            arch = data[e.value_at + 8 : e.value_at + 8 + length].decode()
    return Layout(data, entries, infos, at, alignment, -(-at // alignment) * alignment, arch, fields)


def _skip_value(data: bytes, entry: Entry, fields: list[tuple[int, int, bool]]) -> int:
    at = entry.value_at
    if entry.value_type == GGUFValueType.STRING:
        (length,) = struct.unpack_from("<Q", data, at)
        fields += [(at, at + 8, False), (at + 8, at + 8 + length, True)]
        return at + 8 + length
    if entry.value_type != GGUFValueType.ARRAY:
        size = struct.calcsize(_SCALAR_CODES[GGUFValueType(entry.value_type)])
        fields.append((at, at + size, True))
        return at + size
    element, count = struct.unpack_from("<IQ", data, at)
    entry.element_type, entry.count_at, entry.count = element, at + 4, count
    fields.append((at, at + 12, False))
    at += 12
    if element == GGUFValueType.STRING:
        for _ in range(count):
            (length,) = struct.unpack_from("<Q", data, at)
            fields += [(at, at + 8, False), (at + 8, at + 8 + length, True)]
            at += 8 + length
        return at
    size = struct.calcsize(_SCALAR_CODES[GGUFValueType(element)])
    fields.append((at, at + size * count, True))
    return at + size * count


def tensor_bytes(ggml_type: int, dims: list[int]) -> int | None:
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return None
    elements = math.prod(dims)
    return None if dims[0] % block else elements // block * size


class GGUFMutator:
    """mutate(rng) -> one Mutation of the seed; the operator is chosen at random, weighted by section."""

    def __init__(self, data: bytes) -> None:
        self.layout = parse(data)
        self.data = data
        self.value_spans = sorted((s, e) for s, e, is_value in self.layout.fields if is_value)
        self.value_starts = [s for s, _ in self.value_spans]
        self.operators = [
            (3, self.header),
            (4, self.key),
            (3, self.value_type),
            (10, self.value),
            (3, self.length_or_count),
            (3, self.whole_entry),
            (3, self.tensor_name),
            (3, self.rank),
            (6, self.dims),
            (5, self.tensor_type),
            (6, self.offset),
            (5, self.tensor_data),
            (4, self.nonfinite_weight),
            (2, self.truncate_or_append),
            (6, self.bit_flips),
        ]

    def mutate(self, rng: random.Random) -> Mutation:
        weights = [w for w, _ in self.operators]
        while True:
            _, operator = rng.choices(self.operators, weights)[0]
            mutation = operator(rng)
            if mutation is not None and mutation.data != self.data:
                return mutation

    # ---- helpers --------------------------------------------------------------------------------------------
    def in_value(self, at: int) -> bool:
        """Whether byte `at` of the header belongs to a value (a number, a string's bytes), not to its framing."""
        i = bisect.bisect_right(self.value_starts, at) - 1
        return i >= 0 and at < self.value_spans[i][1]

    def put(self, at: int, code: str, value: int | float) -> bytearray:
        data = bytearray(self.data)
        try:
            struct.pack_into(code, data, at, value)
        except OverflowError:  # a float past the type's range: an infinity
            struct.pack_into(code, data, at, math.copysign(math.inf, value))
        return data

    def splice(self, start: int, end: int, new: bytes, kv_delta: int = 0, tensor_delta: int = 0) -> bytes:
        """The header with [start, end) replaced, the counts adjusted, the data section re-aligned: a consistent
        file whenever the replacement is."""
        layout = self.layout
        header = bytearray(self.data[:start] + new + self.data[end : layout.infos_end])
        tensors, kvs = struct.unpack_from("<QQ", header, 8)
        struct.pack_into("<QQ", header, 8, tensors + tensor_delta, kvs + kv_delta)
        header += bytes(-len(header) % layout.alignment)
        return bytes(header) + self.data[layout.data_start :]

    # ---- operators ------------------------------------------------------------------------------------------
    def header(self, rng: random.Random) -> Mutation:
        part = rng.choice(["magic", "version", "tensor_count", "kv_count"])
        if part == "magic":
            new = rng.choice([b"GGUG", b"FUGG", b"\x00\x00\x00\x00", rng.randbytes(4)])
            return Mutation(new + self.data[4:], "structure", f"magic -> {new!r}")
        if part == "version":
            value = rng.choice([0, 1, 2, 4, 0x03000000, 2**32 - 1])
            return Mutation(self.put(4, "<I", value), "structure", f"version -> {value}")
        at = 8 if part == "tensor_count" else 16
        (old,) = struct.unpack_from("<Q", self.data, at)
        value = _hostile_u64(old, rng)
        return Mutation(self.put(at, "<Q", value), "structure", f"{part} {old} -> {value}")

    def key(self, rng: random.Random) -> Mutation:
        e = rng.choice(self.layout.entries)
        if rng.random() < 0.4:
            value = _hostile_u64(len(e.key), rng)
            return Mutation(self.put(e.start, "<Q", value), "structure", f"{e.key!r} key length -> {value}")
        data = bytearray(self.data)
        i = rng.randrange(len(e.key))
        data[e.key_at + i] = rng.choice([data[e.key_at + i] ^ (1 << rng.randrange(8)), 0xFF, ord("_")])
        return Mutation(data, "structure", f"{e.key!r} key byte {i} -> {data[e.key_at + i]}")

    def value_type(self, rng: random.Random) -> Mutation:
        e = rng.choice(self.layout.entries)
        value = rng.choice([*range(14), 2**31, 2**32 - 1])
        return Mutation(
            self.put(e.type_at, "<I", value), "structure", f"{e.key!r} value type {e.value_type} -> {value}"
        )

    def value(self, rng: random.Random) -> Mutation | None:
        e = rng.choice(self.layout.entries)
        kind = GGUFValueType(e.value_type)
        if kind == GGUFValueType.STRING:
            new = _hostile_string(rng)
            return Mutation(
                self.splice(e.value_at, e.end, struct.pack("<Q", len(new)) + new), "value", f"{e.key!r} -> {new[:40]!r}"
            )
        if kind != GGUFValueType.ARRAY:
            return self._scalar(e.key, kind, e.value_at, rng)
        assert e.element_type is not None and e.count_at is not None
        element = GGUFValueType(e.element_type)
        if e.count == 0:
            return None
        index = rng.randrange(e.count)
        if element != GGUFValueType.STRING:
            size = struct.calcsize(_SCALAR_CODES[element])
            choice = rng.random()
            if choice < 0.7:
                return self._scalar(f"{e.key}[{index}]", element, e.count_at + 8 + index * size, rng)
            # drop or append an element: a consistent array of another length
            body_at = e.count_at + 8
            if choice < 0.85:
                new = self.data[body_at : body_at + index * size] + self.data[body_at + (index + 1) * size : e.end]
                count = e.count - 1
            else:
                new = self.data[body_at : e.end] + self.data[body_at + index * size : body_at + (index + 1) * size]
                count = e.count + 1
            return Mutation(
                self.splice(e.count_at, e.end, struct.pack("<Q", count) + new),
                "value",
                f"{e.key!r} array of {e.count} -> {count}",
            )
        at = e.count_at + 8
        for _ in range(index):
            (length,) = struct.unpack_from("<Q", self.data, at)
            at += 8 + length
        (length,) = struct.unpack_from("<Q", self.data, at)
        if rng.random() < 0.3:  # drop this string
            return Mutation(
                self.splice(
                    e.count_at,
                    e.end,
                    struct.pack("<Q", e.count - 1)
                    + self.data[e.count_at + 8 : at]
                    + self.data[at + 8 + length : e.end],
                ),
                "value",
                f"{e.key!r}[{index}] removed",
            )
        new = _hostile_string(rng)
        return Mutation(
            self.splice(at, at + 8 + length, struct.pack("<Q", len(new)) + new),
            "value",
            f"{e.key!r}[{index}] -> {new[:40]!r}",
        )

    def _scalar(self, what: str, kind: GGUFValueType, at: int, rng: random.Random) -> Mutation:
        code = _SCALAR_CODES[kind]
        (old,) = struct.unpack_from(code, self.data, at)
        if kind in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
            value = rng.choice(
                [math.nan, math.inf, -math.inf, 0.0, -0.0, -old, old * 2, old / 2, 1e-45, 3e38, old * 1.001]
            )
            return Mutation(self.put(at, code, value), "value", f"{what} {old} -> {value}", not math.isfinite(value))
        if kind == GGUFValueType.BOOL:
            value = rng.choice([0, 1, 2, 255])
            return Mutation(self.put(at, code, value), "value", f"{what} {old} -> {value}")
        bits = 8 * struct.calcsize(code)
        signed = code[-1].islower()
        low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
        value = rng.choice([0, 1, old + 1, old - 1, old * 2, old // 2, high, low, 2**31, 815_000_000, -1])
        value = min(max(value, low), high)
        return Mutation(self.put(at, code, value), "value", f"{what} {old} -> {value}")

    def length_or_count(self, rng: random.Random) -> Mutation | None:
        e = rng.choice(self.layout.entries)
        if e.value_type == GGUFValueType.STRING:
            (old,) = struct.unpack_from("<Q", self.data, e.value_at)
            value = _hostile_u64(old, rng)
            return Mutation(self.put(e.value_at, "<Q", value), "structure", f"{e.key!r} string length {old} -> {value}")
        if e.count_at is None:
            return None
        if rng.random() < 0.3:
            value = rng.choice([*range(14), 2**32 - 1])
            return Mutation(self.put(e.value_at, "<I", value), "structure", f"{e.key!r} element type -> {value}")
        value = _hostile_u64(e.count, rng)
        return Mutation(self.put(e.count_at, "<Q", value), "structure", f"{e.key!r} array count {e.count} -> {value}")

    def whole_entry(self, rng: random.Random) -> Mutation:
        e = rng.choice(self.layout.entries)
        action = rng.choice(["remove", "repeat", "add", "add"])
        if action == "remove":
            return Mutation(self.splice(e.start, e.end, b"", kv_delta=-1), "value", f"entry {e.key!r} removed")
        if action == "repeat":
            entry = self.data[e.start : e.end]
            return Mutation(self.splice(e.end, e.end, entry, kv_delta=1), "structure", f"entry {e.key!r} repeated")
        key = rng.choice(INSERTED_KEYS).format(arch=self.layout.arch)
        kind = rng.choice(
            [
                GGUFValueType.UINT32,
                GGUFValueType.FLOAT32,
                GGUFValueType.STRING,
                GGUFValueType.BOOL,
                GGUFValueType.INT32,
                GGUFValueType.ARRAY,
            ]
        )
        if kind == GGUFValueType.STRING:
            raw = _hostile_string(rng)
            value, shown = struct.pack("<Q", len(raw)) + raw, raw[:40]
        elif kind == GGUFValueType.ARRAY:
            value, shown = (
                struct.pack("<IQ", GGUFValueType.FLOAT32, 3) + struct.pack("<3f", 1.0, 0.5, 2.0),
                "[1, .5, 2]",
            )
        else:
            number = rng.choice(
                {GGUFValueType.FLOAT32: [0.5, 2.0, 1e-6, 1e4, math.nan, -1.0], GGUFValueType.BOOL: [0, 1]}.get(
                    kind, [0, 1, 2, 7, 64, 2**20]
                )
            )
            value, shown = struct.pack(_SCALAR_CODES[kind], number), number
        new = struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", kind) + value
        at = rng.choice([e.start, e.end])
        nonfinite = isinstance(shown, float) and not math.isfinite(shown)
        return Mutation(
            self.splice(at, at, new, kv_delta=1), "value", f"entry {key}={shown!r} ({kind.name}) added", nonfinite
        )

    def tensor_name(self, rng: random.Random) -> Mutation:
        t = rng.choice(self.layout.infos)
        if rng.random() < 0.4:
            value = rng.choice([0, len(t.name) - 1, len(t.name) + 1, 64, 700_000, 2**63])
            return Mutation(self.put(t.start, "<Q", value), "structure", f"tensor {t.name!r} name length -> {value}")
        data = bytearray(self.data)
        i = rng.randrange(len(t.name))
        data[t.start + 8 + i] = rng.choice([data[t.start + 8 + i] ^ (1 << rng.randrange(8)), ord("1"), 0xC3])
        return Mutation(data, "structure", f"tensor {t.name!r} name byte {i} -> {data[t.start + 8 + i]}")

    def rank(self, rng: random.Random) -> Mutation:
        t = rng.choice(self.layout.infos)
        n = len(t.dims)
        if rng.random() < 0.5:  # the rank alone: the rest of the table shifts
            value = rng.choice([0, n - 1, n + 1, 5, 2**32 - 1])
            return Mutation(self.put(t.ndims_at, "<I", value), "structure", f"tensor {t.name!r} n_dims {n} -> {value}")
        dims = [*t.dims, 1] if n < 4 and rng.random() < 0.5 else t.dims[:-1] or [1]
        new = struct.pack(f"<I{len(dims)}Q", len(dims), *dims)
        return Mutation(
            self.splice(t.ndims_at, t.type_at, new), "structure", f"tensor {t.name!r} dims {t.dims} -> {dims}"
        )

    def dims(self, rng: random.Random) -> Mutation:
        t = rng.choice(self.layout.infos)
        i = rng.randrange(len(t.dims))
        if len(t.dims) > 1 and rng.random() < 0.2:
            dims = list(reversed(t.dims))
            new = struct.pack(f"<{len(dims)}Q", *dims)
            return Mutation(
                self.splice(t.ndims_at + 4, t.type_at, new), "structure", f"tensor {t.name!r} dims reversed"
            )
        old = t.dims[i]
        value = rng.choice([0, 1, old + 1, old - 1, old * 2, old // 2, old + 32, 2**32, 2**63, 2**64 - 1, 815_000_000])
        value = max(0, min(value, 2**64 - 1))
        return Mutation(
            self.put(t.ndims_at + 4 + 8 * i, "<Q", value), "structure", f"tensor {t.name!r} dim {i} {old} -> {value}"
        )

    def tensor_type(self, rng: random.Random) -> Mutation:
        t = rng.choice(self.layout.infos)
        value = rng.choice([*(int(k) for k in GGMLQuantizationType), 4, 5, 31, 99, 2**32 - 1])
        same_size = value != t.ggml_type and tensor_bytes(value, t.dims) == tensor_bytes(t.ggml_type, t.dims)
        return Mutation(
            self.put(t.type_at, "<I", value),
            "data" if same_size else "structure",
            f"tensor {t.name!r} type {t.ggml_type} -> {value}",
        )

    def offset(self, rng: random.Random) -> Mutation:
        t = rng.choice(self.layout.infos)
        other = rng.choice(self.layout.infos).offset
        a = self.layout.alignment
        value = rng.choice(
            [
                0,
                t.offset + 1,
                t.offset - 1,
                t.offset + a,
                t.offset - a,
                t.offset + 32,
                t.offset - 32,
                other,
                2**63,
                2**64 - 1,
            ]
        )
        value = max(0, min(value, 2**64 - 1))
        return Mutation(
            self.put(t.offset_at, "<Q", value), "structure", f"tensor {t.name!r} offset {t.offset} -> {value}"
        )

    def _tensor_span(self, t: Info) -> tuple[int, int]:
        size = tensor_bytes(t.ggml_type, t.dims) or 0
        return self.layout.data_start + t.offset, size

    def tensor_data(self, rng: random.Random) -> Mutation:
        t = rng.choice(self.layout.infos)
        start, size = self._tensor_span(t)
        data = bytearray(self.data)
        for _ in range(rng.randint(1, 8)):
            data[start + rng.randrange(size)] = rng.randrange(256)
        return Mutation(data, "data", f"tensor {t.name!r} data bytes changed")

    def nonfinite_weight(self, rng: random.Random) -> Mutation | None:
        t = rng.choice(self.layout.infos)
        start, size = self._tensor_span(t)
        kind = GGMLQuantizationType(t.ggml_type).name
        value = rng.choice([math.nan, math.inf, -math.inf])
        if kind == "F32":
            at, packed = start + 4 * rng.randrange(size // 4), struct.pack("<f", value)
        elif kind == "F16":
            at, packed = start + 2 * rng.randrange(size // 2), struct.pack("<e", value)
        elif kind == "BF16":
            at, packed = start + 2 * rng.randrange(size // 2), struct.pack("<f", value)[2:]
        elif kind in _SCALE_BYTES:
            block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)][1]
            at = start + block_bytes * rng.randrange(size // block_bytes) + rng.choice(_SCALE_BYTES[kind])
            packed = struct.pack("<e", value)
        else:
            return None
        data = bytearray(self.data)
        data[at : at + len(packed)] = packed
        return Mutation(data, "data", f"tensor {t.name!r} ({kind}): {value} at byte {at - start}", True)

    def truncate_or_append(self, rng: random.Random) -> Mutation:
        if rng.random() < 0.7:
            cut = rng.choice([rng.randrange(self.layout.infos_end), rng.randrange(len(self.data)), len(self.data) - 1])
            return Mutation(self.data[:cut], "structure", f"truncated at {cut}")
        extra = rng.choice([1, 31, 32, 4096])
        return Mutation(self.data + rng.randbytes(extra), "structure", f"{extra} bytes appended")

    def bit_flips(self, rng: random.Random) -> Mutation:
        data = bytearray(self.data)
        structural, places = False, []
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(self.layout.infos_end)
            data[at] ^= 1 << rng.randrange(8)
            places.append(at)
            structural |= not self.in_value(at)
        return Mutation(data, "structure" if structural else "value", f"bits flipped at {places}")


def _hostile_u64(old: int, rng: random.Random) -> int:
    value = rng.choice([0, 1, old - 1, old + 1, old * 2, old * 1000, 2**31, 2**32, 2**63, 2**64 - 1, 815_000_000])
    return max(0, min(value, 2**64 - 1))


def _hostile_string(rng: random.Random) -> bytes:
    return rng.choice(
        [
            b"",
            b"x",
            b"\xff\xfe\x80",
            "naïve ✓".encode(),
            b"A" * 100_000,
            b"none",
            b"linear",
            b"yarn",
            b"llama",
            b"gpt2",
            b"{{ raise_exception('x') }}",
            b"{% for %}",
            rng.randbytes(rng.randint(1, 64)),
        ]
    )
