//! The RDMA device: a real [`Verbs`] over the system verbs library, loaded at
//! run time: `libibverbs.so.1` on Linux (InfiniBand/RoCE), and on macOS 26.2+
//! `/usr/lib/librdma.dylib`, the library RDMA over Thunderbolt 5 exposes (the
//! file MLX's JACCL dlopens). No build or link dependency: a machine without
//! the library gets [`RdmaError::LibraryNotFound`] at run time.
//!
//! Setting a pod up ([`connect`], then [`Pending::finish`]):
//! 1. every rank opens, per peer, the device its hostfile row names for that
//!    peer (one device per cable, as JACCL's matrix says), checks port 1 is
//!    active, picks a GID (the IPv4-mapped one, as JACCL; else the first
//!    non-zero one), allocates a protection domain, a completion queue, a
//!    queue pair and `slots` send + `slots` receive frames of [`FRAME`]
//!    bytes, registered once;
//! 2. the ranks agree over the TCP side channel that every rank got that
//!    far (one rank's failure fails every rank with that rank's reason);
//! 3. they exchange [`QpInfo`] (queue-pair number, packet sequence number,
//!    LID, GID, MTU) over the side channel and move each queue pair
//!    INIT → RTR → RTS, then agree again;
//! 4. the TCP connections stay open as the side channel: a closed one is a
//!    lost peer ([`Verbs::peer_alive`]), and [`Verbs::shutdown`] closes them.
//!
//! Queue-pair type ([`QueuePairs`]): unreliable connected (UC) on macOS, as
//! JACCL uses (what Apple's stack offers); reliable connected (RC)
//! elsewhere, where every InfiniBand/RoCE device has it.
//!
//! A UC queue pair drops a frame that arrives before its receive is posted,
//! so frames are sent on credit ([`Credit`]): each side counts the receives
//! it has posted and writes the count into every frame it sends; a sender
//! only sends into receives it knows are posted, holding frames back (in
//! order) until the count arrives, and a receiver that has nothing to send
//! returns the count in a credit-only frame. RC queue pairs use the same
//! scheme, so they never fall back on receiver-not-ready retries.
//!
//! Each frame starts with an 8-byte prefix (a per-peer sequence number, the
//! credit count, a magic word for data or credit): should a frame still be
//! lost, the receiver turns the gap into [`CollectiveError::Link`] rather
//! than placing the next frame at the wrong offset.
//!
//! Waits: the transport spins first; a longer wait blocks on a completion
//! channel per queue pair (`ibv_req_notify_cq` arms the queue, `poll(2)` on
//! the channels' fds sleeps until one has a completion, a last poll of the
//! queues after arming catches a completion that came before) where the
//! library has the channel verbs; without them, a 50 us sleep between
//! polls.
//!
//! One [`RdmaVerbs`] is one cable per pair; several cables per pair are
//! several of them, striped by [`super::stripe::Striped`]. A failed queue
//! pair fails only its own peer's traffic ([`CollectiveError::Link`], or
//! [`CollectiveError::PeerLost`] for retries exhausted), so the stripe can
//! carry on over another cable.
//!
//! # Invariants
//! - Work request ids are `kind << 32 | slot`; one completion queue per peer,
//!   so a completion's peer is the queue it came from.
//! - Frames are registered once; no allocation per operation.
//! - Nothing is dlclosed: function pointers stay valid for the process.
//!
//! # Failure
//! Setup fails with [`RdmaError`] (library not found, symbol missing, no such
//! device with the list of those present, port down, no usable GID, a verbs
//! call failing with its errno, a queue-pair transition failing with its
//! errno, a peer rank's failure), wrapped in [`CollectiveError::Rdma`]. At run
//! time a failed work completion is [`CollectiveError::Link`] naming the
//! device (or [`CollectiveError::PeerLost`] for retry-exceeded on RC) and
//! marks that queue pair failed (the good completions polled with it are
//! still handed out), and a closed side channel is a lost peer.

mod ffi;

use std::collections::VecDeque;
use std::ffi::c_int;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::OnceLock;
use std::time::Duration;

use super::verbs::{check_recv, check_send, Completion, CompletionKind, Verbs};
use super::{first_failure, Collective, CollectiveError};

pub use ffi::Library;

/// Bytes per registered frame (JACCL's `FRAME_SIZE`).
pub const FRAME: usize = 4096;
/// Bytes of the per-frame prefix (sequence number, credit count, magic).
pub const PREFIX: usize = 8;
/// Frames per direction per peer.
pub const SLOTS: usize = 16;
/// The device port (JACCL and every single-port device: 1).
const PORT: u8 = 1;
/// The prefix's last two bytes: a data frame, or a frame that only returns
/// credit.
const DATA_MAGIC: u16 = 0x4d56; // "VM"
const CREDIT_MAGIC: u16 = 0x4356; // "VC"
const KIND_SEND: u64 = 1;
const KIND_RECV: u64 = 2;

/// Why RDMA could not be set up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RdmaError {
    #[error("verbs library {library} not found: {reason}")]
    LibraryNotFound { library: String, reason: String },
    #[error("verbs library {library} lacks {symbol}")]
    SymbolMissing {
        library: String,
        symbol: &'static str,
    },
    #[error("no rdma device {device} (devices present: {})", list(available))]
    NoSuchDevice {
        device: String,
        available: Vec<String>,
    },
    #[error("rdma device {device}: port {port} is not active (state {state})")]
    PortDown {
        device: String,
        port: u8,
        state: i32,
    },
    #[error(
        "rdma device {device} publishes no usable GID (on Thunderbolt, give the \
         interface an IPv4 address, e.g. a 169.254/16 link-local one)"
    )]
    NoGid { device: String },
    #[error("rdma device {device}: {call} failed (errno {errno})")]
    Call {
        device: String,
        call: &'static str,
        errno: i32,
    },
    #[error(
        "rdma device {device}: queue pair to rank {peer} could not move to {state} (errno {errno})"
    )]
    QpTransition {
        device: String,
        peer: usize,
        state: &'static str,
        errno: i32,
    },
    #[error("rank {peer} sent a malformed queue-pair record: {reason}")]
    Exchange { peer: usize, reason: String },
    #[error("rank {rank} could not set up rdma: {reason}")]
    PeerFailed { rank: usize, reason: String },
    #[error("{slots} rdma slots need more frame memory than can be allocated")]
    TooManySlots { slots: usize },
}

fn list(v: &[String]) -> String {
    if v.is_empty() {
        "none".into()
    } else {
        v.join(", ")
    }
}

/// The verbs library this platform loads.
pub fn library_name() -> &'static str {
    if cfg!(target_os = "macos") {
        "/usr/lib/librdma.dylib"
    } else {
        "libibverbs.so.1"
    }
}

/// The system verbs library, loaded once per process.
pub fn system() -> Result<&'static Library, RdmaError> {
    static LIB: OnceLock<Result<Library, RdmaError>> = OnceLock::new();
    LIB.get_or_init(|| Library::open(library_name()))
        .as_ref()
        .map_err(Clone::clone)
}

/// One line for `mlx-node doctor`: whether the library loads and which
/// devices it lists.
pub fn probe() -> String {
    match system() {
        Ok(lib) => format!(
            "verbs library {}: loaded, devices: {}",
            lib.path,
            list(&lib.device_names())
        ),
        Err(e) => format!("{e}: RDMA unavailable, pods use TCP"),
    }
}

// ---- pure parts: GIDs, the exchanged record ----

/// A GID as verbs prints it: eight groups of four hex digits.
pub fn format_gid(gid: &[u8; 16]) -> String {
    gid.chunks(2)
        .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
        .collect::<Vec<_>>()
        .join(":")
}

/// Parses [`format_gid`]'s form (also accepts `::`-compressed IPv6 text).
pub fn parse_gid(text: &str) -> Option<[u8; 16]> {
    if let Ok(ip) = text.parse::<std::net::Ipv6Addr>() {
        return Some(ip.octets());
    }
    None
}

/// True for `::ffff:a.b.c.d`, the GID a RoCE v2 / Thunderbolt port derives
/// from an IPv4 address.
pub fn is_ipv4_mapped(gid: &[u8; 16]) -> bool {
    gid[..10].iter().all(|&b| b == 0) && gid[10] == 0xff && gid[11] == 0xff
}

/// The GID table entry to use: the first IPv4-mapped one (what JACCL picks),
/// else the first non-zero one; `None` when every entry is zero.
pub fn pick_gid(table: &[[u8; 16]]) -> Option<usize> {
    table
        .iter()
        .position(is_ipv4_mapped)
        .or_else(|| table.iter().position(|g| g.iter().any(|&b| b != 0)))
}

/// What a rank tells the peer at the other end of one queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpInfo {
    pub qp_num: u32,
    pub psn: u32,
    pub lid: u16,
    /// Active MTU as the `ibv_mtu` enum (1 = 256 .. 5 = 4096).
    pub mtu: u8,
    pub gid: [u8; 16],
}

impl QpInfo {
    pub const BYTES: usize = 32;
    const MAGIC: u32 = 0x5150_4d56; // "VMPQ"

    pub fn encode(&self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        b[0..4].copy_from_slice(&Self::MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&self.qp_num.to_le_bytes());
        b[8..12].copy_from_slice(&self.psn.to_le_bytes());
        b[12..14].copy_from_slice(&self.lid.to_le_bytes());
        b[14] = self.mtu;
        b[16..32].copy_from_slice(&self.gid);
        b
    }

    pub fn decode(peer: usize, b: &[u8]) -> Result<QpInfo, RdmaError> {
        let bad = |reason: String| RdmaError::Exchange { peer, reason };
        if b.len() != Self::BYTES {
            return Err(bad(format!("{} bytes, expected {}", b.len(), Self::BYTES)));
        }
        let word = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        if word(0) != Self::MAGIC {
            return Err(bad("no queue-pair record magic".into()));
        }
        let mut info = QpInfo {
            qp_num: word(4),
            psn: word(8),
            lid: u16::from_le_bytes([b[12], b[13]]),
            mtu: b[14],
            gid: [0; 16],
        };
        info.gid.copy_from_slice(&b[16..32]);
        if info.psn > 0xff_ffff || info.qp_num > 0xff_ffff {
            return Err(bad(format!(
                "queue pair {} / psn {} exceed 24 bits",
                info.qp_num, info.psn
            )));
        }
        if !(1..=5).contains(&info.mtu) {
            return Err(bad(format!("mtu code {}", info.mtu)));
        }
        Ok(info)
    }
}

fn wr_id(kind: u64, slot: usize) -> u64 {
    kind << 32 | slot as u64
}

fn split_wr_id(id: u64) -> (u64, usize) {
    (id >> 32, (id & 0xffff_ffff) as usize)
}

/// A frame's prefix: its sequence number, the sender's count of receives
/// posted for us, and what it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Prefix {
    seq: u32,
    posted: u16,
    credit_only: bool,
}

impl Prefix {
    fn encode(self) -> [u8; PREFIX] {
        let mut p = [0u8; PREFIX];
        p[..4].copy_from_slice(&self.seq.to_le_bytes());
        p[4..6].copy_from_slice(&self.posted.to_le_bytes());
        let magic = if self.credit_only {
            CREDIT_MAGIC
        } else {
            DATA_MAGIC
        };
        p[6..].copy_from_slice(&magic.to_le_bytes());
        p
    }

    /// Decodes a received prefix, checking it is the next expected frame.
    fn check(peer: usize, p: &[u8; PREFIX], expected: u32) -> Result<Prefix, CollectiveError> {
        let credit_only = match u16::from_le_bytes([p[6], p[7]]) {
            DATA_MAGIC => false,
            CREDIT_MAGIC => true,
            _ => {
                return Err(CollectiveError::Link {
                    peer,
                    reason: format!("frame from rank {peer} has no frame magic"),
                })
            }
        };
        let seq = u32::from_le_bytes([p[0], p[1], p[2], p[3]]);
        if seq != expected {
            return Err(CollectiveError::Link {
                peer,
                reason: format!(
                    "frame {expected} from rank {peer} was lost (got frame {seq}; \
                     an unreliable queue pair drops frames silently)"
                ),
            });
        }
        Ok(Prefix {
            seq,
            posted: u16::from_le_bytes([p[4], p[5]]),
            credit_only,
        })
    }
}

/// Credit flow control towards one peer.
///
/// An unreliable queue pair drops a frame that finds no receive posted, so
/// a sender may only send into receives it knows are posted. Each side
/// counts the receives it has posted (cumulative, wrapping) and writes the
/// count into every frame it sends; the sender's credit is the peer's
/// latest count minus the frames it has sent. Every receive is posted
/// before the first exchange (a barrier), so both start at `slots`.
///
/// A data frame needs 2 credits, so one is always left for a credit-only
/// frame: when a receiver has re-posted half its receives without sending
/// anything back, it returns the count in a frame of its own (the receiver
/// of that frame re-posts it at once). Neither side can then wait on the
/// other's credit forever.
#[derive(Debug)]
struct Credit {
    slots: u16,
    /// Receives posted for the peer.
    posted: u16,
    /// The `posted` last written into a frame to the peer.
    advertised: u16,
    /// The peer's `posted`, from its latest frame.
    peer_posted: u16,
    /// Frames sent to the peer.
    sent: u16,
    /// Data frames written into their send slot, waiting for credit:
    /// (slot, length after the prefix).
    deferred: VecDeque<(usize, usize)>,
    /// The credit-only frame is in flight.
    credit_busy: bool,
}

impl Credit {
    fn new(slots: usize) -> Credit {
        let slots = slots as u16;
        Credit {
            slots,
            posted: 0,
            advertised: slots,
            peer_posted: slots,
            sent: 0,
            deferred: VecDeque::with_capacity(slots as usize),
            credit_busy: false,
        }
    }

    /// Receives the peer has posted that no frame of ours has taken yet.
    fn credits(&self) -> i32 {
        self.peer_posted.wrapping_sub(self.sent) as i16 as i32
    }

    /// Receives posted here that the peer has not been told of.
    fn owed(&self) -> i32 {
        (self.posted.wrapping_sub(self.advertised) as i16 as i32).max(0)
    }

    /// A data frame may go now (keeping one credit back).
    fn data_may_go(&self) -> bool {
        self.credits() >= 2
    }

    /// A credit-only frame should go.
    fn credit_frame_due(&self) -> bool {
        !self.credit_busy && self.owed() >= (self.slots as i32 / 2).max(1) && self.credits() >= 1
    }

    /// A frame is being sent: the count it carries.
    fn stamp(&mut self) -> u16 {
        self.sent = self.sent.wrapping_add(1);
        self.advertised = self.posted;
        self.posted
    }

    /// A frame from the peer said it has posted `posted` receives.
    fn heard(&mut self, posted: u16) {
        if posted.wrapping_sub(self.peer_posted) as i16 > 0 {
            self.peer_posted = posted;
        }
    }
}

// ---- the side channel ----

/// The TCP connections kept open beside the queue pairs: a peer whose
/// connection closes is gone.
#[derive(Debug)]
pub struct SideChannel {
    links: Vec<Option<TcpStream>>,
}

impl SideChannel {
    /// `links[p]`: the connection to rank `p` (`None` for this rank).
    pub fn new(links: Vec<Option<TcpStream>>) -> Result<SideChannel, CollectiveError> {
        for (peer, s) in links.iter().enumerate() {
            if let Some(s) = s {
                s.set_nonblocking(true)
                    .map_err(|e| CollectiveError::PeerLost {
                        peer,
                        reason: e.to_string(),
                    })?;
            }
        }
        Ok(SideChannel { links })
    }

    /// The same connections again (for another lane of a striped link:
    /// closing either closes both).
    pub fn try_clone(&self) -> Result<SideChannel, CollectiveError> {
        let links = self
            .links
            .iter()
            .enumerate()
            .map(|(peer, s)| {
                s.as_ref().map(|s| s.try_clone()).transpose().map_err(|e| {
                    CollectiveError::PeerLost {
                        peer,
                        reason: format!("side channel: {e}"),
                    }
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(SideChannel { links })
    }

    /// True while `peer`'s connection is open (no data ever flows after
    /// [`SideChannel::barrier`], so a readable socket means closed).
    pub fn alive(&self, peer: usize) -> bool {
        let Some(Some(s)) = self.links.get(peer) else {
            return false;
        };
        let mut b = [0u8; 1];
        match s.peek(&mut b) {
            Ok(0) => false,
            Ok(_) => true,
            Err(e) => e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted,
        }
    }

    /// Every rank has reached this point (one byte each way per peer).
    pub fn barrier(&mut self, timeout: Duration) -> Result<(), CollectiveError> {
        const SYNC: u8 = 0xb7;
        for (peer, s) in self.links.iter_mut().enumerate() {
            let Some(s) = s else { continue };
            let lost = |e: std::io::Error| CollectiveError::PeerLost {
                peer,
                reason: format!("side channel: {e}"),
            };
            s.set_nonblocking(false).map_err(lost)?;
            s.set_write_timeout(Some(timeout)).map_err(lost)?;
            s.write_all(&[SYNC]).map_err(lost)?;
        }
        for (peer, s) in self.links.iter_mut().enumerate() {
            let Some(s) = s else { continue };
            let lost = |e: std::io::Error| CollectiveError::PeerLost {
                peer,
                reason: format!("side channel: {e}"),
            };
            s.set_read_timeout(Some(timeout)).map_err(lost)?;
            let mut b = [0u8; 1];
            s.read_exact(&mut b).map_err(lost)?;
            if b[0] != SYNC {
                return Err(CollectiveError::Mismatch {
                    peer,
                    expected: "the side channel's sync byte".into(),
                    got: format!("byte {:#x}", b[0]),
                });
            }
            s.set_nonblocking(true).map_err(lost)?;
        }
        Ok(())
    }

    /// Closes every connection: the peers see this rank gone.
    pub fn shutdown(&mut self) {
        for s in self.links.iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

// ---- agreement over the side channel ----

/// Every rank learns whether every rank's `local` step succeeded; a failure
/// anywhere fails everywhere (this rank's own error, or the first failed
/// rank's reason).
pub fn agree<T>(
    comm: &mut dyn Collective,
    local: Result<T, RdmaError>,
) -> Result<T, CollectiveError> {
    let failed = first_failure(comm, local.as_ref().err().map(|e| e as _))?;
    let value = local?;
    match failed {
        Some((rank, reason)) => Err(RdmaError::PeerFailed { rank, reason }.into()),
        None => Ok(value),
    }
}

/// Exchanges one record per ordered pair: `mine[p]` goes to rank `p`; the
/// result's `[p]` is what rank `p` made for this rank.
pub fn exchange_infos(
    comm: &mut dyn Collective,
    mine: &[Option<QpInfo>],
) -> Result<Vec<Option<QpInfo>>, CollectiveError> {
    let (n, rank) = (comm.size(), comm.rank());
    if mine.len() != n {
        return Err(CollectiveError::InvalidArgument(format!(
            "{} queue-pair records for a pod of {n}",
            mine.len()
        )));
    }
    let row = QpInfo::BYTES * n;
    let mut out = vec![0u8; row];
    for (p, info) in mine.iter().enumerate() {
        if let Some(info) = info {
            out[p * QpInfo::BYTES..(p + 1) * QpInfo::BYTES].copy_from_slice(&info.encode());
        }
    }
    let mut all = vec![0u8; row * n];
    comm.all_gather(&out, &mut all)?;
    (0..n)
        .map(|p| {
            // A pair without a cable on this lane exchanges no record (the
            // matrix is symmetric, so neither side expects one).
            if p == rank || mine[p].is_none() {
                return Ok(None);
            }
            let at = p * row + rank * QpInfo::BYTES;
            QpInfo::decode(p, &all[at..at + QpInfo::BYTES])
                .map(Some)
                .map_err(CollectiveError::from)
        })
        .collect()
}

// ---- the device ----

/// Page-aligned frames: `slots` send frames and the credit frame, then
/// `slots` receive frames.
struct Frames {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl Frames {
    /// `None` when `bytes` (rounded to pages) does not fit the address space.
    fn new(bytes: usize) -> Option<Frames> {
        let layout = std::alloc::Layout::from_size_align(bytes, 4096).ok()?;
        // SAFETY: non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Some(Frames { ptr, layout })
    }
}

impl Drop for Frames {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// One peer's queue pair and frames.
struct Conn {
    lib: &'static Library,
    device: String,
    ctx: *mut ffi::Context,
    pd: *mut ffi::Pd,
    /// The completion channel waits block on (null: the library has none).
    channel: *mut ffi::CompChannel,
    /// The completion queue will raise an event on the channel.
    armed: bool,
    cq: *mut ffi::Cq,
    qp: *mut ffi::Qp,
    mr: *mut ffi::Mr,
    frames: Frames,
    slots: usize,
    gid_index: u8,
    local: QpInfo,
    kind: QueuePairs,
    /// Next sequence number to send / expected to receive.
    send_seq: u32,
    recv_seq: u32,
    credit: Credit,
    /// Why this queue pair failed; a failed one is no longer polled or
    /// posted to.
    failed: Option<String>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        // SAFETY: each pointer is null or a live object created by `open`,
        // destroyed once, children before parents.
        unsafe {
            if !self.qp.is_null() {
                (self.lib.destroy_qp)(self.qp);
            }
            if !self.cq.is_null() {
                (self.lib.destroy_cq)(self.cq);
            }
            if let (false, Some(ch)) = (self.channel.is_null(), self.lib.channels) {
                (ch.destroy)(self.channel);
            }
            if !self.mr.is_null() {
                (self.lib.dereg_mr)(self.mr);
            }
            if !self.pd.is_null() {
                (self.lib.dealloc_pd)(self.pd);
            }
            if !self.ctx.is_null() {
                (self.lib.close_device)(self.ctx);
            }
        }
    }
}

/// The queue-pair type: what the device delivers when a frame finds no
/// receive posted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueuePairs {
    /// Reliable connected: the sender retries until a receive is posted.
    Reliable,
    /// Unreliable connected: the frame is dropped (Thunderbolt's only kind).
    Unreliable,
}

impl QueuePairs {
    /// UC on macOS (as JACCL), RC elsewhere.
    pub fn platform() -> QueuePairs {
        if cfg!(target_os = "macos") {
            QueuePairs::Unreliable
        } else {
            QueuePairs::Reliable
        }
    }

    fn raw(self) -> c_int {
        match self {
            QueuePairs::Reliable => ffi::IBV_QPT_RC,
            QueuePairs::Unreliable => ffi::IBV_QPT_UC,
        }
    }
}

impl Conn {
    fn open(
        lib: &'static Library,
        device: &str,
        slots: usize,
        kind: QueuePairs,
    ) -> Result<Conn, RdmaError> {
        let call = |call: &'static str| RdmaError::Call {
            device: device.into(),
            call,
            errno: errno(),
        };
        let frames = slots
            .checked_mul(2)
            .and_then(|n| n.checked_add(1))
            .and_then(|n| n.checked_mul(FRAME))
            .and_then(Frames::new)
            .ok_or(RdmaError::TooManySlots { slots })?;
        // SAFETY: the device list is used and freed here; every pointer
        // comes from the library and is checked before use.
        let ctx = unsafe {
            let mut n: c_int = 0;
            let list = (lib.get_device_list)(&mut n);
            let mut names = Vec::new();
            let mut ctx = std::ptr::null_mut();
            if !list.is_null() {
                for i in 0..n.max(0) as usize {
                    let d = *list.add(i);
                    if d.is_null() {
                        break;
                    }
                    let name = ffi::name_of(lib, d);
                    if name == device {
                        ctx = (lib.open_device)(d);
                        if ctx.is_null() {
                            let e = call("ibv_open_device");
                            (lib.free_device_list)(list);
                            return Err(e);
                        }
                        break;
                    }
                    names.push(name);
                }
                (lib.free_device_list)(list);
            }
            if ctx.is_null() {
                return Err(RdmaError::NoSuchDevice {
                    device: device.into(),
                    available: names,
                });
            }
            ctx
        };
        let mut conn = Conn {
            lib,
            device: device.into(),
            ctx,
            pd: std::ptr::null_mut(),
            channel: std::ptr::null_mut(),
            armed: false,
            cq: std::ptr::null_mut(),
            qp: std::ptr::null_mut(),
            mr: std::ptr::null_mut(),
            frames,
            slots,
            kind,
            credit: Credit::new(slots),
            gid_index: 0,
            local: QpInfo {
                qp_num: 0,
                psn: rand::random::<u32>() & 0xff_ffff,
                lid: 0,
                mtu: ffi::IBV_MTU_1024 as u8,
                gid: [0; 16],
            },
            send_seq: 0,
            recv_seq: 0,
            failed: None,
        };
        // SAFETY: ctx is open; every created object is stored in `conn` at
        // once, so `Drop` releases it on any later error.
        unsafe {
            let mut port = ffi::PortAttr::default();
            if (lib.query_port)(ctx, PORT, &mut port) != 0 {
                return Err(call("ibv_query_port"));
            }
            if port.state != ffi::IBV_PORT_ACTIVE {
                return Err(RdmaError::PortDown {
                    device: device.into(),
                    port: PORT,
                    state: port.state,
                });
            }
            let table: Vec<[u8; 16]> = (0..port.gid_tbl_len.clamp(0, 256))
                .map(|i| {
                    let mut g = ffi::Gid::default();
                    if (lib.query_gid)(ctx, PORT, i, &mut g) == 0 {
                        g.raw
                    } else {
                        [0; 16]
                    }
                })
                .collect();
            match pick_gid(&table) {
                Some(i) => {
                    conn.gid_index = i as u8;
                    conn.local.gid = table[i];
                }
                // InfiniBand routes by LID alone; anything else needs a GID.
                None if port.lid != 0 => {}
                None => {
                    return Err(RdmaError::NoGid {
                        device: device.into(),
                    })
                }
            }
            conn.local.lid = port.lid;
            conn.local.mtu = port.active_mtu.clamp(1, ffi::IBV_MTU_4096) as u8;
            tracing::debug!(
                device,
                gid = %format_gid(&conn.local.gid),
                gid_index = conn.gid_index,
                lid = port.lid,
                mtu = conn.local.mtu,
                "rdma port up"
            );

            conn.pd = (lib.alloc_pd)(ctx);
            if conn.pd.is_null() {
                return Err(call("ibv_alloc_pd"));
            }
            // A completion channel where the library has one (waits then
            // block on its fd); without it, waits poll.
            if let Some(ch) = lib.channels {
                conn.channel = (ch.create)(ctx);
            }
            conn.cq = (lib.create_cq)(
                ctx,
                (2 * slots + 1) as c_int,
                std::ptr::null_mut(),
                conn.channel,
                0,
            );
            if conn.cq.is_null() {
                return Err(call("ibv_create_cq"));
            }
            let mut init = ffi::QpInitAttr {
                qp_context: std::ptr::null_mut(),
                send_cq: conn.cq,
                recv_cq: conn.cq,
                srq: std::ptr::null_mut(),
                cap: ffi::QpCap {
                    max_send_wr: slots as u32 + 1,
                    max_recv_wr: slots as u32,
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline_data: 0,
                },
                qp_type: kind.raw(),
                sq_sig_all: 0,
            };
            conn.qp = (lib.create_qp)(conn.pd, &mut init);
            if conn.qp.is_null() {
                return Err(call("ibv_create_qp"));
            }
            conn.local.qp_num = (*conn.qp).qp_num;
            conn.mr = (lib.reg_mr)(
                conn.pd,
                conn.frames.ptr.cast(),
                conn.frames.layout.size(),
                ffi::IBV_ACCESS_LOCAL_WRITE,
            );
            if conn.mr.is_null() {
                return Err(call("ibv_reg_mr"));
            }
            let mut attr = ffi::QpAttr {
                qp_state: ffi::IBV_QPS_INIT,
                port_num: PORT,
                pkey_index: 0,
                qp_access_flags: (ffi::IBV_ACCESS_LOCAL_WRITE
                    | ffi::IBV_ACCESS_REMOTE_WRITE
                    | ffi::IBV_ACCESS_REMOTE_READ) as u32,
                ..Default::default()
            };
            let mask = ffi::IBV_QP_STATE
                | ffi::IBV_QP_PKEY_INDEX
                | ffi::IBV_QP_PORT
                | ffi::IBV_QP_ACCESS_FLAGS;
            conn.modify(&mut attr, mask, usize::MAX, "INIT")?;
        }
        Ok(conn)
    }

    fn modify(
        &mut self,
        attr: &mut ffi::QpAttr,
        mask: c_int,
        peer: usize,
        state: &'static str,
    ) -> Result<(), RdmaError> {
        // SAFETY: live queue pair; `attr` outlives the call.
        let rc = unsafe { (self.lib.modify_qp)(self.qp, attr, mask) };
        if rc != 0 {
            return Err(RdmaError::QpTransition {
                device: self.device.clone(),
                peer,
                state,
                errno: if rc > 0 { rc } else { errno() },
            });
        }
        Ok(())
    }

    /// RTR towards `remote`, then RTS.
    fn connect(&mut self, peer: usize, remote: &QpInfo) -> Result<(), RdmaError> {
        let rc = self.kind == QueuePairs::Reliable;
        let mut mtu = self.local.mtu.min(remote.mtu) as c_int;
        if cfg!(target_os = "macos") {
            mtu = mtu.min(ffi::IBV_MTU_1024); // what JACCL uses on Thunderbolt
        }
        let mut attr = ffi::QpAttr {
            qp_state: ffi::IBV_QPS_RTR,
            path_mtu: mtu,
            rq_psn: remote.psn,
            dest_qp_num: remote.qp_num,
            ..Default::default()
        };
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.port_num = PORT;
        if remote.gid[8..].iter().any(|&b| b != 0) {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid = ffi::Gid { raw: remote.gid };
            attr.ah_attr.grh.sgid_index = self.gid_index;
            attr.ah_attr.grh.hop_limit = if cfg!(target_os = "macos") { 1 } else { 64 };
        }
        let mut mask = ffi::IBV_QP_STATE
            | ffi::IBV_QP_AV
            | ffi::IBV_QP_PATH_MTU
            | ffi::IBV_QP_DEST_QPN
            | ffi::IBV_QP_RQ_PSN;
        if rc {
            attr.max_dest_rd_atomic = 1;
            attr.min_rnr_timer = 12;
            mask |= ffi::IBV_QP_MAX_DEST_RD_ATOMIC | ffi::IBV_QP_MIN_RNR_TIMER;
        }
        self.modify(&mut attr, mask, peer, "RTR")?;
        let mut attr = ffi::QpAttr {
            qp_state: ffi::IBV_QPS_RTS,
            sq_psn: self.local.psn,
            ..Default::default()
        };
        let mut mask = ffi::IBV_QP_STATE | ffi::IBV_QP_SQ_PSN;
        if rc {
            attr.timeout = 14;
            attr.retry_cnt = 7;
            attr.rnr_retry = 7; // retry forever while the receiver is not ready
            attr.max_rd_atomic = 1;
            mask |= ffi::IBV_QP_TIMEOUT
                | ffi::IBV_QP_RETRY_CNT
                | ffi::IBV_QP_RNR_RETRY
                | ffi::IBV_QP_MAX_QP_RD_ATOMIC;
        }
        self.modify(&mut attr, mask, peer, "RTS")
    }

    /// Send frame `slot` (`slots`: the credit frame) or receive frame `slot`.
    fn frame(&self, recv: bool, slot: usize) -> *mut u8 {
        let index = if recv { self.slots + 1 + slot } else { slot };
        // SAFETY: index < 2 * slots + 1, within the allocation.
        unsafe { self.frames.ptr.add(index * FRAME) }
    }

    fn lkey(&self) -> u32 {
        // SAFETY: registered in `open`.
        unsafe { (*self.mr).lkey }
    }

    fn ops(&self) -> &ffi::ContextOps {
        // SAFETY: the queue pair's context is live and its ops table filled
        // in by the provider.
        unsafe { &(*(*self.qp).context).ops }
    }

    /// Posts send frame `slot` (`slots`: the credit frame), whose `len`
    /// bytes after the prefix are written, stamping its prefix now.
    fn post_frame(
        &mut self,
        peer: usize,
        slot: usize,
        len: usize,
        credit_only: bool,
    ) -> Result<(), CollectiveError> {
        let prefix = Prefix {
            seq: self.send_seq,
            posted: self.credit.stamp(),
            credit_only,
        };
        let frame = self.frame(false, slot);
        // SAFETY: the frame is `FRAME` bytes and not in flight.
        unsafe { std::ptr::copy_nonoverlapping(prefix.encode().as_ptr(), frame, PREFIX) };
        let mut sge = ffi::Sge {
            addr: frame as u64,
            length: (PREFIX + len) as u32,
            lkey: self.lkey(),
        };
        let mut wr = ffi::SendWr {
            wr_id: wr_id(KIND_SEND, slot),
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
            opcode: ffi::IBV_WR_SEND,
            send_flags: ffi::IBV_SEND_SIGNALED,
            imm_data: 0,
            wr: [0; 4],
            qp_type: [0; 2],
            bind_mw: [0; 6],
        };
        let post = self
            .ops()
            .post_send
            .ok_or_else(|| CollectiveError::Verbs("the provider has no post_send".into()))?;
        let mut bad = std::ptr::null_mut();
        // SAFETY: live queue pair; `wr` and `sge` outlive the call (the
        // provider copies them into its queue).
        let rc = unsafe { post(self.qp, &mut wr, &mut bad) };
        if rc != 0 {
            return Err(CollectiveError::Verbs(format!(
                "posting a send to rank {peer} failed (errno {rc})"
            )));
        }
        self.send_seq = self.send_seq.wrapping_add(1);
        Ok(())
    }

    /// Posts receive frame `slot`.
    fn post_receive(&mut self, peer: usize, slot: usize) -> Result<(), CollectiveError> {
        let mut sge = ffi::Sge {
            addr: self.frame(true, slot) as u64,
            length: FRAME as u32,
            lkey: self.lkey(),
        };
        let mut wr = ffi::RecvWr {
            wr_id: wr_id(KIND_RECV, slot),
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        let post = self
            .ops()
            .post_recv
            .ok_or_else(|| CollectiveError::Verbs("the provider has no post_recv".into()))?;
        let mut bad = std::ptr::null_mut();
        // SAFETY: as in `post_frame`.
        let rc = unsafe { post(self.qp, &mut wr, &mut bad) };
        if rc != 0 {
            return Err(CollectiveError::Verbs(format!(
                "posting a receive from rank {peer} failed (errno {rc})"
            )));
        }
        self.credit.posted = self.credit.posted.wrapping_add(1);
        Ok(())
    }

    /// Sends what credit now allows: deferred data frames in order, then a
    /// credit-only frame if one is due.
    fn pump(&mut self, peer: usize) -> Result<(), CollectiveError> {
        while self.credit.data_may_go() {
            let Some((slot, len)) = self.credit.deferred.pop_front() else {
                break;
            };
            self.post_frame(peer, slot, len, false)?;
        }
        if self.credit.credit_frame_due() {
            self.post_frame(peer, self.slots, 0, true)?;
            self.credit.credit_busy = true;
        }
        Ok(())
    }
}

/// A queue pair per peer, set up but not yet joined to its side channel.
pub struct Pending {
    rank: usize,
    conns: Vec<Option<Conn>>,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending").field("rank", &self.rank).finish()
    }
}

/// Sets up a queue pair to every peer over `comm` (the TCP side channel)
/// with verbs library `lib` ([`system`] in production): `devices[p]` is this
/// rank's device towards rank `p` (`None` for itself). Every rank calls it;
/// all succeed or all fail (with [`CollectiveError::Rdma`]; any other error
/// is the side channel's own).
pub fn connect(
    comm: &mut dyn Collective,
    lib: Result<&'static Library, RdmaError>,
    devices: &[Option<String>],
) -> Result<Pending, CollectiveError> {
    connect_with(comm, lib, devices, QueuePairs::platform())
}

/// [`connect`] with queue pairs of `kind`.
pub fn connect_with(
    comm: &mut dyn Collective,
    lib: Result<&'static Library, RdmaError>,
    devices: &[Option<String>],
    kind: QueuePairs,
) -> Result<Pending, CollectiveError> {
    let (n, rank) = (comm.size(), comm.rank());
    let opened = (|| {
        if devices.len() != n {
            return Err(RdmaError::Exchange {
                peer: rank,
                reason: format!("{} devices for a pod of {n}", devices.len()),
            });
        }
        let lib = lib?;
        devices
            .iter()
            .enumerate()
            .map(|(p, d)| match d {
                Some(d) if p != rank => Conn::open(lib, d, SLOTS, kind).map(Some),
                _ => Ok(None),
            })
            .collect::<Result<Vec<_>, _>>()
    })();
    let mut conns = agree(comm, opened)?;
    let mine: Vec<Option<QpInfo>> = conns.iter().map(|c| c.as_ref().map(|c| c.local)).collect();
    // A malformed record is this rank's failure, agreed on like the others.
    let connected = match exchange_infos(comm, &mine) {
        Ok(remote) => conns
            .iter_mut()
            .enumerate()
            .try_for_each(|(p, c)| match (c, &remote[p]) {
                (Some(c), Some(r)) => c.connect(p, r),
                _ => Ok(()),
            }),
        Err(CollectiveError::Rdma(e)) => Err(e),
        Err(e) => return Err(e),
    };
    agree(comm, connected)?;
    Ok(Pending { rank, conns })
}

impl Pending {
    /// Joins the side channel (the same members' TCP connections).
    pub fn finish(self, side: SideChannel) -> RdmaVerbs {
        let slots = self
            .conns
            .iter()
            .flatten()
            .map(|c| c.slots)
            .next()
            .unwrap_or(SLOTS);
        RdmaVerbs {
            rank: self.rank,
            slots,
            wcs: vec![ffi::Wc::default(); 4 * slots],
            conns: self.conns,
            side,
            stash: Vec::new(),
            spare: vec![
                Completion {
                    kind: CompletionKind::Send,
                    peer: 0,
                    slot: 0,
                    len: 0
                };
                4 * slots
            ],
            pending: None,
        }
    }
}

/// [`Verbs`] over real queue pairs.
pub struct RdmaVerbs {
    rank: usize,
    slots: usize,
    conns: Vec<Option<Conn>>,
    side: SideChannel,
    wcs: Vec<ffi::Wc>,
    /// Good completions polled together with a failure or by a wait,
    /// handed out by the next poll.
    stash: Vec<Completion>,
    /// Scratch for a wait's last look.
    spare: Vec<Completion>,
    /// A failure a wait found, returned by the next poll.
    pending: Option<CollectiveError>,
}

// SAFETY: the verbs objects are only used through `&mut self` (one thread at
// a time), and rdma-core's verbs are thread-safe anyway.
unsafe impl Send for RdmaVerbs {}

impl std::fmt::Debug for RdmaVerbs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaVerbs")
            .field("rank", &self.rank)
            .finish()
    }
}

impl RdmaVerbs {
    fn system_channels(&self) -> Option<ffi::Channels> {
        self.conns
            .iter()
            .flatten()
            .next()
            .and_then(|c| c.lib.channels)
    }

    fn conn(&mut self, peer: usize) -> Result<&mut Conn, CollectiveError> {
        let c = self
            .conns
            .get_mut(peer)
            .and_then(Option::as_mut)
            .ok_or_else(|| {
                CollectiveError::InvalidArgument(format!("no queue pair to rank {peer}"))
            })?;
        if let Some(reason) = &c.failed {
            return Err(CollectiveError::Link {
                peer,
                reason: reason.clone(),
            });
        }
        Ok(c)
    }

    /// Every rank has posted its receives (call once, before the first
    /// exchange: an unreliable queue pair drops a frame sent too early).
    pub fn barrier(&mut self, timeout: Duration) -> Result<(), CollectiveError> {
        self.side.barrier(timeout)
    }

    /// Polls `peer`'s completion queue into `out`; a failed work
    /// completion or a lost frame marks the queue pair failed once the
    /// whole batch is taken (the batch's good completions are kept).
    fn poll_conn(&mut self, peer: usize, out: &mut [Completion]) -> Result<usize, CollectiveError> {
        let slots = self.slots;
        let Some(c) = self.conns[peer].as_mut().filter(|c| c.failed.is_none()) else {
            return Ok(0);
        };
        let room = out.len().min(self.wcs.len());
        if room == 0 {
            return Ok(0);
        }
        let poll = c
            .ops()
            .poll_cq
            .ok_or_else(|| CollectiveError::Verbs("the provider has no poll_cq".into()))?;
        // SAFETY: live completion queue; `wcs` has `room` entries.
        let n = unsafe { poll(c.cq, room as c_int, self.wcs.as_mut_ptr()) };
        if n < 0 {
            return Err(CollectiveError::Verbs(format!(
                "polling the completion queue of rank {peer} failed ({n})"
            )));
        }
        let mut got = 0;
        let mut failure: Option<CollectiveError> = None;
        for wc in &self.wcs[..n as usize] {
            let (kind, slot) = split_wr_id(wc.wr_id);
            if wc.status != ffi::IBV_WC_SUCCESS {
                let reason = format!(
                    "{}: work completion status {} (vendor error {})",
                    c.device, wc.status, wc.vendor_err
                );
                if failure.is_none() {
                    failure = Some(
                        if wc.status == ffi::IBV_WC_RETRY_EXC_ERR
                            || wc.status == ffi::IBV_WC_RNR_RETRY_EXC_ERR
                        {
                            CollectiveError::PeerLost { peer, reason }
                        } else {
                            CollectiveError::Link { peer, reason }
                        },
                    );
                }
                continue;
            }
            let recv = kind == KIND_RECV || wc.opcode & ffi::IBV_WC_RECV != 0;
            if !recv {
                if slot == slots {
                    c.credit.credit_busy = false;
                    continue;
                }
                out[got] = Completion {
                    kind: CompletionKind::Send,
                    peer,
                    slot,
                    len: 0,
                };
                got += 1;
                continue;
            }
            let bytes = wc.byte_len as usize;
            if !(PREFIX..=FRAME).contains(&bytes) || slot >= slots {
                failure.get_or_insert(CollectiveError::Link {
                    peer,
                    reason: format!("frame of {bytes} bytes from rank {peer} in slot {slot}"),
                });
                continue;
            }
            let mut raw = [0u8; PREFIX];
            // SAFETY: the frame is FRAME bytes and complete.
            unsafe { std::ptr::copy_nonoverlapping(c.frame(true, slot), raw.as_mut_ptr(), PREFIX) };
            let prefix = match Prefix::check(peer, &raw, c.recv_seq) {
                Ok(p) => p,
                Err(e) => {
                    failure.get_or_insert(e);
                    continue;
                }
            };
            c.recv_seq = c.recv_seq.wrapping_add(1);
            c.credit.heard(prefix.posted);
            if prefix.credit_only {
                // Nothing for the transport: the receive goes back at once.
                c.post_receive(peer, slot)?;
                continue;
            }
            out[got] = Completion {
                kind: CompletionKind::Recv,
                peer,
                slot,
                len: bytes - PREFIX,
            };
            got += 1;
        }
        if let Some(e) = failure {
            c.failed = Some(e.to_string());
            self.stash.extend_from_slice(&out[..got]);
            return Err(e);
        }
        c.pump(peer)?;
        Ok(got)
    }
}

impl Verbs for RdmaVerbs {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.conns.len()
    }

    fn frame_size(&self) -> usize {
        FRAME - PREFIX
    }

    fn slots(&self) -> usize {
        self.slots
    }

    fn connected(&self, peer: usize) -> bool {
        matches!(self.conns.get(peer), Some(Some(_)))
    }

    fn post_send(
        &mut self,
        peer: usize,
        slot: usize,
        head: &[u8],
        body: &[u8],
    ) -> Result<(), CollectiveError> {
        let len = head.len() + body.len();
        check_send(len, slot, FRAME - PREFIX, self.slots)?;
        let c = self.conn(peer)?;
        let frame = c.frame(false, slot);
        // SAFETY: the frame is `FRAME` bytes, not in flight (the transport
        // reuses a slot only after its send completed); the prefix is
        // written when the frame is posted.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(frame.add(PREFIX), len);
            dst[..head.len()].copy_from_slice(head);
            dst[head.len()..].copy_from_slice(body);
        }
        // Queued behind any frame still waiting for credit, so frames leave in order.
        c.credit.deferred.push_back((slot, len));
        c.pump(peer)
    }

    fn post_recv(&mut self, peer: usize, slot: usize) -> Result<(), CollectiveError> {
        check_recv(peer, slot, self.conns.len(), self.slots)?;
        let c = self.conn(peer)?;
        c.post_receive(peer, slot)?;
        c.pump(peer)
    }

    fn read_recv(&self, peer: usize, slot: usize, offset: usize, dst: &mut [u8]) {
        let Some(Some(c)) = self.conns.get(peer) else {
            return;
        };
        assert!(slot < self.slots && PREFIX + offset + dst.len() <= FRAME);
        // SAFETY: bounds checked above; the receive completed, so the device
        // no longer writes this frame until it is re-posted.
        unsafe {
            let src = c.frame(true, slot).add(PREFIX + offset);
            std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len());
        }
    }

    fn read_send(&self, peer: usize, slot: usize, dst: &mut [u8]) -> bool {
        let Some(Some(c)) = self.conns.get(peer) else {
            return false;
        };
        if slot >= self.slots || PREFIX + dst.len() > FRAME {
            return false;
        }
        // SAFETY: bounds checked above; the frame stays as posted until the
        // transport reuses its slot (after the send completed or failed).
        unsafe {
            let src = c.frame(false, slot).add(PREFIX);
            std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len());
        }
        true
    }

    fn poll(&mut self, out: &mut [Completion]) -> Result<usize, CollectiveError> {
        // Good completions taken in a poll that also found a failure, or
        // by a wait; then that failure.
        let mut got = self.stash.len().min(out.len());
        for (o, c) in out.iter_mut().zip(self.stash.drain(..got)) {
            *o = c;
        }
        if got > 0 {
            return Ok(got);
        }
        if let Some(e) = self.pending.take() {
            return Err(e);
        }
        for peer in 0..self.conns.len() {
            match self.poll_conn(peer, &mut out[got..]) {
                Ok(n) => got += n,
                Err(e) => {
                    // Nothing taken is lost: what this poll took before the
                    // failed queue pair comes first next time.
                    let failed_peers = std::mem::take(&mut self.stash);
                    self.stash.extend_from_slice(&out[..got]);
                    self.stash.extend(failed_peers);
                    return Err(e);
                }
            }
        }
        Ok(got)
    }

    /// Blocks on the completion channels until a completion queue gets an
    /// entry or `timeout` passes (the transport spins first, so this is
    /// for waits longer than the spin). Without channels (a library that
    /// has none, say), a short sleep between polls.
    fn wait(&mut self, timeout: Duration) {
        let mut fds = [libc::pollfd {
            fd: -1,
            events: libc::POLLIN,
            revents: 0,
        }; super::MAX_RANKS];
        let mut n = 0;
        let mut channels = true;
        for c in self
            .conns
            .iter_mut()
            .flatten()
            .filter(|c| c.failed.is_none())
        {
            let notify = c.ops().req_notify_cq;
            match (c.channel.is_null(), notify) {
                (false, Some(notify)) => {
                    // SAFETY: live completion queue.
                    if !c.armed && unsafe { notify(c.cq, 0) } == 0 {
                        c.armed = true;
                    }
                    channels &= c.armed;
                    // SAFETY: the channel is live while the connection is.
                    fds[n].fd = unsafe { (*c.channel).fd };
                    n += 1;
                }
                _ => channels = false,
            }
        }
        if !channels || n == 0 {
            std::thread::sleep(timeout.min(Duration::from_micros(50)));
            return;
        }
        // A completion that came before its queue was armed raised no
        // event: look once more before blocking (kept for the next poll).
        let mut spare = std::mem::take(&mut self.spare);
        for peer in 0..self.conns.len() {
            match self.poll_conn(peer, &mut spare) {
                Ok(got) => self.stash.extend_from_slice(&spare[..got]),
                Err(e) => {
                    self.pending.get_or_insert(e);
                }
            }
        }
        self.spare = spare;
        if !self.stash.is_empty() || self.pending.is_some() {
            return;
        }
        let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as c_int;
        // SAFETY: `fds` holds `n` initialised entries.
        if unsafe { libc::poll(fds.as_mut_ptr(), n as libc::nfds_t, ms) } <= 0 {
            return;
        }
        let Some(ch) = self.system_channels() else {
            return;
        };
        let mut i = 0;
        for c in self
            .conns
            .iter_mut()
            .flatten()
            .filter(|c| c.failed.is_none())
        {
            if c.channel.is_null() {
                continue;
            }
            let ready = fds[i].revents & libc::POLLIN != 0;
            i += 1;
            if !ready {
                continue;
            }
            let mut cq = std::ptr::null_mut();
            let mut ctx = std::ptr::null_mut();
            // SAFETY: the channel's fd is readable, so an event is queued
            // and this does not block; every event is acknowledged at once
            // (destroying a queue waits for its events' acknowledgements).
            unsafe {
                if (ch.get_event)(c.channel, &mut cq, &mut ctx) == 0 {
                    (ch.ack)(cq, 1);
                }
            }
            c.armed = false;
        }
    }

    fn peer_alive(&self, peer: usize) -> bool {
        self.side.alive(peer)
    }

    fn shutdown(&mut self) {
        self.side.shutdown();
    }
}

impl Drop for RdmaVerbs {
    fn drop(&mut self) {
        self.side.shutdown();
    }
}

#[cfg(test)]
pub(crate) mod fake;
#[cfg(test)]
mod tests;
