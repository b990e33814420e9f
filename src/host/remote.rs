//! A remote host: our agent run as root through the host's sudo over its
//! SSH connection ([`ssh`](super::ssh)); what it is asked is written once
//! in [`super::live`].

use std::sync::Arc;
use std::time::Duration;

use super::channel::TIMED_OUT;
use super::facts::{Connected, Facts, NotConnected};
use super::protocol::{self, Answer, Limits, Request};
use super::ssh::{AgentStart, AtEnd, Connection, SshOptions};
use super::HostError;
use crate::error;
use crate::model::ConnectFailure;

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

/// Our agent under a remote host's sudo, over its SSH master.
#[derive(Debug)]
pub struct Ssh {
    pub conn: Connection,
    pub ssh: Arc<SshOptions>,
    /// Deadline of each request, connection included.
    pub command_timeout: Duration,
    /// How long its agent lives.
    pub lifetime: AgentLifetime,
}

impl Ssh {
    /// Whether `other` reaches the same host the same way.
    pub fn same_as(&self, other: &Ssh) -> bool {
        self.conn.spec == other.conn.spec
            && self.command_timeout == other.command_timeout
            && self.lifetime == other.lifetime
            && self.ssh.same_connection(&other.ssh)
    }

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

    /// `doctor`'s facts of how the host is reached: the connection, then
    /// sudo, each only if the one before went through; the facts so far
    /// when one did not.
    ///
    /// # Errors
    /// The facts, where the agent cannot be reached.
    pub async fn reach(&self) -> Result<Facts, Box<Facts>> {
        let spec = &self.conn.spec;
        let mut f = Facts::new(spec.id.clone(), spec.python.join(" "));
        f.login.clone_from(&spec.user);
        f.known_hosts_file.clone_from(&self.ssh.known_hosts_file);
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
            return Err(Box::new(f));
        }
        let sudo: Vec<String> = spec.sudo.clone();
        let ran = self
            .conn
            .run(&self.sudo_probe(), None, self.command_timeout, &self.ssh)
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
        if matches!(f.sudo, Some(Ok(_))) {
            Ok(f)
        } else {
            Err(Box::new(f))
        }
    }

    /// The host's Python run with `args` as root, through its sudo.
    fn python_as_root(&self, args: impl IntoIterator<Item = String>) -> Vec<String> {
        let spec = &self.conn.spec;
        spec.sudo
            .iter()
            .chain(&spec.python)
            .cloned()
            .chain(args)
            .collect()
    }

    /// The command that tries whether sudo lets the login user start our
    /// agent's Python as root: the agent's own command form (`sudo -n
    /// python3 -I -S -c ...`) under [`BOUNDED`], so that the one sudoers
    /// rule the docs give (`USER ALL=(root) NOPASSWD: /usr/bin/python3`)
    /// passes `doctor`'s check exactly when it lets the service start its
    /// agent.
    fn sudo_probe(&self) -> Vec<String> {
        self.bounded(self.python_as_root(["-I", "-S", "-c", "pass"].map(String::from)))
    }

    /// How our agent is started, as root through the host's sudo. A run of
    /// one cycle starts it under [`BOUNDED`] (a sudo that hangs is killed
    /// on the host, and so is the agent past the limit); a looping run,
    /// whose agent stays, tries sudo first under that bound, with the
    /// same command as `doctor` ([`Ssh::sudo_probe`]).
    fn agent_start(&self) -> AgentStart {
        let agent = self.python_as_root(protocol::bootstrap());
        let (probe, argv) = match self.lifetime {
            AgentLifetime::OneCycle => (None, self.bounded(agent)),
            AgentLifetime::Kept => (Some(self.sudo_probe()), agent),
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

    /// The agent ends itself half a second before the host-side limit,
    /// and its steps (nvidia-smi, genv's lock) half a second before that,
    /// so that each reports what hung.
    pub fn limits(&self) -> Limits {
        let half = Duration::from_millis(500);
        let run = Duration::from_secs(self.host_limit())
            .saturating_sub(half)
            .max(half);
        Limits {
            run,
            step: run.saturating_sub(half).max(Duration::from_millis(300)),
        }
    }

    /// Asks our agent (started if needed) to carry out `request`.
    ///
    /// # Errors
    /// The connection, sudo or the agent failed, or the deadline passed.
    pub async fn ask(&self, request: &Request) -> Result<Answer, HostError> {
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
