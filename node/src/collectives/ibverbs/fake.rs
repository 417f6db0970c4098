//! An in-process verbs provider for tests: the exported functions and the
//! ops table (`post_send`, `post_recv`, `poll_cq`) of a fake device, so the
//! whole binding (device lookup, port and GID queries, queue-pair creation
//! and INIT → RTR → RTS, posting through the context's ops table, polling)
//! runs here without RDMA hardware. Test double only.
//!
//! Devices: `fake0` and `fake1` (ports up), `fake_down` (port down),
//! `fake_lossy` (its queue pairs silently drop their third send, as an
//! unreliable-connected queue pair may), `fake_flaky` (a cable that can be
//! pulled: once [`break_flaky_after`]'s count of sends over it has passed,
//! its frames are no longer delivered and every send completes with the
//! error a reliable queue pair gives when its retries run out). Queue pairs find each other by number, as on a fabric.
//! Reliable (RC) pairs queue a frame that finds no posted receive until one
//! is posted; unreliable (UC) pairs drop it.
//!
//! It checks what a real provider would refuse: a transition from the
//! wrong state or without the attribute mask that transition needs, a post
//! on a queue pair not yet ready, a wrong memory key, more receives than the
//! queue pair's capacity, and a completion queue overrun (then `poll_cq`
//! fails).

use std::collections::{HashMap, VecDeque};
use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use super::ffi::*;

const NAMES: [&std::ffi::CStr; 5] = [
    c"fake0",
    c"fake_down",
    c"fake_lossy",
    c"fake1",
    c"fake_flaky",
];
const FLAKY: usize = 4;
const LKEY: u32 = 0x5eed;
const EINVAL: c_int = 22;
const ENOMEM: c_int = 12;
const IBV_WC_SEND: c_int = 0;
const IBV_WC_LOC_LEN_ERR: c_int = 1;
const IBV_WC_WR_FLUSH_ERR: c_int = 5;

/// One byte per device; its address is the `ibv_device *`.
static DEVICES: [u8; 5] = [0, 1, 2, 3, 4];

/// Sends over `fake_flaky` so far, and after how many it breaks.
static FLAKY_SENDS: AtomicU64 = AtomicU64::new(0);
static FLAKY_BREAKS_AT: AtomicU64 = AtomicU64::new(u64::MAX);

/// `fake_flaky` stops delivering after `sends` more sends over it (by any
/// queue pair of the process).
pub fn break_flaky_after(sends: u64) {
    let now = FLAKY_SENDS.load(Ordering::SeqCst);
    FLAKY_BREAKS_AT.store(now.saturating_add(sends), Ordering::SeqCst);
}

fn device_index(d: *const c_void) -> usize {
    (d as usize) - (DEVICES.as_ptr() as usize)
}

#[repr(C)]
struct FakeCq {
    cq: Cq,
    wcs: VecDeque<Wc>,
    overrun: bool,
    channel: *mut FakeChannel,
    armed: bool,
}

/// A completion channel: a pipe whose read end is the channel's fd; an
/// armed queue's next completion writes a byte and queues the event.
#[repr(C)]
struct FakeChannel {
    ch: CompChannel,
    write_fd: c_int,
    events: VecDeque<*mut FakeCq>,
}

/// Events handed out by `ibv_get_cq_event`, process-wide.
static CHANNEL_EVENTS: AtomicU64 = AtomicU64::new(0);

/// Completion queues armed for an event (`ibv_req_notify_cq`), process-wide.
static ARMED: AtomicU64 = AtomicU64::new(0);

/// How many completion events waiters have taken from channels so far.
pub fn channel_events() -> u64 {
    CHANNEL_EVENTS.load(Ordering::SeqCst)
}

/// How many times a completion queue was armed so far.
pub fn armed() -> u64 {
    ARMED.load(Ordering::SeqCst)
}

#[repr(C)]
struct FakeQp {
    qp: Qp,
    cq: *mut FakeCq,
    cap: QpCap,
    device: usize,
    dest: u32,
    rq_psn: u32,
    sq_psn: u32,
    sends: u64,
    posted: VecDeque<(u64, u64, u32)>,
    rnr: VecDeque<Vec<u8>>,
}

/// Every fake object is touched only under this lock.
struct World {
    qps: HashMap<u32, usize>,
}

fn world() -> MutexGuard<'static, World> {
    static W: OnceLock<Mutex<World>> = OnceLock::new();
    W.get_or_init(|| {
        Mutex::new(World {
            qps: HashMap::new(),
        })
    })
    .lock()
    .unwrap_or_else(|e| e.into_inner())
}

static NEXT_QPN: AtomicU32 = AtomicU32::new(0x100);

fn set_errno(e: c_int) {
    // SAFETY: the thread's errno location.
    #[cfg(target_os = "linux")]
    unsafe {
        *libc::__errno_location() = e
    };
    #[cfg(target_os = "macos")]
    unsafe {
        *libc::__error() = e
    };
}

unsafe fn push(cq: *mut FakeCq, wc: Wc) {
    let q = &mut *cq;
    if q.wcs.len() >= q.cq.cqe as usize {
        q.overrun = true;
    }
    q.wcs.push_back(wc);
    if q.armed && !q.channel.is_null() {
        q.armed = false;
        let ch = &mut *q.channel;
        ch.events.push_back(cq);
        let byte = 1u8;
        libc::write(ch.write_fd, (&byte as *const u8).cast(), 1);
    }
}

unsafe extern "C" fn req_notify_cq(cq: *mut Cq, _solicited_only: c_int) -> c_int {
    let _w = world();
    (*cq.cast::<FakeCq>()).armed = true;
    ARMED.fetch_add(1, Ordering::SeqCst);
    0
}

unsafe extern "C" fn create_comp_channel(ctx: *mut Context) -> *mut CompChannel {
    let mut fds = [0 as c_int; 2];
    if libc::pipe(fds.as_mut_ptr()) != 0 {
        return std::ptr::null_mut();
    }
    Box::into_raw(Box::new(FakeChannel {
        ch: CompChannel {
            context: ctx,
            fd: fds[0],
            refcnt: 0,
        },
        write_fd: fds[1],
        events: VecDeque::new(),
    }))
    .cast()
}

unsafe extern "C" fn destroy_comp_channel(ch: *mut CompChannel) -> c_int {
    let _w = world();
    let ch = Box::from_raw(ch.cast::<FakeChannel>());
    libc::close(ch.ch.fd);
    libc::close(ch.write_fd);
    0
}

unsafe extern "C" fn get_cq_event(
    ch: *mut CompChannel,
    cq: *mut *mut Cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    let fd = (*ch).fd;
    let mut byte = 0u8;
    if libc::read(fd, (&mut byte as *mut u8).cast(), 1) != 1 {
        return -1;
    }
    let _w = world();
    let Some(q) = (*ch.cast::<FakeChannel>()).events.pop_front() else {
        return -1;
    };
    *cq = q.cast();
    *cq_context = (*q).cq.cq_context;
    CHANNEL_EVENTS.fetch_add(1, Ordering::SeqCst);
    0
}

unsafe extern "C" fn ack_cq_events(_cq: *mut Cq, _n: std::ffi::c_uint) {}

unsafe extern "C" fn get_device_list(n: *mut c_int) -> *mut *mut c_void {
    if !n.is_null() {
        *n = DEVICES.len() as c_int;
    }
    let mut list: Vec<*mut c_void> = DEVICES
        .iter()
        .map(|d| d as *const u8 as *mut c_void)
        .collect();
    list.push(std::ptr::null_mut());
    Box::into_raw(list.into_boxed_slice()) as *mut *mut c_void
}

unsafe extern "C" fn free_device_list(list: *mut *mut c_void) {
    let slice = std::ptr::slice_from_raw_parts_mut(list, DEVICES.len() + 1);
    drop(Box::from_raw(slice));
}

unsafe extern "C" fn get_device_name(d: *mut c_void) -> *const c_char {
    NAMES[device_index(d)].as_ptr()
}

unsafe extern "C" fn open_device(d: *mut c_void) -> *mut Context {
    Box::into_raw(Box::new(Context {
        device: d,
        ops: ContextOps {
            head: [std::ptr::null_mut(); 11],
            poll_cq: Some(poll_cq),
            req_notify_cq: Some(req_notify_cq),
            mid: [std::ptr::null_mut(); 12],
            post_send: Some(post_send),
            post_recv: Some(post_recv),
            tail: [std::ptr::null_mut(); 5],
        },
        cmd_fd: -1,
        async_fd: -1,
        num_comp_vectors: 1,
    }))
}

unsafe extern "C" fn close_device(ctx: *mut Context) -> c_int {
    drop(Box::from_raw(ctx));
    0
}

unsafe extern "C" fn query_port(ctx: *mut Context, port: u8, attr: *mut PortAttr) -> c_int {
    if port != 1 {
        return EINVAL;
    }
    let down = device_index((*ctx).device) == 1;
    *attr = PortAttr {
        state: if down { 1 } else { IBV_PORT_ACTIVE },
        max_mtu: IBV_MTU_4096,
        active_mtu: IBV_MTU_1024,
        gid_tbl_len: 2,
        ..PortAttr::default()
    };
    0
}

unsafe extern "C" fn query_gid(_ctx: *mut Context, port: u8, index: c_int, gid: *mut Gid) -> c_int {
    if port != 1 || !(0..2).contains(&index) {
        return EINVAL;
    }
    let gid = &mut *gid;
    gid.raw = [0; 16];
    if index == 1 {
        gid.raw[10..].copy_from_slice(&[0xff, 0xff, 169, 254, 0, 1]);
    }
    0
}

unsafe extern "C" fn alloc_pd(_ctx: *mut Context) -> *mut c_void {
    Box::into_raw(Box::new(0u64)).cast()
}

unsafe extern "C" fn dealloc_pd(pd: *mut c_void) -> c_int {
    drop(Box::from_raw(pd.cast::<u64>()));
    0
}

unsafe extern "C" fn reg_mr(
    pd: *mut c_void,
    addr: *mut c_void,
    len: usize,
    _access: c_int,
) -> *mut Mr {
    Box::into_raw(Box::new(Mr {
        context: std::ptr::null_mut(),
        pd,
        addr,
        length: len,
        handle: 0,
        lkey: LKEY,
        rkey: 0,
    }))
}

unsafe extern "C" fn dereg_mr(mr: *mut Mr) -> c_int {
    drop(Box::from_raw(mr));
    0
}

unsafe extern "C" fn create_cq(
    ctx: *mut Context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut CompChannel,
    _vector: c_int,
) -> *mut Cq {
    Box::into_raw(Box::new(FakeCq {
        cq: Cq {
            context: ctx,
            channel: channel.cast(),
            cq_context,
            handle: 0,
            cqe,
        },
        wcs: VecDeque::new(),
        overrun: false,
        channel: channel.cast(),
        armed: false,
    }))
    .cast()
}

unsafe extern "C" fn destroy_cq(cq: *mut Cq) -> c_int {
    let _w = world();
    drop(Box::from_raw(cq.cast::<FakeCq>()));
    0
}

unsafe extern "C" fn create_qp(pd: *mut c_void, init: *mut QpInitAttr) -> *mut Qp {
    let init = &*init;
    let ok = !init.send_cq.is_null()
        && init.send_cq == init.recv_cq
        && init.cap.max_send_wr > 0
        && init.cap.max_recv_wr > 0
        && init.cap.max_send_sge >= 1
        && init.cap.max_recv_sge >= 1
        && (init.qp_type == IBV_QPT_RC || init.qp_type == IBV_QPT_UC);
    if !ok {
        set_errno(EINVAL);
        return std::ptr::null_mut();
    }
    let qpn = NEXT_QPN.fetch_add(1, Ordering::Relaxed) & 0xff_ffff;
    let ctx = (*init.send_cq).context;
    let qp = Box::into_raw(Box::new(FakeQp {
        qp: Qp {
            context: ctx,
            qp_context: init.qp_context,
            pd,
            send_cq: init.send_cq,
            recv_cq: init.recv_cq,
            srq: std::ptr::null_mut(),
            handle: 0,
            qp_num: qpn,
            state: 0,
            qp_type: init.qp_type,
        },
        cq: init.send_cq.cast(),
        cap: init.cap,
        device: device_index((*ctx).device),
        dest: 0,
        rq_psn: 0,
        sq_psn: 0,
        sends: 0,
        posted: VecDeque::new(),
        rnr: VecDeque::new(),
    }));
    world().qps.insert(qpn, qp as usize);
    qp.cast()
}

unsafe extern "C" fn destroy_qp(qp: *mut Qp) -> c_int {
    let mut w = world();
    w.qps.remove(&(*qp).qp_num);
    drop(Box::from_raw(qp.cast::<FakeQp>()));
    0
}

unsafe extern "C" fn modify_qp(qp: *mut Qp, attr: *mut QpAttr, mask: c_int) -> c_int {
    let w = world();
    let q = &mut *qp.cast::<FakeQp>();
    let a = &*attr;
    let rc = q.qp.qp_type == IBV_QPT_RC;
    let has = |bits: c_int| mask & bits == bits;
    match (q.qp.state, a.qp_state) {
        (0, IBV_QPS_INIT)
            if has(IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)
                && a.port_num == 1 => {}
        (IBV_QPS_INIT, IBV_QPS_RTR)
            if has(IBV_QP_STATE
                | IBV_QP_AV
                | IBV_QP_PATH_MTU
                | IBV_QP_DEST_QPN
                | IBV_QP_RQ_PSN)
                && (!rc || has(IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
                && (1..=5).contains(&a.path_mtu)
                && a.ah_attr.port_num == 1
                && (a.ah_attr.is_global == 0 || a.ah_attr.grh.sgid_index == 1)
                && w.qps.contains_key(&a.dest_qp_num) =>
        {
            q.dest = a.dest_qp_num;
            q.rq_psn = a.rq_psn;
        }
        (IBV_QPS_RTR, IBV_QPS_RTS)
            if has(IBV_QP_STATE | IBV_QP_SQ_PSN)
                && (!rc
                    || has(IBV_QP_TIMEOUT
                        | IBV_QP_RETRY_CNT
                        | IBV_QP_RNR_RETRY
                        | IBV_QP_MAX_QP_RD_ATOMIC)) =>
        {
            q.sq_psn = a.sq_psn;
        }
        _ => return EINVAL,
    }
    q.qp.state = a.qp_state;
    0
}

unsafe fn deliver(q: &mut FakeQp, bytes: Vec<u8>) {
    let Some((wr_id, addr, len)) = q.posted.pop_front() else {
        if q.qp.qp_type == IBV_QPT_RC {
            q.rnr.push_back(bytes); // receiver not ready: the sender retries
        }
        return;
    };
    let mut wc = Wc {
        wr_id,
        opcode: IBV_WC_RECV,
        byte_len: bytes.len() as u32,
        qp_num: q.qp.qp_num,
        ..Wc::default()
    };
    if bytes.len() > len as usize {
        wc.status = IBV_WC_LOC_LEN_ERR;
    } else {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), addr as *mut u8, bytes.len());
    }
    push(q.cq, wc);
}

unsafe extern "C" fn post_send(qp: *mut Qp, wr: *mut SendWr, _bad: *mut *mut SendWr) -> c_int {
    let w = world();
    let q = &mut *qp.cast::<FakeQp>();
    let wr = &*wr;
    if q.qp.state != IBV_QPS_RTS || wr.num_sge != 1 || wr.opcode != IBV_WR_SEND {
        return EINVAL;
    }
    let sge = &*wr.sg_list;
    if sge.lkey != LKEY {
        return EINVAL;
    }
    let bytes = std::slice::from_raw_parts(sge.addr as *const u8, sge.length as usize).to_vec();
    q.sends += 1;
    let lost = q.device == 2 && q.sends == 3;
    if q.device == FLAKY
        && FLAKY_SENDS.fetch_add(1, Ordering::SeqCst) >= FLAKY_BREAKS_AT.load(Ordering::SeqCst)
    {
        // The cable is out: nothing arrives, the send fails.
        let status = if q.qp.qp_type == IBV_QPT_RC {
            IBV_WC_RETRY_EXC_ERR
        } else {
            IBV_WC_WR_FLUSH_ERR
        };
        push(
            q.cq,
            Wc {
                wr_id: wr.wr_id,
                status,
                qp_num: q.qp.qp_num,
                ..Wc::default()
            },
        );
        return 0;
    }
    match w.qps.get(&q.dest) {
        Some(&dest) if !lost => {
            let d = &mut *(dest as *mut FakeQp);
            // A frame only lands on the queue pair connected back to us,
            // with the packet sequence numbers both sides agreed.
            if d.dest == q.qp.qp_num && d.rq_psn == q.sq_psn {
                deliver(d, bytes);
            }
        }
        None if q.qp.qp_type == IBV_QPT_RC => {
            push(
                q.cq,
                Wc {
                    wr_id: wr.wr_id,
                    status: IBV_WC_RETRY_EXC_ERR,
                    qp_num: q.qp.qp_num,
                    ..Wc::default()
                },
            );
            return 0;
        }
        _ => {}
    }
    if wr.send_flags & IBV_SEND_SIGNALED != 0 {
        push(
            q.cq,
            Wc {
                wr_id: wr.wr_id,
                opcode: IBV_WC_SEND,
                byte_len: sge.length,
                qp_num: q.qp.qp_num,
                ..Wc::default()
            },
        );
    }
    0
}

unsafe extern "C" fn post_recv(qp: *mut Qp, wr: *mut RecvWr, _bad: *mut *mut RecvWr) -> c_int {
    let _w = world();
    let q = &mut *qp.cast::<FakeQp>();
    let wr = &*wr;
    if q.qp.state < IBV_QPS_INIT || wr.num_sge != 1 {
        return EINVAL;
    }
    let sge = &*wr.sg_list;
    if sge.lkey != LKEY {
        return EINVAL;
    }
    if q.posted.len() >= q.cap.max_recv_wr as usize {
        return ENOMEM;
    }
    q.posted.push_back((wr.wr_id, sge.addr, sge.length));
    if let Some(bytes) = q.rnr.pop_front() {
        deliver(q, bytes);
    }
    0
}

unsafe extern "C" fn poll_cq(cq: *mut Cq, n: c_int, wc: *mut Wc) -> c_int {
    let _w = world();
    let cq = &mut *cq.cast::<FakeCq>();
    if cq.overrun {
        return -1;
    }
    let k = (n.max(0) as usize).min(cq.wcs.len());
    for i in 0..k {
        *wc.add(i) = cq.wcs.pop_front().expect("counted");
    }
    k as c_int
}

/// The fake provider as a loaded library.
pub fn library() -> &'static Library {
    static LIB: OnceLock<Library> = OnceLock::new();
    LIB.get_or_init(|| Library {
        path: "fake verbs provider".into(),
        handle: 0,
        get_device_list,
        free_device_list,
        get_device_name,
        open_device,
        close_device,
        query_port,
        query_gid,
        alloc_pd,
        dealloc_pd,
        reg_mr,
        dereg_mr,
        create_cq,
        destroy_cq,
        create_qp,
        modify_qp,
        destroy_qp,
        channels: Some(Channels {
            create: create_comp_channel,
            destroy: destroy_comp_channel,
            get_event: get_cq_event,
            ack: ack_cq_events,
        }),
    })
}
