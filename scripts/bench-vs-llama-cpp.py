#!/usr/bin/env python3
"""llama.cpp's side of the engine benchmark (node/benches/engine_vs_llamacpp.rs).

Runs llama.cpp through llama-cpp-python on a GGUF file with a fixed number of
threads: prefill of the prompt in one batch, then greedy decoding of a fixed
number of tokens (EOS ignored, so every run decodes exactly that many), and
prints one JSON line:

  {"engine": "llama.cpp", "version": "...", "threads": T, "prompt_tokens": P,
   "gen_tokens": G, "prefill_tok_s": [...], "decode_tok_s": [...], "extra_bufts": true,
   "prompt_ids": [...], "first_ids": [...], "top2_margins": [...], "eos_at": ...}

with one entry per measured run (after one warm-up run). Timing is wall clock
around llama.cpp's decode calls (`Llama.eval`); greedy picking is an argmax
over the last logits.

If llama-cpp-python is missing, prints {"error": ..., "install": ...} and exits
with status 3. Install it with:
  CMAKE_ARGS="-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' \
    -DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'" pip install llama-cpp-python
(the AMX flags avoid a SIGILL in ggml's AMX code on CPUs that advertise AMX
but do not allow it, as on some VMs). With a default build that dies that way,
pass --no-extra-bufts: the model is then loaded with use_extra_bufts=False.
"""

import argparse
import json
import sys
import time

INSTALL = (
    "CMAKE_ARGS=\"-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' "
    "-DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'\" "
    "pip install llama-cpp-python"
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--prompt-file", required=True)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--no-extra-bufts", action="store_true")
    args = p.parse_args()

    try:
        import numpy as np
        import llama_cpp
        from llama_cpp import Llama
    except ImportError as e:
        print(json.dumps({"error": f"llama-cpp-python is not installed ({e})", "install": INSTALL}))
        return 3

    if args.no_extra_bufts:
        default_params = llama_cpp.llama_model_default_params

        def params_without_extra_bufts():
            params = default_params()
            params.use_extra_bufts = False
            return params

        llama_cpp.llama_model_default_params = params_without_extra_bufts

    with open(args.prompt_file, encoding="utf-8") as f:
        text = f.read().rstrip("\n")

    llm = Llama(
        model_path=args.model,
        n_ctx=512,
        n_batch=512,
        n_ubatch=512,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
    )
    prompt = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    n_vocab = llm.n_vocab()

    def last_logits():
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))

    def top2_margin():
        top2 = np.partition(last_logits(), -2)[-2:]
        return round(float(top2[1] - top2[0]), 4)

    prefill, decode, ids, margins = [], [], [], []
    for run in range(args.runs + 1):
        warm_up = run == 0
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        token = int(np.argmax(last_logits()))
        if warm_up:
            margins.append(top2_margin())
        out = [token]
        t2 = time.perf_counter()
        for _ in range(args.gen_tokens - 1):
            llm.eval([token])
            token = int(np.argmax(last_logits()))
            # Only in the warm-up run, which is not timed.
            if warm_up and len(margins) < 16:
                margins.append(top2_margin())
            out.append(token)
        t3 = time.perf_counter()
        if run == 0:
            ids = out
            continue  # warm-up
        prefill.append(len(prompt) / (t1 - t0))
        # gen_tokens - 1 single-token forward passes produce the tokens after the first.
        decode.append((args.gen_tokens - 1) / (t3 - t2))

    print(
        json.dumps(
            {
                "engine": "llama.cpp",
                "version": getattr(llama_cpp, "__version__", "?"),
                "threads": args.threads,
                "prompt_tokens": len(prompt),
                "gen_tokens": args.gen_tokens,
                "prefill_tok_s": prefill,
                "decode_tok_s": decode,
                "extra_bufts": not args.no_extra_bufts,
                "prompt_ids": prompt,
                "first_ids": ids[:16],
                # llama.cpp's top-2 logit margin at each of those steps (warm-up run).
                "top2_margins": margins[:16],
                # Where greedy decoding would have stopped (EOS), had it not been ignored.
                "eos_at": next((i for i, t in enumerate(ids) if llm.token_eos() == t), None),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
