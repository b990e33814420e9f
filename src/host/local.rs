//! This machine as a host: our agent (`agent.py`) run here as a child of
//! ours, as root, through the same protocol as on a remote host, so that
//! what touches a live host is written once. The agent stays between
//! cycles; one that fails or ends is started again on the next request.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::channel::{self, Agent, Process};
use super::facts::{self, Facts};
use super::live::Live;
use super::protocol::{Answer, Limits, Request};
use super::HostError;
use crate::error;
use crate::model::HostId;
use crate::snapshot::assemble::ParsedState;

/// The Python that runs our agent here (genv's own needs one).
pub const PYTHON: &str = "python3";

/// How to reach this machine's GPUs and genv state.
#[derive(Debug)]
pub struct LocalHost {
    /// Its name in reports (the machine's hostname).
    pub id: HostId,
    /// genv's state directory.
    pub state_dir: PathBuf,
    /// The nvidia-smi command (a path or a name on PATH).
    pub nvidia_smi: String,
    /// Where procfs is mounted.
    pub proc_root: PathBuf,
    /// Deadline of each command and of waiting for genv's lock.
    pub timeout: Duration,
    /// The state files as parsed last cycle.
    pub parsed: Arc<Mutex<ParsedState>>,
    /// `--max-records`.
    pub max_records: usize,
    /// The groups whose members snapshots say (group exemptions, caps).
    pub groups: Vec<String>,
    /// Whether snapshots say how busy GPUs and processes are (idle rule).
    pub utilization: bool,
    /// The Python that runs the agent.
    pub python: String,
    /// The epoch its requests carry (high availability).
    pub fencing: crate::host::fence::Fencing,
    /// The agent, once started.
    agent: tokio::sync::Mutex<Option<Agent>>,
}

/// genv's state directory here: `$GENV_TMPDIR`, or genv's default.
pub fn state_dir_from_env() -> PathBuf {
    std::env::var_os("GENV_TMPDIR").map_or_else(
        || PathBuf::from(crate::snapshot::genv::DEFAULT_DIR),
        PathBuf::from,
    )
}

impl LocalHost {
    /// This machine with genv's defaults, from the environment.
    pub fn from_env(timeout: Duration) -> Self {
        LocalHost::new(hostname(), state_dir_from_env(), timeout)
    }

    /// This machine, named `id`, with genv's state in `state_dir`.
    pub fn new(id: HostId, state_dir: PathBuf, timeout: Duration) -> Self {
        LocalHost {
            id,
            state_dir,
            nvidia_smi: "nvidia-smi".to_string(),
            proc_root: PathBuf::from("/proc"),
            timeout,
            parsed: Arc::default(),
            max_records: crate::snapshot::genv::DEFAULT_MAX_RECORDS,
            groups: Vec::new(),
            utilization: false,
            python: PYTHON.to_string(),
            fencing: crate::host::fence::Fencing::default(),
            agent: tokio::sync::Mutex::default(),
        }
    }

    /// Whether `other` is the same host reached the same way.
    pub fn same_as(&self, other: &LocalHost) -> bool {
        self.id == other.id
            && self.state_dir == other.state_dir
            && self.nvidia_smi == other.nvidia_smi
            && self.proc_root == other.proc_root
            && self.timeout == other.timeout
            && self.python == other.python
    }

    /// Starts the agent: `python3 -I -S -c <bootstrap>`, its stdin, stdout
    /// and stderr ours, killed if we drop it.
    async fn start(&self, what: &str) -> Result<Agent, HostError> {
        let child = tokio::process::Command::new(&self.python)
            .args(super::protocol::bootstrap())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| HostError::Spawn {
                command: self.python.clone(),
                source,
            })?;
        Agent::start(
            Process::Local(child),
            what,
            self.timeout + Duration::from_secs(2),
            self.limits().run,
        )
        .await
    }

    /// Facts for `doctor`: our agent's account of this machine (root or
    /// not included), and a real snapshot.
    pub async fn doctor(&self) -> Facts {
        let request = Request::doctor(
            &self.genv_dir(),
            std::slice::from_ref(&self.nvidia_smi),
            self.limits(),
            self.fencing.dir(),
        );
        let agent = self
            .ask(&request)
            .await
            .and_then(|a| super::doctor_facts(&a));
        let hello = self.agent.lock().await.as_ref().map(|a| a.hello.clone());
        let snapshot = match self.fetch().await {
            Ok(f) => super::parsed(f, self.parser()).await,
            Err(e) => Err(e),
        };
        Facts {
            host: self.id.clone(),
            ssh: None,
            sudo: None,
            login: None,
            python_command: self.python.clone(),
            root: Some(match (&agent, &hello) {
                (Ok(a), _) => a.euid == 0,
                (_, Some(h)) => h.euid == 0,
                _ => rustix::process::geteuid().is_root(),
            }),
            agent: Some(agent.map_err(|e| {
                format!(
                    "{} could not run the agent: {}",
                    self.python,
                    error::chain(&e)
                )
            })),
            hello,
            snapshot: Some(
                snapshot
                    .map_err(|e| error::chain(&e))
                    .and_then(|s| facts::snapshot_counts(&s)),
            ),
            skew: None,
        }
    }

    /// Ends the agent, if running.
    pub async fn close(&self) {
        if let Some(agent) = self.agent.lock().await.take() {
            agent.close().await;
        }
    }

    /// Facts of the agent run here, if it ran (for tests).
    pub async fn hello(&self) -> Option<super::protocol::Hello> {
        self.agent.lock().await.as_ref().map(|a| a.hello.clone())
    }
}

impl Live for LocalHost {
    fn id(&self) -> &HostId {
        &self.id
    }

    fn genv_dir(&self) -> String {
        self.state_dir.display().to_string()
    }

    fn proc_root(&self) -> String {
        self.proc_root.display().to_string()
    }

    fn nvidia_smi(&self) -> &[String] {
        std::slice::from_ref(&self.nvidia_smi)
    }

    fn max_records(&self) -> usize {
        self.max_records
    }

    fn groups(&self) -> &[String] {
        &self.groups
    }

    fn utilization(&self) -> bool {
        self.utilization
    }

    /// The agent's steps end at our deadline; the agent itself a second
    /// later (each step reports what hung first).
    fn fencing(&self) -> &crate::host::fence::Fencing {
        &self.fencing
    }

    fn limits(&self) -> Limits {
        Limits {
            step: self.timeout,
            run: self.timeout + Duration::from_secs(1),
        }
    }

    /// Errors name genv's state directory.
    fn source(&self) -> String {
        self.genv_dir()
    }

    fn parsed(&self) -> &Arc<Mutex<ParsedState>> {
        &self.parsed
    }

    /// Asks our agent (started if needed) to carry out `request`.
    async fn ask(&self, request: &Request) -> Result<Answer, HostError> {
        let mut slot = self.agent.lock().await;
        let start = self.start(request.name());
        channel::ask(
            &mut slot,
            start,
            request,
            self.limits().run + Duration::from_secs(1),
            self.limits().run,
        )
        .await
    }
}

/// This machine's name for reports.
pub fn hostname() -> HostId {
    HostId(
        nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or_else(|| "localhost".to_string()),
    )
}
