//! The collective algorithms, written once over a [`Transport`].
//!
//! A [`Transport`] moves a set of messages concurrently (every send and
//! receive of one step progresses at once, so a ring step or a mesh exchange
//! cannot deadlock on full buffers). [`Group`] turns steps into collectives:
//! - all-reduce: messages up to [`GroupOptions::mesh_max_bytes`] go through a
//!   direct mesh (one exchange; each rank sums all buffers in rank order);
//!   larger ones through a ring reduce-scatter then all-gather;
//! - all-gather, broadcast, barrier: one direct exchange;
//! - send/recv: one message.
//!
//! # Invariants
//! - Every message header carries the operation, a per-direction message
//!   index and the length; the receiving transport checks all three.
//! - Scratch buffers are `u64`-backed (aligned for every element type) and
//!   only grow.

use super::{CollectiveError, DType, Element, MAX_RANKS};
use half::{bf16, f16};

/// What a message belongs to (checked by the receiver).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    AllReduce = 1,
    ReduceScatter = 2,
    AllGather = 3,
    Broadcast = 4,
    SendRecv = 5,
    Barrier = 6,
}

impl Op {
    pub fn from_u8(v: u8) -> Option<Op> {
        Some(match v {
            1 => Op::AllReduce,
            2 => Op::ReduceScatter,
            3 => Op::AllGather,
            4 => Op::Broadcast,
            5 => Op::SendRecv,
            6 => Op::Barrier,
            _ => return None,
        })
    }
}

/// A message's header: 16 bytes on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub op: Op,
    /// Index of this message among all sent from the sender to the receiver.
    pub index: u64,
    pub len: u32,
}

impl Header {
    pub const BYTES: usize = 16;

    pub fn encode(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0] = 0x4d; // 'M'
        b[1] = self.op as u8;
        b[4..8].copy_from_slice(&self.len.to_le_bytes());
        b[8..16].copy_from_slice(&self.index.to_le_bytes());
        b
    }

    /// Checks received header bytes against what was expected.
    pub fn check(&self, peer: usize, got: &[u8; 16]) -> Result<(), CollectiveError> {
        let mut len = [0u8; 4];
        len.copy_from_slice(&got[4..8]);
        let mut index = [0u8; 8];
        index.copy_from_slice(&got[8..16]);
        let op = Op::from_u8(got[1]);
        let ok = got[0] == 0x4d
            && op == Some(self.op)
            && u32::from_le_bytes(len) == self.len
            && u64::from_le_bytes(index) == self.index;
        if ok {
            return Ok(());
        }
        Err(CollectiveError::Mismatch {
            peer,
            expected: format!("{:?} #{} of {} bytes", self.op, self.index, self.len),
            got: match op {
                Some(op) if got[0] == 0x4d => format!(
                    "{op:?} #{} of {} bytes",
                    u64::from_le_bytes(index),
                    u32::from_le_bytes(len)
                ),
                _ => "a malformed header".to_string(),
            },
        })
    }
}

/// One message to send in an exchange.
#[derive(Debug)]
pub struct Outgoing<'a> {
    pub peer: usize,
    pub header: Header,
    pub data: &'a [u8],
    /// Transport-private progress (bytes or frames done).
    pub done: usize,
}

/// One message to receive in an exchange (exactly `data.len()` bytes).
#[derive(Debug)]
pub struct Incoming<'a> {
    pub peer: usize,
    pub header: Header,
    pub data: &'a mut [u8],
    /// Transport-private progress.
    pub done: usize,
    /// Header bytes received so far (transports that stream bytes).
    pub header_buf: [u8; 16],
}

/// How bytes move between pod members.
///
/// Contract: `exchange` returns once every message in `sends` was handed to
/// the peer and every message in `recvs` was received in full and its header
/// checked, or fails. At most one send and one receive per peer per call.
/// After an error the transport is poisoned by [`Transport::poison`].
pub trait Transport: Send {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    fn exchange(
        &mut self,
        sends: &mut [Outgoing<'_>],
        recvs: &mut [Incoming<'_>],
    ) -> Result<(), CollectiveError>;
    /// Tears down every connection so the peers notice at once.
    fn poison(&mut self);
}

/// Tuning of the algorithms.
#[derive(Debug, Clone, Copy)]
pub struct GroupOptions {
    /// All-reduces up to this many bytes use the direct mesh; larger use the ring.
    pub mesh_max_bytes: usize,
}

impl Default for GroupOptions {
    fn default() -> Self {
        GroupOptions {
            mesh_max_bytes: 64 * 1024,
        }
    }
}

/// A pod's collectives over one transport.
pub struct Group<T> {
    t: T,
    opts: GroupOptions,
    sent: [u64; MAX_RANKS],
    received: [u64; MAX_RANKS],
    poisoned: bool,
    /// One per rank; slot `rank` holds this rank's own copy in the mesh sum.
    scratch: Vec<Vec<u64>>,
}

impl<T: std::fmt::Debug> std::fmt::Debug for Group<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("transport", &self.t)
            .field("poisoned", &self.poisoned)
            .finish()
    }
}

fn grow(buf: &mut Vec<u64>, bytes: usize) -> &mut [u8] {
    let words = bytes.div_ceil(8);
    if buf.len() < words {
        buf.resize(words, 0);
    }
    &mut bytemuck::cast_slice_mut::<u64, u8>(buf)[..bytes]
}

fn view(buf: &[u64], bytes: usize) -> &[u8] {
    &bytemuck::cast_slice::<u64, u8>(buf)[..bytes]
}

/// Splits `data` into a shared `a` range and a mutable `b` range (disjoint).
fn two_ranges(
    data: &mut [u8],
    a: std::ops::Range<usize>,
    b: std::ops::Range<usize>,
) -> (&[u8], &mut [u8]) {
    if a.end <= b.start {
        let (lo, hi) = data.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = data.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}

/// `dst += src` element-wise.
fn add_into(dst: &mut [u8], src: &[u8], dtype: DType) {
    fn typed<E: Element>(dst: &mut [u8], src: &[u8]) {
        match (
            bytemuck::try_cast_slice_mut::<u8, E>(dst),
            bytemuck::try_cast_slice::<u8, E>(src),
        ) {
            (Ok(d), Ok(s)) => {
                for (d, s) in d.iter_mut().zip(s) {
                    *d = E::from_f32(d.to_f32() + s.to_f32());
                }
            }
            // Unaligned caller buffer: element by element through copies.
            (d, _) => {
                let es = std::mem::size_of::<E>();
                let _ = d;
                for (d, s) in dst.chunks_exact_mut(es).zip(src.chunks_exact(es)) {
                    let a: E = bytemuck::pod_read_unaligned(d);
                    let b: E = bytemuck::pod_read_unaligned(s);
                    d.copy_from_slice(bytemuck::bytes_of(&E::from_f32(a.to_f32() + b.to_f32())));
                }
            }
        }
    }
    match dtype {
        DType::F32 => typed::<f32>(dst, src),
        DType::F16 => typed::<f16>(dst, src),
        DType::BF16 => typed::<bf16>(dst, src),
    }
}

/// `bufs[own][i] = Σ_r bufs[r][i]` in rank order, accumulating in f32.
fn sum_ordered(bufs: &mut [Vec<u64>], own: usize, bytes: usize, dtype: DType) {
    fn typed<E: Element>(bufs: &mut [Vec<u64>], own: usize, bytes: usize) {
        let mut out = std::mem::take(&mut bufs[own]);
        let n = bytes / std::mem::size_of::<E>();
        {
            let out_e: &mut [E] = &mut bytemuck::cast_slice_mut::<u64, E>(&mut out)[..n];
            let others: [Option<&[E]>; MAX_RANKS] = std::array::from_fn(|r| {
                (r < bufs.len() && r != own).then(|| &bytemuck::cast_slice::<u64, E>(&bufs[r])[..n])
            });
            let ranks = bufs.len();
            for (i, o) in out_e.iter_mut().enumerate() {
                let mut acc = 0.0f32;
                for (r, other) in others.iter().enumerate().take(ranks) {
                    let v = match other {
                        Some(b) => b[i].to_f32(),
                        None => o.to_f32(),
                    };
                    acc = if r == 0 { v } else { acc + v };
                }
                *o = E::from_f32(acc);
            }
        }
        bufs[own] = out;
    }
    match dtype {
        DType::F32 => typed::<f32>(bufs, own, bytes),
        DType::F16 => typed::<f16>(bufs, own, bytes),
        DType::BF16 => typed::<bf16>(bufs, own, bytes),
    }
}

impl<T: Transport> Group<T> {
    pub fn new(t: T, opts: GroupOptions) -> Self {
        let n = t.size();
        Group {
            t,
            opts,
            sent: [0; MAX_RANKS],
            received: [0; MAX_RANKS],
            poisoned: false,
            scratch: vec![Vec::new(); n],
        }
    }

    pub fn transport(&self) -> &T {
        &self.t
    }

    /// The transport back (e.g. to keep its connections as a side channel).
    pub fn into_transport(self) -> T {
        self.t
    }

    fn out_header(&mut self, peer: usize, op: Op, len: usize) -> Result<Header, CollectiveError> {
        let len = u32::try_from(len).map_err(|_| {
            CollectiveError::InvalidArgument(format!("message of {len} bytes exceeds 4 GiB"))
        })?;
        let index = self.sent[peer];
        self.sent[peer] += 1;
        Ok(Header { op, index, len })
    }

    fn in_header(&mut self, peer: usize, op: Op, len: usize) -> Result<Header, CollectiveError> {
        let len = u32::try_from(len).map_err(|_| {
            CollectiveError::InvalidArgument(format!("message of {len} bytes exceeds 4 GiB"))
        })?;
        let index = self.received[peer];
        self.received[peer] += 1;
        Ok(Header { op, index, len })
    }

    /// Runs `f`, poisoning the group (and the transport) on failure.
    fn guarded<R>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<R, CollectiveError>,
    ) -> Result<R, CollectiveError> {
        if self.poisoned {
            return Err(CollectiveError::Poisoned);
        }
        let r = f(self);
        if let Err(e) = &r {
            if !matches!(e, CollectiveError::InvalidArgument(_)) {
                self.poisoned = true;
                self.t.poison();
            }
        }
        r
    }

    fn mesh_all_reduce(&mut self, data: &mut [u8], dtype: DType) -> Result<(), CollectiveError> {
        let (n, rank, len) = (self.t.size(), self.t.rank(), data.len());
        for s in self.scratch.iter_mut() {
            grow(s, len);
        }
        let mut sends: [Option<Outgoing<'_>>; MAX_RANKS] = std::array::from_fn(|_| None);
        let mut heads = [None; MAX_RANKS];
        for p in (0..n).filter(|&p| p != rank) {
            heads[p] = Some((
                self.out_header(p, Op::AllReduce, len)?,
                self.in_header(p, Op::AllReduce, len)?,
            ));
        }
        {
            let mut recvs: [Option<Incoming<'_>>; MAX_RANKS] = std::array::from_fn(|_| None);
            for (p, s) in self.scratch.iter_mut().enumerate() {
                if let Some((out, inc)) = heads[p] {
                    sends[p] = Some(Outgoing {
                        peer: p,
                        header: out,
                        data,
                        done: 0,
                    });
                    recvs[p] = Some(Incoming {
                        peer: p,
                        header: inc,
                        data: &mut bytemuck::cast_slice_mut::<u64, u8>(s)[..len],
                        done: 0,
                        header_buf: [0; 16],
                    });
                }
            }
            exchange_opt(&mut self.t, &mut sends, &mut recvs)?;
        }
        grow(&mut self.scratch[rank], len).copy_from_slice(data);
        sum_ordered(&mut self.scratch, rank, len, dtype);
        data.copy_from_slice(view(&self.scratch[rank], len));
        Ok(())
    }

    fn ring_all_reduce(&mut self, data: &mut [u8], dtype: DType) -> Result<(), CollectiveError> {
        let (n, rank) = (self.t.size(), self.t.rank());
        let es = dtype.size();
        let elems = data.len() / es;
        let chunk = |c: usize| (c * elems / n) * es..((c + 1) * elems / n) * es;
        let (right, left) = ((rank + 1) % n, (rank + n - 1) % n);
        let biggest = (0..n).map(|c| chunk(c).len()).max().unwrap_or(0);
        grow(&mut self.scratch[rank], biggest);
        // Reduce-scatter.
        for s in 0..n - 1 {
            let (sc, rc) = ((rank + n - s) % n, (rank + 2 * n - s - 1) % n);
            let (sr, rr) = (chunk(sc), chunk(rc));
            let out = self.out_header(right, Op::ReduceScatter, sr.len())?;
            let inc = self.in_header(left, Op::ReduceScatter, rr.len())?;
            let buf = grow(&mut self.scratch[rank], rr.len());
            let mut sends = [Outgoing {
                peer: right,
                header: out,
                data: &data[sr],
                done: 0,
            }];
            let mut recvs = [Incoming {
                peer: left,
                header: inc,
                data: buf,
                done: 0,
                header_buf: [0; 16],
            }];
            self.t.exchange(&mut sends, &mut recvs)?;
            add_into(
                &mut data[rr.clone()],
                view(&self.scratch[rank], rr.len()),
                dtype,
            );
        }
        // All-gather of the reduced chunks.
        for s in 0..n - 1 {
            let (sc, rc) = ((rank + 1 + n - s) % n, (rank + n - s) % n);
            let (sr, rr) = (chunk(sc), chunk(rc));
            let out = self.out_header(right, Op::AllGather, sr.len())?;
            let inc = self.in_header(left, Op::AllGather, rr.len())?;
            let (src, dst) = two_ranges(data, sr, rr);
            let mut sends = [Outgoing {
                peer: right,
                header: out,
                data: src,
                done: 0,
            }];
            let mut recvs = [Incoming {
                peer: left,
                header: inc,
                data: dst,
                done: 0,
                header_buf: [0; 16],
            }];
            self.t.exchange(&mut sends, &mut recvs)?;
        }
        Ok(())
    }
}

/// Compacts the per-peer option arrays into slices and exchanges them.
fn exchange_opt<T: Transport>(
    t: &mut T,
    sends: &mut [Option<Outgoing<'_>>; MAX_RANKS],
    recvs: &mut [Option<Incoming<'_>>; MAX_RANKS],
) -> Result<(), CollectiveError> {
    let mut s: [Outgoing<'_>; MAX_RANKS] = std::array::from_fn(|_| Outgoing {
        peer: 0,
        header: Header {
            op: Op::Barrier,
            index: 0,
            len: 0,
        },
        data: &[],
        done: 0,
    });
    let mut r: [Incoming<'_>; MAX_RANKS] = std::array::from_fn(|_| Incoming {
        peer: 0,
        header: Header {
            op: Op::Barrier,
            index: 0,
            len: 0,
        },
        data: &mut [],
        done: 0,
        header_buf: [0; 16],
    });
    let mut ns = 0;
    for o in sends.iter_mut().filter_map(Option::take) {
        s[ns] = o;
        ns += 1;
    }
    let mut nr = 0;
    for i in recvs.iter_mut().filter_map(Option::take) {
        r[nr] = i;
        nr += 1;
    }
    t.exchange(&mut s[..ns], &mut r[..nr])
}

impl<T: Transport> super::Collective for Group<T> {
    fn rank(&self) -> usize {
        self.t.rank()
    }

    fn size(&self) -> usize {
        self.t.size()
    }

    fn all_reduce_sum(&mut self, data: &mut [u8], dtype: DType) -> Result<(), CollectiveError> {
        if !data.len().is_multiple_of(dtype.size()) {
            return Err(CollectiveError::InvalidArgument(format!(
                "{} bytes is not a whole number of {dtype:?} elements",
                data.len()
            )));
        }
        let n = self.t.size();
        if n == 1 {
            return Ok(());
        }
        let mesh = data.len() <= self.opts.mesh_max_bytes || data.len() / dtype.size() < n;
        self.guarded(|g| {
            if mesh {
                g.mesh_all_reduce(data, dtype)
            } else {
                g.ring_all_reduce(data, dtype)
            }
        })
    }

    fn all_gather(&mut self, input: &[u8], output: &mut [u8]) -> Result<(), CollectiveError> {
        let (n, rank, m) = (self.t.size(), self.t.rank(), input.len());
        if output.len() != n * m {
            return Err(CollectiveError::InvalidArgument(format!(
                "all-gather output is {} bytes, expected {n} x {m}",
                output.len()
            )));
        }
        self.guarded(|g| {
            let mut sends: [Option<Outgoing<'_>>; MAX_RANKS] = std::array::from_fn(|_| None);
            let mut recvs: [Option<Incoming<'_>>; MAX_RANKS] = std::array::from_fn(|_| None);
            let mut rest = output;
            for p in 0..n {
                let (mine, tail) = std::mem::take(&mut rest).split_at_mut(m);
                rest = tail;
                if p == rank {
                    mine.copy_from_slice(input);
                    continue;
                }
                sends[p] = Some(Outgoing {
                    peer: p,
                    header: g.out_header(p, Op::AllGather, m)?,
                    data: input,
                    done: 0,
                });
                recvs[p] = Some(Incoming {
                    peer: p,
                    header: g.in_header(p, Op::AllGather, m)?,
                    data: mine,
                    done: 0,
                    header_buf: [0; 16],
                });
            }
            exchange_opt(&mut g.t, &mut sends, &mut recvs)
        })
    }

    fn broadcast(&mut self, data: &mut [u8], root: usize) -> Result<(), CollectiveError> {
        let (n, rank) = (self.t.size(), self.t.rank());
        if root >= n {
            return Err(CollectiveError::InvalidArgument(format!(
                "broadcast root {root} in a pod of {n}"
            )));
        }
        self.guarded(|g| {
            let mut sends: [Option<Outgoing<'_>>; MAX_RANKS] = std::array::from_fn(|_| None);
            let mut recvs: [Option<Incoming<'_>>; MAX_RANKS] = std::array::from_fn(|_| None);
            let len = data.len();
            if rank == root {
                for p in (0..n).filter(|&p| p != rank) {
                    sends[p] = Some(Outgoing {
                        peer: p,
                        header: g.out_header(p, Op::Broadcast, len)?,
                        data,
                        done: 0,
                    });
                }
            } else {
                recvs[root] = Some(Incoming {
                    peer: root,
                    header: g.in_header(root, Op::Broadcast, len)?,
                    data,
                    done: 0,
                    header_buf: [0; 16],
                });
            }
            exchange_opt(&mut g.t, &mut sends, &mut recvs)
        })
    }

    fn send(&mut self, data: &[u8], to: usize) -> Result<(), CollectiveError> {
        if to >= self.t.size() || to == self.t.rank() {
            return Err(CollectiveError::InvalidArgument(format!(
                "send to rank {to}"
            )));
        }
        self.guarded(|g| {
            let header = g.out_header(to, Op::SendRecv, data.len())?;
            g.t.exchange(
                &mut [Outgoing {
                    peer: to,
                    header,
                    data,
                    done: 0,
                }],
                &mut [],
            )
        })
    }

    fn recv(&mut self, data: &mut [u8], from: usize) -> Result<(), CollectiveError> {
        if from >= self.t.size() || from == self.t.rank() {
            return Err(CollectiveError::InvalidArgument(format!(
                "receive from rank {from}"
            )));
        }
        self.guarded(|g| {
            let header = g.in_header(from, Op::SendRecv, data.len())?;
            g.t.exchange(
                &mut [],
                &mut [Incoming {
                    peer: from,
                    header,
                    data,
                    done: 0,
                    header_buf: [0; 16],
                }],
            )
        })
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        let (n, rank) = (self.t.size(), self.t.rank());
        self.guarded(|g| {
            let mut sends: [Option<Outgoing<'_>>; MAX_RANKS] = std::array::from_fn(|_| None);
            let mut recvs: [Option<Incoming<'_>>; MAX_RANKS] = std::array::from_fn(|_| None);
            for p in (0..n).filter(|&p| p != rank) {
                sends[p] = Some(Outgoing {
                    peer: p,
                    header: g.out_header(p, Op::Barrier, 0)?,
                    data: &[],
                    done: 0,
                });
                recvs[p] = Some(Incoming {
                    peer: p,
                    header: g.in_header(p, Op::Barrier, 0)?,
                    data: &mut [],
                    done: 0,
                    header_buf: [0; 16],
                });
            }
            exchange_opt(&mut g.t, &mut sends, &mut recvs)
        })
    }
}
