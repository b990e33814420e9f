//! A remote host: our [`agent`](super::agent) run as root through the
//! host's sudo over its SSH connection ([`ssh`](super::ssh)), asked for a
//! snapshot, kills and detaches.

use std::sync::Arc;
use std::time::Duration;

use super::agent::{self, Limits};
use super::ssh::{Answer, Connection, PeerStart, SshOptions};
use crate::doctor::{self, AgentFacts, Connected, Facts, NotConnected};
use crate::error::{self, ConnectFailure, HostError};
use crate::outcome::{self, Outcome};
use crate::plan::{HostPlan, Signal, Termination};

/// A host reached over SSH.
#[derive(Debug)]
pub struct SshHost {
    pub conn: Connection,
    pub ssh: Arc<SshOptions>,
    /// Deadline of each request, connection included.
    pub command_timeout: Duration,
    /// One cycle only (`--interval 0`): the agent need not outlive it.
    pub once: bool,
    /// `--max-records`.
    pub max_records: usize,
}

impl SshHost {
    /// Seconds a command may run on the host: [`agent::BOUNDED`] kills it
    /// (1 s grace included) before our own deadline ends.
    fn host_limit(&self) -> u64 {
        self.command_timeout.as_secs().saturating_sub(2).max(1)
    }

    /// The agent ends itself half a second before the host-side limit,
    /// and its steps (nvidia-smi, genv's lock) half a second before that,
    /// so that each reports what hung.
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

    /// `rest` under [`agent::BOUNDED`] on the host, at the host-side limit.
    fn bounded(&self, rest: Vec<String>) -> Vec<String> {
        ["sh", "-c", agent::BOUNDED, "genv-enforce"]
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
                        _ => ConnectFailure::of(&said),
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
                Err(
                    if agent::TIMED_OUT.contains(&out.status.code().unwrap_or(0)) {
                        format!("sudo did not answer within {} s", self.host_limit())
                    } else if said.is_empty() {
                        format!("sudo exited with {}", out.status)
                    } else {
                        said
                    },
                )
            }
            Err(e) => Err(error::chain(&e)),
        });
        if !matches!(f.sudo, Some(Ok(_))) {
            return f;
        }
        let request = agent::doctor_request(&spec.genv_dir, &spec.nvidia_smi, self.limits());
        let asked = std::time::SystemTime::now();
        let answer = self.ask("doctor", &request).await;
        let answered = std::time::SystemTime::now();
        f.agent = Some(match answer {
            Ok(a) if a.status == 0 => serde_json::from_slice::<AgentFacts>(&a.body)
                .map_err(|e| format!("the agent's answer is not what we expect: {e}")),
            Ok(a) => Err(String::from_utf8_lossy(&a.body).trim().to_string()),
            Err(e) => Err(error::chain(&e)),
        });
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
                .map(|s| doctor::counts(&s))
                .map_err(|e| error::chain(&e)),
        );
        f
    }

    /// How our agent is started, as root through the host's sudo. A run of
    /// one cycle starts it under [`agent::BOUNDED`] (a sudo that hangs is
    /// killed on the host, and so is the agent past the limit); a looping
    /// run, whose agent stays, tries sudo first under that bound.
    fn agent_start(&self) -> PeerStart {
        let spec = &self.conn.spec;
        let bounded = |rest| self.bounded(rest);
        let sudo = spec.sudo.iter().cloned();
        let agent: Vec<String> = sudo
            .clone()
            .chain(spec.python.iter().cloned())
            .chain(agent::bootstrap())
            .collect();
        let (probe, argv) = if self.once {
            (None, bounded(agent))
        } else {
            (
                Some(bounded(sudo.chain(["true".to_string()]).collect())),
                agent,
            )
        };
        PeerStart {
            probe,
            argv,
            preamble: agent::AGENT.as_bytes(),
            limit: Duration::from_secs(self.host_limit()),
        }
    }

    /// Asks our agent (started if needed) to carry out `request`.
    async fn ask(&self, what: &str, request: &serde_json::Value) -> Result<Answer, HostError> {
        self.conn
            .exchange(
                what,
                &self.agent_start(),
                &agent::encode(request),
                self.command_timeout,
                &self.ssh,
            )
            .await
    }

    /// See [`Host::fetch`](super::Host::fetch): the agent's frames.
    ///
    /// # Errors
    /// The connection, sudo or the agent failed, or a step failed on the
    /// host.
    pub async fn fetch(&self) -> Result<super::Fetched, HostError> {
        let spec = &self.conn.spec;
        let request = agent::snapshot_request(
            &spec.genv_dir,
            &spec.nvidia_smi,
            self.limits(),
            self.max_records,
        );
        let answer = self.ask("snapshot", &request).await?;
        if answer.status != 0 {
            return Err(HostError::Remote {
                what: "snapshot".into(),
                message: String::from_utf8_lossy(&answer.body).trim().to_string(),
            });
        }
        Ok(super::Fetched::Agent(answer.body))
    }

    /// What turns [`SshHost::fetch`] into a snapshot.
    pub fn parser(&self) -> super::Parser {
        super::Parser::new(
            self.conn.spec.id.0.clone(),
            Arc::clone(&self.conn.parsed),
            self.max_records,
        )
    }

    /// Sends `signal` to each process of `terminations` whose start time
    /// still matches (re-checked on the host, by the agent, right before).
    async fn signal(
        &self,
        terminations: &[Termination],
        signal: Signal,
    ) -> Vec<outcome::TerminateResult> {
        let Some(request) = agent::terminate_request(terminations, signal, self.limits()) else {
            return vec![outcome::TerminateResult::NoIdentity; terminations.len()];
        };
        match self.ask("terminate", &request).await {
            // Kills that happened are answered even if a later one failed.
            Ok(answer) => {
                agent::read_terminations(&String::from_utf8_lossy(&answer.body), terminations)
            }
            Err(e) => vec![
                outcome::TerminateResult::Failed {
                    error: error::chain(&e)
                };
                terminations.len()
            ],
        }
    }

    /// See [`Host::escalate`](super::Host::escalate).
    pub async fn escalate(&self, terminations: &[Termination]) -> Vec<Outcome> {
        let host = &self.conn.spec.id;
        let results = self.signal(terminations, Signal::Kill).await;
        terminations
            .iter()
            .zip(results)
            .map(|(t, outcome)| Outcome::Kill {
                host: host.clone(),
                pid: t.pid,
                outcome,
            })
            .collect()
    }

    /// See [`Host::execute`](super::Host::execute): the start times are
    /// re-checked on the host, by the agent, right before each signal.
    pub async fn execute(&self, plan: &HostPlan) -> Vec<Outcome> {
        let host = &self.conn.spec.id;
        let terminations = self.signal(&plan.terminate, Signal::Term).await;
        let mut outcomes: Vec<Outcome> = plan
            .terminate
            .iter()
            .zip(terminations)
            .map(|(t, outcome)| Outcome::Terminate {
                host: host.clone(),
                pid: t.pid,
                outcome,
            })
            .collect();
        if !plan.detach.is_empty() {
            let request =
                agent::detach_request(&self.conn.spec.genv_dir, &plan.detach, self.limits());
            let detaches = match self.ask("detach", &request).await {
                Ok(answer) if answer.status == 0 => {
                    agent::read_detaches(&String::from_utf8_lossy(&answer.body), &plan.detach)
                }
                Ok(answer) => vec![
                    outcome::DetachResult::Failed {
                        error: String::from_utf8_lossy(&answer.body)
                            .trim()
                            .replace('\n', " ")
                    };
                    plan.detach.len()
                ],
                Err(e) => vec![
                    outcome::DetachResult::Failed {
                        error: error::chain(&e)
                    };
                    plan.detach.len()
                ],
            };
            outcomes.extend(
                plan.detach
                    .iter()
                    .zip(detaches)
                    .map(|(d, outcome)| Outcome::Detach {
                        host: host.clone(),
                        device: d.device,
                        eid: d.eid.clone(),
                        outcome,
                    }),
            );
        }
        outcomes
    }

    /// Closes the master and removes its socket, or with
    /// `--control-persist` leaves it for the next run (our agent ends
    /// either way).
    ///
    /// # Errors
    /// The master did not close when asked and was killed.
    pub async fn close(&self) -> Result<(), HostError> {
        if self.ssh.reuse {
            self.conn.release().await;
            Ok(())
        } else {
            self.conn.close().await
        }
    }
}
