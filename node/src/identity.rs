//! The node's identity: an ed25519 key pair whose public key *is* the node id.
//!
//! The secret is created on first run in the data directory as
//! `node.key` (64 lowercase hex digits of the 32-byte secret seed and a
//! newline), written with mode 0600 in a directory created with mode 0700,
//! atomically (a fsynced temporary file linked in under the name, then the
//! directory fsynced): a crash never leaves an empty or torn key file.
//! Losing the file means becoming a new node (new id, no earnings history).
//!
//! # Invariants
//! - The secret never appears in `Debug` output or logs; it is zeroized when
//!   the [`Identity`] is dropped (ed25519-dalek's `zeroize` feature) and every
//!   intermediate copy read from disk is zeroized too.
//! - A key file readable or writable by group or others is refused, never
//!   silently re-permissioned: it may already have leaked, and the owner
//!   should decide.
//!
//! # Failure
//! [`IdentityError`] names the file and what is wrong with it (permissions,
//! corrupt content, I/O).

use std::{
    fmt,
    io::Write,
    path::{Path, PathBuf},
};

use ed25519_dalek::{Signature, Signer, SigningKey};
use mlxnet_proto::ids::NodeId;
use zeroize::Zeroizing;

/// File name of the secret key inside the data directory.
pub const KEY_FILE: &str = "node.key";

/// Why the identity could not be loaded or created.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IdentityError {
    #[error("cannot create data directory {path}: {source}")]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read key file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write key file {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "key file {path} has mode {mode:o}: it must be readable by its owner only \
         (run `chmod 600 {path}` if you are sure it has not leaked, or delete it to become a new node)"
    )]
    InsecurePermissions { path: PathBuf, mode: u32 },
    #[error(
        "key file {path} is corrupt: expected 64 hex digits (a 32-byte ed25519 seed); \
         restore it from a backup or delete it to become a new node"
    )]
    Corrupt { path: PathBuf },
}

/// The node's key pair. `Debug` shows the node id only.
pub struct Identity {
    key: SigningKey,
}

impl Identity {
    /// A fresh random identity (not saved anywhere).
    pub fn generate() -> Self {
        Self {
            key: SigningKey::generate(&mut rand::rngs::OsRng),
        }
    }

    /// An identity from a known key (tests, tools).
    pub fn from_signing_key(key: SigningKey) -> Self {
        Self { key }
    }

    /// Loads `dir/node.key`, creating the directory and a new key on first run.
    pub fn load_or_create(dir: &Path) -> Result<Self, IdentityError> {
        let path = dir.join(KEY_FILE);
        match Self::load(&path) {
            Ok(id) => return Ok(id),
            Err(IdentityError::Read { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        create_private_dir(dir)?;
        let identity = Self::generate();
        match identity.write_new(&path) {
            Ok(()) => Ok(identity),
            // Another process created it between our read and our write: use theirs.
            Err(IdentityError::Write { source, .. })
                if source.kind() == std::io::ErrorKind::AlreadyExists =>
            {
                Self::load(&path)
            }
            Err(e) => Err(e),
        }
    }

    /// Loads an existing key file, checking its permissions first.
    pub fn load(path: &Path) -> Result<Self, IdentityError> {
        let read_err = |source| IdentityError::Read {
            path: path.to_owned(),
            source,
        };
        let meta = std::fs::metadata(path).map_err(read_err)?;
        check_private(path, &meta)?;
        let text = Zeroizing::new(std::fs::read_to_string(path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::InvalidData {
                IdentityError::Corrupt {
                    path: path.to_owned(),
                }
            } else {
                read_err(e)
            }
        })?);
        let mut seed = Zeroizing::new([0u8; 32]);
        let hex_part = text.trim_end_matches(['\n', '\r']);
        hex::decode_to_slice(hex_part, seed.as_mut_slice()).map_err(|_| {
            IdentityError::Corrupt {
                path: path.to_owned(),
            }
        })?;
        Ok(Self {
            key: SigningKey::from_bytes(&seed),
        })
    }

    /// Writes the key to a file that must not exist yet, mode 0600,
    /// atomically: the key goes to a temporary file beside it (written and
    /// fsynced), which is then linked in under `path` (failing if `path`
    /// exists, so another process's key is never replaced) and the
    /// directory fsynced. A crash leaves either no key file or a whole one,
    /// never an empty or torn one (which would stop every later start).
    fn write_new(&self, path: &Path) -> Result<(), IdentityError> {
        let write_err = |source| IdentityError::Write {
            path: path.to_owned(),
            source,
        };
        let dir = path.parent().unwrap_or(Path::new("."));
        let tmp = dir.join(format!(
            ".{KEY_FILE}.{}.{:016x}.tmp",
            std::process::id(),
            rand::random::<u64>()
        ));
        let mut opts = std::fs::OpenOptions::new();
        opts.write(true).create_new(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            opts.mode(0o600);
        }
        let written = (|| {
            let mut file = opts.open(&tmp)?;
            let mut text = Zeroizing::new(hex::encode(self.key.to_bytes()));
            text.push('\n');
            file.write_all(text.as_bytes())?;
            file.sync_all()?;
            std::fs::hard_link(&tmp, path)
        })();
        let _ = std::fs::remove_file(&tmp);
        written.map_err(write_err)?;
        #[cfg(unix)]
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(write_err)?;
        Ok(())
    }

    /// The node id: the public key.
    pub fn node_id(&self) -> NodeId {
        NodeId::from_key(&self.key.verifying_key())
    }

    /// Signs `msg` with the node's key.
    pub fn sign(&self, msg: &[u8]) -> Signature {
        self.key.sign(msg)
    }

    /// The secret key, for signing result claims.
    pub fn signing_key(&self) -> &SigningKey {
        &self.key
    }
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Identity")
            .field("node_id", &self.node_id())
            .field("secret", &"<redacted>")
            .finish()
    }
}

fn create_private_dir(dir: &Path) -> Result<(), IdentityError> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::DirBuilderExt;
        builder.mode(0o700);
    }
    builder
        .create(dir)
        .map_err(|source| IdentityError::CreateDir {
            path: dir.to_owned(),
            source,
        })
}

#[cfg(unix)]
fn check_private(path: &Path, meta: &std::fs::Metadata) -> Result<(), IdentityError> {
    use std::os::unix::fs::PermissionsExt;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(IdentityError::InsecurePermissions {
            path: path.to_owned(),
            mode,
        });
    }
    Ok(())
}

#[cfg(not(unix))]
fn check_private(_path: &Path, _meta: &std::fs::Metadata) -> Result<(), IdentityError> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::Verifier;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn first_run_creates_a_0600_key_and_later_runs_reload_the_same_id() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("nested/data");
        let first = Identity::load_or_create(&data).unwrap();
        let path = data.join(KEY_FILE);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let dir_mode = std::fs::metadata(&data).unwrap().permissions().mode() & 0o777;
        assert_eq!(dir_mode, 0o700);

        let again = Identity::load_or_create(&data).unwrap();
        assert_eq!(first.node_id(), again.node_id());
        // The reloaded key signs for the same id.
        let sig = again.sign(b"hello");
        first
            .node_id()
            .verifying_key()
            .unwrap()
            .verify(b"hello", &sig)
            .unwrap();
        // Another directory is another node.
        let other = Identity::load_or_create(&dir.path().join("other")).unwrap();
        assert_ne!(other.node_id(), first.node_id());
    }

    #[test]
    fn a_key_readable_by_others_is_refused_with_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let id = Identity::load_or_create(dir.path()).unwrap();
        let path = dir.path().join(KEY_FILE);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = Identity::load_or_create(dir.path()).unwrap_err();
        assert!(
            matches!(err, IdentityError::InsecurePermissions { mode: 0o644, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("chmod 600"), "{err}");
        // The file was left alone, not replaced by a new key.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(
            Identity::load_or_create(dir.path()).unwrap().node_id(),
            id.node_id()
        );
    }

    /// The key is published whole by a link from a fsynced temporary
    /// file: after a first run the directory holds the key file only, and
    /// a temporary file a crash left behind stops nothing.
    #[test]
    fn the_key_file_appears_whole_and_a_crashed_writes_leftover_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let leftover = dir
            .path()
            .join(format!(".{KEY_FILE}.1.0000000000000000.tmp"));
        std::fs::write(&leftover, b"").unwrap();
        let id = Identity::load_or_create(dir.path()).unwrap();
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        let mut expected = vec![
            KEY_FILE.to_string(),
            leftover.file_name().unwrap().to_string_lossy().into_owned(),
        ];
        expected.sort();
        assert_eq!(names, expected, "only the key file was added");
        let text = std::fs::read_to_string(dir.path().join(KEY_FILE)).unwrap();
        assert_eq!(text.len(), 65, "64 hex digits and a newline");
        assert_eq!(
            Identity::load(&dir.path().join(KEY_FILE))
                .unwrap()
                .node_id(),
            id.node_id()
        );
    }

    #[test]
    fn a_corrupt_key_file_is_refused_not_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(KEY_FILE);
        for content in [
            &b"not hex at all\n"[..],
            &b"abcd\n"[..],
            &[0xff, 0xfe, 0x00][..],
            &b""[..],
        ] {
            std::fs::write(&path, content).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
            let err = Identity::load_or_create(dir.path()).unwrap_err();
            assert!(matches!(err, IdentityError::Corrupt { .. }), "{err}");
            assert_eq!(
                std::fs::read(&path).unwrap(),
                content,
                "file was overwritten"
            );
        }
    }

    #[test]
    fn debug_output_never_shows_the_secret() {
        let id = Identity::generate();
        let shown = format!("{id:?}");
        let secret = hex::encode(id.signing_key().to_bytes());
        assert!(!shown.contains(&secret));
        assert!(!shown.contains(&secret[..16]));
        assert!(shown.contains("redacted"));
    }
}
