//! What a host tells of itself for `doctor`, gathered by the hosts (the
//! connection, sudo, our agent's account, a real snapshot). Plain data;
//! `doctor` turns it into checks.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::protocol::Hello;
use crate::model::{ConnectFailure, HostId};

/// What was learned about one host.
#[derive(Debug, Clone)]
pub struct Facts {
    pub host: HostId,
    /// SSH only: how the connection went.
    pub ssh: Option<Result<Connected, NotConnected>>,
    /// SSH only: whether `sudo -n` runs our agent's Python as root, and
    /// what `sudo -l` says we may run.
    pub sudo: Option<Result<String, String>>,
    /// The login user and Python the agent runs as (for hints).
    pub login: Option<String>,
    /// SSH only: the known_hosts file host keys are checked against, where
    /// not the login's own `~/.ssh/known_hosts` (for hints).
    pub known_hosts_file: Option<std::path::PathBuf>,
    pub python_command: String,
    /// Our agent's account of the host.
    pub agent: Option<Result<AgentFacts, String>>,
    /// What the agent said of itself when it started (its protocol and
    /// capabilities).
    pub hello: Option<Hello>,
    /// A real snapshot, parsed as a cycle parses it.
    pub snapshot: Option<Result<Counts, String>>,
    /// Host clock minus ours, in seconds.
    pub skew: Option<f64>,
    /// Local only: whether we run as root.
    pub root: Option<bool>,
}

impl Facts {
    /// Nothing learned yet of `host`, whose agent `python_command` runs.
    pub fn new(host: HostId, python_command: String) -> Facts {
        Facts {
            host,
            ssh: None,
            sudo: None,
            login: None,
            known_hosts_file: None,
            python_command,
            agent: None,
            hello: None,
            snapshot: None,
            skew: None,
            root: None,
        }
    }
}

/// A connection that came up.
#[derive(Debug, Clone)]
pub struct Connected {
    pub ms: u64,
    /// Host-key policy, for the report.
    pub host_key: &'static str,
}

/// A connection that did not.
#[derive(Debug, Clone)]
pub struct NotConnected {
    pub failure: ConnectFailure,
    pub said: String,
    pub port: u16,
}

/// What a snapshot held.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    pub gpus: usize,
    pub processes: usize,
    pub envs: usize,
    pub attachments: usize,
}

/// The agent's answer to a doctor request.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct AgentFacts {
    pub python: String,
    pub euid: u32,
    pub time: f64,
    pub nvidia_smi: GpuFacts,
    pub state: StateFacts,
    pub genv: Option<String>,
    pub tools: BTreeMap<String, Option<String>>,
    /// High availability: the agent's fencing directory, when asked.
    #[serde(default)]
    pub fence: Option<FenceFacts>,
}

/// The fencing directory (high availability) as the agent found it.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct FenceFacts {
    pub dir: String,
    pub kind: FileKind,
    /// The highest leader epoch the host has seen.
    pub epoch: Option<u64>,
    /// Why the agent would refuse to use it.
    pub problem: Option<String>,
}

/// nvidia-smi's answer to `--query-gpu=index,driver_version`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct GpuFacts {
    pub gpus: Option<usize>,
    pub driver: Option<String>,
    pub error: Option<String>,
}

/// genv's state directory as found (never followed through a link).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StateFacts {
    pub dir: String,
    pub kind: FileKind,
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    #[serde(default)]
    pub files: BTreeMap<String, FileKind>,
}

/// What is at a path, as the agent found it (`lstat`, never followed).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum FileKind {
    Is(Kind),
    Unreadable {
        unreadable: String,
    },
    #[default]
    #[serde(skip)]
    Unknown,
}

/// A file's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    Missing,
    Regular,
    Directory,
    Symlink,
    Fifo,
    Socket,
    Device,
    Other,
}

impl std::fmt::Display for FileKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FileKind::Is(Kind::Missing) => "missing",
            FileKind::Is(Kind::Regular) => "regular",
            FileKind::Is(Kind::Directory) => "a directory",
            FileKind::Is(Kind::Symlink) => "a symbolic link",
            FileKind::Is(Kind::Fifo) => "a FIFO",
            FileKind::Is(Kind::Socket) => "a socket",
            FileKind::Is(Kind::Device) => "a device",
            FileKind::Is(Kind::Other) => "not a regular file",
            FileKind::Unreadable { unreadable } => return write!(f, "unreadable: {unreadable}"),
            FileKind::Unknown => "unknown",
        })
    }
}

/// What a snapshot holds, for the report, or why its genv state cannot be
/// used (a degraded host).
///
/// # Errors
/// The state's problem.
pub fn snapshot_counts(s: &crate::model::HostSnapshot) -> Result<Counts, String> {
    match s.state_problem() {
        Some(problem) => Err(format!("{STATE_UNUSABLE}: {problem}")),
        None => Ok(counts(s)),
    }
}

/// How a degraded host's problem starts.
pub const STATE_UNUSABLE: &str = "genv's state cannot be used";

/// What a snapshot holds, for the report.
pub fn counts(s: &crate::model::HostSnapshot) -> Counts {
    Counts {
        gpus: s.devices.len(),
        processes: s.processes.len(),
        envs: s.envs.len(),
        attachments: s.devices.iter().map(|d| d.attachments.len()).sum(),
    }
}
