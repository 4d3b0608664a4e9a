"""What vLLM's and OpenAI's clients send, against a real server: guidellm's exact streaming bodies, vLLM's extra
fields (honoured or refused by name), X-Request-Id, the tokenizer endpoints, int64 seeds; and vLLM's shape of
offline logprobs. Checked against the offline engine (float32 on both sides) and the tokenizer."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from conveyor import SamplingParams
from conveyor.outputs import Logprob
from helpers.server_process import ServerProcess, running_server

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server(
        "--dtype", "float32", "--max-queued-requests", "64", "--request-timeout", "300", "--vllm-metrics"
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _post(server: ServerProcess, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return server.http.post(server.url + path, json=body, timeout=300, **kwargs)


def _sse(server: ServerProcess, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every data line of a streamed response, parsed as guidellm does (an error object is a failure)."""
    chunks: list[dict[str, Any]] = []
    with server.http.stream("POST", server.url + path, json=body, timeout=300) as response:
        assert response.status_code == 200, response.read()
        lines = [line.strip() for line in response.iter_lines() if line.strip()]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data:"), line
        data = json.loads(line[len("data:") :].strip())
        assert not data.get("error"), data
        chunks.append(data)
    return chunks


# ---- guidellm (vLLM's benchmark client) -------------------------------------------------------------------------
# guidellm 0.8.1, src/guidellm/backends/openai/request_handlers.py: TextCompletionsRequestHandler.format and
# ChatCompletionsRequestHandler.format build these bodies for a synthetic-data streaming benchmark (fixed output
# length: stop None and ignore_eos), chat content as a list of text parts (_format_prompts).


def _guidellm_completion(prompt: str, output_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_tokens": output_tokens,
        "stop": None,
        "ignore_eos": True,
        "prompt": prompt,
    }


def _guidellm_chat(prompt: str, output_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_completion_tokens": output_tokens,
        "stop": None,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
    }


def _check_guidellm_stream(chunks: list[dict[str, Any]], output_tokens: int, chat: bool) -> None:
    """What guidellm's response handler reads: text per chunk, usage (its last value wins), usable output."""
    texts = [c["choices"][0]["delta" if chat else "text"] for c in chunks if c["choices"]]
    text = "".join((t.get("content") or "") if chat else t for t in texts)
    assert text.strip(), "guidellm rejects an empty response"
    with_choices = [c for c in chunks if c["choices"]]
    assert all("usage" in c and c["usage"]["prompt_tokens"] > 0 for c in with_choices), "usage in every chunk"
    counts = [c["usage"]["completion_tokens"] for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == output_tokens
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == output_tokens


def test_guidellm_streaming_requests_have_no_errors(server: ServerProcess) -> None:
    assert server.http.get(server.url + "/v1/models", timeout=30).status_code == 200  # guidellm's backend check
    prompts = ["The history of the printing press", "Explain how tides work", "A recipe for bread", "Why is the sky"]
    errors: list[BaseException] = []

    def run(path: str, body: dict[str, Any], tokens: int, chat: bool) -> None:
        try:
            _check_guidellm_stream(_sse(server, path, body), tokens, chat)
        except BaseException as exc:  # collected: a thread's assertion must fail the test
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=("/v1/completions", _guidellm_completion(p, 12 + i), 12 + i, False))
        for i, p in enumerate(prompts)
    ]
    threads += [
        threading.Thread(target=run, args=("/v1/chat/completions", _guidellm_chat(p, 10 + i), 10 + i, True))
        for i, p in enumerate(prompts)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_continuous_usage_counts_the_tokens_sent(client: openai.OpenAI) -> None:
    usage_opts: Any = {"include_usage": True, "continuous_usage_stats": True}
    full = client.completions.create(
        model=MODEL, prompt="One, two,", max_tokens=9, temperature=0, extra_body={"return_token_ids": True}
    )
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="One, two,",
            max_tokens=9,
            temperature=0,
            stream=True,
            stream_options=usage_opts,
            extra_body={"return_token_ids": True},
        )
    )
    sent = 0
    for chunk in chunks[:-1]:
        sent += len(chunk.choices[0].model_extra["token_ids"])
        assert chunk.usage is not None and chunk.usage.completion_tokens == sent
        assert chunk.usage.prompt_tokens == full.usage.prompt_tokens
    assert sent == full.usage.completion_tokens and chunks[-1].usage == full.usage
    chat = list(
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=6, temperature=0, stream=True, stream_options=usage_opts
        )
    )
    assert all(c.usage is not None for c in chat)
    assert chat[0].usage.completion_tokens == 0 and chat[-1].usage.completion_tokens == 6


# ---- seeds ------------------------------------------------------------------------------------------------------


def test_int64_seeds_on_both_endpoints_and_offline(client: openai.OpenAI, default_llm: Any) -> None:
    ask: dict[str, Any] = dict(
        model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0, top_p=1.0, extra_body={"top_k": 0}
    )  # not the model's recommended top-p / top-k
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=-1)
    offline = default_llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].text
    assert client.completions.create(**ask, seed=-1).choices[0].text == offline
    assert client.completions.create(**ask, seed=-1).choices[0].text == offline
    others = {client.completions.create(**ask, seed=seed).choices[0].text for seed in (2**63 - 1, -2)}
    assert offline not in others, "a negative seed must draw its own sequence, not alias a positive one"
    lowest = client.completions.create(**ask, seed=-(2**63), n=2)
    assert lowest.choices[0].text != lowest.choices[1].text
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, temperature=1.0, seed=-7)
    assert (
        chat.choices[0].message.content
        == client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, temperature=1.0, seed=-7)
        .choices[0]
        .message.content
    )
    with pytest.raises(openai.BadRequestError, match="seed"):
        client.completions.create(**ask, seed=2**63)


# ---- vLLM's extra fields ----------------------------------------------------------------------------------------


def test_return_token_ids_matches_offline(client: openai.OpenAI, server: ServerProcess, default_llm: Any) -> None:
    prompt = "The quick brown fox"
    offline = default_llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0), use_tqdm=False)[0]
    reply = _post(
        server, "/v1/completions", {"prompt": prompt, "max_tokens": 10, "temperature": 0, "return_token_ids": True}
    ).json()
    choice = reply["choices"][0]
    assert choice["prompt_token_ids"] == offline.prompt_token_ids
    assert choice["token_ids"] == offline.outputs[0].token_ids and choice["text"] == offline.outputs[0].text
    chunks = _sse(
        server,
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 10, "temperature": 0, "return_token_ids": True, "stream": True},
    )
    assert chunks[0]["choices"][0]["prompt_token_ids"] == offline.prompt_token_ids
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == offline.outputs[0].token_ids
    plain = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2}).json()["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None  # only when asked; null, as vLLM
    chat = _post(
        server,
        "/v1/chat/completions",
        {"messages": QUESTION, "max_tokens": 6, "temperature": 0, "return_token_ids": True},
    ).json()
    chat_prompt = default_llm.get_tokenizer()(default_llm.apply_chat_template(QUESTION), add_special_tokens=False)[
        "input_ids"
    ]
    assert chat["prompt_token_ids"] == chat_prompt
    assert (
        default_llm.get_tokenizer()
        .decode(chat["choices"][0]["token_ids"])
        .startswith(chat["choices"][0]["message"]["content"])
    )
    streamed = _sse(
        server,
        "/v1/chat/completions",
        {"messages": QUESTION, "max_tokens": 6, "temperature": 0, "return_token_ids": True, "stream": True},
    )
    assert streamed[0]["prompt_token_ids"] == chat_prompt
    assert [t for c in streamed for t in c["choices"][0].get("token_ids", [])] == chat["choices"][0]["token_ids"]


def test_prompt_logprobs_match_offline(server: ServerProcess, default_llm: Any) -> None:
    prompt = "The capital of France is"
    offline = default_llm.generate(
        [prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2), use_tqdm=False
    )[0]
    choice = _post(
        server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    ).json()["choices"][0]
    positions = choice["prompt_logprobs"]
    assert len(positions) == len(offline.prompt_token_ids) and positions[0] is None
    tokenizer = default_llm.get_tokenizer()
    for token_id, got, want in zip(offline.prompt_token_ids[1:], positions[1:], offline.prompt_logprobs[1:]):
        assert 2 <= len(got) <= 3 and next(iter(got)) == str(token_id)  # the prompt token, then the top 2
        assert got[str(token_id)]["logprob"] == pytest.approx(want.logprob, abs=1e-4)
        assert got[str(token_id)]["rank"] == want.rank
        assert got[str(token_id)]["decoded_token"] == tokenizer.decode([token_id])
        assert sorted(e["rank"] for e in got.values())[:2] == [1, 2] or want.rank <= 2
    chat = _post(server, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(p) == 1 for p in chat["prompt_logprobs"][1:])
    both = _post(
        server,
        "/v1/completions",
        {
            "prompt": prompt,
            "max_tokens": 0,
            "echo": True,
            "logprobs": 1,
            "prompt_logprobs": 3,
            "return_token_ids": True,
        },
    ).json()["choices"][0]
    assert both["token_ids"] == [] and both["text"] == prompt  # scoring only: nothing generated is shown
    assert all(len(top) <= 2 for top in both["logprobs"]["top_logprobs"][1:])  # echo keeps its own logprobs=1
    assert all(3 <= len(p) <= 4 for p in both["prompt_logprobs"][1:])
    assert both["logprobs"]["token_logprobs"][1:] == [
        p[str(t)]["logprob"] for t, p in zip(offline.prompt_token_ids[1:], both["prompt_logprobs"][1:])
    ]
    refused = _post(server, "/v1/completions", {"prompt": prompt, "prompt_logprobs": 1, "stream": True})
    assert refused.status_code == 400 and "stream" in refused.json()["error"]["message"]


def test_logprobs_zero_gives_the_chosen_token(client: openai.OpenAI) -> None:
    zero = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=0)
    lp = zero.choices[0].logprobs
    assert [list(top) for top in lp.top_logprobs] == [[t] for t in lp.tokens]
    assert [top[t] for top, t in zip(lp.top_logprobs, lp.tokens)] == lp.token_logprobs
    two = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=1.0, seed=3, logprobs=2)
    for top, token in zip(two.choices[0].logprobs.top_logprobs, two.choices[0].logprobs.tokens):
        assert token in top and 2 <= len(top) <= 3


def test_tokens_as_token_ids(client: openai.OpenAI, server: ServerProcess) -> None:
    reply = _post(
        server,
        "/v1/completions",
        {
            "prompt": "Hello",
            "max_tokens": 4,
            "temperature": 0,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        },
    ).json()
    choice = reply["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(all(k.startswith("token_id:") for k in top) for top in choice["logprobs"]["top_logprobs"])
    chat = _post(
        server,
        "/v1/chat/completions",
        {
            "messages": QUESTION,
            "max_tokens": 4,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 1,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        },
    ).json()["choices"][0]
    assert [e["token"] for e in chat["logprobs"]["content"]] == [f"token_id:{t}" for t in chat["token_ids"]]


def test_chat_echo_and_continue_final_message(server: ServerProcess, default_llm: Any) -> None:
    start = "The capital of France is"
    messages = [*QUESTION, {"role": "assistant", "content": start}]
    tokenizer = default_llm.get_tokenizer()
    rendered = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert rendered.rstrip().endswith(start)
    offline = default_llm.generate(
        [tokenizer(rendered, add_special_tokens=False)["input_ids"]],
        SamplingParams(max_tokens=8, temperature=0.0),
        use_tqdm=False,
    )[0]
    body = {
        "messages": messages,
        "max_tokens": 8,
        "temperature": 0,
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    reply = _post(server, "/v1/chat/completions", body | {"echo": True}).json()
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": start + offline.outputs[0].text}
    assert (
        _post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
        == offline.outputs[0].text
    )
    implicit = dict(body)
    del implicit["add_generation_prompt"]  # continue_final_message alone turns the generation prompt off
    assert (
        _post(server, "/v1/chat/completions", implicit).json()["choices"][0]["message"]["content"]
        == offline.outputs[0].text
    )
    streamed = _sse(server, "/v1/chat/completions", body | {"echo": True, "stream": True})
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in streamed) == start + offline.outputs[0].text
    both = _post(server, "/v1/chat/completions", body | {"add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    # add_generation_prompt off without continuing: the reply takes the last message's role (as vLLM)
    off = _post(
        server,
        "/v1/chat/completions",
        {"messages": QUESTION, "max_tokens": 3, "temperature": 0, "add_generation_prompt": False, "echo": True},
    ).json()
    assert off["choices"][0]["message"]["role"] == "user"
    assert off["choices"][0]["message"]["content"].startswith(QUESTION[0]["content"])


@pytest.mark.parametrize(
    "path, body, param, words",
    [
        (
            "/v1/chat/completions",
            {"messages": QUESTION, "logprobs": True, "top_logprobs": -1},
            "top_logprobs",
            "whole vocabulary",
        ),
        ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs", "whole vocabulary"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs", "whole vocabulary"),
        ("/v1/completions", {"prompt": "x", "use_beam_search": True}, "use_beam_search", "beam search"),
        ("/v1/chat/completions", {"messages": QUESTION, "use_beam_search": True}, "use_beam_search", "beam search"),
        ("/v1/completions", {"prompt": "x", "length_penalty": 0.5}, "length_penalty", "beam search"),
        ("/v1/completions", {"prompt": "x", "prompt_embeds": "AAAA"}, "prompt_embeds", "embeddings"),
    ],
)
def test_what_conveyor_does_not_do_is_refused_by_name(
    server: ServerProcess, path: str, body: dict[str, Any], param: str, words: str
) -> None:
    response = _post(server, path, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_x_request_id_is_echoed_or_made(server: ServerProcess) -> None:
    body = {"prompt": "Hi", "max_tokens": 2}
    given = _post(server, "/v1/completions", body, headers={"X-Request-Id": "my-trace-1"})
    assert given.headers["x-request-id"] == "my-trace-1" and given.json()["id"] == "cmpl-my-trace-1"
    made = _post(server, "/v1/completions", body)
    assert made.json()["id"] == "cmpl-" + made.headers["x-request-id"]
    assert _post(server, "/v1/completions", body).headers["x-request-id"] != made.headers["x-request-id"]
    with server.http.stream(
        "POST",
        server.url + "/v1/chat/completions",
        json={"messages": QUESTION, "max_tokens": 2, "stream": True},
        headers={"X-Request-Id": "stream-7"},
        timeout=300,
    ) as response:
        assert response.headers["x-request-id"] == "stream-7"
        assert '"id": "chatcmpl-stream-7"' in response.read().decode()
    refused = _post(server, "/v1/completions", {"prompt": "x", "n": 0}, headers={"X-Request-Id": "bad-1"})
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "bad-1"
    results: list[int] = []  # the same id twice at once: both served (the engine's own ids stay unique)
    threads = [
        threading.Thread(
            target=lambda: results.append(
                _post(
                    server,
                    "/v1/completions",
                    {"prompt": "Hi", "max_tokens": 4, "ignore_eos": True},
                    headers={"X-Request-Id": "same"},
                ).status_code
            )
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200, 200]
    too_long = _post(server, "/v1/completions", body, headers={"X-Request-Id": "x" * 300})
    assert too_long.status_code == 400 and "X-Request-Id" in too_long.json()["error"]["message"]


def test_tokenize_detokenize_tokenizer_info(server: ServerProcess, default_llm: Any) -> None:
    tokenizer = default_llm.get_tokenizer()
    text = "Tokenize me, café 😀"
    got = _post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert got["tokens"] == tokenizer(text)["input_ids"] and got["count"] == len(got["tokens"])
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(got["tokens"]) and got["max_model_len"] == 2048
    assert _post(server, "/detokenize", {"tokens": got["tokens"]}).json() == {"prompt": tokenizer.decode(got["tokens"])}
    chat = _post(server, "/tokenize", {"messages": QUESTION}).json()
    reply = _post(server, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 1}).json()
    assert chat["count"] == reply["usage"]["prompt_tokens"]
    assert chat["tokens"] == tokenizer(default_llm.apply_chat_template(QUESTION), add_special_tokens=False)["input_ids"]
    bad = _post(server, "/detokenize", {"tokens": [1, 10**9]})
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]
    assert _post(server, "/tokenize", {"prompt": "x", "model": "other"}).status_code == 404
    for body in ({}, {"prompt": "x", "messages": QUESTION}):
        unclear = _post(server, "/tokenize", body)
        assert unclear.status_code == 400 and "either `prompt`" in unclear.json()["error"]["message"]
    assert (
        _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
        == tokenizer(text, add_special_tokens=False)["input_ids"]
    )
    info = server.http.get(server.url + "/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == tokenizer.eos_token and info["model_max_length"] == 2048
    assert info["vocab_size"] >= len(tokenizer) - len(info["added_tokens_decoder"])
    assert info["chat_template"] == tokenizer.chat_template


# ---- offline: vLLM's logprobs shape ------------------------------------------------------------------------------


def test_offline_logprobs_in_vllm_shape(default_llm: Any) -> None:
    tokenizer = default_llm.get_tokenizer()
    out = default_llm.generate(
        ["The sea is"],
        SamplingParams(max_tokens=6, temperature=0.8, seed=5, logprobs=2, prompt_logprobs=1),
        use_tqdm=False,
    )[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids)
    total = 0.0
    for token_id, position in zip(completion.token_ids, completion.logprobs):
        assert token_id in position and next(iter(position)) == token_id and 2 <= len(position) <= 3
        chosen = position[token_id]
        assert isinstance(chosen, Logprob) and chosen.logprob == position.logprob and chosen.rank == position.rank
        assert chosen.decoded_token == tokenizer.decode([token_id])
        best_id, best = position.top[0]
        assert position[best_id].rank == 1 and position[best_id].logprob == best >= chosen.logprob
        assert dict(position.items())[best_id] == position[best_id]
        total += position[token_id].logprob
    assert completion.cumulative_logprob == pytest.approx(total)
    assert out.prompt_logprobs[0] is None
    for token_id, position in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert position[token_id].logprob == position.logprob and 1 <= len(position) <= 2
    zero = default_llm.generate(
        ["The sea is"], SamplingParams(max_tokens=3, temperature=0.0, logprobs=0), use_tqdm=False
    )[0].outputs[0]
    assert [list(p) for p in zero.logprobs] == [[t] for t in zero.token_ids]
    assert all(p[t].rank == 1 for p, t in zip(zero.logprobs, zero.token_ids))  # greedy picks the most likely


def test_metrics_under_vllm_names(server: ServerProcess) -> None:
    _post(server, "/v1/completions", {"prompt": "Count: 1, 2,", "max_tokens": 3})
    lines = server.http.get(server.url + "/metrics", timeout=30).text.splitlines()
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if not line.startswith("#")}
    label = f'{{model_name="{MODEL}"}}'
    for name in ("prompt_tokens_total", "time_to_first_token_seconds_count", "e2e_request_latency_seconds_sum"):
        assert values["conveyor_" + name] > 0
        assert values[f"vllm:{name}{label}"] == values["conveyor_" + name]
