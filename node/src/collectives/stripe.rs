//! Several cables between the same pair of pod members: frames striped over
//! one queue pair per cable ("lane"), and a fall-back to the other lanes
//! when one fails.
//!
//! [`Striped`] is a [`Verbs`] over several [`Verbs`] lanes (one
//! [`super::ibverbs::RdmaVerbs`] per cable index of the hostfile's `rdma`
//! lists). Every frame towards a peer gets a per-peer sequence number (the
//! first [`SEQ`] bytes of the frame) and goes on the peer's live lanes in
//! turn, so a large message moves about `1/lanes` of its bytes on each; the
//! receiver hands frames to the transport in sequence order, whichever lane
//! brought them.
//!
//! When a lane's queue pair to a peer fails (a failed work completion, as a
//! pulled cable or a port going down gives, or a post the device refuses)
//! while another lane to that peer lives and the side channel says the peer
//! is there, the lane is dropped for that peer with a logged reason, and
//! every frame still in flight on it is posted again, in order, on the
//! remaining lanes: a frame whose completion never came may or may not have
//! arrived, and the receiver drops the copy it already has by its sequence
//! number. The peer is told over a remaining lane (a notice frame), so it
//! stops using the lane too, even if it has nothing in flight on it that
//! could fail (a frame waiting there for credit, say).
//!
//! # Invariants
//! - A transport send slot is in flight on at most one lane at a time, and
//!   each lane's send slot `s` is only ever used by transport slot `s`, so a
//!   frame can always move to another lane.
//! - Send completions reach the transport in the order the frames were
//!   posted, as one queue pair gives them ([`super::verbs::VerbsTransport`]
//!   reuses its send slots in turn, so it relies on that): lanes complete
//!   out of order (and a frame sent again after a failure completes after
//!   newer ones), so a completion is held until every older frame to that
//!   peer has completed too. A slot posted again before its completion was
//!   handed out is refused.
//! - Frames reach the transport exactly once and in sequence order.
//!
//! # Failure
//! With no lane left to a peer (or the side channel reporting it gone) the
//! lane's error is returned as is. On unreliable-connected queue pairs a
//! frame lost without an error completion is not fallen back from: the
//! lane's sequence check still turns it into an error.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use super::verbs::{Completion, CompletionKind, Verbs};
use super::{CollectiveError, MAX_RANKS};

/// Bytes of the per-peer sequence number at the start of every frame.
pub const SEQ: usize = 4;
/// Data frames count modulo 2^31; a sequence word with this bit set is a
/// notice ("lane `n` to you failed", the lane in the next byte).
const NOTICE: u32 = 1 << 31;
const SEQ_MASK: u32 = NOTICE - 1;
/// Most lanes (cables) per pair.
pub const MAX_LANES: usize = 4;
/// Largest transport header a frame carries (the group's message header).
const MAX_HEAD: usize = 16;

/// Where one in-flight transport send slot is.
#[derive(Debug, Clone, Copy)]
struct InFlight {
    lane: usize,
    /// Bytes of the frame after the sequence number.
    len: usize,
    seq: u32,
}

/// Per-peer state.
#[derive(Debug)]
struct Peer {
    /// Lanes that reach this peer and have not failed.
    live: [bool; MAX_LANES],
    next_send: u32,
    next_recv: u32,
    in_flight: Vec<Option<InFlight>>,
    /// Send slots posted and not yet handed back to the transport, oldest
    /// first.
    order: VecDeque<usize>,
    /// Per send slot: its frame completed, waiting for older ones.
    completed: Vec<bool>,
    /// Frames that came ahead of `next_recv`: sequence → (receive id, len).
    ahead: BTreeMap<u32, (usize, usize)>,
    /// Failed lanes the peer has yet to be told of.
    notices: VecDeque<usize>,
}

/// [`Verbs`] striped over several lanes.
pub struct Striped<V> {
    lanes: Vec<V>,
    /// Transport send slots; each lane's slot `slots` carries notices.
    slots: usize,
    /// Notice slot of each lane towards each peer is in flight.
    notice_busy: Vec<[bool; MAX_LANES]>,
    /// Receive frames per lane and peer (a transport receive id is
    /// `lane * lane_recv + slot`).
    lane_recv: usize,
    peers: Vec<Peer>,
    /// Completions ready for the transport.
    ready: VecDeque<Completion>,
    scratch: Vec<Completion>,
    /// Payload bytes posted per lane (sequence numbers not counted).
    bytes: Vec<u64>,
    failovers: Vec<String>,
}

impl<V> std::fmt::Debug for Striped<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Striped")
            .field("lanes", &self.lanes.len())
            .field("bytes", &self.bytes)
            .field("failovers", &self.failovers)
            .finish()
    }
}

/// `a` comes before `b` in wrapping (31-bit) sequence order.
fn before(a: u32, b: u32) -> bool {
    a != b && b.wrapping_sub(a) & SEQ_MASK < NOTICE / 2
}

impl<V: Verbs> Striped<V> {
    /// Stripes over `lanes` (at least one; every lane of the same pod, rank
    /// and frame layout; lane 0 reaches every peer).
    pub fn new(lanes: Vec<V>) -> Result<Striped<V>, CollectiveError> {
        let Some(first) = lanes.first() else {
            return Err(CollectiveError::InvalidArgument(
                "no lanes to stripe over".into(),
            ));
        };
        if lanes.len() > MAX_LANES {
            return Err(CollectiveError::InvalidArgument(format!(
                "{} lanes per pair, at most {MAX_LANES}",
                lanes.len()
            )));
        }
        let (rank, size, slots, lane_recv) = (
            first.rank(),
            first.size(),
            first.slots(),
            first.recv_slots(),
        );
        if size > MAX_RANKS {
            return Err(CollectiveError::TooManyRanks(size));
        }
        if lanes.iter().any(|l| {
            l.rank() != rank
                || l.size() != size
                || l.slots() != slots
                || l.recv_slots() != lane_recv
        }) || first.frame_size() <= SEQ + MAX_HEAD
            || slots < 2
        {
            return Err(CollectiveError::InvalidArgument(
                "striped lanes must have the same ranks, slots and frames".into(),
            ));
        }
        let peers = (0..size)
            .map(|p| Peer {
                live: std::array::from_fn(|l| l < lanes.len() && lanes[l].connected(p)),
                next_send: 0,
                next_recv: 0,
                in_flight: vec![None; slots - 1],
                order: VecDeque::with_capacity(slots - 1),
                completed: vec![false; slots - 1],
                ahead: BTreeMap::new(),
                notices: VecDeque::new(),
            })
            .collect();
        let bytes = vec![0; lanes.len()];
        Ok(Striped {
            scratch: vec![
                Completion {
                    kind: CompletionKind::Send,
                    peer: 0,
                    slot: 0,
                    len: 0,
                };
                size * (slots + lane_recv)
            ],
            lanes,
            slots: slots - 1,
            notice_busy: vec![[false; MAX_LANES]; size],
            lane_recv,
            peers,
            ready: VecDeque::new(),
            bytes,
            failovers: Vec::new(),
        })
    }

    /// The lanes (e.g. for a start-up barrier).
    pub fn lanes_mut(&mut self) -> &mut [V] {
        &mut self.lanes
    }

    /// Payload bytes posted on each lane so far.
    pub fn lane_bytes(&self) -> &[u64] {
        &self.bytes
    }

    /// Why lanes were dropped, one line per fall-back.
    pub fn failovers(&self) -> &[String] {
        &self.failovers
    }

    /// The lane frame `seq` to `peer` goes on: its live lanes in turn.
    fn lane_for(&self, peer: usize, seq: u32) -> Option<usize> {
        let live = &self.peers[peer].live;
        let n = live.iter().filter(|&&l| l).count();
        if n == 0 {
            return None;
        }
        (0..MAX_LANES).filter(|&l| live[l]).nth(seq as usize % n)
    }

    /// Posts frame `seq` (`head`, which starts with the sequence number,
    /// then `body`) from transport slot `slot` on a live lane, falling back
    /// while lanes fail.
    fn post_frame(
        &mut self,
        peer: usize,
        slot: usize,
        seq: u32,
        head: &[u8],
        body: &[u8],
    ) -> Result<(), CollectiveError> {
        let len = head.len() + body.len() - SEQ;
        loop {
            let Some(lane) = self.lane_for(peer, seq) else {
                return Err(CollectiveError::Link {
                    peer,
                    reason: "no rdma lane left".into(),
                });
            };
            match self.lanes[lane].post_send(peer, slot, head, body) {
                Ok(()) => {
                    self.peers[peer].in_flight[slot] = Some(InFlight { lane, len, seq });
                    self.bytes[lane] += len as u64;
                    return Ok(());
                }
                Err(e) => self.fail(peer, lane, e, true)?,
            }
        }
    }

    /// Drops `lane` for `peer` after `error`, moving its frames in flight
    /// to the other lanes; `error` itself when there is nothing to fall
    /// back to.
    fn fail(
        &mut self,
        peer: usize,
        lane: usize,
        error: CollectiveError,
        tell: bool,
    ) -> Result<(), CollectiveError> {
        if !self.peers[peer].live[lane] {
            // Fallen back from already: what the lane still reports is moot.
            return Ok(());
        }
        let others = (0..self.lanes.len()).any(|l| l != lane && self.peers[peer].live[l]);
        if !others || !self.peer_alive(peer) {
            return Err(error);
        }
        // Read every frame in flight on the failed lane before anything
        // else is posted.
        let next = self.peers[peer].next_send;
        let mut moving: Vec<(usize, InFlight)> = self.peers[peer]
            .in_flight
            .iter()
            .enumerate()
            .filter_map(|(s, f)| f.filter(|f| f.lane == lane).map(|f| (s, f)))
            .collect();
        // Oldest first: the farthest behind the next sequence number.
        moving.sort_by_key(|(_, f)| std::cmp::Reverse(next.wrapping_sub(f.seq) & SEQ_MASK));
        let mut frames = Vec::with_capacity(moving.len());
        for &(slot, f) in &moving {
            let mut frame = vec![0u8; SEQ + f.len];
            if !self.lanes[lane].read_send(peer, slot, &mut frame) {
                return Err(error);
            }
            frames.push((slot, f.seq, frame));
        }
        self.peers[peer].live[lane] = false;
        let reason = format!(
            "rdma lane {lane} to rank {peer} failed ({error}); {} frames in flight go again \
             over the remaining lanes",
            frames.len()
        );
        tracing::warn!(rank = self.lanes[0].rank(), peer, lane, %reason, "rdma lane dropped");
        self.failovers.push(reason);
        for (slot, seq, frame) in frames {
            self.peers[peer].in_flight[slot] = None;
            self.post_frame(peer, slot, seq, &frame, &[])?;
        }
        if tell {
            self.peers[peer].notices.push_back(lane);
            self.send_notices(peer)?;
        }
        Ok(())
    }

    /// Sends the peer its pending notices, each on a live lane whose notice
    /// slot is free.
    fn send_notices(&mut self, peer: usize) -> Result<(), CollectiveError> {
        while let Some(&failed) = self.peers[peer].notices.front() {
            let Some(lane) = (0..self.lanes.len())
                .find(|&l| self.peers[peer].live[l] && !self.notice_busy[peer][l])
            else {
                return Ok(());
            };
            let mut frame = [0u8; SEQ + 1];
            frame[..SEQ].copy_from_slice(&NOTICE.to_le_bytes());
            frame[SEQ] = failed as u8;
            match self.lanes[lane].post_send(peer, self.slots, &frame, &[]) {
                Ok(()) => {
                    self.notice_busy[peer][lane] = true;
                    self.peers[peer].notices.pop_front();
                }
                Err(e) => self.fail(peer, lane, e, true)?,
            }
        }
        Ok(())
    }

    /// Posts receive `slot` of `lane` from `peer` again, unless the lane
    /// has failed for that peer.
    fn repost(&mut self, peer: usize, lane: usize, slot: usize) -> Result<(), CollectiveError> {
        if !self.peers[peer].live[lane] {
            return Ok(());
        }
        match self.lanes[lane].post_recv(peer, slot) {
            Ok(()) => Ok(()),
            Err(e) => self.fail(peer, lane, e, true),
        }
    }

    /// Takes one lane's completions into `ready`.
    fn take(&mut self, lane: usize, got: usize) -> Result<(), CollectiveError> {
        for i in 0..got {
            let c = self.scratch[i];
            match c.kind {
                CompletionKind::Send if c.slot == self.slots => {
                    self.notice_busy[c.peer][lane] = false;
                    self.send_notices(c.peer)?;
                }
                CompletionKind::Send => {
                    let p = &mut self.peers[c.peer];
                    // Only the lane it is on now completes a slot (a frame
                    // moved off a failed lane may still complete there).
                    if p.in_flight
                        .get(c.slot)
                        .copied()
                        .flatten()
                        .is_some_and(|f| f.lane == lane)
                    {
                        p.in_flight[c.slot] = None;
                        p.completed[c.slot] = true;
                        // Handed back in posting order.
                        while let Some(&s) = p.order.front().filter(|&&s| p.completed[s]) {
                            p.order.pop_front();
                            p.completed[s] = false;
                            self.ready.push_back(Completion { slot: s, ..c });
                        }
                    }
                }
                CompletionKind::Recv => {
                    let mut seq = [0u8; SEQ];
                    self.lanes[lane].read_recv(c.peer, c.slot, 0, &mut seq);
                    let seq = u32::from_le_bytes(seq);
                    if seq & NOTICE != 0 && c.len == SEQ + 1 {
                        let mut failed = [0u8; 1];
                        self.lanes[lane].read_recv(c.peer, c.slot, SEQ, &mut failed);
                        self.repost(c.peer, lane, c.slot)?;
                        let failed = usize::from(failed[0]);
                        if failed < self.lanes.len() {
                            let why = CollectiveError::Link {
                                peer: c.peer,
                                reason: format!("rank {} reports its lane {failed} failed", c.peer),
                            };
                            self.fail(c.peer, failed, why, false)?;
                        }
                        continue;
                    }
                    let p = &mut self.peers[c.peer];
                    let id = lane * self.lane_recv + c.slot;
                    if c.len < SEQ || before(seq, p.next_recv) || p.ahead.contains_key(&seq) {
                        // A copy of a frame already here (sent again after
                        // its lane failed): the receive goes back at once.
                        if c.len >= SEQ {
                            self.repost(c.peer, lane, c.slot)?;
                            continue;
                        }
                        return Err(CollectiveError::Link {
                            peer: c.peer,
                            reason: format!("a frame of {} bytes has no sequence number", c.len),
                        });
                    }
                    p.ahead.insert(seq, (id, c.len - SEQ));
                    while let Some((id, len)) = p.ahead.remove(&p.next_recv) {
                        p.next_recv = p.next_recv.wrapping_add(1) & SEQ_MASK;
                        self.ready.push_back(Completion {
                            kind: CompletionKind::Recv,
                            peer: c.peer,
                            slot: id,
                            len,
                        });
                    }
                }
            }
        }
        Ok(())
    }
}

impl<V: Verbs> Verbs for Striped<V> {
    fn rank(&self) -> usize {
        self.lanes[0].rank()
    }

    fn size(&self) -> usize {
        self.lanes[0].size()
    }

    fn frame_size(&self) -> usize {
        self.lanes.iter().map(V::frame_size).min().unwrap_or(0) - SEQ
    }

    fn slots(&self) -> usize {
        self.slots
    }

    fn recv_slots(&self) -> usize {
        self.lanes.len() * self.lane_recv
    }

    fn connected(&self, peer: usize) -> bool {
        self.peers
            .get(peer)
            .is_some_and(|p| p.live.iter().any(|&l| l))
    }

    fn post_send(
        &mut self,
        peer: usize,
        slot: usize,
        head: &[u8],
        body: &[u8],
    ) -> Result<(), CollectiveError> {
        if peer >= self.peers.len() || slot >= self.slots || head.len() > MAX_HEAD {
            return Err(CollectiveError::Verbs(format!(
                "send to rank {peer} in slot {slot} with a {}-byte head",
                head.len()
            )));
        }
        if self.peers[peer].in_flight[slot].is_some() || self.peers[peer].completed[slot] {
            return Err(CollectiveError::Verbs(format!(
                "send slot {slot} to rank {peer} posted again before its completion"
            )));
        }
        let seq = self.peers[peer].next_send;
        self.peers[peer].next_send = seq.wrapping_add(1) & SEQ_MASK;
        let mut frame = [0u8; SEQ + MAX_HEAD];
        frame[..SEQ].copy_from_slice(&seq.to_le_bytes());
        frame[SEQ..SEQ + head.len()].copy_from_slice(head);
        // The lane copies the two pieces into its registered frame.
        self.post_frame(peer, slot, seq, &frame[..SEQ + head.len()], body)?;
        self.peers[peer].order.push_back(slot);
        Ok(())
    }

    fn post_recv(&mut self, peer: usize, slot: usize) -> Result<(), CollectiveError> {
        let (lane, s) = (slot / self.lane_recv, slot % self.lane_recv);
        if lane >= self.lanes.len() || peer >= self.peers.len() {
            return Err(CollectiveError::Verbs(format!(
                "receive slot {slot} from rank {peer} does not exist"
            )));
        }
        // A failed or absent lane's receives are not posted again.
        self.repost(peer, lane, s)
    }

    fn read_recv(&self, peer: usize, slot: usize, offset: usize, dst: &mut [u8]) {
        let (lane, s) = (slot / self.lane_recv, slot % self.lane_recv);
        if let Some(l) = self.lanes.get(lane) {
            l.read_recv(peer, s, SEQ + offset, dst);
        }
    }

    fn poll(&mut self, out: &mut [Completion]) -> Result<usize, CollectiveError> {
        // Failed lanes too: frames the peer's device delivered (and saw
        // completed) before the failure are still to be taken, and only
        // their sequence numbers say whether they are copies.
        for lane in 0..self.lanes.len() {
            let polled = {
                let (lanes, scratch) = (&mut self.lanes, &mut self.scratch);
                lanes[lane].poll(scratch)
            };
            match polled {
                Ok(got) => self.take(lane, got)?,
                Err(e) => {
                    let peer = match &e {
                        CollectiveError::Link { peer, .. }
                        | CollectiveError::PeerLost { peer, .. } => *peer,
                        _ => return Err(e),
                    };
                    self.fail(peer, lane, e, true)?;
                }
            }
        }
        let n = out.len().min(self.ready.len());
        for (o, c) in out.iter_mut().zip(self.ready.drain(..n)) {
            *o = c;
        }
        Ok(n)
    }

    fn wait(&mut self, timeout: Duration) {
        if self.ready.is_empty() {
            self.lanes[0].wait(timeout);
        }
    }

    fn peer_alive(&self, peer: usize) -> bool {
        self.lanes.iter().any(|l| l.peer_alive(peer))
    }

    fn shutdown(&mut self) {
        for l in &mut self.lanes {
            l.shutdown();
        }
    }
}
