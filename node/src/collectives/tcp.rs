//! The TCP transport: one connection per pair of pod members.
//!
//! Connection set-up: every rank listens (the caller binds the listener, so
//! tests use port 0); rank `j` dials every rank `i < j` (retrying until the
//! connect timeout, since members start at different times) and introduces
//! itself with a hello (magic, its rank, the pod size); rank `i` accepts the
//! ranks above it. An accepted peer whose hello is missing (within
//! [`HELLO_WAIT`]), malformed, of another pod size or of a rank already
//! connected is dropped and formation goes on. Then every socket gets
//! `TCP_NODELAY` and goes non-blocking.
//!
//! Authentication ([`PeerAuth`]): when the hostfile names every member's
//! node id, each pair proves both keys before its link counts. The dialer
//! sends a fresh nonce after its hello; the acceptor answers with its own
//! nonce and its signature over both nonces, the pod size and both ranks;
//! the dialer checks it against the acceptor rank's key and answers with
//! its own signature over the same (in the other role). A peer that cannot
//! sign as the rank it claims is dropped (acceptor) or dialled again until
//! the connect timeout (dialer), and formation goes on. Without node ids
//! ([`PeerAuth::Open`]) the hello is not authenticated: a stranger that
//! sends a well-formed one before the real member takes its rank. Only
//! membership is authenticated: the bytes of an established link are not
//! (an on-path attacker on the pod's cable or LAN is out of scope).
//!
//! Data: an exchange writes and reads all its messages at once. It spins
//! for [`TcpOptions::spin`] when no socket is ready (a loopback or
//! Thunderbolt round trip is a few tens of microseconds, less than a sleep
//! and wake-up), yielding the core between attempts, then waits in `poll`.
//!
//! # Failure
//! A closed or reset connection is [`CollectiveError::PeerLost`]; no byte
//! moving on any pending message for [`TcpOptions::timeout`] is
//! [`CollectiveError::Timeout`]. Poisoning shuts every socket down, so a
//! member that fails makes the others fail at once instead of waiting.

use std::io::{ErrorKind, IoSlice, IoSliceMut, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ed25519_dalek::{Signature, VerifyingKey};

use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Token};

use super::group::{Header, Incoming, Outgoing, Transport};
use super::{CollectiveError, MAX_RANKS};
use crate::identity::Identity;

const HELLO_MAGIC: u32 = 0x4d4c_5850; // "MLXP"
/// Longest wait for an accepted peer's hello before it is dropped.
const HELLO_WAIT: Duration = Duration::from_secs(2);

/// How pod members prove who they are when they connect (see the module
/// header).
#[derive(Clone, Debug, Default)]
pub enum PeerAuth {
    /// Not at all (a hostfile without node ids).
    #[default]
    Open,
    /// Every member proves its node key: `keys[r]` is rank `r`'s public
    /// key (from the hostfile), `identity` this member's key.
    NodeKeys {
        identity: Arc<Identity>,
        keys: Vec<VerifyingKey>,
    },
}

/// Bytes of a nonce of the authenticated hello.
const NONCE: usize = 32;
/// Bytes of a signature.
const SIGNATURE: usize = 64;

/// What a member signs to prove it is rank `signer` of a pod of `size`
/// on the link between ranks `acceptor` < `dialer`, bound to both nonces
/// (its peer's first, so a signature is never valid on another link or
/// connection).
fn transcript(
    role: &str,
    size: usize,
    acceptor: usize,
    dialer: usize,
    theirs: &[u8; NONCE],
    mine: &[u8; NONCE],
) -> Vec<u8> {
    let mut t = Vec::with_capacity(64 + 2 * NONCE);
    t.extend_from_slice(b"mlxnet pod data plane v1: ");
    t.extend_from_slice(role.as_bytes());
    for w in [size, acceptor, dialer] {
        t.extend_from_slice(&(w as u32).to_le_bytes());
    }
    t.extend_from_slice(theirs);
    t.extend_from_slice(mine);
    t
}

fn verifies(key: &VerifyingKey, msg: &[u8], sig: &[u8]) -> bool {
    Signature::from_slice(sig).is_ok_and(|s| key.verify_strict(msg, &s).is_ok())
}

/// The dialer's side of the authenticated hello, after its plain hello:
/// its nonce out, the acceptor's proof in and checked, its own proof out.
fn prove_as_dialer(
    s: &mut std::net::TcpStream,
    identity: &Identity,
    acceptor_key: &VerifyingKey,
    (size, acceptor, dialer): (usize, usize, usize),
    wait: Duration,
) -> Result<(), String> {
    let mine: [u8; NONCE] = rand::random();
    s.write_all(&mine).map_err(|e| format!("hello: {e}"))?;
    s.set_read_timeout(Some(wait.max(Duration::from_millis(1))))
        .map_err(|e| e.to_string())?;
    let mut reply = [0u8; NONCE + SIGNATURE];
    s.read_exact(&mut reply)
        .map_err(|e| format!("no proof of its node key: {e}"))?;
    let mut theirs = [0u8; NONCE];
    theirs.copy_from_slice(&reply[..NONCE]);
    let signed = transcript("acceptor", size, acceptor, dialer, &mine, &theirs);
    if !verifies(acceptor_key, &signed, &reply[NONCE..]) {
        return Err(format!("did not prove rank {acceptor}'s node key"));
    }
    let proof = identity.sign(&transcript(
        "dialer", size, acceptor, dialer, &theirs, &mine,
    ));
    s.write_all(&proof.to_bytes())
        .map_err(|e| format!("proof: {e}"))
}

/// The acceptor's side of the authenticated hello, after the plain hello
/// of rank `dialer`: the dialer's nonce in, its own nonce and proof out,
/// the dialer's proof in and checked.
fn prove_as_acceptor(
    s: &mut std::net::TcpStream,
    identity: &Identity,
    dialer_key: &VerifyingKey,
    (size, acceptor, dialer): (usize, usize, usize),
) -> Result<(), String> {
    let mut theirs = [0u8; NONCE];
    s.read_exact(&mut theirs)
        .map_err(|e| format!("no nonce: {e}"))?;
    let mine: [u8; NONCE] = rand::random();
    let proof = identity.sign(&transcript(
        "acceptor", size, acceptor, dialer, &theirs, &mine,
    ));
    let mut reply = [0u8; NONCE + SIGNATURE];
    reply[..NONCE].copy_from_slice(&mine);
    reply[NONCE..].copy_from_slice(&proof.to_bytes());
    s.write_all(&reply).map_err(|e| format!("proof: {e}"))?;
    let mut sig = [0u8; SIGNATURE];
    s.read_exact(&mut sig)
        .map_err(|e| format!("no proof of its node key: {e}"))?;
    let signed = transcript("dialer", size, acceptor, dialer, &mine, &theirs);
    if !verifies(dialer_key, &signed, &sig) {
        return Err(format!("did not prove rank {dialer}'s node key"));
    }
    Ok(())
}

/// Timeouts of the TCP transport.
#[derive(Debug, Clone, Copy)]
pub struct TcpOptions {
    /// No progress on a pending message for this long fails the operation.
    pub timeout: Duration,
    /// How long forming the pod may take (peers that start late are retried).
    pub connect_timeout: Duration,
    /// Busy-wait this long before sleeping in `poll`.
    pub spin: Duration,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(30),
            // A tensor-parallel rank mostly waits for its peer to finish its
            // share of a layer (about a millisecond on a 50 ms step); waking
            // from `poll` costs tens to hundreds of microseconds in a VM, 32
            // times a step. The spin yields, so an oversubscribed host loses
            // little (pod_tp bench, Q4_0, quiet 2-core VM, runs interleaved:
            // 1.67-1.84x with a 2-5 ms spin against 1.59-1.60x with 50 us).
            spin: Duration::from_millis(2),
        }
    }
}

/// Connections to every other member.
pub struct TcpTransport {
    rank: usize,
    size: usize,
    links: Vec<Option<TcpStream>>,
    poll: Poll,
    events: Events,
    opts: TcpOptions,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

fn connect_err(what: impl std::fmt::Display) -> CollectiveError {
    CollectiveError::Connect(what.to_string())
}

fn hello(rank: usize, size: usize) -> [u8; 12] {
    let mut b = [0u8; 12];
    b[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    b[4..8].copy_from_slice(&(rank as u32).to_le_bytes());
    b[8..12].copy_from_slice(&(size as u32).to_le_bytes());
    b
}

impl TcpTransport {
    /// Forms the pod: `listener` is this rank's bound listener, `peers[r]` the
    /// address rank `r` listens on (this rank's own entry is ignored). No
    /// authentication ([`PeerAuth::Open`]).
    pub fn connect(
        rank: usize,
        listener: TcpListener,
        peers: &[SocketAddr],
        opts: TcpOptions,
    ) -> Result<TcpTransport, CollectiveError> {
        Self::connect_with(rank, listener, peers, opts, &PeerAuth::Open)
    }

    /// [`TcpTransport::connect`], every link proved by `auth`.
    pub fn connect_with(
        rank: usize,
        listener: TcpListener,
        peers: &[SocketAddr],
        opts: TcpOptions,
        auth: &PeerAuth,
    ) -> Result<TcpTransport, CollectiveError> {
        let size = peers.len();
        if let PeerAuth::NodeKeys { keys, .. } = auth {
            if keys.len() != size {
                return Err(CollectiveError::InvalidArgument(format!(
                    "{} member keys for a pod of {size}",
                    keys.len()
                )));
            }
        }
        if size > MAX_RANKS {
            return Err(CollectiveError::TooManyRanks(size));
        }
        if rank >= size {
            return Err(CollectiveError::InvalidArgument(format!(
                "rank {rank} in a pod of {size}"
            )));
        }
        let deadline = Instant::now() + opts.connect_timeout;
        let mut links: Vec<Option<std::net::TcpStream>> = (0..size).map(|_| None).collect();
        // Dial the lower ranks.
        for (peer, addr) in peers.iter().enumerate().take(rank) {
            // Why the last peer that answered at this address was refused:
            // reported at the deadline even when the last try found no one
            // listening (a stranger that gave up), since it says more.
            let mut unproved: Option<String> = None;
            loop {
                let stream =
                    match std::net::TcpStream::connect_timeout(addr, Duration::from_millis(500)) {
                        Ok(s) => s,
                        Err(e) if Instant::now() < deadline => {
                            tracing::debug!(peer, %addr, error = %e, "pod member not up yet");
                            std::thread::sleep(Duration::from_millis(20));
                            continue;
                        }
                        Err(e) => {
                            let why = match &unproved {
                                Some(why) => format!("{why} (last try: {e})"),
                                None => e.to_string(),
                            };
                            return Err(connect_err(format!("rank {peer} at {addr}: {why}")));
                        }
                    };
                let mut s = stream;
                s.set_write_timeout(Some(opts.connect_timeout))
                    .and_then(|_| s.write_all(&hello(rank, size)))
                    .map_err(|e| connect_err(format!("hello to rank {peer}: {e}")))?;
                if let PeerAuth::NodeKeys { identity, keys } = auth {
                    let wait = deadline.saturating_duration_since(Instant::now());
                    // Who answers at the member's address must prove the
                    // member's key; until it does (a stranger there, or the
                    // member not up yet), it is dialled again.
                    if let Err(why) =
                        prove_as_dialer(&mut s, identity, &keys[peer], (size, peer, rank), wait)
                    {
                        if Instant::now() < deadline {
                            tracing::debug!(peer, %addr, %why, "pod member not proved yet");
                            unproved = Some(why);
                            std::thread::sleep(Duration::from_millis(20));
                            continue;
                        }
                        return Err(connect_err(format!("rank {peer} at {addr}: {why}")));
                    }
                }
                links[peer] = Some(s);
                break;
            }
        }
        // Accept the higher ranks.
        listener
            .set_nonblocking(true)
            .map_err(|e| connect_err(format!("listener: {e}")))?;
        let mut missing = size - rank - 1;
        while missing > 0 {
            match listener.accept() {
                Ok((mut s, from)) => {
                    // A silent stranger holds formation up for at most this.
                    let wait = opts.connect_timeout.min(HELLO_WAIT);
                    s.set_nonblocking(false)
                        .and_then(|_| s.set_read_timeout(Some(wait)))
                        .map_err(|e| connect_err(format!("accepting {from}: {e}")))?;
                    let mut b = [0u8; 12];
                    if let Err(e) = s.read_exact(&mut b) {
                        tracing::debug!(%from, error = %e, "dropped a connection without hello");
                        continue;
                    }
                    let word = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
                    let (magic, peer, peer_size) = (word(0), word(4) as usize, word(8) as usize);
                    // A stranger (no hello, another pod's, a rank taken) is
                    // dropped; formation goes on waiting for the real peer.
                    if magic != HELLO_MAGIC || peer_size != size || peer <= rank || peer >= size {
                        tracing::warn!(
                            %from,
                            "dropped a peer that introduced itself as rank {peer} of {peer_size} \
                             (this is rank {rank} of {size})"
                        );
                        continue;
                    }
                    if links[peer].is_some() {
                        tracing::warn!(%from, "dropped a second connection claiming rank {peer}");
                        continue;
                    }
                    if let PeerAuth::NodeKeys { identity, keys } = auth {
                        if let Err(why) =
                            prove_as_acceptor(&mut s, identity, &keys[peer], (size, rank, peer))
                        {
                            tracing::warn!(%from, %why, "dropped a peer claiming rank {peer}");
                            continue;
                        }
                    }
                    links[peer] = Some(s);
                    missing -= 1;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let absent: Vec<usize> =
                            (rank + 1..size).filter(|&p| links[p].is_none()).collect();
                        return Err(connect_err(format!(
                            "ranks {absent:?} did not connect within {:?}",
                            opts.connect_timeout
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(connect_err(format!("accept: {e}"))),
            }
        }
        let poll = Poll::new().map_err(|e| connect_err(format!("poll: {e}")))?;
        let mut mio_links = Vec::with_capacity(size);
        for (peer, link) in links.into_iter().enumerate() {
            match link {
                None => mio_links.push(None),
                Some(s) => {
                    s.set_nodelay(true)
                        .and_then(|_| s.set_nonblocking(true))
                        .map_err(|e| connect_err(format!("socket to rank {peer}: {e}")))?;
                    let mut s = TcpStream::from_std(s);
                    poll.registry()
                        .register(&mut s, Token(peer), Interest::READABLE | Interest::WRITABLE)
                        .map_err(|e| connect_err(format!("poll register: {e}")))?;
                    mio_links.push(Some(s));
                }
            }
        }
        Ok(TcpTransport {
            rank,
            size,
            links: mio_links,
            poll,
            events: Events::with_capacity(2 * MAX_RANKS),
            opts,
        })
    }
}

impl TcpTransport {
    /// The connections as blocking std sockets (`[p]`: to rank `p`, `None`
    /// for this rank), e.g. to keep them as an RDMA side channel.
    pub fn into_streams(mut self) -> Vec<Option<std::net::TcpStream>> {
        let links = std::mem::take(&mut self.links);
        links
            .into_iter()
            .map(|l| {
                l.map(|mut s| {
                    let _ = self.poll.registry().deregister(&mut s);
                    std::net::TcpStream::from(s)
                })
            })
            .collect()
    }
}

fn lost(peer: usize, e: impl std::fmt::Display) -> CollectiveError {
    CollectiveError::PeerLost {
        peer,
        reason: e.to_string(),
    }
}

impl Transport for TcpTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn exchange(
        &mut self,
        sends: &mut [Outgoing<'_>],
        recvs: &mut [Incoming<'_>],
    ) -> Result<(), CollectiveError> {
        let mut heads: [[u8; 16]; MAX_RANKS] = [[0; 16]; MAX_RANKS];
        for (h, s) in heads.iter_mut().zip(sends.iter()) {
            *h = s.header.encode();
        }
        let mut last_progress = Instant::now();
        let mut spin_until = last_progress + self.opts.spin;
        loop {
            let mut progressed = false;
            let mut pending = false;
            for (i, s) in sends.iter_mut().enumerate() {
                let total = Header::BYTES + s.data.len();
                if s.done == total {
                    continue;
                }
                let stream = self.links[s.peer]
                    .as_mut()
                    .ok_or_else(|| lost(s.peer, "no connection"))?;
                loop {
                    // Header and data in one segment: one wake-up at the peer.
                    let (h, d) = if s.done < Header::BYTES {
                        (&heads[i][s.done..], s.data)
                    } else {
                        (&[][..], &s.data[s.done - Header::BYTES..])
                    };
                    match stream.write_vectored(&[IoSlice::new(h), IoSlice::new(d)]) {
                        Ok(0) => return Err(lost(s.peer, "connection closed")),
                        Ok(n) => {
                            s.done += n;
                            progressed = true;
                            if s.done == total {
                                break;
                            }
                        }
                        Err(e) if e.kind() == ErrorKind::WouldBlock => {
                            pending = true;
                            break;
                        }
                        Err(e) if e.kind() == ErrorKind::Interrupted => {}
                        Err(e) => return Err(lost(s.peer, e)),
                    }
                }
            }
            for r in recvs.iter_mut() {
                let total = Header::BYTES + r.data.len();
                if r.done == total {
                    continue;
                }
                let stream = self.links[r.peer]
                    .as_mut()
                    .ok_or_else(|| lost(r.peer, "no connection"))?;
                loop {
                    let res = if r.done < Header::BYTES {
                        let (h, d) = (&mut r.header_buf[r.done..], &mut *r.data);
                        stream.read_vectored(&mut [IoSliceMut::new(h), IoSliceMut::new(d)])
                    } else {
                        stream.read(&mut r.data[r.done - Header::BYTES..])
                    };
                    match res {
                        Ok(0) => return Err(lost(r.peer, "connection closed")),
                        Ok(n) => {
                            let was_header = r.done < Header::BYTES;
                            r.done += n;
                            progressed = true;
                            if was_header && r.done >= Header::BYTES {
                                r.header.check(r.peer, &r.header_buf)?;
                            }
                            if r.done == total {
                                break;
                            }
                        }
                        Err(e) if e.kind() == ErrorKind::WouldBlock => {
                            pending = true;
                            break;
                        }
                        Err(e) if e.kind() == ErrorKind::Interrupted => {}
                        Err(e) => return Err(lost(r.peer, e)),
                    }
                }
            }
            if !pending {
                return Ok(());
            }
            let now = Instant::now();
            if progressed {
                last_progress = now;
                spin_until = now + self.opts.spin;
                continue;
            }
            let idle = now - last_progress;
            if idle >= self.opts.timeout {
                let peer = recvs
                    .iter()
                    .find(|r| r.done < Header::BYTES + r.data.len())
                    .map(|r| r.peer)
                    .or_else(|| sends.first().map(|s| s.peer))
                    .unwrap_or(self.rank);
                return Err(CollectiveError::Timeout {
                    peer,
                    timeout: self.opts.timeout,
                });
            }
            if now < spin_until {
                // Yield rather than burn: when cores are oversubscribed the
                // peer we wait for may need this one.
                std::thread::yield_now();
                continue;
            }
            let wait = (self.opts.timeout - idle).min(Duration::from_millis(50));
            match self.poll.poll(&mut self.events, Some(wait)) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(lost(self.rank, format!("poll: {e}"))),
            }
        }
    }

    fn poison(&mut self) {
        for s in self.links.iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.poison();
    }
}
