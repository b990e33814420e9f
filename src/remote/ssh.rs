//! One persistent OpenSSH ControlMaster per host (the `openssh` crate,
//! native-mux: commands go straight to the master's socket, no `ssh`
//! process per command), opened on first use, kept across cycles and
//! re-established when it has died (reboot, sshd restart).

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use openssh::{ControlPersist, KnownHosts, Session, SessionBuilder, Stdio};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Mutex;

use crate::error::HostError;
use crate::inventory::HostSpec;
use crate::remote::agent::MAX_OUTPUT_BYTES;

/// How connections are made.
#[derive(Debug, Clone)]
pub struct SshOptions {
    /// `-t`: SSH ConnectTimeout.
    pub connect_timeout: Option<Duration>,
    /// Where master sockets live.
    pub control_dir: PathBuf,
    /// How long an idle master outlives us if we die without closing it.
    pub persist: Duration,
    /// Host-key policy.
    pub known_hosts: KnownHosts,
    /// A known_hosts file to use instead of the user's.
    pub known_hosts_file: Option<PathBuf>,
}

/// A host and its master connection, if open.
#[derive(Debug)]
pub struct Connection {
    pub spec: HostSpec,
    session: Mutex<Option<Session>>,
}

fn expand_home(path: &Path) -> PathBuf {
    match (path.strip_prefix("~"), std::env::var_os("HOME")) {
        (Ok(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => path.to_path_buf(),
    }
}

impl Connection {
    /// A host with no connection yet.
    pub fn new(spec: HostSpec) -> Self {
        Connection {
            spec,
            session: Mutex::new(None),
        }
    }

    async fn connect(&self, opts: &SshOptions) -> Result<Session, HostError> {
        let mut b = SessionBuilder::default();
        b.known_hosts_check(opts.known_hosts.clone())
            .control_directory(&opts.control_dir)
            .server_alive_interval(Duration::from_secs(15));
        if let Some(n) = std::num::NonZeroUsize::new(opts.persist.as_secs() as usize) {
            b.control_persist(ControlPersist::IdleFor(n));
        }
        if let Some(u) = &self.spec.user {
            b.user(u.clone());
        }
        if let Some(p) = self.spec.port {
            b.port(p);
        }
        if let Some(k) = &self.spec.identity_file {
            b.keyfile(expand_home(k));
        }
        if let Some(t) = opts.connect_timeout {
            b.connect_timeout(t);
        }
        if let Some(f) = &opts.known_hosts_file {
            b.user_known_hosts_file(f);
        }
        if !self.spec.ssh_options.is_empty() {
            b.config_file(self.write_config(opts)?);
        }
        // ConnectTimeout bounds the TCP connect only; a peer that accepts
        // and then stalls the handshake must not hold the cycle forever.
        let limit =
            opts.connect_timeout.unwrap_or(Duration::from_secs(30)) + Duration::from_secs(10);
        match tokio::time::timeout(limit, b.connect_mux(&self.spec.address)).await {
            Ok(Ok(s)) => Ok(s),
            Ok(Err(e)) => Err(HostError::Ssh {
                message: ssh_message(&e),
            }),
            Err(_) => Err(HostError::Timeout {
                command: "ssh connect".into(),
                after: limit,
            }),
        }
    }

    /// The inventory's `ssh_options` as an ssh config file, then the user's own.
    fn write_config(&self, opts: &SshOptions) -> Result<PathBuf, HostError> {
        let mut text = String::from("# written by genv-enforce\n");
        for o in &self.spec.ssh_options {
            let (k, v) = o.split_once('=').unwrap_or((o, ""));
            text.push_str(&format!("{} {}\n", k.trim(), v.trim()));
        }
        text.push_str("Include ~/.ssh/config\n");
        let safe: String = self
            .spec
            .id
            .0
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let path = opts.control_dir.join(format!("{safe}.ssh_config"));
        std::fs::write(&path, text).map_err(|e| HostError::Spawn {
            command: format!("write {}", path.display()),
            source: e,
        })?;
        Ok(path)
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
        let mut guard = self.session.lock().await;
        if let Some(s) = guard.as_ref() {
            if s.check().await.is_err() {
                if let Some(dead) = guard.take() {
                    let _ = dead.close().await;
                }
            }
        }
        if guard.is_none() {
            *guard = Some(self.connect(opts).await?);
        }
        let Some(session) = guard.as_ref() else {
            unreachable!("connected just above")
        };
        let result = tokio::time::timeout(deadline, run_on(session, argv, stdin)).await;
        match result {
            Ok(Ok(out)) => Ok(out),
            Ok(Err(e)) => {
                if session.check().await.is_err() {
                    if let Some(dead) = guard.take() {
                        let _ = dead.close().await;
                    }
                }
                Err(HostError::Ssh {
                    message: ssh_message(&e),
                })
            }
            Err(_) => Err(HostError::Timeout {
                command: argv_summary(argv),
                after: deadline,
            }),
        }
    }

    /// Closes the master, if open, removing its socket.
    ///
    /// # Errors
    /// The master could not be shut down cleanly.
    pub async fn close(&self) -> Result<(), openssh::Error> {
        match self.session.lock().await.take() {
            Some(s) => s.close().await,
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
            r.take(MAX_OUTPUT_BYTES).read_to_end(&mut out).await?;
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

/// An ssh error with its causes, as one line.
fn ssh_message(e: &openssh::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    text.trim().replace('\n', " ")
}

fn argv_summary(argv: &[String]) -> String {
    let shown: Vec<&str> = argv
        .iter()
        .take_while(|a| a.as_str() != "-c")
        .map(String::as_str)
        .collect();
    format!("{} ...", shown.join(" "))
}
