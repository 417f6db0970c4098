//! An in-memory emulated RDMA fabric with verbs semantics, for tests.
//!
//! [`MemFabric::endpoints`] makes one [`MemEndpoint`] per rank (move each into its
//! own thread). Each endpoint has, per peer, `slots` registered receive
//! frames of `frame_size` bytes. A posted send whose peer has a posted
//! receive lands in that frame at once (receive completion at the peer, send
//! completion here); with none posted the frame waits in the peer's
//! receiver-not-ready queue until one is (as a reliable queue pair retries),
//! in order. A frame larger than `frame_size` is refused at post time, as a
//! verbs length error. A dropped endpoint is dead: its peers' side channel
//! reports it, and frames sent to it vanish silently, as on Apple's
//! unreliable-connected queue pairs.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use super::verbs::{check_recv, check_send, Completion, CompletionKind, Verbs};
use super::CollectiveError;

struct Inner {
    /// `recv_mem[peer * slots + slot]`.
    recv_mem: Vec<Vec<u8>>,
    /// Posted receive slots per source peer.
    posted: Vec<VecDeque<usize>>,
    /// Frames that arrived with no receive posted, per source peer.
    rnr: Vec<VecDeque<Vec<u8>>>,
    cq: VecDeque<Completion>,
}

struct Port {
    inner: Mutex<Inner>,
    cv: Condvar,
    alive: AtomicBool,
}

struct Shared {
    frame: usize,
    slots: usize,
    ports: Vec<Port>,
}

/// Builds the endpoints of one emulated fabric.
#[derive(Debug)]
pub struct MemFabric;

impl MemFabric {
    /// `size` endpoints with `slots` frames of `frame_size` bytes per peer.
    pub fn endpoints(size: usize, frame_size: usize, slots: usize) -> Vec<MemEndpoint> {
        let ports = (0..size)
            .map(|_| Port {
                inner: Mutex::new(Inner {
                    recv_mem: vec![vec![0u8; frame_size]; size * slots],
                    posted: (0..size).map(|_| VecDeque::new()).collect(),
                    rnr: (0..size).map(|_| VecDeque::new()).collect(),
                    cq: VecDeque::new(),
                }),
                cv: Condvar::new(),
                alive: AtomicBool::new(true),
            })
            .collect();
        let shared = Arc::new(Shared {
            frame: frame_size,
            slots,
            ports,
        });
        (0..size)
            .map(|rank| MemEndpoint {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }
}

/// One rank's port on the emulated fabric.
pub struct MemEndpoint {
    rank: usize,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for MemEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemEndpoint")
            .field("rank", &self.rank)
            .finish()
    }
}

fn lock(port: &Port) -> MutexGuard<'_, Inner> {
    // A panicking test thread poisons the mutex; the data is still consistent
    // (every critical section completes its writes before anything can panic).
    port.inner.lock().unwrap_or_else(|e| e.into_inner())
}

impl MemEndpoint {
    fn port(&self, rank: usize) -> &Port {
        &self.shared.ports[rank]
    }
}

impl Verbs for MemEndpoint {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.ports.len()
    }

    fn frame_size(&self) -> usize {
        self.shared.frame
    }

    fn slots(&self) -> usize {
        self.shared.slots
    }

    fn post_send(
        &mut self,
        peer: usize,
        slot: usize,
        head: &[u8],
        body: &[u8],
    ) -> Result<(), CollectiveError> {
        let len = head.len() + body.len();
        check_send(len, slot, self.shared.frame, self.shared.slots)?;
        let dst = self.port(peer);
        if dst.alive.load(Ordering::Acquire) {
            let mut d = lock(dst);
            let me = self.rank;
            if let Some(rslot) = d.posted[me].pop_front() {
                let idx = me * self.shared.slots + rslot;
                let frame = &mut d.recv_mem[idx];
                frame[..head.len()].copy_from_slice(head);
                frame[head.len()..len].copy_from_slice(body);
                d.cq.push_back(Completion {
                    kind: CompletionKind::Recv,
                    peer: me,
                    slot: rslot,
                    len,
                });
                dst.cv.notify_all();
            } else {
                let mut f = Vec::with_capacity(len);
                f.extend_from_slice(head);
                f.extend_from_slice(body);
                d.rnr[me].push_back(f);
            }
        }
        let port = self.port(self.rank);
        lock(port).cq.push_back(Completion {
            kind: CompletionKind::Send,
            peer,
            slot,
            len,
        });
        Ok(())
    }

    fn post_recv(&mut self, peer: usize, slot: usize) -> Result<(), CollectiveError> {
        check_recv(peer, slot, self.size(), self.shared.slots)?;
        let port = self.port(self.rank);
        let mut me = lock(port);
        if let Some(f) = me.rnr[peer].pop_front() {
            let idx = peer * self.shared.slots + slot;
            me.recv_mem[idx][..f.len()].copy_from_slice(&f);
            me.cq.push_back(Completion {
                kind: CompletionKind::Recv,
                peer,
                slot,
                len: f.len(),
            });
        } else {
            me.posted[peer].push_back(slot);
        }
        Ok(())
    }

    fn read_recv(&self, peer: usize, slot: usize, offset: usize, dst: &mut [u8]) {
        let me = lock(self.port(self.rank));
        let frame = &me.recv_mem[peer * self.shared.slots + slot];
        dst.copy_from_slice(&frame[offset..offset + dst.len()]);
    }

    fn poll(&mut self, out: &mut [Completion]) -> Result<usize, CollectiveError> {
        let mut me = lock(self.port(self.rank));
        let n = out.len().min(me.cq.len());
        for (o, c) in out.iter_mut().zip(me.cq.drain(..n)) {
            *o = c;
        }
        Ok(n)
    }

    fn wait(&mut self, timeout: Duration) {
        let port = self.port(self.rank);
        let me = lock(port);
        if me.cq.is_empty() {
            let _ = port.cv.wait_timeout(me, timeout);
        }
    }

    fn peer_alive(&self, peer: usize) -> bool {
        self.port(peer).alive.load(Ordering::Acquire)
    }

    fn shutdown(&mut self) {
        self.port(self.rank).alive.store(false, Ordering::Release);
        for p in &self.shared.ports {
            let _guard = lock(p);
            p.cv.notify_all();
        }
    }
}

impl Drop for MemEndpoint {
    fn drop(&mut self) {
        self.shutdown();
    }
}
