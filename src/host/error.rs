//! A host's errors, each with its cause as its `source()`. A host's error
//! is data: it is reported and the other hosts are still enforced;
//! [`crate::error::chain`] makes it one line of text.

use std::path::PathBuf;
use std::time::Duration;

use thiserror::Error;

use super::protocol::{FailKind, ProtocolError};
use crate::error::chain;
use crate::model::{ConnectFailure, FailureKind, HostFailure};
use crate::snapshot::ParseError;

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
    /// sudo would not run our agent: its words (`a password is required`).
    #[error("{command} exited with {status}: {output}")]
    Sudo {
        command: String,
        status: String,
        output: String,
    },
    /// A step failed on the host, as our agent there reported it.
    #[error("{}: {message}", fail.word())]
    Remote { fail: FailKind, message: String },
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
    /// A file of ours could not be written (an ssh config).
    #[error("cannot write {}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A recorded snapshot could not be read.
    #[error("{}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Our agent answered outside its protocol.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// A worker task of ours failed (a bug): reported, never a panic.
    #[error("internal error in {what}")]
    Join {
        what: &'static str,
        #[source]
        source: tokio::task::JoinError,
    },
    /// Output that could not be parsed.
    #[error(transparent)]
    Parse(#[from] ParseError),
}

impl HostError {
    /// The kind of step that failed.
    pub fn kind(&self) -> FailureKind {
        match self {
            HostError::Connect { failure, .. } => FailureKind::Connect(*failure),
            HostError::Ssh(_) => FailureKind::Connect(ConnectFailure::Other),
            HostError::Sudo { .. } => FailureKind::Sudo,
            HostError::Timeout { .. } => FailureKind::Timeout,
            HostError::Spawn { .. } | HostError::Command { .. } | HostError::Agent { .. } => {
                FailureKind::Agent
            }
            HostError::Write { .. } => FailureKind::Internal,
            HostError::Protocol(_) => FailureKind::Agent,
            HostError::Remote { fail, .. } => match fail {
                FailKind::State => FailureKind::State,
                FailKind::Lock => FailureKind::Lock,
                FailKind::NvidiaSmi => FailureKind::NvidiaSmi,
                FailKind::Fenced => FailureKind::Fenced,
                FailKind::Fence => FailureKind::Fence,
                FailKind::Request | FailKind::Agent => FailureKind::Agent,
            },
            HostError::Read { .. } => FailureKind::Recorded,
            HostError::Join { .. } => FailureKind::Internal,
            HostError::Parse(_) => FailureKind::Parse,
        }
    }

    /// As the core sees it: its kind and its whole account.
    pub fn failure(&self) -> HostFailure {
        HostFailure::new(self.kind(), chain(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ConnectFailure;

    #[test]
    fn causes_are_told_once_in_order() {
        let e = HostError::Read {
            path: "/var/tmp/genv/envs.json".into(),
            source: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        };
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
