//! Collectives over every transport that runs here: TCP on loopback and the
//! emulated RDMA fabric. Values are small integers, so every dtype sums
//! them exactly and results are compared for equality, not closeness.

use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::fabric::MemFabric;
use super::tcp::{TcpOptions, TcpTransport};
use super::verbs::{VerbsOptions, VerbsTransport};
use super::*;

type Boxed = Box<dyn Collective>;

/// A TCP mesh of `n` ranks on loopback (rank order).
pub(crate) fn tcp_mesh(n: usize, opts: TcpOptions) -> Vec<TcpTransport> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let handles: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(rank, l)| {
            let addrs = addrs.clone();
            std::thread::spawn(move || TcpTransport::connect(rank, l, &addrs, opts).unwrap())
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

pub(crate) fn tcp_pod(n: usize, opts: TcpOptions, group: GroupOptions) -> Vec<Boxed> {
    tcp_mesh(n, opts)
        .into_iter()
        .map(|t| Box::new(Group::new(t, group)) as Boxed)
        .collect()
}

fn mem_pod(n: usize, frame: usize, slots: usize, timeout: Duration) -> Vec<Boxed> {
    MemFabric::endpoints(n, frame, slots)
        .into_iter()
        .map(|e| {
            let t = VerbsTransport::new(
                e,
                VerbsOptions {
                    timeout,
                    ..VerbsOptions::default()
                },
            )
            .unwrap();
            Box::new(Group::new(t, GroupOptions::default())) as Boxed
        })
        .collect()
}

/// Runs `f` on every rank in its own thread; returns the results in rank order.
pub(crate) fn run<R: Send + 'static>(
    pod: Vec<Boxed>,
    f: impl Fn(&mut dyn Collective) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    let handles: Vec<_> = pod
        .into_iter()
        .map(|mut c| {
            let f = f.clone();
            std::thread::spawn(move || f(c.as_mut()))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn ints(seed: u64, len: usize) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| rng.gen_range(-8i32..=8) as f32).collect()
}

fn check_all_reduce<E: Element + PartialEq + std::fmt::Debug>(pod: Vec<Boxed>, len: usize) {
    let n = pod.len();
    let out = run(pod, move |c| {
        let mut v: Vec<E> = ints(c.rank() as u64, len)
            .into_iter()
            .map(E::from_f32)
            .collect();
        let rank = c.rank();
        all_reduce(c, &mut v)
            .unwrap_or_else(|e| panic!("rank {rank}, {n} ranks, {len} x {:?}: {e}", E::DTYPE));
        v
    });
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| ints(r as u64, len)).collect();
    let expected: Vec<E> = (0..len)
        .map(|i| E::from_f32(inputs.iter().map(|v| v[i]).sum()))
        .collect();
    for (rank, got) in out.iter().enumerate() {
        if got != &expected {
            let at = got.iter().zip(&expected).position(|(a, b)| a != b);
            panic!(
                "{n} ranks, {len} x {:?}: rank {rank} differs at {at:?}",
                E::DTYPE
            );
        }
    }
}

/// 1 element to 64 MiB of f32, odd sizes, across the mesh/ring boundary.
const SIZES: &[usize] = &[
    1,
    2,
    3,
    7,
    576,
    577,
    16_384,
    16_385,
    16_387,
    100_003,
    1 << 20,
];
const BIG: usize = 16 << 20; // 16 Mi f32 = 64 MiB

#[test]
fn tcp_all_reduce_every_size_and_dtype_2_and_3_ranks() {
    for n in [2, 3] {
        for &len in SIZES {
            check_all_reduce::<f32>(
                tcp_pod(n, TcpOptions::default(), GroupOptions::default()),
                len,
            );
        }
        for &len in &[1, 577, 40_001, 300_001] {
            check_all_reduce::<f16>(
                tcp_pod(n, TcpOptions::default(), GroupOptions::default()),
                len,
            );
            check_all_reduce::<bf16>(
                tcp_pod(n, TcpOptions::default(), GroupOptions::default()),
                len,
            );
        }
    }
}

#[test]
fn tcp_all_reduce_64_mib() {
    for n in [2, 3] {
        check_all_reduce::<f32>(
            tcp_pod(n, TcpOptions::default(), GroupOptions::default()),
            BIG,
        );
    }
}

#[test]
fn emulated_rdma_all_reduce_every_size_and_dtype_2_and_3_ranks() {
    let t = Duration::from_secs(10);
    for n in [2, 3] {
        for &len in SIZES {
            // Small frames on small sizes exercise multi-frame messages.
            check_all_reduce::<f32>(mem_pod(n, 4096, 4, t), len);
        }
        for &len in &[1, 577, 40_001, 300_001] {
            check_all_reduce::<f16>(mem_pod(n, 1024, 2, t), len);
            check_all_reduce::<bf16>(mem_pod(n, 64 << 10, 8, t), len);
        }
        check_all_reduce::<f32>(mem_pod(n, 1 << 20, 8, t), BIG);
    }
}

#[test]
fn mesh_and_ring_give_the_same_sums() {
    // Force the ring for everything and the mesh for everything.
    for mesh_max_bytes in [0, usize::MAX] {
        for &len in &[3, 1000, 70_001] {
            check_all_reduce::<f32>(
                tcp_pod(3, TcpOptions::default(), GroupOptions { mesh_max_bytes }),
                len,
            );
        }
    }
}

fn other_ops(pod: Vec<Boxed>) {
    let n = pod.len();
    let out = run(pod, move |c| {
        let r = c.rank();
        // All-gather of odd-sized pieces.
        let piece: Vec<u8> = (0..13).map(|i| (r * 31 + i) as u8).collect();
        let mut gathered = vec![0u8; 13 * c.size()];
        c.all_gather(&piece, &mut gathered).unwrap();
        // Broadcast from the last rank, 100 kB.
        let mut b: Vec<u8> = if r == n - 1 {
            (0..100_000u32).map(|i| (i % 251) as u8).collect()
        } else {
            vec![0; 100_000]
        };
        c.broadcast(&mut b, n - 1).unwrap();
        // Point to point: 0 -> 1, then 1 -> 0; others skip.
        let mut p2p = vec![0u8; 5];
        if r == 0 {
            c.send(b"hello", 1).unwrap();
            c.recv(&mut p2p, 1).unwrap();
        } else if r == 1 {
            c.recv(&mut p2p, 0).unwrap();
            c.send(b"world", 0).unwrap();
        }
        c.barrier().unwrap();
        // The group still works after send/recv between only two ranks.
        let mut x = [r as f32 + 1.0];
        all_reduce(c, &mut x).unwrap();
        (gathered, b, p2p, x[0])
    });
    let gathered: Vec<u8> = (0..n)
        .flat_map(|r| (0..13).map(move |i| (r * 31 + i) as u8))
        .collect();
    let bcast: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let total = (1..=n).sum::<usize>() as f32;
    for (r, (g, b, p, x)) in out.into_iter().enumerate() {
        assert_eq!(g, gathered, "rank {r} all-gather");
        assert_eq!(b, bcast, "rank {r} broadcast");
        match r {
            0 => assert_eq!(&p, b"world"),
            1 => assert_eq!(&p, b"hello"),
            _ => assert_eq!(p, vec![0; 5]),
        }
        assert_eq!(x, total);
    }
}

#[test]
fn all_gather_broadcast_send_recv_barrier_over_tcp_and_emulated_rdma() {
    for n in [2, 3] {
        other_ops(tcp_pod(n, TcpOptions::default(), GroupOptions::default()));
        other_ops(mem_pod(n, 256, 3, Duration::from_secs(10)));
    }
}

#[test]
fn members_out_of_step_get_a_mismatch_not_a_hang() {
    let out = run(
        tcp_pod(2, TcpOptions::default(), GroupOptions::default()),
        |c| {
            if c.rank() == 0 {
                let mut x = [1.0f32; 4];
                all_reduce(c, &mut x).err()
            } else {
                let mut b = [0u8; 16];
                c.broadcast(&mut b, 1).err()
            }
        },
    );
    assert!(
        out.iter()
            .any(|e| matches!(e, Some(CollectiveError::Mismatch { .. }))),
        "{out:?}"
    );
}

#[test]
fn bad_arguments_are_refused_and_leave_the_group_usable() {
    let out = run(
        tcp_pod(2, TcpOptions::default(), GroupOptions::default()),
        |c| {
            let bad = c.all_reduce_sum(&mut [0u8; 3], DType::F32).unwrap_err();
            let bad_gather = c.all_gather(&[1], &mut [0u8; 3]).unwrap_err();
            let bad_root = c.broadcast(&mut [0u8; 1], 7).unwrap_err();
            let mut x = [2.0f32];
            all_reduce(c, &mut x).unwrap();
            (bad, bad_gather, bad_root, x[0])
        },
    );
    for (a, b, r, x) in out {
        assert!(matches!(a, CollectiveError::InvalidArgument(_)));
        assert!(matches!(b, CollectiveError::InvalidArgument(_)));
        assert!(matches!(r, CollectiveError::InvalidArgument(_)));
        assert_eq!(x, 4.0);
    }
}

/// A lost peer must be noticed from its death, not from the timeout: the
/// transports are given `timeout`, long against how fast a death shows
/// (a closed socket, a dead endpoint); the others must fail with
/// `PeerLost`, not `Timeout`, and well inside that timeout counted from the
/// death itself. The bound is a wide margin against the configured value,
/// not a speed: a loaded machine takes milliseconds, not seconds.
fn assert_lost_not_timed_out(
    rank: usize,
    err: &CollectiveError,
    after_death: Duration,
    timeout: Duration,
) {
    assert!(
        matches!(err, CollectiveError::PeerLost { .. }),
        "rank {rank}: expected a lost peer, got {err}"
    );
    assert!(
        after_death < timeout / 2,
        "rank {rank} failed {after_death:?} after the death, against a timeout of {timeout:?}"
    );
}

/// Ranks 0 and 2 start an all-reduce; rank 1 dies (its transport is
/// dropped: connections close, as when its process is killed). The others
/// fail from noticing the death, and stay failed.
fn dead_peer_fails_fast(pod: Vec<Boxed>, len: usize, timeout: Duration) {
    let (died_tx, died_rx) = std::sync::mpsc::channel();
    let handles: Vec<_> = pod
        .into_iter()
        .map(|mut c| {
            let died_tx = died_tx.clone();
            std::thread::spawn(move || {
                if c.rank() == 1 {
                    drop(c);
                    died_tx.send(Instant::now()).unwrap();
                    return None;
                }
                let mut v = vec![1.0f32; len];
                let start = Instant::now();
                let err = all_reduce(c.as_mut(), &mut v).unwrap_err();
                let at = Instant::now();
                let again = all_reduce(c.as_mut(), &mut v).unwrap_err();
                Some((err, start, at, again))
            })
        })
        .collect();
    let out: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let died = died_rx.recv().unwrap();
    for (rank, r) in out.into_iter().enumerate() {
        let Some((err, start, at, again)) = r else {
            continue;
        };
        // From the later of the death and the start of this rank's wait.
        let after = at.saturating_duration_since(died.max(start));
        assert_lost_not_timed_out(rank, &err, after, timeout);
        assert!(
            matches!(again, CollectiveError::Poisoned),
            "rank {rank}: {again}"
        );
    }
}

#[test]
fn killed_peer_fails_the_others_from_its_death_not_the_timeout() {
    let timeout = Duration::from_secs(30);
    for len in [576, 1 << 20] {
        let opts = TcpOptions {
            timeout,
            ..TcpOptions::default()
        };
        dead_peer_fails_fast(tcp_pod(3, opts, GroupOptions::default()), len, timeout);
        dead_peer_fails_fast(mem_pod(3, 4096, 4, timeout), len, timeout);
    }
}

/// A peer alive but silent fails the operation by the configured timeout:
/// `Timeout` naming the peer and the configured value, never before it,
/// and not long after it (a wide margin, counted from the start of the wait).
#[test]
fn hung_peer_times_out_at_the_configured_timeout() {
    let timeout = Duration::from_millis(300);
    let opts = TcpOptions {
        timeout,
        ..TcpOptions::default()
    };
    // Rank 0 says when it is done; rank 1 stays alive until then.
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let tx = std::sync::Arc::new(std::sync::Mutex::new(tx));
    let rx = std::sync::Arc::new(std::sync::Mutex::new(rx));
    let out = run(tcp_pod(2, opts, GroupOptions::default()), move |c| {
        if c.rank() == 1 {
            // Alive (connection open) but never joins.
            let _ = rx.lock().unwrap().recv_timeout(Duration::from_secs(60));
            return None;
        }
        let start = Instant::now();
        let mut v = [1.0f32; 576];
        let err = all_reduce(c, &mut v).unwrap_err();
        let elapsed = start.elapsed();
        let _ = tx.lock().unwrap().send(());
        Some((err, elapsed))
    });
    let (err, elapsed) = out[0].as_ref().unwrap();
    assert!(
        matches!(err, CollectiveError::Timeout { peer: 1, timeout: t } if *t == timeout),
        "{err}"
    );
    assert!(*elapsed >= timeout, "timed out early, after {elapsed:?}");
    assert!(
        *elapsed < timeout * 20,
        "took {elapsed:?} against a timeout of {timeout:?}"
    );
}

#[test]
fn connecting_refuses_a_stranger_and_reports_absent_members() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = l.local_addr().unwrap();
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let b = silent.local_addr().unwrap();
    let opts = TcpOptions {
        connect_timeout: Duration::from_millis(300),
        ..TcpOptions::default()
    };
    // Rank 0 of 2: rank 1 never dials.
    let err = TcpTransport::connect(0, l, &[a, b], opts).unwrap_err();
    assert!(
        matches!(&err, CollectiveError::Connect(m) if m.contains("[1]")),
        "{err}"
    );
}

/// Rank 1 of [`killed_process_fails_the_others_from_its_death`], run as
/// a child process (this test binary, this test, `--ignored`): joins the pod,
/// takes part in one all-reduce, then stays alive doing nothing until killed.
/// Run any other way (`--include-ignored`), it has no pod to join and
/// returns at once.
#[test]
#[ignore = "run as a child process by killed_process_fails_the_others_from_its_death"]
fn rank_process_helper() {
    let Ok(addrs) = std::env::var("MLXP_HELPER_ADDRS") else {
        eprintln!("not started by killed_process_fails_the_others_from_its_death: nothing to do");
        return;
    };
    let addrs: Vec<SocketAddr> = addrs.split(',').map(|a| a.parse().unwrap()).collect();
    let l = TcpListener::bind(addrs[1]).unwrap();
    let t = TcpTransport::connect(1, l, &addrs, TcpOptions::default()).unwrap();
    let mut g = Group::new(t, GroupOptions::default());
    let mut v = vec![1.0f32; 1000];
    all_reduce(&mut g, &mut v).unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn killed_process_fails_the_others_from_its_death() {
    let listeners: Vec<TcpListener> = (0..3)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let mut listeners: Vec<Option<TcpListener>> = listeners.into_iter().map(Some).collect();
    // The child binds rank 1's port itself.
    drop(listeners[1].take());
    let list = addrs
        .iter()
        .map(|a| a.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "collectives::tests::rank_process_helper",
            "--ignored",
        ])
        .env("MLXP_HELPER_ADDRS", &list)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let timeout = Duration::from_secs(30);
    let opts = TcpOptions {
        timeout,
        ..TcpOptions::default()
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let ranks: Vec<_> = [0usize, 2]
        .into_iter()
        .map(|rank| {
            let l = listeners[rank].take().unwrap();
            let addrs = addrs.clone();
            let tx = tx.clone();
            std::thread::spawn(move || {
                let t = TcpTransport::connect(rank, l, &addrs, opts).unwrap();
                let mut g = Group::new(t, GroupOptions::default());
                let mut v = vec![1.0f32; 1000];
                all_reduce(&mut g, &mut v).unwrap();
                assert_eq!(v[0], 3.0);
                tx.send(()).unwrap();
                // Rank 1 never joins this one; it is killed meanwhile.
                let start = Instant::now();
                let err = all_reduce(&mut g, &mut v).unwrap_err();
                (err, start, Instant::now())
            })
        })
        .collect();
    // Both finished the first all-reduce; whether they have entered the
    // second when the kill lands or not, it must fail from the death.
    rx.recv().unwrap();
    rx.recv().unwrap();
    let killed = Instant::now();
    child.kill().unwrap();
    child.wait().unwrap();
    for (i, h) in ranks.into_iter().enumerate() {
        let (err, start, at) = h.join().unwrap();
        let after = at.saturating_duration_since(killed.max(start));
        assert_lost_not_timed_out([0, 2][i], &err, after, timeout);
    }
}

/// Strangers dialing a member's data-plane port before its real peer (one
/// sending bytes that are no hello, one a hello of another pod size, one
/// nothing and hanging up) are dropped, and the pod still forms.
#[test]
fn a_stray_or_malformed_peer_is_dropped_and_formation_continues() {
    use std::io::Write;
    let listeners: Vec<TcpListener> = (0..2)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let opts = TcpOptions {
        connect_timeout: Duration::from_secs(10),
        ..TcpOptions::default()
    };
    let mut garbage = std::net::TcpStream::connect(addrs[0]).unwrap();
    garbage.write_all(b"GET / HTTP/1.1\r\n").unwrap();
    let mut other_pod = std::net::TcpStream::connect(addrs[0]).unwrap();
    let mut hello = Vec::new();
    for w in [0x4d4c_5850u32, 1, 7] {
        hello.extend_from_slice(&w.to_le_bytes());
    }
    other_pod.write_all(&hello).unwrap();
    drop(std::net::TcpStream::connect(addrs[0]).unwrap());
    let mut it = listeners.into_iter();
    let (l0, l1) = (it.next().unwrap(), it.next().unwrap());
    let a0 = addrs.clone();
    let rank0 = std::thread::spawn(move || TcpTransport::connect(0, l0, &a0, opts));
    let rank1 = std::thread::spawn(move || TcpTransport::connect(1, l1, &addrs, opts));
    let t0 = rank0
        .join()
        .unwrap()
        .expect("rank 0 formed despite the strangers");
    let t1 = rank1.join().unwrap().expect("rank 1 formed");
    let mut g: Vec<Boxed> = vec![
        Box::new(Group::new(t0, GroupOptions::default())),
        Box::new(Group::new(t1, GroupOptions::default())),
    ];
    let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
        let handles: Vec<_> = g
            .iter_mut()
            .map(|c| {
                s.spawn(move || {
                    let mut v = vec![1.0f32; 16];
                    all_reduce(c.as_mut(), &mut v).unwrap();
                    v
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(sums.iter().all(|v| v.iter().all(|x| *x == 2.0)), "{sums:?}");
}
