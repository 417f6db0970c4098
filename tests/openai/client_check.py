"""Drives a running coordinator's /v1 API with the official `openai` client.

Run by tests/tests/it/openai.rs (never by hand in CI): the environment names
the base URL, a key with the submit scope, the model and its file digest.
Every check asserts with a message; the last line printed is a JSON summary
the Rust test cross-checks against gRPC (job ids, texts).
"""

import json
import os
import sys

import openai
from openai import OpenAI

BASE = os.environ["MLXNET_BASE_URL"]
KEY = os.environ["MLXNET_API_KEY"]
MODEL = os.environ["MLXNET_MODEL"]
DIGEST = os.environ["MLXNET_MODEL_SHA256"]

client = OpenAI(base_url=BASE, api_key=KEY, max_retries=0, timeout=120)
summary = {}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)


# Models: the catalogue, with the network's own fields.
models = client.models.list()
ids = [m.id for m in models.data]
check(MODEL in ids, f"{MODEL} in /v1/models {ids}")
one = client.models.retrieve(MODEL)
check(one.id == MODEL and one.object == "model", f"GET /v1/models/{MODEL}: {one}")
check((one.model_extra or {}).get("nodes_serving") == 1, f"nodes_serving: {one}")

# Chat, not streamed: a job named by id and header, fingerprint = file digest.
raw = client.chat.completions.with_raw_response.create(
    model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, seed=7
)
chat = raw.parse()
check(raw.headers.get("x-mlxnet-job-id") == chat.id, f"job header {raw.headers}")
check(chat.object == "chat.completion", f"object {chat.object}")
check(chat.system_fingerprint == DIGEST, f"fingerprint {chat.system_fingerprint}")
c0 = chat.choices[0]
check(c0.message.role == "assistant" and c0.message.content, f"message {c0}")
check(c0.finish_reason in ("stop", "length"), f"finish_reason {c0.finish_reason}")
check(
    chat.usage.completion_tokens > 0
    and chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens,
    f"usage {chat.usage}",
)
summary["chat"] = {"id": chat.id, "text": c0.message.content, "usage": chat.usage.model_dump()}

# Chat, streamed with the usage chunk: the same seed gives the same text.
chunks = list(
    client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=12,
        temperature=0,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
    )
)
check(all(ch.object == "chat.completion.chunk" for ch in chunks), "chunk objects")
check(chunks[0].choices[0].delta.role == "assistant", f"first delta {chunks[0]}")
check(len({ch.id for ch in chunks}) == 1, "one id for every chunk")
usage = chunks[-1]
check(usage.choices == [] and usage.usage is not None, f"usage chunk {usage}")
check(all(ch.usage is None for ch in chunks[:-1]), "usage only on the last chunk")
check(usage.usage.completion_tokens == chat.usage.completion_tokens, "stream usage")
finishes = [ch.choices[0].finish_reason for ch in chunks[:-1] if ch.choices[0].finish_reason]
check(finishes == [c0.finish_reason], f"one finish_reason {finishes}")
streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks[:-1])
check(streamed == c0.message.content, f"streamed {streamed!r} != {c0.message.content!r}")
summary["stream_id"] = chunks[0].id

# Seed reproducibility at temperature 1: the same seed, the same text.
def sampled(seed):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Write one sentence about cats."}],
        max_tokens=16,
        temperature=1.0,
        seed=seed,
    )
    return r.choices[0].message.content


a, b = sampled(1234), sampled(1234)
check(a == b, f"seed 1234 gave {a!r} then {b!r}")

# Stop strings: cut where the stop string would start, finish_reason stop.
full = client.completions.create(
    model=MODEL, prompt="One, two, three, four, five,", max_tokens=12, temperature=0
)
text = full.choices[0].text
words = [w for w in text.split() if len(w) > 2]
check(words, f"a word to stop at in {text!r}")
stop = words[len(words) // 2]
cut = client.completions.create(
    model=MODEL, prompt="One, two, three, four, five,", max_tokens=12, temperature=0, stop=[stop]
)
check(cut.object == "text_completion", f"object {cut.object}")
check(cut.choices[0].text == text[: text.index(stop)], f"stop {stop!r}: {cut.choices[0].text!r} vs {text!r}")
check(cut.choices[0].finish_reason == "stop", f"finish {cut.choices[0].finish_reason}")
check(full.choices[0].finish_reason == "length", f"finish {full.choices[0].finish_reason}")

# Completions: echo, and streamed (with usage).
echo = client.completions.create(
    model=MODEL, prompt="The sky is", max_tokens=4, temperature=0, echo=True
)
check(echo.choices[0].text.startswith("The sky is"), f"echo {echo.choices[0].text!r}")
parts = list(
    client.completions.create(
        model=MODEL,
        prompt="The sky is",
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
)
check(parts[-1].usage.completion_tokens == echo.usage.completion_tokens, "completion usage")
streamed = "".join(p.choices[0].text for p in parts[:-1])
check("The sky is" + streamed == echo.choices[0].text, f"{streamed!r} vs {echo.choices[0].text!r}")

# Errors: the client's exception classes, OpenAI's body shape.
def refused(cls, status, call):
    try:
        call()
    except cls as e:
        check(e.status_code == status, f"{cls.__name__}: status {e.status_code}")
        body = e.body if isinstance(e.body, dict) else {}
        err = body.get("error", body)
        for k in ("message", "type", "param", "code"):
            check(k in err, f"{cls.__name__}: {k} in {e.body}")
        return err
    check(False, f"{cls.__name__} expected")


def chat_with(**kw):
    args = dict(model=MODEL, messages=QUESTION, max_tokens=4)
    args.update(kw)
    return lambda: client.chat.completions.create(**args)


bad_key = OpenAI(base_url=BASE, api_key="mlx_not_a_key", max_retries=0)
refused(openai.AuthenticationError, 401, lambda: bad_key.chat.completions.create(model=MODEL, messages=QUESTION))
refused(openai.NotFoundError, 404, chat_with(model="no-such-model"))
refused(openai.NotFoundError, 404, lambda: client.models.retrieve("no-such-model"))
e = refused(openai.BadRequestError, 400, chat_with(temperature=3))
check(e["param"] == "temperature", f"param {e}")
e = refused(openai.BadRequestError, 400, chat_with(n=2))
check(e["param"] == "n", f"param {e}")
e = refused(openai.BadRequestError, 400, chat_with(messages=[{"role": "wizard", "content": "hi"}]))
check(e["param"] == "messages", f"param {e}")
e = refused(openai.BadRequestError, 400, chat_with(frequency_penalty=1.0))
check(e["code"] == "unsupported_parameter", f"code {e}")
e = refused(openai.BadRequestError, 400, chat_with(max_tokens=100000))
refused(openai.BadRequestError, 400, lambda: client.completions.create(model=MODEL, prompt="a", suffix="b"))

print(json.dumps(summary))
