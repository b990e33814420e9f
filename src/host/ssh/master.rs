//! Masters' lifecycle: each host's `ssh -M -N` started by us (in a
//! process group of its own, so that one that does not come up in time is
//! killed whole and reaped), one left by an earlier run adopted only if it
//! is ours and alive, and closed (killed if it does not close when asked).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use openssh::{KnownHosts, Session};

use super::{Connection, SshOptions, DEFAULT_CONNECT_TIMEOUT, MASTER_WAIT};
use crate::host::channel::Agent;
use crate::host::HostError;
use crate::model::ConnectFailure;

/// A running master: its socket, its log, the mux session over it, and
/// our agent on the host, reached over it, if started.
#[derive(Debug)]
pub(super) struct Master {
    pub(super) session: Arc<Session>,
    pub(super) socket: PathBuf,
    pub(super) log: PathBuf,
    pub(super) agent: Option<Agent>,
}

fn expand_home(path: &Path) -> PathBuf {
    match (path.strip_prefix("~"), std::env::var_os("HOME")) {
        (Ok(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => path.to_path_buf(),
    }
}

/// `StrictHostKeyChecking` for a policy.
pub(super) fn host_key_option(k: &KnownHosts) -> &'static str {
    match k {
        KnownHosts::Strict => "StrictHostKeyChecking=yes",
        KnownHosts::Add => "StrictHostKeyChecking=accept-new",
        KnownHosts::Accept => "StrictHostKeyChecking=no",
    }
}

impl Connection {
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

    pub(super) async fn connect(&self, opts: &SshOptions) -> Result<Master, HostError> {
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
        std::fs::write(&path, text).map_err(|source| HostError::Write {
            path: path.clone(),
            source,
        })?;
        Ok(path)
    }
}

/// A master an earlier run left on `socket`, if it is ours and alive: the
/// socket owned by us and private, the process answering on it running as
/// us and serving that socket. Anything else is not used (and is replaced).
pub(super) async fn adopt(socket: &Path, log: &Path) -> Option<Master> {
    let me = rustix::process::geteuid().as_raw();
    crate::private::own_path(socket, rustix::fs::FileType::Socket, 0o077).ok()?;
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
pub(super) async fn alive(session: &Session) -> bool {
    matches!(
        tokio::time::timeout(MASTER_WAIT, session.check()).await,
        Ok(Ok(()))
    )
}

/// Asks a master to stop (it then exits, its sessions done), within
/// [`MASTER_WAIT`]; if it does not, kills it. Removes its socket and log.
pub(super) async fn shut(mut m: Master) -> Result<(), HostError> {
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
