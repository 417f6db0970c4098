"""Tool calls through a running coordinator's /v1 API with the official `openai` client.

Run by tests/tests/it/openai.rs (`openai_tool_calls`), never by hand in CI:
the environment names the base URL, a key with the submit scope and the
model. Every check asserts with a message; the last line printed is a JSON
summary (job ids) the Rust test cross-checks against gRPC (also written to
the file MLXNET_TOOL_SUMMARY names, when set).
"""

import concurrent.futures
import json
import os
import sys

import jsonschema
import openai
from openai import OpenAI

BASE = os.environ["MLXNET_BASE_URL"]
KEY = os.environ["MLXNET_API_KEY"]
MODEL = os.environ["MLXNET_MODEL"]

client = OpenAI(base_url=BASE, api_key=KEY, max_retries=0, timeout=120)
summary = {}


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "minLength": 1, "maxLength": 30}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.", "parameters": WEATHER, "strict": True}},
    {"type": "function", "function": {"name": "get_time", "description": "The current time in a time zone.", "parameters": TIME, "strict": True}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def the_call(r, what):
    """The one call of an answer, its arguments validated against its tool's schema."""
    c0 = r.choices[0]
    check(c0.finish_reason == "tool_calls", f"{what}: finish {c0.finish_reason} {c0.message}")
    m = c0.message
    check(m.content is None and m.tool_calls and len(m.tool_calls) == 1, f"{what}: message {m}")
    call = m.tool_calls[0]
    check(call.type == "function" and call.id, f"{what}: call {call}")
    check(call.function.name in SCHEMAS, f"{what}: name {call.function.name}")
    try:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    except Exception as e:  # noqa: BLE001 - any failure is the check's
        check(False, f"{what}: arguments {call.function.arguments!r} do not validate: {e}")
    return call


# Required: greedy, and 4 seeded runs at temperature 1 (sent together).
def required(seed, temperature):
    return client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
        max_tokens=60, temperature=temperature, seed=seed,
    )


greedy = required(7, 0)
call = the_call(greedy, "required")
summary["required_id"] = greedy.id
summary["required_call"] = [call.function.name, call.function.arguments]
with concurrent.futures.ThreadPoolExecutor(8) as pool:
    seeded = [the_call(r, f"required seed {i}") for i, r in enumerate(pool.map(lambda s: required(s, 1.0), range(4)))]
summary["required_seeds"] = [[c.function.name, c.function.arguments] for c in seeded]

# Named: that tool, whatever the question.
named = client.chat.completions.create(
    model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0, seed=7,
    tool_choice={"type": "function", "function": {"name": "get_time"}},
)
ncall = the_call(named, "named")
check(ncall.function.name == "get_time", f"named: {ncall}")
summary["named_call"] = ncall.function.arguments

# Streamed and reassembled by the client: the same call as not streamed.
with client.chat.completions.stream(
    model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0, seed=7,
) as s:
    kinds = [e.type for e in s]
    final = s.get_final_completion()
scall = the_call(final, "streamed")
check(
    [scall.function.name, scall.function.arguments] == summary["required_call"],
    f"streamed {scall} vs {summary['required_call']}",
)
check(scall.id == call.id.replace(greedy.id, final.id), f"ids {scall.id} {call.id}")
check("tool_calls.function.arguments.delta" in kinds, f"argument deltas: {kinds}")
# The raw chunks: deltas of tool_calls at index 0, the id on the first.
chunks = list(client.chat.completions.create(
    model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0, seed=7,
    stream=True,
))
deltas = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
check(deltas and all(d.index == 0 for d in deltas), f"deltas {deltas}")
check(deltas[0].id and deltas[0].type == "function" and deltas[0].function.name == call.function.name, f"first delta {deltas[0]}")
check(all(d.id is None for d in deltas[1:]), f"one id: {deltas}")
check("".join(d.function.arguments or "" for d in deltas) == call.function.arguments, f"arguments {deltas}")
check([ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason] == ["tool_calls"], "finish")

# The agent loop: the call and its result go back; with tool_choice none the
# model answers in text.
loop = client.chat.completions.create(
    model=MODEL, tools=TOOLS, tool_choice="none", max_tokens=16, temperature=0, seed=7,
    messages=ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "sunny", "celsius": 21})},
    ],
)
l0 = loop.choices[0]
check(l0.finish_reason in ("stop", "length") and l0.message.content and not l0.message.tool_calls, f"loop {l0}")
summary["loop_id"] = loop.id
summary["loop_text"] = l0.message.content


# Auto (tool_choice absent: OpenAI's default with tools): the model's choice
# of text or a call; a call must be whole and valid, text is plain text.
# Greedy, streamed (the same answer), and 3 seeds at temperature 1 (short:
# a text answer runs to max_tokens).
def answer(r, what):
    c0 = r.choices[0]
    if c0.finish_reason == "tool_calls":
        c = the_call(r, what)
        return ["call", c.function.name, c.function.arguments]
    m = c0.message
    check(c0.finish_reason in ("stop", "length") and m.content and not m.tool_calls, f"{what}: {c0}")
    check(not m.content.startswith("{"), f"{what}: a text answer starting with {{: {m.content!r}")
    return ["text", m.content]


def auto(seed, temperature):
    return client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=24, temperature=temperature, seed=seed,
    )


summary["auto"] = answer(auto(7, 0), "auto")
# Streamed (raw chunks: the client's stream helper refuses a "length" finish
# when tools are given): the same text, or the same call.
achunks = [ch for ch in client.chat.completions.create(
    model=MODEL, messages=ASK, tools=TOOLS, max_tokens=24, temperature=0, seed=7, stream=True,
) if ch.choices]
afinish = [ch.choices[0].finish_reason for ch in achunks if ch.choices[0].finish_reason]
acalls = [tc for ch in achunks for tc in (ch.choices[0].delta.tool_calls or [])]
if afinish == ["tool_calls"]:
    sauto = ["call", acalls[0].function.name, "".join(c.function.arguments or "" for c in acalls)]
else:
    check(not acalls, f"auto streamed: calls with finish {afinish}")
    sauto = ["text", "".join(ch.choices[0].delta.content or "" for ch in achunks)]
check(sauto == summary["auto"], f"auto streamed {sauto} vs {summary['auto']}")
with concurrent.futures.ThreadPoolExecutor(3) as pool:
    summary["auto_seeds"] = [answer(r, f"auto seed {i}") for i, r in enumerate(pool.map(lambda s: auto(s, 1.0), range(3)))]


# Refused: OpenAI's error shape naming the parameter.
def refused(param, **kw):
    args = dict(model=MODEL, messages=ASK, max_tokens=8)
    args.update(kw)
    try:
        client.chat.completions.create(**args)
    except openai.BadRequestError as e:
        err = e.body.get("error", e.body) if isinstance(e.body, dict) else {}
        check(e.status_code == 400 and err.get("param") == param, f"{param}: {e.status_code} {e.body}")
        return
    check(False, f"{param}: a 400 expected for {kw}")


refused("tool_choice", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
refused("tools", tools=[{"type": "function", "function": {"name": "bad name"}}], tool_choice="required")
refused("tools", tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}}}], tool_choice="required")
refused("messages", messages=ASK + [{"role": "tool", "tool_call_id": "call_nobody", "content": "1"}])

print(json.dumps(summary))
if os.environ.get("MLXNET_TOOL_SUMMARY"):  # to read what the model did
    with open(os.environ["MLXNET_TOOL_SUMMARY"], "w") as f:
        json.dump(summary, f, indent=1)
