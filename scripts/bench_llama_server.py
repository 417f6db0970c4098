#!/usr/bin/env python3
"""llama.cpp's side of the batching bench (tests/benches/batching.rs).

Starts llama.cpp's server (`llama-server`, built by
scripts/build-llama-server.sh) on a GGUF file with a fixed number of threads
and `--parallel` slots with continuous batching, then for each stream count
runs that many concurrent clients, each sending its jobs one after the other
(streamed chat completions, greedy), and prints one JSON line:

  {"engine": "llama-server", "threads": T, "parallel": P,
   "rounds": [{"streams": S, "jobs": [{"ttft_s": .., "tokens": .., "end_s": ..}, ..],
               "wall_s": ..}, ..]}

Jobs come from --jobs FILE, a JSON list of chat message lists; client `c`
of `S` sends jobs `c, c + S, c + 2S, ...` up to --per-stream jobs each (the
Rust side does the same, so both serve the same prompts). TTFT is wall clock
from sending the request to the first streamed content; tokens are the
server's own `usage.completion_tokens`.

Uses only the standard library (http.client, threads).
"""

import argparse
import http.client
import json
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            r = c.getresponse()
            r.read()
            if r.status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("llama-server did not become healthy")


def one_job(port: int, messages, max_tokens: int):
    """Streams one chat completion; returns (ttft_s, completion_tokens, text)."""
    body = json.dumps(
        {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"status {r.status}: {r.read()[:200]!r}")
    ttft, tokens, text, pieces = None, None, [], 0
    for raw in r:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        for ch in chunk.get("choices") or []:
            piece = (ch.get("delta") or {}).get("content")
            if piece:
                pieces += 1
                text.append(piece)
                if ttft is None:
                    ttft = time.perf_counter() - t0
        usage = chunk.get("usage")
        if usage:
            tokens = usage.get("completion_tokens")
    c.close()
    return ttft if ttft is not None else time.perf_counter() - t0, tokens if tokens is not None else pieces, "".join(text)


def run_round(port: int, jobs, streams: int, per_stream: int, max_tokens: int):
    results = [None] * (streams * per_stream)
    errors = []
    start = time.perf_counter()

    def client(c: int):
        try:
            for k in range(per_stream):
                i = c + k * streams
                ttft, tokens, _ = one_job(port, jobs[i % len(jobs)], max_tokens)
                results[i] = {"ttft_s": ttft, "tokens": tokens, "end_s": time.perf_counter() - start}
        except Exception as e:  # reported in the output, not swallowed
            errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return {"streams": streams, "jobs": [r for r in results if r], "wall_s": wall, "errors": errors}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--server", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--parallel", type=int, default=8)
    p.add_argument("--ctx-per-slot", type=int, default=1024)
    p.add_argument("--streams", default="1,2,4,8,16")
    p.add_argument("--per-stream", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--jobs", required=True)
    args = p.parse_args()
    with open(args.jobs, encoding="utf-8") as f:
        jobs = json.load(f)
    port = free_port()
    cmd = [
        args.server, "-m", args.model, "-t", str(args.threads), "-tb", str(args.threads),
        "--parallel", str(args.parallel), "--cont-batching",
        "-c", str(args.ctx_per_slot * args.parallel),
        "--host", "127.0.0.1", "--port", str(port), "--no-webui",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_healthy(port, proc)
        one_job(port, jobs[0], 8)  # warm-up
        rounds = [
            run_round(port, jobs, int(s), args.per_stream, args.max_tokens)
            for s in args.streams.split(",")
        ]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(json.dumps({
        "engine": "llama-server", "threads": args.threads, "parallel": args.parallel,
        "rounds": rounds,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
