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

# Logprobs (chat): asking for them changes no token; one entry per token,
# each <= 0 with its 5 alternatives; at temperature 0 the chosen token is the
# most probable one; the bytes add up to the text.
lp = client.chat.completions.create(
    model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, seed=7,
    logprobs=True, top_logprobs=5,
)
lc = lp.choices[0]
check(lc.message.content == c0.message.content, f"logprobs changed the text: {lc.message.content!r}")
content = lc.logprobs.content
n = lp.usage.completion_tokens
check(len(content) in (n, n + 1), f"{len(content)} logprob entries for {n} tokens")
for e in content:
    check(e.logprob <= 0, f"logprob {e}")
    check(len(e.top_logprobs) == 5, f"5 alternatives: {e}")
    check(all(t.logprob <= 0 for t in e.top_logprobs), f"alternatives <= 0: {e}")
    top = e.top_logprobs[0]
    check(e.token in [t.token for t in e.top_logprobs], f"chosen among the top 5: {e}")
    check(top.token == e.token and top.logprob == e.logprob, f"greedy picks the argmax: {e}")
    check(
        all(a.logprob >= b.logprob for a, b in zip(e.top_logprobs, e.top_logprobs[1:])),
        f"most probable first: {e}",
    )
if lc.finish_reason == "length":
    joined = b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace")
    check(joined == lc.message.content, f"bytes {joined!r} vs {lc.message.content!r}")
summary["logprobs_id"] = lp.id

# Logprobs streamed: the same entries, chunk by chunk.
lchunks = list(
    client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, seed=7,
        logprobs=True, top_logprobs=5, stream=True,
    )
)
streamed_lp = [e for ch in lchunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
check(
    [(e.token, e.logprob) for e in streamed_lp] == [(e.token, e.logprob) for e in content],
    f"streamed logprobs {streamed_lp} vs {content}",
)
check(
    "".join(ch.choices[0].delta.content or "" for ch in lchunks if ch.choices) == lc.message.content,
    "streamed text with logprobs",
)

# Sampled (temperature 1): still log-probabilities of the model's distribution.
hot = client.chat.completions.create(
    model=MODEL, messages=QUESTION, max_tokens=8, temperature=1.0, seed=3,
    logprobs=True, top_logprobs=3,
)
for e in hot.choices[0].logprobs.content:
    check(e.logprob <= e.top_logprobs[0].logprob <= 0, f"sampled logprob {e}")

# Logprobs (completions): tokens, token_logprobs, top_logprobs, text_offset.
tl = client.completions.create(
    model=MODEL, prompt="The sky is", max_tokens=6, temperature=0, logprobs=3
)
l = tl.choices[0].logprobs
check(len(l.tokens) == len(l.token_logprobs) == len(l.top_logprobs) == len(l.text_offset), f"lengths {l}")
check(len(l.tokens) >= tl.usage.completion_tokens, f"one entry per token {l}")
check(all(x <= 0 for x in l.token_logprobs), f"token_logprobs {l.token_logprobs}")
check(l.text_offset == sorted(l.text_offset) and l.text_offset[0] == 0, f"text_offset {l.text_offset}")
for tok, x, top in zip(l.tokens, l.token_logprobs, l.top_logprobs):
    check(1 <= len(top) <= 3 and all(v <= 0 for v in top.values()), f"top {top}")
    check(tok in top and top[tok] == x == max(top.values()), f"greedy argmax {tok!r} {x} {top}")
tparts = list(
    client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=6, temperature=0, logprobs=3, stream=True
    )
)
st = [t for p in tparts if p.choices[0].logprobs for t in p.choices[0].logprobs.token_logprobs]
check(st == l.token_logprobs, f"streamed token_logprobs {st} vs {l.token_logprobs}")

# logit_bias: -100 on the greedy first token (its id from the test, which ran
# the same request through gRPC) bans it: the output changes, and its first
# token is another one.
first = int(os.environ["MLXNET_GREEDY_FIRST_TOKEN"])
biased = client.chat.completions.create(
    model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, seed=7,
    logit_bias={str(first): -100}, logprobs=True, top_logprobs=1,
)
bc = biased.choices[0]
check(bc.message.content != c0.message.content, f"logit_bias on {first} left {bc.message.content!r}")
check(bc.logprobs.content[0].token != content[0].token, f"first token still {content[0].token!r}")
# A bias of 0 changes nothing.
zero = client.chat.completions.create(
    model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, seed=7,
    logit_bias={str(first): 0}, presence_penalty=0, frequency_penalty=0,
)
check(zero.choices[0].message.content == c0.message.content, f"bias 0 changed {zero.choices[0].message.content!r}")
summary["bias_id"] = biased.id

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

# Frequency and presence penalties (over generated tokens): a counting
# continuation repeats its commas, so penalising repeats changes it.
pen = client.completions.create(
    model=MODEL, prompt="One, two, three, four, five,", max_tokens=12, temperature=0,
    frequency_penalty=2.0, presence_penalty=2.0,
)
check(pen.choices[0].text != text, f"penalties left {text!r}")

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
e = refused(openai.BadRequestError, 400, chat_with(frequency_penalty=2.5))
check(e["param"] == "frequency_penalty", f"param {e}")
e = refused(openai.BadRequestError, 400, chat_with(logit_bias={"1": 101}))
check(e["param"] == "logit_bias", f"param {e}")
e = refused(openai.BadRequestError, 400, chat_with(logit_bias={"49152": 1}))
check("vocabulary" in e["message"], f"vocabulary {e}")
e = refused(openai.BadRequestError, 400, chat_with(logprobs=True, top_logprobs=21))
check(e["param"] == "top_logprobs", f"param {e}")
e = refused(openai.BadRequestError, 400, chat_with(logprobs=True, top_logprobs=-1))
check(e["param"] == "top_logprobs", f"param {e}")
e = refused(openai.BadRequestError, 400, lambda: client.completions.create(model=MODEL, prompt="a", logprobs=21))
check(e["param"] == "logprobs", f"param {e}")
e = refused(openai.BadRequestError, 400, chat_with(max_tokens=100000))
refused(openai.BadRequestError, 400, lambda: client.completions.create(model=MODEL, prompt="a", suffix="b"))

# Structured output: a json_schema enforced by the node's token mask. 50
# seeded runs at temperature 1 (sent 8 at a time: the node batches them);
# every answer parses and validates against its schema.
import concurrent.futures

import jsonschema

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "member"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}}
ASK = [{"role": "user", "content": "Describe a person as JSON with name, age and member."}]


def structured(seed):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=40, temperature=1.0, seed=seed, response_format=FORMAT
    )
    text = r.choices[0].message.content
    try:
        jsonschema.validate(json.loads(text), PERSON)
    except Exception as e:  # noqa: BLE001 - any failure is the check's
        check(False, f"seed {seed}: {text!r} does not validate: {e}")
    check(r.choices[0].finish_reason == "stop", f"seed {seed}: finish {r.choices[0].finish_reason} {text!r}")
    return r.id, text


with concurrent.futures.ThreadPoolExecutor(8) as pool:
    runs = list(pool.map(structured, range(50)))
check(len(set(t for _, t in runs)) > 1, f"50 seeds, one answer: {runs[0]}")
# The same seed streamed: the same text, in chunks.
again = "".join(
    c.choices[0].delta.content or ""
    for c in client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=40, temperature=1.0, seed=0, response_format=FORMAT, stream=True
    )
    if c.choices
)
check(again == runs[0][1], f"streamed {again!r} != {runs[0][1]!r}")
summary["schema_id"] = runs[0][0]
summary["schema_text"] = runs[0][1]
obj = client.chat.completions.create(
    model=MODEL, messages=ASK, max_tokens=40, temperature=0, seed=7, response_format={"type": "json_object"}
)
# (any object is allowed: greedy SmolLM2 may nest objects until max_tokens,
# so only a complete answer must parse)
o0 = obj.choices[0]
check(o0.message.content.startswith("{"), f"json_object: {o0}")
check(o0.finish_reason == "length" or isinstance(json.loads(o0.message.content), dict), f"json_object: {o0}")
for bad in (
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "https://example.com/s.json"}}},
    {"type": "json_schema", "json_schema": {"name": "x"}},
    {"type": "yaml"},
):
    e = refused(openai.BadRequestError, 400, chat_with(response_format=bad))
    check(e["param"] == "response_format", f"param {e}")

print(json.dumps(summary))
