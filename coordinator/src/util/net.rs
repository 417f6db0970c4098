//! What the client listeners share: a cap on open connections per TCP
//! listener, and a response body that keeps its request's permit until it
//! has been sent.
//!
//! # Invariants
//! - A connection beyond a listener's cap is closed at accept; a capped
//!   connection holds its slot until it closes.
//! - A [`Held`] body releases its permit when it ends or is dropped.

use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use bytes::Bytes;
use tokio::{
    net::{TcpListener, TcpStream},
    sync::{OwnedSemaphorePermit, Semaphore},
};

/// A response body that keeps its request's permit (any guard `P`) until
/// the body ends or is dropped.
#[derive(Debug)]
pub struct Held<B, P> {
    inner: B,
    permit: Option<P>,
}

impl<B: Default, P> Default for Held<B, P> {
    fn default() -> Self {
        Self {
            inner: B::default(),
            permit: None,
        }
    }
}

impl<B, P> Held<B, P> {
    pub fn new(inner: B, permit: Option<P>) -> Self {
        Self { inner, permit }
    }
}

impl<B, P> http_body::Body for Held<B, P>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    P: Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(None) = r {
            this.permit = None;
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A connection of a TCP listener, holding one of the listener's
/// connection slots until it closes.
#[derive(Debug)]
pub struct Capped {
    io: TcpStream,
    _slot: OwnedSemaphorePermit,
}

/// Accepts connections from `listener`, at most `max` open at once: a
/// connection beyond that is closed at once (the peer sees a reset), so idle
/// or slow clients cannot pile up sockets and buffers without bound.
/// Accepted sockets get `TCP_NODELAY` (responses are small and latency
/// matters more than packet count).
pub fn capped_incoming(
    listener: TcpListener,
    max: usize,
) -> impl futures::Stream<Item = std::io::Result<Capped>> {
    let slots = Arc::new(Semaphore::new(max.max(1)));
    futures::stream::unfold((listener, slots), |(listener, slots)| async move {
        loop {
            let (io, _) = match listener.accept().await {
                Ok(c) => c,
                // Per-connection errors (reset before accept, out of file
                // descriptors): back off briefly, keep the listener.
                Err(e) => {
                    tracing::debug!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    continue;
                }
            };
            let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                tracing::debug!("connection refused: listener at its connection cap");
                continue;
            };
            let _ = io.set_nodelay(true);
            return Some((Ok(Capped { io, _slot: slot }), (listener, slots)));
        }
    })
}

impl tokio::io::AsyncRead for Capped {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Capped {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl tonic::transport::server::Connected for Capped {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}
