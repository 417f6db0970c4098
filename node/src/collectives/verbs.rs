//! The RDMA transport, over a minimal verbs interface.
//!
//! [`Verbs`] is what the transport needs from an RDMA device, in the shape of
//! ibverbs: per peer a queue pair with `slots` registered send frames and
//! `slots` registered receive frames of `frame_size` bytes; posted sends and
//! receives; a completion queue polled without blocking; and a side channel
//! that says whether a peer is still alive (Apple's unreliable-connected
//! queue pairs report nothing when a peer dies, so JACCL keeps a TCP side
//! channel for that; the emulated [`super::fabric`] models the same).
//!
//! [`VerbsTransport`] cuts each message into frames (the first frame carries
//! the 16-byte header), keeps every receive frame posted, copies arrived
//! frames out in order and re-posts them at once, and recycles send frames on
//! their completions.
//!
//! # Invariants
//! - Frames from one peer complete in order (one queue pair per peer, as an
//!   RC/UC queue pair delivers); frames that belong to the next operation
//!   wait in a per-peer ready queue, their receive frame not yet re-posted.
//!
//! # Failure
//! A peer the side channel reports dead fails the exchange with
//! [`CollectiveError::PeerLost`]; no completion for the configured timeout
//! with work pending is [`CollectiveError::Timeout`].

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::group::{Header, Incoming, Outgoing, Transport};
use super::{CollectiveError, MAX_RANKS};

/// What completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompletionKind {
    Send,
    Recv,
}

/// One work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub kind: CompletionKind,
    pub peer: usize,
    pub slot: usize,
    /// Bytes received (receives only).
    pub len: usize,
}

/// The bounds every [`Verbs::post_send`] checks: at most a frame, an
/// existing slot.
pub(super) fn check_send(
    len: usize,
    slot: usize,
    frame: usize,
    slots: usize,
) -> Result<(), CollectiveError> {
    if len > frame || slot >= slots {
        return Err(CollectiveError::Verbs(format!(
            "send of {len} bytes in slot {slot}: frames are {frame} bytes x {slots} slots"
        )));
    }
    Ok(())
}

/// The bounds every [`Verbs::post_recv`] checks: an existing peer and slot.
pub(super) fn check_recv(
    peer: usize,
    slot: usize,
    peers: usize,
    slots: usize,
) -> Result<(), CollectiveError> {
    if slot >= slots || peer >= peers {
        return Err(CollectiveError::Verbs(format!(
            "receive slot {slot} from rank {peer} does not exist"
        )));
    }
    Ok(())
}

/// The verbs a device (or the emulated fabric) provides.
pub trait Verbs: Send {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Bytes per frame (one work request).
    fn frame_size(&self) -> usize;
    /// Registered send frames per peer (and receive frames, unless
    /// [`Verbs::recv_slots`] says otherwise).
    fn slots(&self) -> usize;
    /// Registered receive frames per peer: ids `0..recv_slots()`.
    fn recv_slots(&self) -> usize {
        self.slots()
    }
    /// Whether this rank has a queue pair to `peer` (a lane of a striped
    /// link may reach only some peers).
    fn connected(&self, peer: usize) -> bool {
        peer != self.rank() && peer < self.size()
    }
    /// Copies `head` then `body` (together at most a frame; a two-entry
    /// gather list) into send frame `slot` towards `peer` and posts it.
    fn post_send(
        &mut self,
        peer: usize,
        slot: usize,
        head: &[u8],
        body: &[u8],
    ) -> Result<(), CollectiveError>;
    /// Posts receive frame `slot` for frames from `peer`.
    fn post_recv(&mut self, peer: usize, slot: usize) -> Result<(), CollectiveError>;
    /// Copies `dst.len()` bytes from `offset` of receive frame `slot` from `peer`.
    fn read_recv(&self, peer: usize, slot: usize, offset: usize, dst: &mut [u8]);
    /// Copies the first `dst.len()` bytes of send frame `slot` towards
    /// `peer` as it was last posted (to send it again elsewhere when its
    /// queue pair fails); `false` where the backend keeps no copy.
    fn read_send(&self, peer: usize, slot: usize, dst: &mut [u8]) -> bool {
        let _ = (peer, slot, dst);
        false
    }
    /// Non-blocking: fills `out` with completions, returns how many.
    fn poll(&mut self, out: &mut [Completion]) -> Result<usize, CollectiveError>;
    /// Blocks until a completion may be ready or `timeout` passed.
    fn wait(&mut self, timeout: Duration);
    /// The side channel's view of `peer`.
    fn peer_alive(&self, peer: usize) -> bool;
    /// Tells every peer this member is gone.
    fn shutdown(&mut self);
}

/// Timeouts of the verbs transport.
#[derive(Debug, Clone, Copy)]
pub struct VerbsOptions {
    pub timeout: Duration,
    pub spin: Duration,
}

impl Default for VerbsOptions {
    fn default() -> Self {
        VerbsOptions {
            timeout: Duration::from_secs(10),
            spin: Duration::from_micros(200),
        }
    }
}

/// Collective messages over frames.
pub struct VerbsTransport<V> {
    v: V,
    opts: VerbsOptions,
    /// Arrived, not yet consumed frames per peer: (slot, len).
    ready: Vec<VecDeque<(usize, usize)>>,
    /// Send frames in flight per peer, and the next one to use.
    in_flight: [usize; MAX_RANKS],
    next_send: [usize; MAX_RANKS],
    completions: Vec<Completion>,
}

impl<V> std::fmt::Debug for VerbsTransport<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsTransport").finish()
    }
}

impl<V: Verbs> VerbsTransport<V> {
    /// Posts every receive frame for every peer.
    pub fn new(mut v: V, opts: VerbsOptions) -> Result<Self, CollectiveError> {
        let (n, rank, slots, recv_slots) = (v.size(), v.rank(), v.slots(), v.recv_slots());
        if n > MAX_RANKS {
            return Err(CollectiveError::TooManyRanks(n));
        }
        if v.frame_size() <= Header::BYTES || slots == 0 {
            return Err(CollectiveError::InvalidArgument(format!(
                "verbs frames of {} bytes x {slots} slots are too small",
                v.frame_size()
            )));
        }
        for p in (0..n).filter(|&p| p != rank) {
            for s in 0..recv_slots {
                v.post_recv(p, s)?;
            }
        }
        Ok(VerbsTransport {
            v,
            opts,
            ready: (0..n)
                .map(|_| VecDeque::with_capacity(recv_slots))
                .collect(),
            in_flight: [0; MAX_RANKS],
            next_send: [0; MAX_RANKS],
            completions: vec![
                Completion {
                    kind: CompletionKind::Send,
                    peer: 0,
                    slot: 0,
                    len: 0
                };
                MAX_RANKS * (slots + recv_slots)
            ],
        })
    }

    /// The device (e.g. for a start-up barrier once every receive is posted).
    pub fn verbs_mut(&mut self) -> &mut V {
        &mut self.v
    }

    /// The device (e.g. for its counters).
    pub fn verbs(&self) -> &V {
        &self.v
    }

    fn frames(&self, len: usize) -> usize {
        (Header::BYTES + len).div_ceil(self.v.frame_size())
    }
}

impl<V: Verbs> Transport for VerbsTransport<V> {
    fn rank(&self) -> usize {
        self.v.rank()
    }

    fn size(&self) -> usize {
        self.v.size()
    }

    fn exchange(
        &mut self,
        sends: &mut [Outgoing<'_>],
        recvs: &mut [Incoming<'_>],
    ) -> Result<(), CollectiveError> {
        let frame = self.v.frame_size();
        let slots = self.v.slots();
        let mut last_progress = Instant::now();
        let mut spin_until = last_progress + self.opts.spin;
        let mut suspect = false;
        loop {
            let mut progressed = false;
            // Post as many frames as free send slots allow.
            for s in sends.iter_mut() {
                let total = self.frames(s.data.len());
                while s.done < total && self.in_flight[s.peer] < slots {
                    let slot = self.next_send[s.peer];
                    if s.done == 0 {
                        // First frame: header + the start of the data.
                        let body = (frame - Header::BYTES).min(s.data.len());
                        self.v
                            .post_send(s.peer, slot, &s.header.encode(), &s.data[..body])?;
                    } else {
                        let start = s.done * frame - Header::BYTES;
                        let end = (start + frame).min(s.data.len());
                        self.v.post_send(s.peer, slot, &[], &s.data[start..end])?;
                    }
                    s.done += 1;
                    self.in_flight[s.peer] += 1;
                    self.next_send[s.peer] = (slot + 1) % slots;
                    progressed = true;
                }
            }
            // Collect completions.
            let got = self.v.poll(&mut self.completions)?;
            for c in &self.completions[..got] {
                match c.kind {
                    CompletionKind::Send => {
                        self.in_flight[c.peer] = self.in_flight[c.peer].saturating_sub(1)
                    }
                    CompletionKind::Recv => self.ready[c.peer].push_back((c.slot, c.len)),
                }
                progressed = true;
            }
            // Consume arrived frames in order.
            for r in recvs.iter_mut() {
                let total = self.frames(r.data.len());
                while r.done < total {
                    let Some((slot, len)) = self.ready[r.peer].pop_front() else {
                        break;
                    };
                    if r.done == 0 {
                        let body = (frame - Header::BYTES).min(r.data.len());
                        let mut head = [0u8; 16];
                        self.v
                            .read_recv(r.peer, slot, 0, &mut head[..len.min(Header::BYTES)]);
                        r.header.check(r.peer, &head)?;
                        if len != Header::BYTES + body {
                            return Err(CollectiveError::Verbs(format!(
                                "frame of {len} bytes from rank {}, expected {}",
                                r.peer,
                                Header::BYTES + body
                            )));
                        }
                        self.v
                            .read_recv(r.peer, slot, Header::BYTES, &mut r.data[..body]);
                    } else {
                        let start = r.done * frame - Header::BYTES;
                        let end = (start + frame).min(r.data.len());
                        if len != end - start {
                            return Err(CollectiveError::Verbs(format!(
                                "frame of {len} bytes from rank {}, expected {}",
                                r.peer,
                                end - start
                            )));
                        }
                        self.v.read_recv(r.peer, slot, 0, &mut r.data[start..end]);
                    }
                    self.v.post_recv(r.peer, slot)?;
                    r.done += 1;
                    progressed = true;
                }
            }
            let sends_done = sends.iter().all(|s| s.done == self.frames(s.data.len()));
            let recvs_done = recvs.iter().all(|r| r.done == self.frames(r.data.len()));
            if sends_done && recvs_done {
                return Ok(());
            }
            let now = Instant::now();
            if progressed {
                last_progress = now;
                spin_until = now + self.opts.spin;
                suspect = false;
                continue;
            }
            // Nothing moved: is everyone we wait for still there?
            let waiting = sends
                .iter()
                .filter(|s| s.done < self.frames(s.data.len()))
                .map(|s| s.peer)
                .chain(
                    recvs
                        .iter()
                        .filter(|r| r.done < self.frames(r.data.len()))
                        .map(|r| r.peer),
                );
            // A peer may deliver its last frames and exit between our poll
            // and this check: it is lost only if one more poll finds nothing.
            for peer in waiting {
                if !self.v.peer_alive(peer) {
                    if !suspect {
                        suspect = true;
                        break;
                    }
                    return Err(CollectiveError::PeerLost {
                        peer,
                        reason: "the side channel reports it gone".into(),
                    });
                }
            }
            let idle = now - last_progress;
            if idle >= self.opts.timeout {
                let peer = recvs
                    .iter()
                    .find(|r| r.done < self.frames(r.data.len()))
                    .map(|r| r.peer)
                    .or_else(|| sends.first().map(|s| s.peer))
                    .unwrap_or(self.v.rank());
                return Err(CollectiveError::Timeout {
                    peer,
                    timeout: self.opts.timeout,
                });
            }
            if suspect || now < spin_until {
                std::hint::spin_loop();
                continue;
            }
            self.v
                .wait((self.opts.timeout - idle).min(Duration::from_millis(20)));
        }
    }

    fn poison(&mut self) {
        self.v.shutdown();
    }
}
