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


def the_calls(r, what, most=None):
    """The calls of an answer (one or more; at most `most`), each one's
    arguments validated against its tool's schema, ids call_<job>_<i>."""
    c0 = r.choices[0]
    check(c0.finish_reason == "tool_calls", f"{what}: finish {c0.finish_reason} {c0.message}")
    m = c0.message
    check(m.content is None and m.tool_calls, f"{what}: message {m}")
    check(most is None or len(m.tool_calls) <= most, f"{what}: {len(m.tool_calls)} calls, at most {most}")
    for i, call in enumerate(m.tool_calls):
        check(call.type == "function" and call.id == f"call_{r.id}_{i}", f"{what}: call {i} {call}")
        check(call.function.name in SCHEMAS, f"{what}: name {call.function.name}")
        try:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        except Exception as e:  # noqa: BLE001 - any failure is the check's
            check(False, f"{what}: arguments {call.function.arguments!r} do not validate: {e}")
    return m.tool_calls


def the_call(r, what):
    """The one call of an answer that allows one."""
    return the_calls(r, what, most=1)[0]


def pairs(calls):
    return [[c.function.name, c.function.arguments] for c in calls]


def from_deltas(deltas, what):
    """The calls streamed deltas make, as a client reassembles them by
    index: each call's first delta has its id, type and name, the next ones
    none; indices come in order."""
    calls = []
    for d in deltas:
        if d.id is not None:
            check(d.index == len(calls) and d.type == "function" and d.function.name, f"{what}: first delta {d}")
            calls.append([d.id, d.function.name, d.function.arguments or ""])
        else:
            check(calls and d.index == len(calls) - 1 and d.function.name is None, f"{what}: delta {d}")
            calls[-1][2] += d.function.arguments or ""
    return calls


# Required: greedy, and 4 seeded runs at temperature 1 (sent together).
def required(seed, temperature):
    return client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
        max_tokens=60, temperature=temperature, seed=seed,
    )


greedy = required(7, 0)
calls = the_calls(greedy, "required", most=1)
call = calls[0]
summary["required_id"] = greedy.id
summary["required_calls"] = pairs(calls)
with concurrent.futures.ThreadPoolExecutor(8) as pool:
    seeded = [the_calls(r, f"required seed {i}", most=1) for i, r in enumerate(pool.map(lambda s: required(s, 1.0), range(4)))]
summary["required_seeds"] = [pairs(c) for c in seeded]

# parallel_tool_calls false: exactly one call (as absent). True, on a
# question asking for two things: at most 8 calls, each valid, ids
# call_<job>_<i>; how many is the model's choice (recorded, not asserted),
# and a model that repeats calls until max_tokens gets its answer cut into
# text (recorded as "cut").
one = client.chat.completions.create(
    model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
    max_tokens=60, temperature=0, seed=7,
)
summary["single_call"] = pairs([the_call(one, "parallel_tool_calls false")])
BOTH = [{"role": "user", "content": "What is the weather in Paris, and what time is it in Europe/Paris? Call both tools."}]
both = client.chat.completions.create(
    model=MODEL, messages=BOTH, tools=TOOLS, tool_choice="required", parallel_tool_calls=True,
    max_tokens=200, temperature=0, seed=7,
)
if both.choices[0].finish_reason == "length":
    check(both.choices[0].message.content and not both.choices[0].message.tool_calls, f"cut: {both.choices[0]}")
    summary["both_calls"] = "cut"
else:
    summary["both_calls"] = pairs(the_calls(both, "two questions", most=8))

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
scalls = the_calls(final, "streamed")
check(pairs(scalls) == summary["required_calls"], f"streamed {scalls} vs {summary['required_calls']}")
check(scalls[0].id == call.id.replace(greedy.id, final.id), f"ids {scalls[0].id} {call.id}")
check("tool_calls.function.arguments.delta" in kinds, f"argument deltas: {kinds}")
# The raw chunks: each call's deltas under its index, its id on its first.
def raw_calls(messages, what, **kw):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", temperature=0, seed=7,
        stream=True, **kw,
    ))
    deltas = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    got = from_deltas(deltas, what)
    check([ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason] == ["tool_calls"], f"{what}: finish")
    check([c[0] for c in got] == [f"call_{chunks[0].id}_{i}" for i in range(len(got))], f"{what}: ids {got}")
    return [c[1:] for c in got]


check(raw_calls(ASK, "raw chunks", max_tokens=60) == summary["required_calls"], "raw chunks")
if summary["both_calls"] != "cut":
    check(
        raw_calls(BOTH, "raw chunks, two questions", max_tokens=200, parallel_tool_calls=True) == summary["both_calls"],
        "raw chunks, two questions",
    )

# The agent loop: the call and its result go back; with tool_choice none the
# model answers in text.
loop = client.chat.completions.create(
    model=MODEL, tools=TOOLS, tool_choice="none", max_tokens=16, temperature=0, seed=7,
    messages=ASK + [
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump(exclude_none=True) for c in calls]},
    ] + [
        {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"sky": "sunny", "celsius": 21})}
        for c in calls
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
        return ["calls", pairs(the_calls(r, what))]
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
    sauto = ["calls", [c[1:] for c in from_deltas(acalls, "auto streamed")]]
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
