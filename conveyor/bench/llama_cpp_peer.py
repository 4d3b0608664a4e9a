"""llama.cpp as a peer, through llama-cpp-python's C API, with continuous batching of its own.

llama-cpp-python's high-level `Llama` runs one sequence at a time, which would understate
llama.cpp. Here up to `max_seqs` sequences decode together in one `llama_decode` per step, each
in its own KV stream (`kv_unified=False`: with a unified buffer every sequence's attention spans the
whole buffer, several times slower at 64 sequences), with prompts fed in chunks under the same token budget
as ours; a finished sequence's slot is cleared and refilled from the queue. Greedy: argmax of each row's logits.
"""

from __future__ import annotations

import ctypes
import heapq
import logging
import time
from collections import deque
from typing import Any

import numpy as np

from conveyor.bench.workloads import Workload

BATCH_TOKENS = 2048


class _LlamaCpp:
    """A llama.cpp model and context sized for `max_seqs` sequences of up to `seq_len` tokens."""

    def __init__(self, model_path: str, max_seqs: int, seq_len: int, threads: int) -> None:
        import llama_cpp as lc

        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # its loader logs every tensor otherwise
        self.lc = lc
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(model_path.encode(), lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        params = lc.llama_context_default_params()
        params.n_seq_max = max_seqs
        params.n_ctx = max_seqs * (-(-seq_len // 256) * 256)  # split evenly between the sequences
        params.n_batch = params.n_ubatch = BATCH_TOKENS
        params.kv_unified = False
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.memory = lc.llama_get_memory(self.ctx)
        self.batch = lc.llama_batch_init(BATCH_TOKENS, 0, 1)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """entries: (token, position, sequence, wants logits) -> the greedy token of each entry that wants logits."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, int(logits)
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        status = self.lc.llama_decode(self.ctx, b)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        picked = []
        for i, entry in enumerate(entries):
            if entry[3]:
                row = self.lc.llama_get_logits_ith(self.ctx, i)
                picked.append(
                    int(
                        np.ctypeslib.as_array(
                            ctypes.cast(row, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,)
                        ).argmax()
                    )
                )
        return picked

    def clear(self, seq: int) -> None:
        self.lc.llama_memory_seq_rm(self.memory, seq, -1, -1)


def run_workload(model_path: str, workload: Workload, threads: int, max_seqs: int = 64) -> tuple[float, int]:
    """Continuous batching over the workload -> (seconds, output tokens)."""
    seq_len = max(len(p) + (q.max_tokens or 16) for p, q in zip(workload.prompts, workload.params))
    engine = _LlamaCpp(model_path, min(max_seqs, len(workload.prompts)), seq_len, threads)
    queue: deque[tuple[list[int], int]] = deque(
        (list(p), q.max_tokens or 16) for p, q in zip(workload.prompts, workload.params)
    )
    # Lowest free id first, decodes in ascending id order: llama.cpp (0.3.36, per-sequence KV) only puts
    # sequences whose ids ascend by one into one micro-batch, so descending ids ran every decode step as
    # one single-token pass per sequence (about half its real speed).
    free = list(range(min(max_seqs, len(workload.prompts))))
    active: dict[int, dict[str, Any]] = {}  # seq -> tokens, fed (prompt tokens in KV), want, produced
    produced = 0
    start = time.perf_counter()
    while queue or active:
        while free and queue:
            prompt, want = queue.popleft()
            active[heapq.heappop(free)] = {
                "tokens": prompt,
                "fed": 0,
                "prompt_len": len(prompt),
                "want": want,
                "out": 0,
            }
        entries: list[tuple[int, int, int, bool]] = []
        owners: list[int] = []
        order = sorted(active)
        for seq in order:  # decodes first, then prompt chunks, under the token budget
            s = active[seq]
            if s["fed"] >= s["prompt_len"] and len(entries) < BATCH_TOKENS:
                entries.append((s["tokens"][-1], len(s["tokens"]) - 1, seq, True))
                owners.append(seq)
        for seq in order:
            s = active[seq]
            take = min(s["prompt_len"] - s["fed"], BATCH_TOKENS - len(entries))
            if s["fed"] >= s["prompt_len"] or take <= 0:
                continue
            for pos in range(s["fed"], s["fed"] + take):
                last = pos == s["prompt_len"] - 1
                entries.append((s["tokens"][pos], pos, seq, last))
                if last:
                    owners.append(seq)
            s["fed"] += take
        for seq, token in zip(owners, engine.decode(entries)):
            s = active[seq]
            s["tokens"].append(token)
            s["out"] += 1
            produced += 1
            if s["out"] >= s["want"]:
                engine.clear(seq)
                del active[seq]
                heapq.heappush(free, seq)
    seconds = time.perf_counter() - start
    engine.close()
    return seconds, produced


class LlamaCppLatency:
    """One sequence for bench latency (conveyor.bench.latency.LatencyRunner): the prompt in one decode call,
    then one call per token."""

    def __init__(self, model_path: str, prompt: list[int], output_len: int, threads: int) -> None:
        self.engine = _LlamaCpp(model_path, 1, len(prompt) + output_len, threads)
        self.prompt = prompt
        self.output_len = output_len

    def once(self) -> tuple[float, float]:
        prompt, engine = self.prompt, self.engine
        engine.clear(0)
        start = time.perf_counter()
        token = engine.decode([(t, p, 0, p == len(prompt) - 1) for p, t in enumerate(prompt)])[0]
        first = time.perf_counter()
        for pos in range(len(prompt), len(prompt) + self.output_len - 1):
            token = engine.decode([(token, pos, 0, True)])[0]
        end = time.perf_counter()
        return first - start, (end - first) / (self.output_len - 1)

    def close(self) -> None:
        self.engine.close()
