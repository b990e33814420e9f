//! Errors of the I/O shell, each with its cause as its `source()`. A host's
//! error is data: it is reported and the other hosts are still enforced.
//! [`chain`] is how any of them becomes text (reports, stderr).

use std::path::PathBuf;
use std::time::Duration;

use thiserror::Error;

use crate::snapshot::frames::FrameError;
use crate::snapshot::ParseError;

/// An error and all its causes, `: `-separated, on one line.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text.trim().replace('\n', " ")
}

/// Why a host could not be snapshotted, or an action not carried out.
#[derive(Debug, Error)]
pub enum HostError {
    /// A command could not be started.
    #[error("cannot run {command}")]
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
    /// ssh could not open a connection; `said` is ssh's own account.
    #[error("{said}")]
    Connect {
        failure: ConnectFailure,
        said: String,
    },
    /// The SSH multiplexed channel failed.
    #[error(transparent)]
    Ssh(#[from] openssh::Error),
    /// Our agent on the host ended or broke its protocol; `said` is the
    /// last line of its stderr, if any.
    #[error("the agent failed: {error}{}", if said.is_empty() { String::new() } else { format!(": {said}") })]
    Agent { error: std::io::Error, said: String },
    /// A recorded snapshot could not be read.
    #[error("{}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A worker task of ours failed (a bug): reported, never a panic.
    #[error("internal error in {what}")]
    Join {
        what: &'static str,
        #[source]
        source: tokio::task::JoinError,
    },
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

impl From<FrameError> for HostError {
    fn from(e: FrameError) -> Self {
        match e {
            FrameError::Failed { what, message } => HostError::Remote { what, message },
            FrameError::Parse(p) => HostError::Parse(p),
        }
    }
}

/// Why ssh could not connect, as far as its words tell: what an admin fixes
/// differs for each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectFailure {
    /// Nothing listens on the port.
    Refused,
    /// The host or its network does not answer.
    Unreachable,
    /// The name does not resolve.
    UnknownHost,
    /// The key was refused (or a password would be needed).
    Auth,
    /// The host key is unknown or changed.
    HostKey,
    /// Anything else.
    Other,
}

impl ConnectFailure {
    /// Classifies what ssh said when it gave up.
    pub fn of(said: &str) -> Self {
        let s = said.to_ascii_lowercase();
        if s.contains("host key verification failed")
            || s.contains("remote host identification has changed")
            || s.contains("no matching host key")
        {
            ConnectFailure::HostKey
        } else if s.contains("permission denied") || s.contains("too many authentication failures")
        {
            ConnectFailure::Auth
        } else if s.contains("connection refused") {
            ConnectFailure::Refused
        } else if s.contains("could not resolve hostname")
            || s.contains("name or service not known")
        {
            ConnectFailure::UnknownHost
        } else if s.contains("timed out")
            || s.contains("no route to host")
            || s.contains("network is unreachable")
        {
            ConnectFailure::Unreachable
        } else {
            ConnectFailure::Other
        }
    }
}

/// A failure reading or locking genv's state directory.
#[derive(Debug, Error)]
pub enum StateError {
    /// A file could not be read, written or created.
    #[error("{}", path.display())]
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causes_are_told_once_in_order() {
        let e = HostError::State(StateError::io(
            "/var/tmp/genv/envs.json",
            std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        ));
        assert_eq!(chain(&e), "/var/tmp/genv/envs.json: permission denied");
        let e = HostError::Spawn {
            command: "nvidia-smi".into(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        };
        assert_eq!(chain(&e), "cannot run nvidia-smi: entity not found");
    }

    #[test]
    fn ssh_failures_are_told_apart() {
        use ConnectFailure as F;
        for (said, kind) in [
            (
                "ssh: connect to host 10.0.0.9 port 22: Connection refused",
                F::Refused,
            ),
            (
                "ssh: connect to host 10.0.0.9 port 22: Connection timed out",
                F::Unreachable,
            ),
            (
                "ssh: connect to host 10.0.0.9 port 22: No route to host",
                F::Unreachable,
            ),
            (
                "ssh: Could not resolve hostname gpu9: Name or service not known",
                F::UnknownHost,
            ),
            ("ops@gpu1: Permission denied (publickey).", F::Auth),
            ("Host key verification failed.", F::HostKey),
            ("ssh exited without a connection", F::Other),
        ] {
            assert_eq!(ConnectFailure::of(said), kind, "{said}");
        }
    }
}
