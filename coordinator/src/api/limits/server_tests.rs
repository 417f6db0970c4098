//! The abuse limits on real listeners (port 0, fresh database): a key's
//! in-flight cap is never exceeded, oversized messages are refused without
//! the process's memory growing, and overload is shed with
//! RESOURCE_EXHAUSTED / 429 while health checks still answer.

use std::{net::SocketAddr, sync::Arc};

use mlxnet_proto::v1::{jobs_client::JobsClient, ListJobsRequest, WatchJobRequest};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;
use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};

use crate::{
    ledger::keys::KeyLimits,
    test_utils::{prompt_job, spawn_app, TestApp},
};

/// Resident memory of this process (server and clients alike), from
/// `/proc/self/status`.
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("procfs");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS line");
    kb * 1024
}

async fn key_id(app: &TestApp) -> String {
    let keys = app.ledger.list_keys(&app.client_account).await.unwrap();
    keys[0].id.clone()
}

/// Waits until the server has noticed dropped streams. The bound is a wide
/// margin that only keeps a broken build from hanging the suite (on an idle
/// machine it takes milliseconds).
async fn until(mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "condition not reached in 60 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// One HTTP/1.1 request on a fresh connection; the status line's code.
async fn http_status(addr: SocketAddr, head: &str, body: &[u8]) -> u16 {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    // The server may answer (and close) before the body is all sent.
    let _ = s.write_all(body).await;
    let mut buf = vec![0u8; 512];
    let mut got = 0;
    while got < 12 {
        match s.read(&mut buf[got..]).await {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    let line = String::from_utf8_lossy(&buf[..got]);
    line.get(9..12)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {line:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_never_has_more_requests_in_flight_than_its_cap() {
    const CAP: u32 = 4;
    let app = spawn_app(|c| {
        c.limits.key_max_in_flight = CAP;
        c.limits.key_requests_per_sec = 0;
    })
    .await;
    let key = key_id(&app).await;
    let mut client = JobsClient::new(app.grpc().await);
    let job = client
        .submit(prompt_job("hello", 8))
        .await
        .unwrap()
        .into_inner();

    // Watch streams stay open (no node runs the job), each holding a slot.
    let mut streams = Vec::new();
    let mut refused = 0;
    for _ in 0..CAP + 6 {
        let mut c = JobsClient::new(app.grpc().await);
        match c
            .watch(WatchJobRequest {
                job_id: job.id.clone(),
            })
            .await
        {
            Ok(s) => streams.push(s.into_inner()),
            Err(s) => {
                assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
                assert!(s.message().contains("in flight"), "{}", s.message());
                refused += 1;
            }
        }
    }
    assert_eq!(streams.len(), CAP as usize);
    assert_eq!(refused, 6);
    assert_eq!(app.admission.key_in_flight(&key), (CAP, CAP));

    // Ending streams frees their slots; keep CAP - 1 open so one slot is
    // left, then drive 16 concurrent submitters at it.
    streams.truncate(CAP as usize - 1);
    until(|| app.admission.key_in_flight(&key).0 == CAP - 1).await;
    let mut tasks = Vec::new();
    for t in 0..16 {
        let mut c = JobsClient::new(app.grpc().await);
        tasks.push(tokio::spawn(async move {
            let (mut ok, mut exhausted) = (0u32, 0u32);
            for i in 0..20 {
                match c.submit(prompt_job(&format!("job {t}-{i}"), 8)).await {
                    Ok(_) => ok += 1,
                    Err(s) if s.code() == Code::ResourceExhausted => exhausted += 1,
                    Err(s) => panic!("unexpected status {s:?}"),
                }
            }
            (ok, exhausted)
        }));
    }
    let (mut ok, mut exhausted) = (0, 0);
    for t in tasks {
        let (o, e) = t.await.unwrap();
        ok += o;
        exhausted += e;
    }
    let (now, peak) = app.admission.key_in_flight(&key);
    println!("16 submitters x 20 at one free slot: {ok} accepted, {exhausted} refused; peak in flight {peak} (cap {CAP})");
    assert_eq!(ok + exhausted, 320);
    assert!(
        ok > 0 && exhausted > 0,
        "{ok} accepted, {exhausted} refused"
    );
    assert!(peak <= CAP, "peak {peak} over the cap {CAP}");
    assert_eq!(now, CAP - 1, "finished submits released their slots");
    // Every accepted submit holds its price; refused ones hold nothing.
    let totals = app.ledger.totals().await.unwrap();
    assert_eq!(totals.open_holds, i64::from(ok) + 1);
    drop(streams);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_rate_limit_refuses_the_excess_and_its_own_limits_apply_at_once() {
    let app = spawn_app(|c| {
        c.limits.key_requests_per_sec = 0;
    })
    .await;
    let key = key_id(&app).await;
    let mut client = JobsClient::new(app.grpc().await);
    let list = || ListJobsRequest { limit: 1 };
    // Unlimited by default here; the key's own limit (5/s, burst 10) takes
    // effect on the next request, cache or not.
    for _ in 0..30 {
        client.list(list()).await.unwrap();
    }
    assert!(app
        .ledger
        .set_key_limits(
            &key,
            KeyLimits {
                requests_per_sec: Some(5),
                max_in_flight: None,
            },
        )
        .await
        .unwrap());
    let (mut ok, mut limited) = (0, 0);
    let started = std::time::Instant::now();
    for _ in 0..30 {
        // Paced (10 a second, twice the limit), so the loop lasts long
        // enough for the refill rate to count: a bucket that refilled at
        // twice 5/s would let every request through. Not a readiness wait.
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        match client.list(list()).await {
            Ok(_) => ok += 1,
            Err(s) => {
                assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
                assert!(s.message().contains("5 requests/s"), "{}", s.message());
                limited += 1;
            }
        }
    }
    // A burst of 10, plus what refilled at 5/s while the loop ran (however
    // long a loaded machine took: the bound follows the clock, it is no
    // speed requirement).
    let refilled = (5.0 * started.elapsed().as_secs_f64()).ceil() as usize;
    assert!(
        (10..=10 + refilled).contains(&ok),
        "{ok} allowed, with {refilled} refilled"
    );
    assert_eq!(ok + limited, 30);
    app.stop().await;
}

#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_messages_are_refused_without_the_memory_growing() {
    const BIG: usize = 4 << 20;
    const ROUNDS: usize = 60;
    let app = spawn_app(|c| {
        c.limits.max_request_bytes = 1 << 20;
        c.limits.key_requests_per_sec = 0;
    })
    .await;
    let mut client = JobsClient::new(app.grpc().await);
    let big = prompt_job(&"x".repeat(BIG), 8);
    let refuse = |rounds: usize| {
        let mut client = client.clone();
        let big = big.clone();
        async move {
            for _ in 0..rounds {
                let s = client.submit(big.clone()).await.unwrap_err();
                assert_eq!(s.code(), Code::OutOfRange, "{s:?}");
                assert!(s.message().contains("too large"), "{}", s.message());
            }
        }
    };
    // Warm-up: allocator arenas and connection buffers reach their size.
    refuse(5).await;
    let before = rss_bytes();
    refuse(ROUNDS).await;
    // HTTP: bodies declared over the limit are refused on their header;
    // an undeclared (chunked) one is never read.
    for _ in 0..ROUNDS {
        let head = format!(
            "POST /readyz HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            1u64 << 30
        );
        assert_eq!(
            http_status(app.http_addr, &head, &[b'x'; 64 * 1024]).await,
            413
        );
    }
    let after = rss_bytes();
    let growth = after.saturating_sub(before);
    let sent = (ROUNDS * BIG) as u64;
    println!(
        "{ROUNDS} oversized gRPC messages ({} MiB) and {ROUNDS} oversized HTTP bodies: RSS {} -> {} MiB",
        sent >> 20,
        before >> 20,
        after >> 20
    );
    assert!(
        growth < 32 << 20,
        "RSS grew by {} MiB after {} MiB of refused messages",
        growth >> 20,
        sent >> 20
    );
    // The server still serves normal requests.
    client.submit(prompt_job("small", 8)).await.unwrap();
    app.stop().await;
}

/// `SUBMITTERS` closed loops of `EACH` submits over `channels`: (admitted,
/// shed). Anything but success or RESOURCE_EXHAUSTED fails the test.
async fn load_round(
    channels: &[crate::test_utils::Authed],
    submitters: usize,
    each: u32,
) -> (u32, u32) {
    let mut tasks = Vec::new();
    for t in 0..submitters {
        let mut c = JobsClient::new(channels[t % channels.len()].clone());
        tasks.push(tokio::spawn(async move {
            let (mut ok, mut shed) = (0u32, 0u32);
            for i in 0..each {
                match c.submit(prompt_job(&format!("load {t}-{i}"), 8)).await {
                    Ok(_) => ok += 1,
                    Err(s) if s.code() == Code::ResourceExhausted => {
                        assert!(s.message().contains("overloaded"), "{}", s.message());
                        shed += 1
                    }
                    Err(s) => panic!("unexpected status {s:?}"),
                }
            }
            (ok, shed)
        }));
    }
    let (mut ok, mut shed) = (0u32, 0u32);
    for t in tasks {
        let (o, s) = t.await.unwrap();
        ok += o;
        shed += s;
    }
    (ok, shed)
}

/// Offers three times the work the server admits at once (closed loops: 3x
/// the in-flight capacity, so 3x the rate it sustains) and checks by counts:
/// the excess is shed with RESOURCE_EXHAUSTED, every admitted submit is
/// durable, health checks on both listeners all answer, and memory after a
/// warm-up round does not grow with further rounds.
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_three_times_capacity_the_excess_is_shed_and_health_still_answers() {
    const CAPACITY: usize = 8;
    const SUBMITTERS: usize = 3 * CAPACITY;
    const EACH: u32 = 40;
    const ROUNDS: u32 = 3;
    let app = spawn_app(|c| {
        c.limits.max_in_flight_requests = CAPACITY;
        c.limits.key_requests_per_sec = 0;
        c.limits.key_max_in_flight = 0;
    })
    .await;
    let channels = [
        app.grpc().await,
        app.grpc().await,
        app.grpc().await,
        app.grpc().await,
    ];
    // Warm-up round: connections, buffers and caches reach their size.
    let (mut ok, mut shed) = load_round(&channels, SUBMITTERS, EACH).await;
    let before = rss_bytes();
    let finished = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let health = {
        let channel = channels[0].clone();
        let http = app.http_addr;
        let finished = Arc::clone(&finished);
        tokio::spawn(async move {
            let mut h = HealthClient::new(channel);
            let mut answered = 0u32;
            loop {
                let r = h
                    .check(HealthCheckRequest {
                        service: String::new(),
                    })
                    .await
                    .expect("gRPC health answers under overload");
                assert_eq!(r.into_inner().status, 1, "SERVING");
                let code = http_status(
                    http,
                    "GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
                    b"",
                )
                .await;
                assert_eq!(code, 200);
                answered += 1;
                if finished.load(std::sync::atomic::Ordering::Relaxed) {
                    return answered;
                }
            }
        })
    };
    for _ in 1..ROUNDS {
        let (o, s) = load_round(&channels, SUBMITTERS, EACH).await;
        ok += o;
        shed += s;
    }
    finished.store(true, std::sync::atomic::Ordering::Relaxed);
    let health_answers = health.await.unwrap();
    let after = rss_bytes();
    let peak = app.admission.peak_in_flight();
    println!(
        "{ROUNDS} rounds of {SUBMITTERS} submitters x {EACH} at capacity {CAPACITY}: {ok} admitted, \
         {shed} shed; peak in flight {peak}; {health_answers} health rounds answered; \
         RSS after warm-up {} MiB, after {} more rounds {} MiB",
        before >> 20,
        ROUNDS - 1,
        after >> 20
    );
    assert_eq!(ok + shed, ROUNDS * SUBMITTERS as u32 * EACH);
    assert!(ok > 0 && shed > 0, "{ok} admitted, {shed} shed");
    assert!(peak <= CAPACITY, "peak {peak} over {CAPACITY}");
    assert!(health_answers >= 1);
    let totals = app.ledger.totals().await.unwrap();
    assert_eq!(
        totals.open_holds,
        i64::from(ok),
        "one hold per admitted submit"
    );
    assert!(
        after.saturating_sub(before) < 32 << 20,
        "RSS grew by {} MiB",
        after.saturating_sub(before) >> 20
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_sheds_with_429_when_its_slots_are_taken_and_healthz_still_answers() {
    const SLOTS: usize = 3;
    let app = spawn_app(|c| c.limits.max_http_in_flight = SLOTS).await;
    let mut streams = Vec::new();
    for _ in 0..SLOTS {
        let mut s = tokio::net::TcpStream::connect(app.http_addr).await.unwrap();
        s.write_all(b"GET /api/world/events HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 12];
        s.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf[9..12], b"200");
        streams.push(s);
    }
    let get = |path: &str| format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    assert_eq!(http_status(app.http_addr, &get("/metrics"), b"").await, 429);
    assert_eq!(http_status(app.http_addr, &get("/healthz"), b"").await, 200);
    drop(streams);
    let addr = app.http_addr;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let code = http_status(addr, &get("/metrics"), b"").await;
        if code == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "slots come back when streams close: still {code} after 60 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    app.stop().await;
}

/// A sender stuck in its request head is cut off by the header timeout
/// (`limits.request_timeout_ms`), and by nothing else: the connection is
/// closed without a response (hyper's header timeout answers nothing; any
/// other refusal would be a status line), never before the configured
/// timeout, while a request whose head arrives in time, on the same server,
/// is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_http_sender_is_cut_off() {
    let timeout = std::time::Duration::from_millis(300);
    let app = spawn_app(|c| c.limits.request_timeout_ms = timeout.as_millis() as u64).await;
    let mut s = tokio::net::TcpStream::connect(app.http_addr).await.unwrap();
    // Half a request head, then nothing.
    s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    let sent = std::time::Instant::now();
    let mut buf = Vec::new();
    // The guard only keeps a broken build from hanging the suite.
    let read = tokio::time::timeout(std::time::Duration::from_secs(60), s.read_to_end(&mut buf))
        .await
        .expect("the server never closed a connection stuck in its headers");
    let after = sent.elapsed();
    match read {
        Ok(_) => assert!(
            buf.is_empty(),
            "a response instead of the timeout's bare close: {}",
            String::from_utf8_lossy(&buf)
        ),
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
    }
    assert!(
        after >= timeout,
        "closed {after:?} after the partial head, before the {timeout:?} header timeout"
    );
    // And by the configured timeout, not by hyper's own header timeout (30 s
    // by default), which would cut the sender off even if ours were never
    // set: a wide margin over the configured 300 ms, counted from the partial
    // head, that still stops well short of that default.
    let hyper_default = std::time::Duration::from_secs(30);
    assert!(
        after < hyper_default / 2,
        "closed {after:?} after the partial head: hyper's own {hyper_default:?} default, \
         not the configured {timeout:?}"
    );
    // The same server answers a head that arrives whole.
    let get = "GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n";
    assert_eq!(http_status(app.http_addr, get, b"").await, 200);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_link_refuses_connections_over_its_cap_and_oversized_frames() {
    use crate::test_utils::{client_config, Dialer};
    let app = spawn_app(|c| c.limits.max_node_connections = 1).await;
    let first = Dialer::connect(&app).await;
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    endpoint.set_default_client_config(client_config(&app.fingerprint));
    let second = endpoint.connect(app.quic_addr, "localhost").unwrap().await;
    assert!(second.is_err(), "a connection over the cap is refused");
    // The refusal is counted, so an operator sees the cap being hit.
    let metrics = crate::test_utils::http_get(app.http_addr, "/metrics").await;
    assert!(
        metrics.contains("node_connections_refused_at_cap_total 1\n"),
        "{metrics}"
    );

    // A frame header announcing 64 MiB: refused on the header, and the
    // connection is closed.
    let Dialer { mut send, conn, .. } = first;
    send.write_all(&(64u32 << 20).to_be_bytes()).await.unwrap();
    let closed = tokio::time::timeout(std::time::Duration::from_secs(30), conn.closed())
        .await
        .expect("the coordinator closes a connection that sent an oversized frame");
    assert!(
        matches!(closed, quinn::ConnectionError::ApplicationClosed(_)),
        "{closed:?}"
    );
    // Its slot is free again.
    drop(send);
    let mut admitted = false;
    for _ in 0..500 {
        if let Ok(c) = endpoint.connect(app.quic_addr, "localhost").unwrap().await {
            admitted = true;
            c.close(0u32.into(), b"");
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(admitted, "the slot came back");
    app.stop().await;
}
