//! The verbs ABI, loaded at run time: `#[repr(C)]` mirrors of the parts of
//! rdma-core's `infiniband/verbs.h` this backend touches, and a [`Library`]
//! of function pointers resolved with `dlopen`/`dlsym`.
//!
//! Why at run time: the library is `libibverbs.so.1` on Linux and
//! `/usr/lib/librdma.dylib` on macOS 26.2+ (RDMA over Thunderbolt; MLX's
//! JACCL dlopens the same file), and neither may be a build or link
//! dependency: a default build must run on machines without them.
//!
//! `ibv_post_send`, `ibv_post_recv` and `ibv_poll_cq` are `static inline` in
//! verbs.h: they call through the context's ops table
//! (`qp->context->ops.post_send`), so [`Context`] mirrors `ibv_context` up to
//! and including that table; fields after it (a `pthread_mutex_t`, whose size
//! differs by platform) are never read.
//!
//! # Invariants
//! - Every struct here is laid out exactly as verbs.h lays it out on LP64
//!   (x86_64, aarch64); the layout tests pin sizes and offsets to the values
//!   the C compiler gives.
//! - Structs the library fills (`ibv_port_attr`, `ibv_wc`) are zeroed first;
//!   [`PortAttr`] carries reserved tail bytes for fields newer rdma-core
//!   versions append.
//!
//! # Failure
//! [`Library::open`] fails with [`RdmaError::LibraryNotFound`] or
//! [`RdmaError::SymbolMissing`]; nothing here panics.

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_void, CStr, CString};

use super::RdmaError;

// ---- enums and flags (verbs.h values) ----

pub const IBV_QPT_RC: c_int = 2;
pub const IBV_QPT_UC: c_int = 3;

pub const IBV_QPS_INIT: c_int = 1;
pub const IBV_QPS_RTR: c_int = 2;
pub const IBV_QPS_RTS: c_int = 3;

pub const IBV_MTU_1024: c_int = 3;
pub const IBV_MTU_4096: c_int = 5;

pub const IBV_PORT_ACTIVE: c_int = 4;

pub const IBV_ACCESS_LOCAL_WRITE: c_int = 1;
pub const IBV_ACCESS_REMOTE_WRITE: c_int = 1 << 1;
pub const IBV_ACCESS_REMOTE_READ: c_int = 1 << 2;

pub const IBV_QP_STATE: c_int = 1;
pub const IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
pub const IBV_QP_PKEY_INDEX: c_int = 1 << 4;
pub const IBV_QP_PORT: c_int = 1 << 5;
pub const IBV_QP_AV: c_int = 1 << 7;
pub const IBV_QP_PATH_MTU: c_int = 1 << 8;
pub const IBV_QP_TIMEOUT: c_int = 1 << 9;
pub const IBV_QP_RETRY_CNT: c_int = 1 << 10;
pub const IBV_QP_RNR_RETRY: c_int = 1 << 11;
pub const IBV_QP_RQ_PSN: c_int = 1 << 12;
pub const IBV_QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
pub const IBV_QP_MIN_RNR_TIMER: c_int = 1 << 15;
pub const IBV_QP_SQ_PSN: c_int = 1 << 16;
pub const IBV_QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
pub const IBV_QP_DEST_QPN: c_int = 1 << 20;

pub const IBV_WR_SEND: c_int = 2;
pub const IBV_SEND_SIGNALED: u32 = 1 << 1;

pub const IBV_WC_SUCCESS: c_int = 0;
pub const IBV_WC_RETRY_EXC_ERR: c_int = 12;
pub const IBV_WC_RNR_RETRY_EXC_ERR: c_int = 13;
/// `opcode & IBV_WC_RECV` is set for receive completions.
pub const IBV_WC_RECV: c_int = 1 << 7;

// ---- structs ----

/// `union ibv_gid` (16 bytes; 8-aligned through its `__be64` view).
#[repr(C, align(8))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Gid {
    pub raw: [u8; 16],
}

/// `struct ibv_port_attr` (+ reserved tail for fields newer versions add).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct PortAttr {
    pub state: c_int,
    pub max_mtu: c_int,
    pub active_mtu: c_int,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
    pub reserved: [u8; 76],
}

impl Default for PortAttr {
    fn default() -> Self {
        // SAFETY: plain integers; all-zero is a valid value.
        unsafe { std::mem::zeroed() }
    }
}

/// `struct ibv_sge`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// `struct ibv_send_wr`: the `wr`, `qp_type` and `bind_mw`/`tso` unions are
/// opaque words (a plain SEND leaves them zero).
#[repr(C)]
#[derive(Debug)]
pub struct SendWr {
    pub wr_id: u64,
    pub next: *mut SendWr,
    pub sg_list: *mut Sge,
    pub num_sge: c_int,
    pub opcode: c_int,
    pub send_flags: u32,
    pub imm_data: u32,
    /// `union { rdma; atomic; ud; } wr` (32 bytes).
    pub wr: [u64; 4],
    /// `union { xrc; } qp_type` (4 bytes, then padding).
    pub qp_type: [u32; 2],
    /// `union { bind_mw; tso; }` (48 bytes).
    pub bind_mw: [u64; 6],
}

/// `struct ibv_recv_wr`.
#[repr(C)]
#[derive(Debug)]
pub struct RecvWr {
    pub wr_id: u64,
    pub next: *mut RecvWr,
    pub sg_list: *mut Sge,
    pub num_sge: c_int,
}

/// `struct ibv_wc`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Wc {
    pub wr_id: u64,
    pub status: c_int,
    pub opcode: c_int,
    pub vendor_err: u32,
    pub byte_len: u32,
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: u32,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct QpCap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// `struct ibv_qp_init_attr`.
#[repr(C)]
#[derive(Debug)]
pub struct QpInitAttr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut Cq,
    pub recv_cq: *mut Cq,
    pub srq: *mut c_void,
    pub cap: QpCap,
    pub qp_type: c_int,
    pub sq_sig_all: c_int,
}

/// `struct ibv_global_route`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct GlobalRoute {
    pub dgid: Gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct AhAttr {
    pub grh: GlobalRoute,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

/// `struct ibv_qp_attr`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct QpAttr {
    pub qp_state: c_int,
    pub cur_qp_state: c_int,
    pub path_mtu: c_int,
    pub path_mig_state: c_int,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: u32,
    pub cap: QpCap,
    pub ah_attr: AhAttr,
    pub alt_ah_attr: AhAttr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

/// `struct ibv_mr`.
#[repr(C)]
#[derive(Debug)]
pub struct Mr {
    pub context: *mut Context,
    pub pd: *mut c_void,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

type PostSend = unsafe extern "C" fn(*mut Qp, *mut SendWr, *mut *mut SendWr) -> c_int;
type ReqNotifyCq = unsafe extern "C" fn(*mut Cq, c_int) -> c_int;
type PostRecv = unsafe extern "C" fn(*mut Qp, *mut RecvWr, *mut *mut RecvWr) -> c_int;
type PollCq = unsafe extern "C" fn(*mut Cq, c_int, *mut Wc) -> c_int;

/// `struct ibv_context_ops`: 32 function pointers; only three are called.
#[repr(C)]
#[derive(Debug)]
pub struct ContextOps {
    /// `_compat_query_device` .. `_compat_create_cq` (11 entries).
    pub head: [*mut c_void; 11],
    pub poll_cq: Option<PollCq>,
    pub req_notify_cq: Option<ReqNotifyCq>,
    /// `_compat_cq_event` .. `_compat_destroy_qp` (12 entries).
    pub mid: [*mut c_void; 12],
    pub post_send: Option<PostSend>,
    pub post_recv: Option<PostRecv>,
    /// `_compat_create_ah` .. `_compat_async_event` (5 entries).
    pub tail: [*mut c_void; 5],
}

/// `struct ibv_context`, up to `num_comp_vectors` (the mutex after it is
/// never touched).
#[repr(C)]
#[derive(Debug)]
pub struct Context {
    pub device: *mut c_void,
    pub ops: ContextOps,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
}

/// `struct ibv_qp`, up to `qp_type`.
#[repr(C)]
#[derive(Debug)]
pub struct Qp {
    pub context: *mut Context,
    pub qp_context: *mut c_void,
    pub pd: *mut c_void,
    pub send_cq: *mut Cq,
    pub recv_cq: *mut Cq,
    pub srq: *mut c_void,
    pub handle: u32,
    pub qp_num: u32,
    pub state: c_int,
    pub qp_type: c_int,
}

/// `struct ibv_cq`, up to `cqe`.
#[repr(C)]
#[derive(Debug)]
pub struct Cq {
    pub context: *mut Context,
    pub channel: *mut c_void,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
}

/// `struct ibv_comp_channel`: a file descriptor that becomes readable
/// when an armed completion queue gets a completion.
#[repr(C)]
#[derive(Debug)]
pub struct CompChannel {
    pub context: *mut Context,
    pub fd: c_int,
    pub refcnt: c_int,
}

/// Opaque `struct ibv_device` / `struct ibv_pd`.
pub type Device = c_void;
pub type Pd = c_void;

type FnGetDeviceList = unsafe extern "C" fn(*mut c_int) -> *mut *mut Device;
type FnFreeDeviceList = unsafe extern "C" fn(*mut *mut Device);
type FnGetDeviceName = unsafe extern "C" fn(*mut Device) -> *const c_char;
type FnOpenDevice = unsafe extern "C" fn(*mut Device) -> *mut Context;
type FnCloseDevice = unsafe extern "C" fn(*mut Context) -> c_int;
type FnQueryPort = unsafe extern "C" fn(*mut Context, u8, *mut PortAttr) -> c_int;
type FnQueryGid = unsafe extern "C" fn(*mut Context, u8, c_int, *mut Gid) -> c_int;
type FnAllocPd = unsafe extern "C" fn(*mut Context) -> *mut Pd;
type FnDeallocPd = unsafe extern "C" fn(*mut Pd) -> c_int;
type FnRegMr = unsafe extern "C" fn(*mut Pd, *mut c_void, usize, c_int) -> *mut Mr;
type FnDeregMr = unsafe extern "C" fn(*mut Mr) -> c_int;
type FnCreateCq =
    unsafe extern "C" fn(*mut Context, c_int, *mut c_void, *mut CompChannel, c_int) -> *mut Cq;
type FnDestroyCq = unsafe extern "C" fn(*mut Cq) -> c_int;
type FnCreateQp = unsafe extern "C" fn(*mut Pd, *mut QpInitAttr) -> *mut Qp;
type FnModifyQp = unsafe extern "C" fn(*mut Qp, *mut QpAttr, c_int) -> c_int;
type FnDestroyQp = unsafe extern "C" fn(*mut Qp) -> c_int;
type FnCreateCompChannel = unsafe extern "C" fn(*mut Context) -> *mut CompChannel;
type FnDestroyCompChannel = unsafe extern "C" fn(*mut CompChannel) -> c_int;
type FnGetCqEvent = unsafe extern "C" fn(*mut CompChannel, *mut *mut Cq, *mut *mut c_void) -> c_int;
type FnAckCqEvents = unsafe extern "C" fn(*mut Cq, std::ffi::c_uint);

/// The completion-channel verbs, where the library has them (a library
/// without them is waited on by polling).
#[derive(Debug, Clone, Copy)]
pub struct Channels {
    pub create: FnCreateCompChannel,
    pub destroy: FnDestroyCompChannel,
    pub get_event: FnGetCqEvent,
    pub ack: FnAckCqEvents,
}

/// The exported verbs, resolved from one library.
#[derive(Debug)]
pub struct Library {
    pub path: String,
    /// The `dlopen` handle (never closed).
    pub handle: usize,
    pub get_device_list: FnGetDeviceList,
    pub free_device_list: FnFreeDeviceList,
    pub get_device_name: FnGetDeviceName,
    pub open_device: FnOpenDevice,
    pub close_device: FnCloseDevice,
    pub query_port: FnQueryPort,
    pub query_gid: FnQueryGid,
    pub alloc_pd: FnAllocPd,
    pub dealloc_pd: FnDeallocPd,
    pub reg_mr: FnRegMr,
    pub dereg_mr: FnDeregMr,
    pub create_cq: FnCreateCq,
    pub destroy_cq: FnDestroyCq,
    pub create_qp: FnCreateQp,
    pub modify_qp: FnModifyQp,
    pub destroy_qp: FnDestroyQp,
    pub channels: Option<Channels>,
}

fn dl_error() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string owned by libc.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: non-null, NUL-terminated (above).
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

impl Library {
    /// Loads `path` (a file path or a soname) and resolves every verb.
    pub fn open(path: &str) -> Result<Library, RdmaError> {
        let c = CString::new(path).map_err(|_| RdmaError::LibraryNotFound {
            library: path.into(),
            reason: "the name contains a NUL byte".into(),
        })?;
        // SAFETY: a valid C string; the handle is kept for the process's life
        // (never dlclosed: the function pointers below point into it).
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(RdmaError::LibraryNotFound {
                library: path.into(),
                reason: dl_error(),
            });
        }
        let sym = |name: &'static str| -> Result<*mut c_void, RdmaError> {
            let cname = CString::new(name).map_err(|_| RdmaError::SymbolMissing {
                library: path.into(),
                symbol: name,
            })?;
            // SAFETY: valid handle and C string.
            let p = unsafe { libc::dlsym(handle, cname.as_ptr()) };
            if p.is_null() {
                Err(RdmaError::SymbolMissing {
                    library: path.into(),
                    symbol: name,
                })
            } else {
                Ok(p)
            }
        };
        macro_rules! load {
            ($name:literal, $ty:ty) => {
                // SAFETY: the symbol is the verbs.h function of this name, whose
                // C signature the field's type mirrors.
                unsafe { std::mem::transmute::<*mut c_void, $ty>(sym($name)?) }
            };
        }
        macro_rules! load_optional {
            ($name:literal, $ty:ty) => {
                sym($name).ok().map(|p| {
                    // SAFETY: as in `load!`.
                    unsafe { std::mem::transmute::<*mut c_void, $ty>(p) }
                })
            };
        }
        Ok(Library {
            path: path.into(),
            handle: handle as usize,
            get_device_list: load!("ibv_get_device_list", FnGetDeviceList),
            free_device_list: load!("ibv_free_device_list", FnFreeDeviceList),
            get_device_name: load!("ibv_get_device_name", FnGetDeviceName),
            open_device: load!("ibv_open_device", FnOpenDevice),
            close_device: load!("ibv_close_device", FnCloseDevice),
            query_port: load!("ibv_query_port", FnQueryPort),
            query_gid: load!("ibv_query_gid", FnQueryGid),
            alloc_pd: load!("ibv_alloc_pd", FnAllocPd),
            dealloc_pd: load!("ibv_dealloc_pd", FnDeallocPd),
            reg_mr: load!("ibv_reg_mr", FnRegMr),
            dereg_mr: load!("ibv_dereg_mr", FnDeregMr),
            create_cq: load!("ibv_create_cq", FnCreateCq),
            destroy_cq: load!("ibv_destroy_cq", FnDestroyCq),
            create_qp: load!("ibv_create_qp", FnCreateQp),
            modify_qp: load!("ibv_modify_qp", FnModifyQp),
            destroy_qp: load!("ibv_destroy_qp", FnDestroyQp),
            channels: (|| {
                Some(Channels {
                    create: load_optional!("ibv_create_comp_channel", FnCreateCompChannel)?,
                    destroy: load_optional!("ibv_destroy_comp_channel", FnDestroyCompChannel)?,
                    get_event: load_optional!("ibv_get_cq_event", FnGetCqEvent)?,
                    ack: load_optional!("ibv_ack_cq_events", FnAckCqEvents)?,
                })
            })(),
        })
    }

    /// The names of the devices the library lists (empty when none).
    pub fn device_names(&self) -> Vec<String> {
        let mut n: c_int = 0;
        // SAFETY: the list is NUL-terminated with `n` entries and freed below.
        unsafe {
            let list = (self.get_device_list)(&mut n);
            if list.is_null() {
                return Vec::new();
            }
            let names = (0..n.max(0) as usize)
                .map(|i| *list.add(i))
                .take_while(|d| !d.is_null())
                .map(|d| name_of(self, d))
                .collect();
            (self.free_device_list)(list);
            names
        }
    }
}

/// A device's name.
///
/// # Safety
/// `dev` must be a live entry of a device list from `lib`.
pub unsafe fn name_of(lib: &Library, dev: *mut Device) -> String {
    let p = (lib.get_device_name)(dev);
    if p.is_null() {
        return String::new();
    }
    CStr::from_ptr(p).to_string_lossy().into_owned()
}

#[cfg(all(test, target_pointer_width = "64"))]
mod tests {
    use std::mem::{offset_of, size_of};

    use super::*;

    /// Sizes and offsets as verbs.h gives them on LP64 (x86_64, aarch64).
    #[test]
    fn structs_match_the_verbs_h_layout() {
        assert_eq!((size_of::<Gid>(), std::mem::align_of::<Gid>()), (16, 8));
        assert_eq!(size_of::<Sge>(), 16);
        assert_eq!((offset_of!(Sge, length), offset_of!(Sge, lkey)), (8, 12));

        assert_eq!(size_of::<RecvWr>(), 32);
        assert_eq!(offset_of!(RecvWr, num_sge), 24);

        assert_eq!(size_of::<SendWr>(), 128);
        assert_eq!(offset_of!(SendWr, sg_list), 16);
        assert_eq!(offset_of!(SendWr, num_sge), 24);
        assert_eq!(offset_of!(SendWr, opcode), 28);
        assert_eq!(offset_of!(SendWr, send_flags), 32);
        assert_eq!(offset_of!(SendWr, imm_data), 36);
        assert_eq!(offset_of!(SendWr, wr), 40);
        assert_eq!(offset_of!(SendWr, qp_type), 72);
        assert_eq!(offset_of!(SendWr, bind_mw), 80);

        assert_eq!(size_of::<Wc>(), 48);
        assert_eq!(offset_of!(Wc, status), 8);
        assert_eq!(offset_of!(Wc, opcode), 12);
        assert_eq!(offset_of!(Wc, byte_len), 20);
        assert_eq!(offset_of!(Wc, qp_num), 28);
        assert_eq!(offset_of!(Wc, wc_flags), 36);
        assert_eq!(offset_of!(Wc, slid), 42);
        assert_eq!(offset_of!(Wc, dlid_path_bits), 45);

        assert_eq!(size_of::<QpCap>(), 20);
        assert_eq!(size_of::<QpInitAttr>(), 64);
        assert_eq!(offset_of!(QpInitAttr, cap), 32);
        assert_eq!(offset_of!(QpInitAttr, qp_type), 52);
        assert_eq!(offset_of!(QpInitAttr, sq_sig_all), 56);

        assert_eq!(size_of::<GlobalRoute>(), 24);
        assert_eq!(offset_of!(GlobalRoute, flow_label), 16);
        assert_eq!(offset_of!(GlobalRoute, sgid_index), 20);
        assert_eq!(offset_of!(GlobalRoute, traffic_class), 22);
        assert_eq!(size_of::<AhAttr>(), 32);
        assert_eq!(offset_of!(AhAttr, dlid), 24);
        assert_eq!(offset_of!(AhAttr, is_global), 29);
        assert_eq!(offset_of!(AhAttr, port_num), 30);

        assert_eq!(size_of::<QpAttr>(), 144);
        assert_eq!(offset_of!(QpAttr, qkey), 16);
        assert_eq!(offset_of!(QpAttr, rq_psn), 20);
        assert_eq!(offset_of!(QpAttr, sq_psn), 24);
        assert_eq!(offset_of!(QpAttr, dest_qp_num), 28);
        assert_eq!(offset_of!(QpAttr, qp_access_flags), 32);
        assert_eq!(offset_of!(QpAttr, cap), 36);
        assert_eq!(offset_of!(QpAttr, ah_attr), 56);
        assert_eq!(offset_of!(QpAttr, alt_ah_attr), 88);
        assert_eq!(offset_of!(QpAttr, pkey_index), 120);
        assert_eq!(offset_of!(QpAttr, max_rd_atomic), 126);
        assert_eq!(offset_of!(QpAttr, max_dest_rd_atomic), 127);
        assert_eq!(offset_of!(QpAttr, min_rnr_timer), 128);
        assert_eq!(offset_of!(QpAttr, port_num), 129);
        assert_eq!(offset_of!(QpAttr, timeout), 130);
        assert_eq!(offset_of!(QpAttr, retry_cnt), 131);
        assert_eq!(offset_of!(QpAttr, rnr_retry), 132);
        assert_eq!(offset_of!(QpAttr, rate_limit), 136);

        assert_eq!(offset_of!(PortAttr, gid_tbl_len), 12);
        assert_eq!(offset_of!(PortAttr, lid), 34);
        assert_eq!(offset_of!(PortAttr, link_layer), 46);
        assert_eq!(offset_of!(PortAttr, port_cap_flags2), 48);
        assert!(size_of::<PortAttr>() >= 56);

        assert_eq!(size_of::<Mr>(), 48);
        assert_eq!(size_of::<CompChannel>(), 16);
        assert_eq!(offset_of!(CompChannel, fd), 8);
        assert_eq!(offset_of!(Mr, lkey), 36);

        // The ops table: 32 pointers; poll_cq is entry 11, post_send 25.
        assert_eq!(size_of::<ContextOps>(), 32 * 8);
        assert_eq!(offset_of!(Context, ops), 8);
        assert_eq!(
            offset_of!(Context, ops) + offset_of!(ContextOps, poll_cq),
            8 + 11 * 8
        );
        assert_eq!(
            offset_of!(Context, ops) + offset_of!(ContextOps, req_notify_cq),
            8 + 12 * 8
        );
        assert_eq!(
            offset_of!(Context, ops) + offset_of!(ContextOps, post_send),
            8 + 25 * 8
        );
        assert_eq!(
            offset_of!(Context, ops) + offset_of!(ContextOps, post_recv),
            8 + 26 * 8
        );
        assert_eq!(offset_of!(Context, cmd_fd), 264);
        assert_eq!(offset_of!(Context, num_comp_vectors), 272);

        assert_eq!(offset_of!(Qp, handle), 48);
        assert_eq!(offset_of!(Qp, qp_num), 52);
        assert_eq!(offset_of!(Qp, qp_type), 60);
        assert_eq!(offset_of!(Cq, cqe), 28);
    }
}
