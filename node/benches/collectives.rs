//! All-reduce on loopback, 2 ranks: mlx-node's TCP collectives against MLX's
//! ring backend and against a raw TCP ping-pong, measured in the same run.
//!
//! `cargo bench -p mlx-node --bench collectives`
//! - latency: all-reduce of 576 f32 (one SmolLM2-135M hidden state), median;
//! - bandwidth: all-reduce of 16 Mi f32 (64 MiB), median;
//! - floor: a TCP_NODELAY ping-pong round trip of the same number of bytes
//!   (send, echo back) between two threads on blocking sockets;
//! - MLX: `scripts/bench_mlx_ring.py` (2 processes, `mx.distributed` ring on
//!   127.0.0.1, CPU), run with `$MLX_PYTHON` or `.venv-mlx/bin/python` or
//!   `python3`, whichever imports mlx. Skipped with the reason when absent.
//!
//! Goals (issue 4): latency <= 0.5x MLX ring; within 1.5x of the ping-pong floor.

#![allow(
    clippy::expect_used,
    reason = "a bench binary: a failed step ends the run"
)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use mlx_node::collectives::tcp::{TcpOptions, TcpTransport};
use mlx_node::collectives::{all_reduce, Collective, Group, GroupOptions};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ours(len: usize, warmup: usize, iters: usize, opts: TcpOptions) -> Duration {
    let listeners: Vec<TcpListener> = (0..2)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind"))
        .collect();
    let addrs: Vec<SocketAddr> = listeners
        .iter()
        .map(|l| l.local_addr().expect("addr"))
        .collect();
    let handles: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(rank, l)| {
            let addrs = addrs.clone();
            std::thread::spawn(move || {
                let t = TcpTransport::connect(rank, l, &addrs, opts).expect("connect");
                let mut g = Group::new(t, GroupOptions::default());
                let mut x = vec![1.0f32; len];
                let mut times = Vec::with_capacity(iters);
                for i in 0..warmup + iters {
                    x.fill(1.0);
                    let start = Instant::now();
                    all_reduce(&mut g, &mut x).expect("all-reduce");
                    if i >= warmup {
                        times.push(start.elapsed());
                    }
                }
                assert_eq!(x[len - 1], 2.0, "wrong sum");
                let _ = g.barrier();
                median(times)
            })
        })
        .collect();
    let times: Vec<Duration> = handles
        .into_iter()
        .map(|h| h.join().expect("rank"))
        .collect();
    times[0]
}

fn ping_pong(bytes: usize, warmup: usize, iters: usize) -> Duration {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let echo = std::thread::spawn(move || {
        let (mut s, _) = l.accept().expect("accept");
        s.set_nodelay(true).expect("nodelay");
        let mut buf = vec![0u8; bytes];
        for _ in 0..warmup + iters {
            s.read_exact(&mut buf).expect("read");
            s.write_all(&buf).expect("write");
        }
    });
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_nodelay(true).expect("nodelay");
    let mut buf = vec![1u8; bytes];
    let mut times = Vec::with_capacity(iters);
    for i in 0..warmup + iters {
        let start = Instant::now();
        s.write_all(&buf).expect("write");
        s.read_exact(&mut buf).expect("read");
        if i >= warmup {
            times.push(start.elapsed());
        }
    }
    echo.join().expect("echo");
    median(times)
}

struct Mlx {
    version: String,
    latency: Duration,
    bandwidth: Duration,
}

fn json_number(line: &str, key: &str) -> Option<f64> {
    let at = line.find(&format!("\"{key}\":"))? + key.len() + 3;
    let rest = line[at..].trim_start();
    let end = rest.find([',', '}'])?;
    rest[..end].trim().parse().ok()
}

fn mlx_ring() -> Result<Mlx, String> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let script = root.join("scripts/bench_mlx_ring.py");
    let candidates: Vec<PathBuf> = std::env::var_os("MLX_PYTHON")
        .map(PathBuf::from)
        .into_iter()
        .chain([root.join(".venv-mlx/bin/python"), PathBuf::from("python3")])
        .collect();
    let python = candidates
        .into_iter()
        .find(|p| {
            Command::new(p)
                .args(["-c", "import mlx.core"])
                .output()
                .map(|o| o.status.success())
                .unwrap_or(false)
        })
        .ok_or("no python with mlx (pip install mlx, or set MLX_PYTHON)")?;
    let out = Command::new(&python)
        .arg(&script)
        .output()
        .map_err(|e| format!("running {}: {e}", script.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().find(|l| l.starts_with('{')).ok_or_else(|| {
        format!(
            "no result from MLX: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    let version = line
        .split("\"mlx\": \"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .unwrap_or("?")
        .to_string();
    let lat = json_number(line, "latency_576_us").ok_or("no latency in MLX output")?;
    let bw = json_number(line, "bandwidth_64mib_ms").ok_or("no bandwidth in MLX output")?;
    Ok(Mlx {
        version,
        latency: Duration::from_secs_f64(lat * 1e-6),
        bandwidth: Duration::from_secs_f64(bw * 1e-3),
    })
}

fn us(d: Duration) -> String {
    format!("{:.1} us", d.as_secs_f64() * 1e6)
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

fn ratio(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64()
}

fn main() {
    const SMALL: usize = 576;
    const BIG: usize = 16 << 20;
    let lat = ours(SMALL, 500, 5000, TcpOptions::default());
    let poll_only = TcpOptions {
        spin: Duration::ZERO,
        ..TcpOptions::default()
    };
    let lat_poll = ours(SMALL, 500, 5000, poll_only);
    let floor_small = ping_pong(SMALL * 4, 500, 5000);
    let bw = ours(BIG, 2, 10, TcpOptions::default());
    let floor_big = ping_pong(BIG * 4, 2, 10);
    let mlx = mlx_ring();

    println!("all-reduce, 2 ranks, loopback (medians)");
    println!(
        "  576 f32:  mlx-node {:>10}   ping-pong {:>10}   ratio to floor {:.2}x (goal <= 1.5x)",
        us(lat),
        us(floor_small),
        ratio(lat, floor_small)
    );
    println!(
        "  576 f32, no spin (poll only): {:>10}   ratio to floor {:.2}x",
        us(lat_poll),
        ratio(lat_poll, floor_small)
    );
    println!(
        "  64 MiB:   mlx-node {:>10}   ping-pong {:>10}   ratio to floor {:.2}x  ({:.2} GB/s algorithm bandwidth)",
        ms(bw),
        ms(floor_big),
        ratio(bw, floor_big),
        (BIG * 4) as f64 / bw.as_secs_f64() / 1e9
    );
    match mlx {
        Ok(m) => {
            println!(
                "  MLX {} ring: 576 f32 {:>10} -> mlx-node/MLX {:.2}x (goal <= 0.5x)",
                m.version,
                us(m.latency),
                ratio(lat, m.latency)
            );
            println!(
                "  MLX {} ring: 64 MiB  {:>10} -> mlx-node/MLX {:.2}x",
                m.version,
                ms(m.bandwidth),
                ratio(bw, m.bandwidth)
            );
        }
        Err(e) => println!("  MLX ring: skipped ({e})"),
    }
}
