//! The verbs backend without RDMA hardware: the pure parts, the loader's
//! typed errors, and the side channel (agreement, queue-pair exchange,
//! liveness) over real loopback TCP between threads.

use std::time::{Duration, Instant};

use super::*;
use crate::collectives::tcp::{TcpOptions, TcpTransport};
use crate::collectives::tests::{run, tcp_mesh};
use crate::collectives::{Group, GroupOptions};

fn tcp_groups(n: usize) -> Vec<Group<TcpTransport>> {
    tcp_mesh(n, TcpOptions::default())
        .into_iter()
        .map(|t| Group::new(t, GroupOptions::default()))
        .collect()
}

fn on_every_rank<R: Send + 'static>(
    groups: Vec<Group<TcpTransport>>,
    f: impl Fn(Group<TcpTransport>) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    let handles: Vec<_> = groups
        .into_iter()
        .map(|g| {
            let f = f.clone();
            std::thread::spawn(move || f(g))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn gids_format_parse_and_pick_like_jaccl() {
    let mapped: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 169, 254, 0, 1];
    let text = format_gid(&mapped);
    assert_eq!(text, "0000:0000:0000:0000:0000:ffff:a9fe:0001");
    assert_eq!(parse_gid(&text), Some(mapped));
    assert_eq!(parse_gid("::ffff:169.254.0.1"), Some(mapped));
    assert_eq!(parse_gid("fe80::1:2"), {
        let mut g = [0u8; 16];
        g[0] = 0xfe;
        g[1] = 0x80;
        g[13] = 1;
        g[15] = 2;
        Some(g)
    });
    assert_eq!(parse_gid("not a gid"), None);
    assert!(is_ipv4_mapped(&mapped));
    let link_local = parse_gid("fe80::a:b:c:d").unwrap();
    assert!(!is_ipv4_mapped(&link_local));
    // The IPv4-mapped entry wins even after a link-local one; else the first
    // non-zero one; an all-zero table has none.
    assert_eq!(pick_gid(&[link_local, [0; 16], mapped]), Some(2));
    assert_eq!(pick_gid(&[[0; 16], link_local]), Some(1));
    assert_eq!(pick_gid(&[[0; 16], [0; 16]]), None);
    assert_eq!(pick_gid(&[]), None);
}

#[test]
fn queue_pair_records_round_trip_and_bad_ones_are_refused() {
    let info = QpInfo {
        qp_num: 0x12_3456,
        psn: 0xab_cdef,
        lid: 7,
        mtu: 3,
        gid: parse_gid("::ffff:10.0.0.2").unwrap(),
    };
    let b = info.encode();
    assert_eq!(QpInfo::decode(1, &b), Ok(info));

    let err = QpInfo::decode(1, &b[..31]).unwrap_err();
    assert!(matches!(err, RdmaError::Exchange { peer: 1, .. }), "{err}");
    let mut bad = b;
    bad[0] ^= 1;
    assert!(QpInfo::decode(2, &bad)
        .unwrap_err()
        .to_string()
        .contains("magic"));
    let mut bad = b;
    bad[14] = 9;
    assert!(QpInfo::decode(2, &bad)
        .unwrap_err()
        .to_string()
        .contains("mtu code 9"));
    let mut bad = b;
    bad[11] = 1; // psn above 24 bits
    assert!(QpInfo::decode(2, &bad)
        .unwrap_err()
        .to_string()
        .contains("24 bits"));
    // An all-zero slot (a rank that made no record for us) is refused too.
    assert!(QpInfo::decode(0, &[0u8; QpInfo::BYTES]).is_err());
}

#[test]
fn frame_prefixes_catch_a_dropped_frame() {
    let data = Prefix {
        seq: 5,
        posted: 40,
        credit_only: false,
    };
    assert_eq!(Prefix::check(1, &data.encode(), 5).unwrap(), data);
    let credit = Prefix {
        credit_only: true,
        ..data
    };
    assert_eq!(Prefix::check(1, &credit.encode(), 5).unwrap(), credit);
    let lost = Prefix::check(1, &Prefix { seq: 6, ..data }.encode(), 5).unwrap_err();
    assert!(
        lost.to_string().contains("frame 5 from rank 1 was lost"),
        "{lost}"
    );
    let mut garbage = data.encode();
    garbage[7] ^= 0xff;
    assert!(Prefix::check(1, &garbage, 5).is_err());
    for (kind, slot) in [
        (KIND_SEND, 0),
        (KIND_RECV, 15),
        (KIND_RECV, usize::MAX >> 40),
    ] {
        assert_eq!(split_wr_id(wr_id(kind, slot)), (kind, slot));
    }
}

#[test]
fn a_missing_library_or_symbol_is_a_typed_error() {
    let err = Library::open("libmlx-node-no-such-verbs.so.1").unwrap_err();
    assert!(
        matches!(&err, RdmaError::LibraryNotFound { library, .. } if library == "libmlx-node-no-such-verbs.so.1"),
        "{err}"
    );
    // A real library that is not a verbs library: the first verb is missing.
    let libc_name = if cfg!(target_os = "macos") {
        "/usr/lib/libSystem.B.dylib"
    } else {
        "libc.so.6"
    };
    let err = Library::open(libc_name).unwrap_err();
    assert_eq!(
        err,
        RdmaError::SymbolMissing {
            library: libc_name.into(),
            symbol: "ibv_get_device_list"
        }
    );
}

/// Without RDMA hardware every rank's set-up fails with a typed error: the
/// library is missing, or (rdma-core installed, no device) the device is
/// not there and the error lists what is. Nothing panics, every rank fails.
#[test]
fn setting_up_without_a_device_fails_every_rank_with_a_typed_error() {
    match system() {
        Ok(lib) => println!(
            "{} loaded, devices: {:?} (testing the no-such-device path)",
            lib.path,
            lib.device_names()
        ),
        Err(e) => println!("{e} (testing the library-not-found path)"),
    }
    let results = on_every_rank(tcp_groups(2), |mut g| {
        let rank = g.rank();
        let devices: Vec<Option<String>> = (0..2)
            .map(|p| (p != rank).then(|| "mlxnode_test_dev".to_string()))
            .collect();
        connect(&mut g, system(), &devices).map(|_| ())
    });
    for (rank, r) in results.into_iter().enumerate() {
        let Err(e) = r else {
            panic!("set-up must fail")
        };
        match e {
            CollectiveError::Rdma(RdmaError::LibraryNotFound { .. }) => {}
            CollectiveError::Rdma(RdmaError::NoSuchDevice { device, available }) => {
                assert_eq!(device, "mlxnode_test_dev");
                assert!(!available.contains(&device));
            }
            other => panic!("rank {rank}: {other}"),
        }
    }
}

#[test]
fn one_ranks_failure_fails_every_rank_with_its_reason() {
    let results = on_every_rank(tcp_groups(3), |mut g| {
        let local = if g.rank() == 1 {
            Err(RdmaError::PortDown {
                device: "rdma_en3".into(),
                port: 1,
                state: 1,
            })
        } else {
            Ok(g.rank())
        };
        let first = agree(&mut g, local);
        // The group stays usable: a second, successful round agrees.
        let rank = g.rank();
        let second = agree(&mut g, Ok(rank));
        (first, second)
    });
    for (rank, (first, second)) in results.into_iter().enumerate() {
        let err = first.unwrap_err();
        match (rank, &err) {
            (1, CollectiveError::Rdma(RdmaError::PortDown { .. })) => {}
            (_, CollectiveError::Rdma(RdmaError::PeerFailed { rank: 1, reason })) => {
                assert!(
                    reason.contains("rdma_en3: port 1 is not active"),
                    "{reason}"
                )
            }
            _ => panic!("rank {rank}: {err}"),
        }
        assert_eq!(second.unwrap(), rank);
    }
}

#[test]
fn queue_pair_records_cross_the_side_channel_pairwise() {
    let results = on_every_rank(tcp_groups(3), |mut g| {
        let rank = g.rank();
        let mine: Vec<Option<QpInfo>> = (0..3)
            .map(|p| {
                (p != rank).then(|| QpInfo {
                    qp_num: (rank * 16 + p) as u32,
                    psn: 100 + rank as u32,
                    lid: p as u16,
                    mtu: 3,
                    gid: [rank as u8; 16],
                })
            })
            .collect();
        exchange_infos(&mut g, &mine).unwrap()
    });
    for (rank, got) in results.into_iter().enumerate() {
        for (p, info) in got.into_iter().enumerate() {
            if p == rank {
                assert_eq!(info, None);
                continue;
            }
            let info = info.unwrap();
            assert_eq!(info.qp_num as usize, p * 16 + rank, "rank {rank} from {p}");
            assert_eq!(
                (info.psn, info.lid, info.gid),
                (100 + p as u32, rank as u16, [p as u8; 16])
            );
        }
    }
}

/// The TCP connections, kept as the side channel: a barrier passes, a
/// dropped member is seen gone within the bound, one that shuts down too.
#[test]
fn the_side_channel_reports_a_lost_peer() {
    let sides: Vec<SideChannel> = on_every_rank(tcp_groups(3), |g| {
        let mut side = SideChannel::new(g.into_transport().into_streams()).unwrap();
        side.barrier(Duration::from_secs(10)).unwrap();
        side
    });
    let mut sides = sides.into_iter();
    let (mut s0, mut s1, s2) = (
        sides.next().unwrap(),
        sides.next().unwrap(),
        sides.next().unwrap(),
    );
    assert!(s0.alive(1) && s0.alive(2) && s1.alive(0) && s1.alive(2));
    assert!(!s0.alive(0), "no link to itself");
    drop(s2);
    assert!(gone_soon(&s0, 2), "rank 2 dropped its side channel");
    assert!(s0.alive(1), "rank 1 is still there");
    s1.shutdown();
    assert!(gone_soon(&s0, 1), "rank 1 shut its side channel down");
    s0.shutdown();
}

/// Whether `side` reports `peer` gone within a wide margin (the close
/// reaches a loopback socket in microseconds; the margin only bounds the
/// test, it is no speed requirement).
fn gone_soon(side: &SideChannel, peer: usize) -> bool {
    let until = Instant::now() + LOST_PEER_TIMEOUT;
    while side.alive(peer) {
        if Instant::now() > until {
            return false;
        }
        std::thread::yield_now();
    }
    true
}

// ---- the whole binding over the in-process fake provider ----

use super::fake;
use crate::collectives::verbs::{VerbsOptions, VerbsTransport};

/// The verbs transport's timeout in these pods: long against how fast a
/// lost peer shows on the side channel, so a failure that comes from the
/// timeout and not from noticing the loss is told apart.
const LOST_PEER_TIMEOUT: Duration = Duration::from_secs(30);

/// Forms an `n`-rank pod over the fake provider's `device` exactly as the
/// pod runtime does (TCP mesh, queue pairs over it, side channel, barrier).
fn fake_pod(n: usize, device: &'static str) -> Vec<Result<Box<dyn Collective>, CollectiveError>> {
    fake_pod_of(n, device, QueuePairs::platform())
}

/// [`fake_pod`] with queue pairs of `kind`.
fn fake_pod_of(
    n: usize,
    device: &'static str,
    kind: QueuePairs,
) -> Vec<Result<Box<dyn Collective>, CollectiveError>> {
    on_every_rank(tcp_groups(n), move |mut g| {
        let rank = g.rank();
        let devices: Vec<Option<String>> = (0..n)
            .map(|p| (p != rank).then(|| device.to_string()))
            .collect();
        let pending = connect_with(&mut g, Ok(fake::library()), &devices, kind)?;
        let side = SideChannel::new(g.into_transport().into_streams())?;
        let opts = VerbsOptions {
            timeout: LOST_PEER_TIMEOUT,
            ..VerbsOptions::default()
        };
        let mut t = VerbsTransport::new(pending.finish(side), opts)?;
        t.verbs_mut().barrier(Duration::from_secs(10))?;
        Ok(Box::new(Group::new(t, GroupOptions::default())) as Box<dyn Collective>)
    })
}

#[test]
fn collectives_run_over_the_verbs_binding() {
    collectives_run_over(QueuePairs::Reliable);
}

/// Thunderbolt's queue pairs are unreliable: a frame sent before the
/// receiver re-posted its receive would be dropped. Credit flow control
/// keeps every frame within the receives the peer has posted.
#[test]
fn collectives_run_over_unreliable_queue_pairs() {
    collectives_run_over(QueuePairs::Unreliable);
}

fn collectives_run_over(kind: QueuePairs) {
    let pod: Vec<_> = fake_pod_of(3, "fake0", kind)
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let sums = run(pod, |c| {
        let rank = c.rank();
        let mut out = Vec::new();
        // One frame, a SmolLM2 hidden state, many frames (ring), odd sizes.
        for len in [1usize, 576, 1021, 5000, (1 << 20) + 3] {
            let mut v: Vec<f32> = (0..len).map(|i| (i % 97) as f32 + rank as f32).collect();
            crate::collectives::all_reduce(c, &mut v).unwrap();
            out.push(v);
        }
        let mine = [rank as u8 + 1; 4999];
        let mut all = vec![0u8; 3 * mine.len()];
        c.all_gather(&mine, &mut all).unwrap();
        let mut b = vec![rank as u8; 10_000];
        c.broadcast(&mut b, 2).unwrap();
        c.barrier().unwrap();
        (out, all, b)
    });
    for (rank, (out, all, b)) in sums.into_iter().enumerate() {
        for v in out {
            for (i, x) in v.iter().enumerate() {
                assert_eq!(*x, 3.0 * (i % 97) as f32 + 3.0, "rank {rank} element {i}");
            }
        }
        for r in 0..3 {
            assert!(all[r * 4999..(r + 1) * 4999]
                .iter()
                .all(|&x| x == r as u8 + 1));
        }
        assert!(b.iter().all(|&x| x == 2), "rank {rank} broadcast");
    }
}

/// A lost member is noticed from its loss (the side channel), not from the
/// timeout: `PeerLost`, well inside the configured timeout counted from the
/// event (the start of the operation: the member was already gone).
#[test]
fn a_lost_member_fails_the_others_from_its_loss_not_the_timeout() {
    let mut pod: Vec<_> = fake_pod(3, "fake0")
        .into_iter()
        .map(Result::unwrap)
        .collect();
    drop(pod.pop()); // rank 2 goes away: queue pairs destroyed, side channel closed
    let errs = run(pod, |c| {
        let mut v = vec![1.0f32; 100_000];
        let start = Instant::now();
        let e = crate::collectives::all_reduce(c, &mut v).unwrap_err();
        (e, start.elapsed())
    });
    for (rank, (e, after)) in errs.into_iter().enumerate() {
        assert!(
            matches!(e, CollectiveError::PeerLost { .. }),
            "rank {rank}: expected a lost peer, got {e}"
        );
        assert!(
            after < LOST_PEER_TIMEOUT / 2,
            "rank {rank} failed {after:?} into the operation, against a timeout of {LOST_PEER_TIMEOUT:?}"
        );
    }
}

#[test]
fn device_problems_fail_every_rank_with_a_typed_error() {
    for r in fake_pod(2, "no_such_dev") {
        let Err(e) = r else {
            panic!("set-up must fail")
        };
        match e {
            CollectiveError::Rdma(RdmaError::NoSuchDevice { device, available }) => {
                assert_eq!(device, "no_such_dev");
                assert_eq!(
                    available,
                    ["fake0", "fake_down", "fake_lossy", "fake1", "fake_flaky"]
                );
            }
            e => panic!("{e}"),
        }
    }
    for r in fake_pod(2, "fake_down") {
        let Err(e) = r else {
            panic!("set-up must fail")
        };
        assert!(
            matches!(
                &e,
                CollectiveError::Rdma(RdmaError::PortDown {
                    port: 1,
                    state: 1,
                    ..
                })
            ),
            "{e}"
        );
        assert!(
            e.to_string().contains("fake_down: port 1 is not active"),
            "{e}"
        );
    }
}

/// A frame an unreliable queue pair drops is an error naming the gap, on
/// the receiver; never data at the wrong offset.
#[test]
fn a_dropped_frame_is_an_error_not_garbage() {
    let pod: Vec<_> = fake_pod(2, "fake_lossy")
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let results = run(pod, |c| {
        let mut v = vec![1.0f32; 20_000];
        crate::collectives::all_reduce(c, &mut v).map(|_| v)
    });
    let errs: Vec<String> = results
        .into_iter()
        .map(|r| r.unwrap_err().to_string())
        .collect();
    assert!(
        errs.iter().any(|e| e.contains("frame 2 from rank")),
        "{errs:?}"
    );
}

/// A receiver that is busy elsewhere (it consumes nothing for a while)
/// while its peer streams many frames at it over an unreliable queue pair:
/// every message arrives whole and in order, none is dropped.
#[test]
fn a_slow_receiver_loses_nothing_on_unreliable_queue_pairs() {
    let pod: Vec<_> = fake_pod_of(2, "fake0", QueuePairs::Unreliable)
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let got = run(pod, |c| {
        let msg =
            |i: usize| -> Vec<u8> { (0..50_000).map(|j| ((i * 7 + j) % 251) as u8).collect() };
        if c.rank() == 0 {
            for i in 0..20 {
                c.send(&msg(i), 1).unwrap();
            }
            c.barrier().unwrap();
            0
        } else {
            let mut ok = 0;
            for i in 0..20 {
                if i % 5 == 0 {
                    std::thread::sleep(Duration::from_millis(30));
                }
                let mut buf = vec![0u8; 50_000];
                c.recv(&mut buf, 0).unwrap();
                assert!(buf == msg(i), "message {i} arrived changed");
                ok += 1;
            }
            c.barrier().unwrap();
            ok
        }
    });
    assert_eq!(got, [0, 20]);
}

#[test]
fn credit_keeps_one_frame_back_for_returning_credit() {
    let mut c = Credit::new(16);
    // The transport posts every receive before the first exchange.
    for _ in 0..16 {
        c.posted = c.posted.wrapping_add(1);
    }
    assert_eq!((c.credits(), c.owed()), (16, 0));
    for _ in 0..15 {
        assert!(c.data_may_go());
        c.stamp();
    }
    // One credit left: data waits, a credit-only frame could still go.
    assert_eq!(c.credits(), 1);
    assert!(!c.data_may_go());
    // The peer re-posted 8 receives and said so.
    c.heard(16 + 8);
    assert_eq!(c.credits(), 9);
    // A stale count changes nothing.
    c.heard(16 + 3);
    assert_eq!(c.credits(), 9);
    // Receiving: after re-posting half the receives, credit is owed.
    for _ in 0..7 {
        c.posted = c.posted.wrapping_add(1);
    }
    assert!(!c.credit_frame_due());
    c.posted = c.posted.wrapping_add(1);
    assert!(c.credit_frame_due());
    c.stamp();
    assert_eq!(c.owed(), 0);
    // The counters wrap.
    let mut w = Credit::new(16);
    w.posted = u16::MAX - 2;
    w.advertised = u16::MAX - 2;
    w.posted = w.posted.wrapping_add(10);
    assert_eq!(w.owed(), 10);
}

// ---- two cables per pair: striping and fall-back ----

use crate::collectives::stripe::Striped;

type StripedGroup = Group<VerbsTransport<Striped<RdmaVerbs>>>;

/// A 2-rank pod with two cables: lane 0 over `fake0`, lane 1 over `second`.
fn two_cable_pod(second: &'static str) -> Vec<StripedGroup> {
    on_every_rank(tcp_groups(2), move |mut g| {
        let rank = g.rank();
        let on = |d: &str| -> Vec<Option<String>> {
            (0..2).map(|p| (p != rank).then(|| d.to_string())).collect()
        };
        let kind = QueuePairs::Reliable;
        let lane0 = connect_with(&mut g, Ok(fake::library()), &on("fake0"), kind).unwrap();
        let lane1 = connect_with(&mut g, Ok(fake::library()), &on(second), kind).unwrap();
        let side = SideChannel::new(g.into_transport().into_streams()).unwrap();
        let lanes = vec![lane0.finish(side.try_clone().unwrap()), lane1.finish(side)];
        let opts = VerbsOptions {
            timeout: Duration::from_secs(20),
            ..VerbsOptions::default()
        };
        let mut t = VerbsTransport::new(Striped::new(lanes).unwrap(), opts).unwrap();
        t.verbs_mut().lanes_mut()[0]
            .barrier(Duration::from_secs(10))
            .unwrap();
        Group::new(t, GroupOptions::default())
    })
}

/// 64 MiB of f32 summed over two ranks: exact, and `(lanes, failovers)`
/// of each rank.
fn all_reduce_64_mib(pod: Vec<StripedGroup>) -> Vec<(Vec<u64>, Vec<String>)> {
    const LEN: usize = 16 << 20;
    let handles: Vec<_> = pod
        .into_iter()
        .map(|mut g| {
            std::thread::spawn(move || {
                let rank = g.rank();
                let mut v: Vec<f32> = (0..LEN).map(|i| (i % 1000) as f32 + rank as f32).collect();
                crate::collectives::all_reduce(&mut g, &mut v).unwrap();
                // Nobody leaves (closing the side channel) while the other
                // still takes its last frames.
                g.barrier().unwrap();
                let wrong = v
                    .iter()
                    .enumerate()
                    .find(|(i, &x)| x != 2.0 * (i % 1000) as f32 + 1.0);
                assert_eq!(wrong, None, "rank {rank}: first wrong element");
                let s = g.transport().verbs();
                (s.lane_bytes().to_vec(), s.failovers().to_vec())
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Two ranks: the ring sends each peer one 32 MiB reduce-scatter message
/// and one 32 MiB all-gather message (each with its 16-byte header), then
/// the barrier's header.
const SENT_PER_RANK: u64 = 2 * ((32 << 20) + 16) + 16;

#[test]
fn a_64_mib_all_reduce_over_two_cables_moves_half_the_bytes_on_each() {
    for (rank, (lanes, failovers)) in all_reduce_64_mib(two_cable_pod("fake1"))
        .into_iter()
        .enumerate()
    {
        assert!(failovers.is_empty(), "rank {rank}: {failovers:?}");
        assert_eq!(lanes.iter().sum::<u64>(), SENT_PER_RANK, "rank {rank}");
        // Frames alternate between the cables: the halves differ by at
        // most one frame.
        assert!(
            lanes[0].abs_diff(lanes[1]) <= FRAME as u64,
            "rank {rank}: {lanes:?}"
        );
        eprintln!("rank {rank}: bytes per cable {lanes:?}");
    }
}

/// The second cable is pulled a few thousand frames into the transfer:
/// both ranks drop it with a logged reason naming the device and the
/// failed completion, send what was in flight on it again over the first,
/// and the sum is still exact (no frame lost, none counted twice).
#[test]
fn a_cable_failing_mid_transfer_falls_back_and_loses_no_frame() {
    let pod = two_cable_pod("fake_flaky");
    fake::break_flaky_after(3000);
    let mut named = 0;
    for (rank, (lanes, failovers)) in all_reduce_64_mib(pod).into_iter().enumerate() {
        assert_eq!(failovers.len(), 1, "rank {rank}: {failovers:?}");
        let why = &failovers[0];
        // Its own failed send names the device and the completion; or the
        // peer's notice came first.
        let own = why.contains("fake_flaky: work completion status 12");
        named += usize::from(own);
        assert!(
            why.contains("lane 1 to rank") && (own || why.contains("reports its lane 1 failed")),
            "rank {rank}: {why}"
        );
        // Lane 1 carried some frames before it failed; lane 0 the rest,
        // the frames sent again included.
        assert!(
            lanes[1] > 0 && lanes[0] > lanes[1],
            "rank {rank}: {lanes:?}"
        );
        assert!(lanes.iter().sum::<u64>() >= SENT_PER_RANK, "rank {rank}");
        eprintln!("rank {rank}: bytes per cable {lanes:?}; {why}");
    }
    assert!(named >= 1, "no rank saw the failed completion itself");
}

/// A receiver that waits longer than its spin sleeps on the completion
/// channel (its queue is armed, the fd wakes it), not in a sleep-and-poll
/// loop, and the message arrives whole.
#[test]
fn a_long_wait_blocks_on_the_completion_channel() {
    let pod: Vec<_> = fake_pod_of(2, "fake0", QueuePairs::Reliable)
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let armed = fake::armed();
    let got = run(pod, |c| {
        let msg: Vec<u8> = (0..10_000).map(|i| (i % 253) as u8).collect();
        if c.rank() == 0 {
            // Long enough that the receiver's spin is over.
            std::thread::sleep(Duration::from_millis(100));
            c.send(&msg, 1).unwrap();
            true
        } else {
            let mut buf = vec![0u8; msg.len()];
            c.recv(&mut buf, 0).unwrap();
            buf == msg
        }
    });
    assert_eq!(got, [true, true]);
    assert!(fake::armed() > armed, "the receiver never armed its queue");
    eprintln!(
        "queues armed {}, channel events {}",
        fake::armed() - armed,
        fake::channel_events()
    );
}
