//! A remote host: our [`agent`](super::agent) run as root through the
//! host's sudo over its SSH connection ([`ssh`](super::ssh)), asked for a
//! snapshot, kills and detaches.

use std::sync::Arc;
use std::time::Duration;

use super::channel::TIMED_OUT;
use super::facts::{self, Connected, Facts, NotConnected};
use super::live::Live;
use super::protocol::{self, Answer, Limits, Request};
use super::ssh::{AgentStart, AtEnd, Connection, SshOptions};
use super::HostError;
use crate::error;
use crate::model::ConnectFailure;
use crate::model::HostId;
use crate::snapshot::assemble::ParsedState;

/// Runs its arguments under `timeout` when the host has it (coreutils and
/// busybox both do), so that a command that hangs (sudo waiting on a
/// directory service) is killed on the host before our deadline; otherwise
/// its session would linger on the master and count against sshd's
/// MaxSessions. Used to try `sudo` before the agent is started; past sudo,
/// the agent bounds itself, as root. See the file's header for its
/// arguments and exit statuses.
pub const BOUNDED: &str = include_str!("bounded.sh");

/// How long a remote host's agent lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentLifetime {
    /// One cycle (`--interval 0`): it runs under [`BOUNDED`], ends with it.
    OneCycle,
    /// Across cycles: it stays, answering each cycle's requests.
    Kept,
}

/// A host reached over SSH.
#[derive(Debug)]
pub struct SshHost {
    pub conn: Connection,
    pub ssh: Arc<SshOptions>,
    /// Deadline of each request, connection included.
    pub command_timeout: Duration,
    /// How long its agent lives.
    pub lifetime: AgentLifetime,
    /// `--max-records`.
    pub max_records: usize,
    /// The groups whose members snapshots say (group exemptions, caps).
    pub groups: Vec<String>,
    /// Whether snapshots say how busy GPUs and processes are (idle rule).
    pub utilization: bool,
    /// The epoch its requests carry (high availability).
    pub fencing: crate::host::fence::Fencing,
}

impl SshHost {
    /// Seconds a command may run on the host: [`BOUNDED`] kills it
    /// (1 s grace included) before our own deadline ends.
    fn host_limit(&self) -> u64 {
        self.command_timeout.as_secs().saturating_sub(2).max(1)
    }

    /// `rest` under [`BOUNDED`] on the host, at the host-side limit.
    fn bounded(&self, rest: Vec<String>) -> Vec<String> {
        ["sh", "-c", BOUNDED, "genv-enforce"]
            .into_iter()
            .map(String::from)
            .chain([self.host_limit().to_string()])
            .chain(rest)
            .collect()
    }

    /// Facts for `doctor`: the connection, sudo, the agent's account of
    /// the host and a real snapshot, each step only if the one before
    /// went through.
    pub async fn doctor(&self) -> Facts {
        let spec = &self.conn.spec;
        let mut f = Facts {
            host: spec.id.clone(),
            ssh: None,
            sudo: None,
            login: spec.user.clone(),
            python_command: spec.python.join(" "),
            agent: None,
            hello: None,
            snapshot: None,
            skew: None,
            root: None,
        };
        let port = spec.port.unwrap_or(22);
        let start = std::time::Instant::now();
        let truth = ["true".to_string()];
        f.ssh = Some(
            match self
                .conn
                .run(&truth, None, self.command_timeout, &self.ssh)
                .await
            {
                Ok(out) if out.status.success() => {
                    let took = self.conn.take_connect_time().unwrap_or(start.elapsed());
                    Ok(Connected {
                        ms: u64::try_from(took.as_millis()).unwrap_or(u64::MAX),
                        host_key: match self.ssh.known_hosts {
                            openssh::KnownHosts::Strict => "verified against known_hosts",
                            openssh::KnownHosts::Add => {
                                "verified against known_hosts (a new host's key is added)"
                            }
                            openssh::KnownHosts::Accept => "not checked",
                        },
                    })
                }
                Ok(out) => Err(NotConnected {
                    failure: ConnectFailure::Other,
                    said: format!(
                        "a command failed on the host: {}",
                        String::from_utf8_lossy(&out.stderr).trim()
                    ),
                    port,
                }),
                Err(HostError::Connect { failure, said }) => Err(NotConnected {
                    failure,
                    said,
                    port,
                }),
                Err(e) => {
                    let said = error::chain(&e);
                    let failure = match e {
                        HostError::Timeout { .. } => ConnectFailure::Unreachable,
                        // The mux's words about the connection under it.
                        HostError::Ssh(_) => ConnectFailure::of(&said),
                        _ => ConnectFailure::Other,
                    };
                    Err(NotConnected {
                        failure,
                        said,
                        port,
                    })
                }
            },
        );
        if !matches!(f.ssh, Some(Ok(_))) {
            return f;
        }
        let sudo: Vec<String> = spec.sudo.clone();
        let probe = self.bounded(
            sudo.iter()
                .chain(&spec.python)
                .cloned()
                .chain(["-I", "-S", "-c", "pass"].map(String::from))
                .collect(),
        );
        let ran = self
            .conn
            .run(&probe, None, self.command_timeout, &self.ssh)
            .await;
        f.sudo = Some(match ran {
            Ok(out) if out.status.success() => {
                let mut allowed = format!(
                    "`{}` runs `{}` as root",
                    sudo.join(" "),
                    spec.python.join(" ")
                );
                if sudo.first().is_some_and(|s| s.ends_with("sudo")) {
                    let list = self.bounded(sudo.iter().cloned().chain(["-l".into()]).collect());
                    if let Ok(out) = self
                        .conn
                        .run(&list, None, self.command_timeout, &self.ssh)
                        .await
                    {
                        let text = String::from_utf8_lossy(&out.stdout);
                        let rules: Vec<&str> = text
                            .lines()
                            .skip_while(|l| !l.contains("may run the following commands"))
                            .skip(1)
                            .map(str::trim)
                            .filter(|l| !l.is_empty())
                            .collect();
                        if !rules.is_empty() {
                            allowed.push_str(&format!("; sudo -l: {}", rules.join("; ")));
                        }
                    }
                }
                Ok(allowed)
            }
            Ok(out) => {
                let said = String::from_utf8_lossy(if out.stderr.is_empty() {
                    &out.stdout
                } else {
                    &out.stderr
                })
                .trim()
                .replace('\n', " ");
                Err(if TIMED_OUT.contains(&out.status.code().unwrap_or(0)) {
                    format!("sudo did not answer within {} s", self.host_limit())
                } else if said.is_empty() {
                    format!("sudo exited with {}", out.status)
                } else {
                    said
                })
            }
            Err(e) => Err(error::chain(&e)),
        });
        if !matches!(f.sudo, Some(Ok(_))) {
            return f;
        }
        let request = Request::doctor(
            &spec.genv_dir,
            &spec.nvidia_smi,
            self.limits(),
            self.fencing.dir(),
        );
        let asked = std::time::SystemTime::now();
        let answer = self.ask(&request).await;
        let answered = std::time::SystemTime::now();
        f.agent = Some(
            answer
                .and_then(|a| super::doctor_facts(&a))
                .map_err(|e| error::chain(&e)),
        );
        f.hello = self.conn.hello().await;
        if let Some(Ok(a)) = &f.agent {
            let secs = |t: std::time::SystemTime| {
                t.duration_since(std::time::UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64())
            };
            f.skew = Some(a.time - (secs(asked) + secs(answered)) / 2.0);
        }
        f.snapshot = Some(
            async { super::parsed(self.fetch().await?, self.parser()).await }
                .await
                .map_err(|e| error::chain(&e))
                .and_then(|s| facts::snapshot_counts(&s)),
        );
        f
    }

    /// How our agent is started, as root through the host's sudo. A run of
    /// one cycle starts it under [`BOUNDED`] (a sudo that hangs is killed
    /// on the host, and so is the agent past the limit); a looping run,
    /// whose agent stays, tries sudo first under that bound.
    fn agent_start(&self) -> AgentStart {
        let spec = &self.conn.spec;
        let bounded = |rest| self.bounded(rest);
        let sudo = spec.sudo.iter().cloned();
        let agent: Vec<String> = sudo
            .clone()
            .chain(spec.python.iter().cloned())
            .chain(protocol::bootstrap())
            .collect();
        let (probe, argv) = match self.lifetime {
            AgentLifetime::OneCycle => (None, bounded(agent)),
            AgentLifetime::Kept => (
                Some(bounded(sudo.chain(["true".to_string()]).collect())),
                agent,
            ),
        };
        AgentStart {
            probe,
            argv,
            limit: Duration::from_secs(self.host_limit()),
        }
    }

    /// Closes the master and removes its socket, or with
    /// `--control-persist` leaves it for the next run (our agent ends
    /// either way).
    ///
    /// # Errors
    /// The master did not close when asked and was killed.
    pub async fn close(&self) -> Result<(), HostError> {
        if self.ssh.at_end == AtEnd::Persist {
            self.conn.release().await;
            Ok(())
        } else {
            self.conn.close().await
        }
    }
}

impl Live for SshHost {
    fn id(&self) -> &HostId {
        &self.conn.spec.id
    }

    fn genv_dir(&self) -> String {
        self.conn.spec.genv_dir.clone()
    }

    fn proc_root(&self) -> String {
        "/proc".into()
    }

    fn nvidia_smi(&self) -> &[String] {
        &self.conn.spec.nvidia_smi
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

    /// The agent ends itself half a second before the host-side limit,
    /// and its steps (nvidia-smi, genv's lock) half a second before that,
    /// so that each reports what hung.
    fn fencing(&self) -> &crate::host::fence::Fencing {
        &self.fencing
    }

    fn limits(&self) -> Limits {
        let half = Duration::from_millis(500);
        let run = Duration::from_secs(self.host_limit())
            .saturating_sub(half)
            .max(half);
        Limits {
            run,
            step: run.saturating_sub(half).max(Duration::from_millis(300)),
        }
    }

    fn source(&self) -> String {
        self.conn.spec.id.0.clone()
    }

    fn parsed(&self) -> &Arc<std::sync::Mutex<ParsedState>> {
        &self.conn.parsed
    }

    /// Asks our agent (started if needed) to carry out `request`.
    async fn ask(&self, request: &Request) -> Result<Answer, HostError> {
        self.conn
            .exchange(
                &self.agent_start(),
                request,
                self.command_timeout,
                &self.ssh,
            )
            .await
    }
}
