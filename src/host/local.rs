//! This machine as a host: our agent (`agent.py`) run here as a child of
//! ours, as root, through the same protocol as on a remote host, so that
//! what touches a live host is written once ([`super::live`]). The agent
//! stays between cycles; one that fails or ends is started again on the
//! next request.

use std::path::PathBuf;
use std::time::Duration;

use super::channel::{self, Agent, Process};
use super::facts::Facts;
use super::protocol::{Answer, Hello, Limits, Request};
use super::HostError;
use crate::model::HostId;

/// The Python that runs our agent here (genv's own needs one).
pub const PYTHON: &str = "python3";

/// Our agent as a child of ours, over its pipes.
#[derive(Debug)]
pub struct Pipes {
    /// The Python that runs the agent.
    pub python: String,
    /// Deadline of each command and of waiting for genv's lock.
    pub timeout: Duration,
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

impl Pipes {
    /// Our agent run by [`PYTHON`], each request within `timeout`.
    pub fn new(timeout: Duration) -> Self {
        Pipes {
            python: PYTHON.to_string(),
            timeout,
            agent: tokio::sync::Mutex::default(),
        }
    }

    /// Whether `other` runs the agent the same way.
    pub fn same_as(&self, other: &Pipes) -> bool {
        self.timeout == other.timeout && self.python == other.python
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

    /// The agent's steps end at our deadline; the agent itself a second
    /// later (each step reports what hung first).
    pub fn limits(&self) -> Limits {
        Limits {
            step: self.timeout,
            run: self.timeout + Duration::from_secs(1),
        }
    }

    /// Asks our agent (started if needed) to carry out `request`.
    ///
    /// # Errors
    /// The agent could not be started, failed or overran its deadline.
    pub async fn ask(&self, request: &Request) -> Result<Answer, HostError> {
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

    /// `doctor`'s facts before the agent is asked: none to reach it.
    pub fn facts(&self, host: &HostId) -> Facts {
        Facts::new(host.clone(), self.python.clone())
    }

    /// Ends the agent, if running.
    pub async fn close(&self) {
        if let Some(agent) = self.agent.lock().await.take() {
            agent.close().await;
        }
    }

    /// What the running agent said of itself, if one runs.
    pub async fn hello(&self) -> Option<Hello> {
        self.agent.lock().await.as_ref().map(|a| a.hello.clone())
    }
}

/// This machine's name for reports.
pub fn hostname() -> HostId {
    HostId(
        nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or_else(|| "localhost".to_string())
            .into(),
    )
}
