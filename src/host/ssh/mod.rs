//! One persistent OpenSSH ControlMaster per host, opened on first use,
//! kept across cycles and re-established when it has died (reboot, sshd
//! restart). Commands go straight to the master's socket through the
//! `openssh` crate's native mux client: no `ssh` process per command.
//!
//! We start each master ourselves (`ssh -M -N`, in a process group of its
//! own), so that one that does not come up in time is killed whole and
//! reaped, never left behind; there is always a connect timeout. Every
//! wait on a master (check, close) is bounded, and a master that does not
//! close when asked is killed.

use std::path::PathBuf;
use std::process::Output;
use std::time::Duration;

use std::sync::Arc;

use openssh::{KnownHosts, Session, Stdio};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Mutex;

mod master;

use master::{alive, host_key_option, shut, Master};

use super::channel::{self, Agent, Process, TIMED_OUT};
use super::protocol::{Answer, Request, MAX_ANSWER_BYTES};
use crate::host::HostError;
use crate::model::HostId;

/// How to reach one host and run genv's tools there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSpec {
    /// The name printed in reports (`[gpu1] ...`), as the admin wrote it.
    pub id: HostId,
    /// Host name or address to connect to.
    pub address: String,
    pub user: Option<String>,
    pub port: Option<u16>,
    pub identity_file: Option<PathBuf>,
    /// Extra `ssh -o` options (`Key=Value`).
    pub ssh_options: Vec<String>,
    /// genv's state directory there (`GENV_TMPDIR`).
    pub genv_dir: String,
    /// The privilege wrapper, as words (`["sudo", "-n"]`; empty for root logins).
    pub sudo: Vec<String>,
    /// The Python 3 that runs our agent on the host (genv's own will do), as words.
    pub python: Vec<String>,
    /// The nvidia-smi command, as words.
    pub nvidia_smi: Vec<String>,
}

/// The connect timeout when `-t` gives none.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a check or close of a master may take.
const MASTER_WAIT: Duration = Duration::from_secs(5);

/// How connections are made.
#[derive(Debug, Clone)]
pub struct SshOptions {
    /// `-t`: SSH ConnectTimeout ([`DEFAULT_CONNECT_TIMEOUT`] when `None`).
    pub connect_timeout: Option<Duration>,
    /// Where master sockets live.
    pub control_dir: PathBuf,
    /// How long an idle master outlives us if we die without closing it.
    pub persist: Duration,
    /// Host-key policy.
    pub known_hosts: KnownHosts,
    /// A known_hosts file to use instead of the user's.
    pub known_hosts_file: Option<PathBuf>,
    /// What becomes of masters at the end of the run. Either way a master
    /// an earlier run left, ours and alive, is used.
    pub at_end: AtEnd,
}

/// What becomes of a host's master at the end of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtEnd {
    /// Closed, its socket removed.
    Close,
    /// Left running for the next run to use (`--control-persist`).
    Persist,
}

impl SshOptions {
    /// Whether connections made with `other` would be the same as with
    /// these (the socket directory aside).
    pub fn same_connection(&self, other: &SshOptions) -> bool {
        self.connect_timeout == other.connect_timeout
            && self.persist == other.persist
            && self.at_end == other.at_end
            && host_key_option(&self.known_hosts) == host_key_option(&other.known_hosts)
            && self.known_hosts_file == other.known_hosts_file
    }
}

/// How to start the agent: a bounded command that must succeed first, if
/// any (it fails fast where a long-lived one would hang, e.g. a sudo that
/// waits on a directory service), then the command that runs the agent.
/// `limit`: the host-side limit that bounds either, for reports.
#[derive(Debug, Clone)]
pub struct AgentStart {
    pub probe: Option<Vec<String>>,
    pub argv: Vec<String>,
    pub limit: Duration,
}

/// A host and its master connection, if open.
#[derive(Debug)]
pub struct Connection {
    pub spec: HostSpec,
    master: Mutex<Option<Master>>,
    /// How long the last master took to come up, until asked for.
    connected_in: std::sync::Mutex<Option<Duration>>,
}

impl Connection {
    /// A host with no connection yet.
    pub fn new(spec: HostSpec) -> Self {
        Connection {
            spec,
            master: Mutex::new(None),
            connected_in: std::sync::Mutex::new(None),
        }
    }

    /// The master, opened if there is none or the old one has died.
    async fn master<'a>(
        &self,
        guard: &'a mut Option<Master>,
        opts: &SshOptions,
    ) -> Result<&'a mut Master, HostError> {
        if let Some(m) = guard.as_ref() {
            if !alive(&m.session).await {
                if let Some(dead) = guard.take() {
                    let _ = shut(dead).await; // dead already: only its files are left to remove
                }
            }
        }
        if guard.is_none() {
            *guard = Some(self.connect(opts).await?);
        }
        Ok(guard.as_mut().expect("connected just above"))
    }

    /// Runs `argv` on the host (each word shell-quoted by the transport),
    /// feeding `stdin`. Opens the master first if there is none or the old
    /// one has died (bounded by the connect timeout, `-t`); then the
    /// command itself has `deadline`.
    ///
    /// # Errors
    /// Connection failures, a channel the master refused, or the deadline.
    /// A non-zero exit status is not an error here: it is in the [`Output`].
    pub async fn run(
        &self,
        argv: &[String],
        stdin: Option<&[u8]>,
        deadline: Duration,
        opts: &SshOptions,
    ) -> Result<Output, HostError> {
        let mut guard = self.master.lock().await;
        let master = self.master(&mut guard, opts).await?;
        // A master that died under the command is found out on next use.
        self.run_on_master(master, argv, stdin, deadline).await
    }

    async fn run_on_master(
        &self,
        master: &Master,
        argv: &[String],
        stdin: Option<&[u8]>,
        deadline: Duration,
    ) -> Result<Output, HostError> {
        match tokio::time::timeout(deadline, run_on(&master.session, argv, stdin)).await {
            Ok(Ok(out)) => Ok(out),
            Ok(Err(e)) => Err(HostError::Ssh(e)),
            Err(_) => Err(HostError::Timeout {
                command: argv_summary(argv),
                after: deadline,
            }),
        }
    }

    /// Asks this host's agent (started first if there is none, see
    /// [`AgentStart`]) to carry out `request`. Opening the master is
    /// bounded by the connect timeout (`-t`); starting the agent and the
    /// request each have `deadline`. An agent
    /// that fails, ends or overruns the deadline is ended and started
    /// again next time.
    ///
    /// # Errors
    /// Connection failures, the probe failing or timing out (a
    /// [`HostError::Sudo`] or [`HostError::Timeout`] naming the
    /// request), the agent ending (with what it said on stderr), or the
    /// deadline.
    pub async fn exchange(
        &self,
        start: &AgentStart,
        request: &Request,
        deadline: Duration,
        opts: &SshOptions,
    ) -> Result<Answer, HostError> {
        let mut guard = self.master.lock().await;
        // A running agent is the proof that its master lives: no check per
        // request (a dead master shows as the agent failing, and is checked
        // before the next agent starts).
        let master = match guard.as_mut() {
            Some(m) if m.agent.is_some() => m,
            _ => self.master(&mut guard, opts).await?,
        };
        let session = Arc::clone(&master.session);
        let what = request.name();
        let started = self.start_agent(session, start, what, deadline);
        channel::ask(&mut master.agent, started, request, deadline, start.limit).await
    }

    /// Starts our agent over `session`: the probe first, if any.
    async fn start_agent(
        &self,
        session: Arc<Session>,
        start: &AgentStart,
        what: &str,
        deadline: Duration,
    ) -> Result<Agent, HostError> {
        if let Some(argv) = &start.probe {
            let probe = match tokio::time::timeout(deadline, run_on(&session, argv, None)).await {
                Ok(Ok(out)) => out,
                Ok(Err(e)) => return Err(HostError::Ssh(e)),
                Err(_) => {
                    return Err(HostError::Timeout {
                        command: argv_summary(argv),
                        after: deadline,
                    })
                }
            };
            match probe.status.code() {
                Some(0) => {}
                Some(code) if TIMED_OUT.contains(&code) => {
                    return Err(HostError::Timeout {
                        command: format!("{what} (killed on the host)"),
                        after: start.limit,
                    })
                }
                _ => {
                    let said = String::from_utf8_lossy(if probe.stderr.is_empty() {
                        &probe.stdout
                    } else {
                        &probe.stderr
                    })
                    .trim()
                    .replace('\n', " ");
                    return Err(HostError::Sudo {
                        command: what.to_string(),
                        status: probe.status.to_string(),
                        output: said,
                    });
                }
            }
        }
        let (program, args) = start
            .argv
            .split_first()
            .expect("argv is never empty: callers pass a command");
        let mut cmd = Session::arc_command(session, program.as_str());
        cmd.args(args.iter().map(String::as_str));
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let child = cmd.spawn().await.map_err(HostError::Ssh)?;
        Agent::start(Process::Ssh(child), what, deadline, start.limit)
            .await
            .map_err(|e| match e {
                // Ended before its hello, in sudo's words: sudo refused.
                HostError::Command {
                    command,
                    status,
                    output,
                } if output.starts_with("sudo:") => HostError::Sudo {
                    command,
                    status,
                    output,
                },
                e => e,
            })
    }

    /// What this host's agent said of itself, if one runs.
    pub async fn hello(&self) -> Option<super::protocol::Hello> {
        let guard = self.master.lock().await;
        guard.as_ref()?.agent.as_ref().map(|a| a.hello.clone())
    }

    /// How long a master took to come up, if one was opened since last asked.
    pub fn take_connect_time(&self) -> Option<Duration> {
        self.connected_in
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// Leaves the master running for a later run (`--control-persist`); our
    /// agent on the host ends (its stdin closes).
    pub async fn release(&self) {
        if let Some(mut m) = self.master.lock().await.take() {
            if let Some(agent) = m.agent.take() {
                agent.close().await;
            }
        }
    }

    /// Closes the master, if open, removing its socket; a master that does
    /// not stop when asked is killed.
    ///
    /// # Errors
    /// The master could not be shut down cleanly (it was killed instead).
    pub async fn close(&self) -> Result<(), HostError> {
        match self.master.lock().await.take() {
            Some(m) => shut(m).await,
            None => Ok(()),
        }
    }
}

async fn run_on(
    session: &Session,
    argv: &[String],
    stdin: Option<&[u8]>,
) -> Result<Output, openssh::Error> {
    let (program, args) = argv
        .split_first()
        .expect("argv is never empty: callers pass a script");
    let mut cmd = session.command(program.as_str());
    cmd.args(args.iter().map(String::as_str));
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().await?;
    let (input, stdout, stderr) = (
        child.stdin().take(),
        child.stdout().take(),
        child.stderr().take(),
    );
    let feed = async {
        if let (Some(data), Some(mut pipe)) = (stdin, input) {
            pipe.write_all(data).await?;
            pipe.shutdown().await?;
        }
        Ok::<_, std::io::Error>(())
    };
    // A host's answer is capped: past the cap it is cut, and the cut
    // answer fails to parse rather than filling our memory.
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let read_out = async {
        if let Some(r) = stdout {
            r.take(MAX_ANSWER_BYTES).read_to_end(&mut out).await?;
        }
        Ok::<_, std::io::Error>(())
    };
    let read_err = async {
        if let Some(r) = stderr {
            r.take(1 << 20).read_to_end(&mut err).await?;
        }
        Ok::<_, std::io::Error>(())
    };
    let (fed, read_out, read_err) = tokio::join!(feed, read_out, read_err);
    // The agent reads all its input before answering; a refused write
    // (it died early) is told by its exit status.
    let _ = fed;
    read_out.and(read_err).map_err(openssh::Error::ChildIo)?;
    let status = child.wait().await?;
    Ok(Output {
        status,
        stdout: out,
        stderr: err,
    })
}

fn argv_summary(argv: &[String]) -> String {
    let shown: Vec<&str> = argv
        .iter()
        .take_while(|a| a.as_str() != "-c")
        .map(String::as_str)
        .collect();
    format!("{} ...", shown.join(" "))
}
