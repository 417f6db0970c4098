//! Length-prefixed prost frames with a hard size cap, for QUIC streams.
//!
//! A frame is a u32 big-endian length, then that many bytes of one encoded
//! message. The length is checked against the cap *before* any buffer is
//! allocated, so a peer cannot make us allocate more than the cap.
//!
//! # Failure
//! [`FrameError::TooLarge`] for a frame over the cap (the caller should reset
//! the stream), [`FrameError::Closed`] when the stream ends cleanly between
//! frames, [`FrameError::Io`] / [`FrameError::Decode`] otherwise.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Largest frame either side accepts: 1 MiB. A claim for 32k output tokens
/// with their text is well under this.
pub const MAX_FRAME_LEN: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    #[error("frame of {len} bytes exceeds the {max}-byte cap")]
    TooLarge { len: usize, max: usize },
    #[error("stream closed")]
    Closed,
    #[error("stream i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("malformed frame: {0}")]
    Decode(#[from] prost::DecodeError),
}

/// Writes one frame.
pub async fn write_frame<W, M>(w: &mut W, msg: &M) -> Result<(), FrameError>
where
    W: AsyncWrite + Unpin,
    M: prost::Message,
{
    let len = msg.encoded_len();
    if len > MAX_FRAME_LEN {
        return Err(FrameError::TooLarge {
            len,
            max: MAX_FRAME_LEN,
        });
    }
    let mut buf = Vec::with_capacity(4 + len);
    buf.extend_from_slice(&(len as u32).to_be_bytes());
    msg.encode(&mut buf)
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    w.write_all(&buf).await?;
    Ok(())
}

/// Reads one frame; `Err(FrameError::Closed)` at a clean end of stream.
pub async fn read_frame<R, M>(r: &mut R) -> Result<M, FrameError>
where
    R: AsyncRead + Unpin,
    M: prost::Message + Default,
{
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(FrameError::Closed),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME_LEN {
        return Err(FrameError::TooLarge {
            len,
            max: MAX_FRAME_LEN,
        });
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf).await?;
    Ok(M::decode(buf.as_slice())?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{node_control, Heartbeat, NodeControl};

    #[tokio::test]
    async fn frames_round_trip_and_oversized_ones_are_refused_before_allocation() {
        let msg = NodeControl {
            msg: Some(node_control::Msg::Heartbeat(Heartbeat {
                free_memory_bytes: 42,
                running_jobs: 1,
                ..Default::default()
            })),
        };
        let mut buf = Vec::new();
        write_frame(&mut buf, &msg).await.unwrap();
        let back: NodeControl = read_frame(&mut buf.as_slice()).await.unwrap();
        assert_eq!(back, msg);

        // A header announcing 4 GiB is refused without reading on.
        let huge = u32::MAX.to_be_bytes();
        let err = read_frame::<_, NodeControl>(&mut huge.as_slice())
            .await
            .unwrap_err();
        assert!(matches!(err, FrameError::TooLarge { .. }), "{err}");

        let err = read_frame::<_, NodeControl>(&mut [].as_slice())
            .await
            .unwrap_err();
        assert!(matches!(err, FrameError::Closed), "{err}");

        let garbage = [0, 0, 0, 3, 0xff, 0xff, 0xff];
        let err = read_frame::<_, NodeControl>(&mut garbage.as_slice())
            .await
            .unwrap_err();
        assert!(matches!(err, FrameError::Decode(_)), "{err}");
    }
}
