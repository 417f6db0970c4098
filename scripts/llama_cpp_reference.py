#!/usr/bin/env python3
"""Records llama.cpp's token ids for the engine's reference tests.

Runs a test model through llama.cpp via the PyPI package llama-cpp-python:
- `smollm2` (default): SmolLM2-135M-Instruct Q4_1 GGUF, written to
  node/src/engine/testdata/llama_cpp_reference.json;
- `gemma3`: Gemma 3 270M (base) Q4_K_M GGUF, written to
  node/src/engine/testdata/llama_cpp_reference_gemma3.json: the two text
  prompts plus one of over 600 tokens (past Gemma's 512-position sliding
  window, so the windowed layers are exercised), no chat prompt (a base
  model has no chat template).

Each file holds:

- "greedy": for three fixed prompts, the prompt's token ids and the ids of the
  greedy continuation (argmax of llama.cpp's logits, up to N_PREDICT tokens,
  stopping at an end-of-generation token, which is not recorded). The third
  prompt is the model's chat template rendered (jinja2, as Hugging Face does)
  for a short system prompt and the question "What is the capital of France?".
  With each step's "top2_margins": llama.cpp's best minus second-best logit,
  so a test can tell a near tie (where llama.cpp's own variants, e.g. flash
  attention or token-by-token prefill, pick differently) from a real mismatch.
- "tokenize": llama.cpp's ids for tricky strings (digits, spaces, tabs,
  newlines, special tokens, non-ASCII), tokenized without BOS and with
  special tokens recognised.

- `qwen3moe DIR`: the random-weight Qwen3-MoE files the engine's test
  `engine::moe::reference_tests` writes (written into DIR first with
  `MLXNET_MOE_REFERENCE_DIR=DIR cargo nextest run -p mlx-node --run-ignored
  only -E 'test(write_the_reference_files)'`), written to
  node/src/engine/testdata/llama_cpp_reference_qwen3moe.json: per file, its
  SHA-256 and, for three prompts given as token ids (the files' vocabulary
  is tiny and random), N_PREDICT greedy steps, each with llama.cpp's token,
  its top-2 margin and its TOP_LOGITS best (id, logit) pairs. End tokens do
  not stop a run: the test teacher-forces these tokens.

Usage: pip install llama-cpp-python jinja2; scripts/fetch-test-model.sh;
       python3 scripts/llama_cpp_reference.py [smollm2|gemma3|qwen3moe DIR]
On CPUs with AMX, the default llama-cpp-python build can die with SIGILL in
ggml's AMX code; the model is loaded with use_extra_bufts=False when the
installed version accepts it, or build it with
CMAKE_ARGS="-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' -DCMAKE_CXX_FLAGS='...same...'".
"""

import hashlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTDATA = os.path.join(ROOT, "node", "src", "engine", "testdata")
MODELS = {
    "smollm2": ("SmolLM2-135M-Instruct.Q4_1.gguf", "llama_cpp_reference.json"),
    "gemma3": ("gemma-3-270m-q4_k_m.gguf", "llama_cpp_reference_gemma3.json"),
}
MOE_OUT = os.path.join(TESTDATA, "llama_cpp_reference_qwen3moe.json")
# The files engine::moe::reference_tests writes, in its order.
MOE_FILES = ["routed-F16", "routed-Q8_0", "routed-Q4_K", "every-F16", "every-Q8_0"]
MOE_PROMPTS = [
    [40, 71, 12, 99, 3, 250, 17, 17, 180, 64, 5, 200],
    [1, 100, 150],
    [(7 * i + 3) % 261 + 3 for i in range(40)],
]
TOP_LOGITS = 16
WHICH = sys.argv[1] if len(sys.argv) > 1 else "smollm2"
if WHICH not in MODELS and WHICH != "qwen3moe":
    sys.exit(f"usage: {sys.argv[0]} [{'|'.join(MODELS)}|qwen3moe DIR]")
if WHICH == "qwen3moe":
    MODEL, OUT = None, MOE_OUT
else:
    MODEL = os.path.join(ROOT, "models", MODELS[WHICH][0])
    OUT = os.path.join(TESTDATA, MODELS[WHICH][1])
N_PREDICT = 32

TEXT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]
# SmolLM2-135M answers this with "Paris" under a short system prompt; with the
# template's default system prompt it rambles about L'Étoile (llama.cpp too).
CHAT_SYSTEM = "You are a helpful assistant."
CHAT_QUESTION = "What is the capital of France?"

# Past Gemma 3's sliding window of 512 positions: the bench prompt five times,
# then a question about it.
with open(os.path.join(ROOT, "node", "benches", "prompt-128.txt"), encoding="utf-8") as _f:
    LONG_PROMPT = (_f.read().strip() + "\n\n") * 5 + "In one sentence, the passage above says that"

TRICKY = [
    "12345",
    "Pi is 3.14159, e is 2.71828 and 1000000 is a million.",
    "  two leading spaces",
    "    four leading spaces and trailing   ",
    "\ttab\tseparated\tvalues",
    "line one\nline two\n\nline four\r\n",
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "café, naïve, résumé, Ærøskøbing",
    "日本語のテキストです。",
    "emoji: 🎉👍🏽 🇫🇷",
    "don't DON'T we'll I'd",
    "mixedCASE_snake_case and kebab-case!?",
    " ",
    "",
]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load(model=None, n_ctx=1024):
    from llama_cpp import Llama

    kwargs = dict(model_path=model or MODEL, n_ctx=n_ctx, n_batch=1024, n_threads=2, seed=0, verbose=False, logits_all=True)
    try:
        return Llama(use_extra_bufts=False, **kwargs)
    except TypeError:
        return Llama(**kwargs)


def greedy(llm, tokens, eog):
    """The greedy continuation and, at each step, llama.cpp's margin between
    its best and second-best logit (a small margin is a near tie)."""
    llm.reset()
    llm.eval(tokens)
    out, margins = [], []
    for _ in range(N_PREDICT):
        logits = list(llm.scores[llm.n_tokens - 1])
        order = sorted(range(len(logits)), key=lambda i: -logits[i])
        tok = int(order[0])
        if tok in eog:
            break
        out.append(tok)
        margins.append(round(float(logits[order[0]] - logits[order[1]]), 4))
        llm.eval([tok])
    return out, margins


def moe_run(llm, tokens):
    """N_PREDICT greedy steps from `tokens`, end tokens included: at each,
    the token, the top-2 margin and the TOP_LOGITS best (id, logit)."""
    llm.reset()
    llm.eval(tokens)
    out, margins, tops = [], [], []
    for _ in range(N_PREDICT):
        logits = [float(x) for x in llm.scores[llm.n_tokens - 1]]
        order = sorted(range(len(logits)), key=lambda i: -logits[i])
        out.append(int(order[0]))
        margins.append(round(logits[order[0]] - logits[order[1]], 5))
        tops.append([[int(i), round(logits[i], 5)] for i in order[:TOP_LOGITS]])
        llm.eval([order[0]])
    return out, margins, tops


def moe_main():
    if len(sys.argv) < 3:
        sys.exit(f"usage: {sys.argv[0]} qwen3moe DIR (the files written by the engine's test)")
    import llama_cpp

    files = []
    for name in MOE_FILES:
        path = os.path.join(sys.argv[2], f"qwen3moe-{name}.gguf")
        if not os.path.exists(path):
            sys.exit(f"{path} is missing: write the files first (see this script's header)")
        llm = load(path, n_ctx=128)
        runs = []
        for prompt in MOE_PROMPTS:
            output, margins, tops = moe_run(llm, prompt)
            runs.append({"prompt_tokens": prompt, "output_tokens": output, "top2_margins": margins, "top_logits": tops})
        files.append({"name": name, "sha256": sha256(path), "greedy": runs})
        print(name, "smallest margin", min(m for r in runs for m in r["top2_margins"]))
        del llm
    out = {"llama_cpp_python": llama_cpp.__version__, "n_predict": N_PREDICT, "top_logits": TOP_LOGITS, "files": files}
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print("wrote", OUT)


def main():
    if WHICH == "qwen3moe":
        return moe_main()
    if not os.path.exists(MODEL):
        sys.exit(f"{MODEL} is missing: run scripts/fetch-test-model.sh")
    import jinja2
    import llama_cpp

    llm = load()
    meta = llm.metadata
    prompts = list(TEXT_PROMPTS)
    if WHICH == "gemma3":
        prompts.append(LONG_PROMPT)
    else:
        template = jinja2.Environment(loader=jinja2.BaseLoader()).from_string(meta["tokenizer.chat_template"])
        prompts.append(
            template.render(
                messages=[{"role": "system", "content": CHAT_SYSTEM}, {"role": "user", "content": CHAT_QUESTION}],
                add_generation_prompt=True,
                bos_token="",
                eos_token="",
            )
        )
    eog = {llm.token_eos()}
    for i in range(llm.n_vocab()):
        if llama_cpp.llama_vocab_is_eog(llama_cpp.llama_model_get_vocab(llm.model), i):
            eog.add(i)

    greedy_runs = []
    for prompt in prompts:
        toks = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
        output, margins = greedy(llm, toks, eog)
        greedy_runs.append(
            {
                "prompt": prompt,
                "prompt_tokens": toks,
                "output_tokens": output,
                "top2_margins": margins,
            }
        )
    tokenize = [
        {"text": t, "ids": llm.tokenize(t.encode("utf-8"), add_bos=False, special=True)} for t in TRICKY
    ]
    out = {
        "model": os.path.basename(MODEL),
        "model_sha256": sha256(MODEL),
        "llama_cpp_python": llama_cpp.__version__,
        "n_predict": N_PREDICT,
        "chat_system": CHAT_SYSTEM,
        "chat_question": CHAT_QUESTION,
        "eog_ids": sorted(eog),
        "greedy": greedy_runs,
        "tokenize": tokenize,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    for g in greedy_runs:
        print(repr(g["prompt"][:40]), "->", llm.detokenize(g["output_tokens"]).decode("utf-8", "replace"))
    print("wrote", OUT)


if __name__ == "__main__":
    main()
