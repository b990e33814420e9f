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

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use std::sync::Arc;

use openssh::{KnownHosts, Session, Stdio};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Mutex;

use super::channel::{self, Agent, Process, TIMED_OUT};
use super::protocol::{Answer, Request, MAX_ANSWER_BYTES};
use crate::error::{ConnectFailure, HostError};
use crate::inventory::HostSpec;

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
    /// Masters outlive the run (`--control-persist`) for the next run to
    /// use; otherwise every master used is closed at the end. Either way a
    /// master an earlier run left, ours and alive, is used.
    pub reuse: bool,
}

impl SshOptions {
    /// Whether connections made with `other` would be the same as with
    /// these (the socket directory aside).
    pub fn same_connection(&self, other: &SshOptions) -> bool {
        self.connect_timeout == other.connect_timeout
            && self.persist == other.persist
            && self.reuse == other.reuse
            && host_key_option(&self.known_hosts) == host_key_option(&other.known_hosts)
            && self.known_hosts_file == other.known_hosts_file
    }
}

/// A running master: its socket, its log, the mux session over it, and
/// our agent on the host, reached over it, if started.
#[derive(Debug)]
struct Master {
    session: Arc<Session>,
    socket: PathBuf,
    log: PathBuf,
    agent: Option<Agent>,
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
    /// The host's state files as parsed last cycle.
    pub parsed: Arc<std::sync::Mutex<crate::snapshot::assemble::ParsedState>>,
}

fn expand_home(path: &Path) -> PathBuf {
    match (path.strip_prefix("~"), std::env::var_os("HOME")) {
        (Ok(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => path.to_path_buf(),
    }
}

/// `StrictHostKeyChecking` for a policy.
fn host_key_option(k: &KnownHosts) -> &'static str {
    match k {
        KnownHosts::Strict => "StrictHostKeyChecking=yes",
        KnownHosts::Add => "StrictHostKeyChecking=accept-new",
        KnownHosts::Accept => "StrictHostKeyChecking=no",
    }
}

impl Connection {
    /// A host with no connection yet.
    pub fn new(spec: HostSpec) -> Self {
        Connection {
            spec,
            master: Mutex::new(None),
            connected_in: std::sync::Mutex::new(None),
            parsed: Arc::default(),
        }
    }

    /// The `ssh` options of this host's master: everything but its
    /// socket and log.
    fn master_options(&self, opts: &SshOptions) -> Result<Vec<OsString>, HostError> {
        let timeout = opts.connect_timeout.unwrap_or(DEFAULT_CONNECT_TIMEOUT);
        let mut args: Vec<OsString> = vec![
            "-M".into(),
            "-N".into(),
            "-o".into(),
            format!("ControlPersist={}s", opts.persist.as_secs().max(1)).into(),
            "-o".into(),
            "BatchMode=yes".into(),
            "-o".into(),
            host_key_option(&opts.known_hosts).into(),
            "-o".into(),
            format!("ConnectTimeout={}", timeout.as_secs().max(1)).into(),
            "-o".into(),
            "ServerAliveInterval=15".into(),
        ];
        if let Some(p) = self.spec.port {
            args.extend(["-p".into(), p.to_string().into()]);
        }
        if let Some(u) = &self.spec.user {
            args.extend(["-l".into(), u.into()]);
        }
        if let Some(k) = &self.spec.identity_file {
            args.extend([
                "-o".into(),
                "IdentitiesOnly=yes".into(),
                "-i".into(),
                expand_home(k).into(),
            ]);
        }
        if let Some(f) = &opts.known_hosts_file {
            let mut o = OsString::from("UserKnownHostsFile=");
            o.push(f);
            args.extend(["-o".into(), o]);
        }
        if !self.spec.ssh_options.is_empty() {
            args.extend(["-F".into(), self.write_config(opts)?.into()]);
        }
        args.extend(["--".into(), self.spec.address.clone().into()]);
        Ok(args)
    }

    /// A short name for files of this host in the control directory (socket
    /// paths are limited to about 100 bytes): its name, and a hash of `what`
    /// that tells different settings apart.
    fn file_stem(&self, what: &[impl AsRef<std::ffi::OsStr>]) -> String {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.spec.id.hash(&mut h);
        for w in what {
            w.as_ref().as_encoded_bytes().hash(&mut h);
        }
        let safe: String = self
            .spec
            .id
            .0
            .chars()
            .filter(char::is_ascii_alphanumeric)
            .take(16)
            .collect();
        format!("{safe}-{:016x}", h.finish())
    }

    async fn connect(&self, opts: &SshOptions) -> Result<Master, HostError> {
        let options = self.master_options(opts)?;
        // Same host, same options, same file names: what a master left by an
        // earlier run with these settings would use.
        let stem = self.file_stem(&options);
        let socket = opts.control_dir.join(format!("{stem}.sock"));
        let log = opts.control_dir.join(format!("{stem}.log"));
        if let Some(m) = adopt(&socket, &log).await {
            tracing::debug!(host = %self.spec.id, socket = %socket.display(), "reusing a master left by an earlier run");
            return Ok(m);
        }
        // Whatever is left there is stale or foreign: replaced.
        let _ = std::fs::remove_file(&socket);
        let mut args: Vec<OsString> = vec![
            "-E".into(),
            log.clone().into(),
            "-S".into(),
            socket.clone().into(),
        ];
        args.extend(options);
        let mut child = tokio::process::Command::new("ssh")
            .args(&args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| HostError::Spawn {
                command: "ssh".into(),
                source,
            })?;
        let group = child
            .id()
            .and_then(|id| rustix::process::Pid::from_raw(id as i32));
        let give_up = |child: &mut tokio::process::Child| {
            if let Some(g) = group {
                let _ = rustix::process::kill_process_group(g, rustix::process::Signal::KILL);
            }
            let _ = child.start_kill();
        };
        // ConnectTimeout bounds the TCP connect and the banner; a peer that
        // stalls the key exchange or authentication is cut off here.
        let timeout = opts.connect_timeout.unwrap_or(DEFAULT_CONNECT_TIMEOUT);
        let limit = timeout * 2 + Duration::from_secs(2);
        let started = tokio::time::Instant::now();
        let up = loop {
            // With ControlPersist the master forks into the background once
            // authenticated and its socket appears; the process we started
            // then exits. Until then it is ours, and dies with the group.
            if std::fs::symlink_metadata(&socket).is_ok() {
                break true;
            }
            match tokio::time::timeout(Duration::from_millis(20), child.wait()).await {
                Ok(Ok(status)) if !status.success() => break false,
                Ok(Err(_)) => break false,
                _ => {}
            }
            if started.elapsed() >= limit {
                give_up(&mut child);
                let _ = child.wait().await;
                let _ = std::fs::remove_file(&log);
                return Err(HostError::Timeout {
                    command: "ssh connect".into(),
                    after: limit,
                });
            }
        };
        if !up {
            let said = std::fs::read_to_string(&log).unwrap_or_default();
            let _ = std::fs::remove_file(&log);
            let _ = std::fs::remove_file(&socket);
            let said = said.trim().replace('\n', " ");
            let said = if said.is_empty() {
                "ssh exited without a connection".to_string()
            } else {
                said
            };
            return Err(HostError::Connect {
                failure: ConnectFailure::of(&said),
                said,
            });
        }
        *self.connected_in.lock().unwrap_or_else(|e| e.into_inner()) = Some(started.elapsed());
        // Reap the launcher once it has handed over (it exits right away).
        if tokio::time::timeout(MASTER_WAIT, child.wait())
            .await
            .is_err()
        {
            tracing::debug!(host = %self.spec.id, "ssh master launcher still running");
        }
        Ok(Master {
            session: Arc::new(Session::resume_mux(
                socket.clone().into_boxed_path(),
                Some(log.clone().into_boxed_path()),
            )),
            socket,
            log,
            agent: None,
        })
    }

    /// The inventory's `ssh_options` as an ssh config file, then the user's own.
    fn write_config(&self, opts: &SshOptions) -> Result<PathBuf, HostError> {
        let mut text = String::from("# written by genv-enforce\n");
        for o in &self.spec.ssh_options {
            let (k, v) = o.split_once('=').unwrap_or((o, ""));
            text.push_str(&format!("{} {}\n", k.trim(), v.trim()));
        }
        text.push_str("Include ~/.ssh/config\n");
        let path = opts
            .control_dir
            .join(format!("{}.ssh_config", self.file_stem(&[&text])));
        std::fs::write(&path, text).map_err(|e| HostError::Spawn {
            command: format!("write {}", path.display()),
            source: e,
        })?;
        Ok(path)
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
    /// feeding `stdin`, within `deadline`. Opens the master if there is none
    /// or the old one has died.
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
    /// [`AgentStart`]) to carry out `request`, within `deadline`. An agent
    /// that fails, ends or overruns the deadline is ended and started
    /// again next time.
    ///
    /// # Errors
    /// Connection failures, the probe failing or timing out (a
    /// [`HostError::Command`] or [`HostError::Timeout`] naming the
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

/// A master an earlier run left on `socket`, if it is ours and alive: the
/// socket owned by us and private, the process answering on it running as
/// us and serving that socket. Anything else is not used (and is replaced).
async fn adopt(socket: &Path, log: &Path) -> Option<Master> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let me = rustix::process::geteuid().as_raw();
    let meta = std::fs::symlink_metadata(socket).ok()?;
    if !meta.file_type().is_socket() || meta.uid() != me || meta.mode() & 0o077 != 0 {
        return None;
    }
    let pid = master_pid(socket).await?;
    let status = std::fs::read_to_string(format!("/proc/{}/status", pid.as_raw_nonzero())).ok()?;
    let uid = real_uid(&status)?;
    if uid != me || !is_master_of(pid, socket) {
        return None;
    }
    Some(Master {
        session: Arc::new(Session::resume_mux(
            socket.to_path_buf().into_boxed_path(),
            Some(log.to_path_buf().into_boxed_path()),
        )),
        socket: socket.to_path_buf(),
        log: log.to_path_buf(),
        agent: None,
    })
}

/// The real uid in `/proc/<pid>/status`.
fn real_uid(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_ascii_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Whether a master still answers, within [`MASTER_WAIT`].
async fn alive(session: &Session) -> bool {
    matches!(
        tokio::time::timeout(MASTER_WAIT, session.check()).await,
        Ok(Ok(()))
    )
}

/// Asks a master to stop (it then exits, its sessions done), within
/// [`MASTER_WAIT`]; if it does not, kills it. Removes its socket and log.
async fn shut(mut m: Master) -> Result<(), HostError> {
    let pid = master_pid(&m.socket).await;
    // The agent's channel closes with its stdin: it ends.
    if let Some(agent) = m.agent.take() {
        agent.close().await;
    }
    let asked = match Arc::try_unwrap(m.session) {
        Ok(session) => tokio::time::timeout(MASTER_WAIT, session.close()).await,
        Err(_) => Ok(Err(openssh::Error::Disconnected)),
    };
    let result = match asked {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(HostError::Ssh(e)),
        Err(_) => Err(HostError::Timeout {
            command: "ssh master close".into(),
            after: MASTER_WAIT,
        }),
    };
    if result.is_err() {
        if let Some(pid) = pid.filter(|p| is_master_of(*p, &m.socket)) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
    let _ = std::fs::remove_file(&m.socket);
    let _ = std::fs::remove_file(&m.log);
    result
}

/// The master's pid, as it tells over its socket.
async fn master_pid(socket: &Path) -> Option<rustix::process::Pid> {
    let ask = async {
        let mut c = openssh_mux_client::Connection::connect(socket).await.ok()?;
        c.send_alive_check().await.ok()
    };
    let pid = tokio::time::timeout(MASTER_WAIT, ask).await.ok()??;
    rustix::process::Pid::from_raw(pid.get() as i32)
}

/// Whether `pid` is still the ssh master serving `socket` (pids are reused).
fn is_master_of(pid: rustix::process::Pid, socket: &Path) -> bool {
    let cmdline =
        std::fs::read(format!("/proc/{}/cmdline", pid.as_raw_nonzero())).unwrap_or_default();
    let socket = socket.as_os_str().as_encoded_bytes();
    cmdline.split(|b| *b == 0).any(|arg| arg == socket)
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
