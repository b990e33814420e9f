//! Errors of the I/O shell. A host's error is data: it is reported and the
//! other hosts are still enforced.

use std::path::PathBuf;
use std::time::Duration;

use thiserror::Error;

use crate::snapshot::ParseError;

/// Why a host could not be snapshotted this cycle.
#[derive(Debug, Error)]
pub enum HostError {
    /// A command could not be started.
    #[error("cannot run {command}: {source}")]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },
    /// A command exited non-zero.
    #[error("{command} exited with {status}: {output}")]
    Command {
        command: String,
        status: String,
        output: String,
    },
    /// A command ran past its deadline and was killed.
    #[error("{command} did not finish within {}", humantime::format_duration(*after))]
    Timeout { command: String, after: Duration },
    /// A step failed on a remote host, as our agent there reported it.
    #[error("{what}: {message}")]
    Remote { what: String, message: String },
    /// The SSH connection or channel failed.
    #[error("{message}")]
    Ssh { message: String },
    /// Output that was not UTF-8.
    #[error("{command} printed output that is not UTF-8")]
    NotUtf8 { command: String },
    /// Output that could not be parsed.
    #[error(transparent)]
    Parse(#[from] ParseError),
    /// genv's state could not be read or written.
    #[error(transparent)]
    State(#[from] StateError),
}

/// A failure reading or locking genv's state directory.
#[derive(Debug, Error)]
pub enum StateError {
    /// A file could not be read, written or created.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Another process held genv's lock past the deadline.
    #[error("{}: still locked by another process after {}", path.display(), humantime::format_duration(*after))]
    LockTimeout { path: PathBuf, after: Duration },
    /// A name in the world-writable state directory is not what genv
    /// writes there (a symlink, FIFO, device, ...): refused, never followed.
    #[error("{} is {what}: refused (genv's state directory is writable by every user)", path.display())]
    Unsafe { path: PathBuf, what: &'static str },
    /// A state file larger than any real state.
    #[error("{} is larger than {limit} bytes: refused", path.display())]
    TooLarge { path: PathBuf, limit: u64 },
    /// A state file that is not UTF-8 (genv writes ASCII JSON).
    #[error("{} is not UTF-8", path.display())]
    NotUtf8 { path: PathBuf },
}

impl StateError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        StateError::Io {
            path: path.into(),
            source,
        }
    }
}
