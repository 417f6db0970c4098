#!/usr/bin/env python3
"""MLX ring all_sum on loopback: the reference for `cargo bench --bench collectives`.

Usage: bench_mlx_ring.py [--ranks 2] [--port 0]
Starts `ranks` processes of itself (rank given by MLX_RANK, hostfile by
MLX_HOSTFILE, as `mlx.launch --backend ring` would), each timing
`mx.distributed.all_sum` on the CPU: 576 float32 (one SmolLM2 hidden state)
and 16 Mi float32 (64 MiB). Rank 0 prints one JSON line:
{"mlx": "<version>", "latency_576_us": median, "bandwidth_64mib_ms": median}.
Needs `pip install mlx` (on Linux it brings the CPU backend).
"""
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker():
    import mlx.core as mx

    group = mx.distributed.init(strict=True, backend="ring")
    cpu = mx.cpu

    def bench(n, iters, warmup):
        x = mx.ones((n,), dtype=mx.float32)
        mx.eval(x)
        times = []
        for i in range(warmup + iters):
            t = time.perf_counter()
            y = mx.distributed.all_sum(x, group=group, stream=cpu)
            mx.eval(y)
            dt = time.perf_counter() - t
            if i >= warmup:
                times.append(dt)
        assert float(y[0]) == group.size(), "wrong sum"
        return statistics.median(times)

    lat = bench(576, 2000, 200)
    bw = bench(16 << 20, 10, 2)
    if group.rank() == 0:
        print(json.dumps({
            "mlx": mx.__version__,
            "ranks": group.size(),
            "latency_576_us": lat * 1e6,
            "bandwidth_64mib_ms": bw * 1e3,
        }), flush=True)


def main():
    if "MLX_RANK" in os.environ:
        return worker()
    ranks = 2
    if "--ranks" in sys.argv:
        ranks = int(sys.argv[sys.argv.index("--ranks") + 1])
    hosts = [[f"127.0.0.1:{free_port()}"] for _ in range(ranks)]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(hosts, f)
        hostfile = f.name
    procs = []
    for r in range(ranks):
        env = dict(os.environ, MLX_RANK=str(r), MLX_HOSTFILE=hostfile, MLX_WORLD_SIZE=str(ranks))
        procs.append(subprocess.Popen([sys.executable, __file__], env=env))
    codes = [p.wait(timeout=600) for p in procs]
    os.unlink(hostfile)
    sys.exit(max(codes))


if __name__ == "__main__":
    main()
