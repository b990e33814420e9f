//! This machine as a host: its snapshot (nvidia-smi, genv's state files,
//! `/proc`) and carrying out its plan (SIGTERM, detach).

use std::collections::{BTreeMap, BTreeSet};
use std::io::ErrorKind;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustix::process::{pidfd_open, pidfd_send_signal, PidfdFlags, Signal};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::process::Command;

use super::genv_state::StateDir;
use crate::doctor::{self, AgentFacts, Facts};
use crate::error::{self, HostError};

/// The Python that runs our agent here for `doctor`.
const PYTHON: &str = "python3";
use crate::model::HostId;
use crate::outcome::{self, Outcome};
use crate::plan::{HostPlan, Termination};
use crate::snapshot::assemble::{pids_to_read, ParsedState, RawHost, RawProc};
use crate::snapshot::proc;

/// The most we read of a tool's output: far above any real nvidia-smi answer.
pub const MAX_OUTPUT_BYTES: u64 = 64 << 20;

/// Reads `from` into `to`, at most [`MAX_OUTPUT_BYTES`] (the rest is left
/// unread: the tool then fails or is killed at its deadline).
async fn read_capped<R: AsyncRead + Unpin>(
    from: Option<&mut R>,
    to: &mut Vec<u8>,
) -> std::io::Result<()> {
    if let Some(r) = from {
        r.take(MAX_OUTPUT_BYTES).read_to_end(to).await?;
    }
    Ok(())
}

/// How to reach this machine's GPUs and genv state.
#[derive(Debug, Clone)]
pub struct LocalHost {
    /// Its name in reports (the machine's hostname).
    pub id: HostId,
    pub state: StateDir,
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
}

impl LocalHost {
    /// genv's defaults, from the environment.
    pub fn from_env(timeout: Duration) -> Self {
        LocalHost {
            id: hostname(),
            state: StateDir::from_env(),
            nvidia_smi: "nvidia-smi".to_string(),
            proc_root: PathBuf::from("/proc"),
            timeout,
            parsed: Arc::default(),
            max_records: crate::snapshot::genv::DEFAULT_MAX_RECORDS,
        }
    }

    /// Runs nvidia-smi with genv's `GENV_BYPASS=1`, in a process group of
    /// its own that is killed whole at the deadline (a wrapper's children
    /// included).
    async fn nvidia_smi(&self, query: &str) -> Result<String, HostError> {
        let command = format!("{} {query} --format=csv,noheader,nounits", self.nvidia_smi);
        let mut child = Command::new(&self.nvidia_smi)
            .arg(query)
            .arg("--format=csv,noheader,nounits")
            .env("GENV_BYPASS", "1")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| HostError::Spawn {
                command: command.clone(),
                source,
            })?;
        let group = child
            .id()
            .and_then(|id| rustix::process::Pid::from_raw(id as i32));
        let (mut stdout, mut stderr) = (child.stdout.take(), child.stderr.take());
        let run = async {
            let (mut out, mut err) = (Vec::new(), Vec::new());
            let read_out = read_capped(stdout.as_mut(), &mut out);
            let read_err = read_capped(stderr.as_mut(), &mut err);
            let (a, b, status) = tokio::join!(read_out, read_err, child.wait());
            a.and(b).and(status).map(|status| (status, out, err))
        };
        let finished = tokio::time::timeout(self.timeout, run).await;
        let Ok(result) = finished else {
            if let Some(g) = group {
                let _ = rustix::process::kill_process_group(g, Signal::KILL);
            }
            return Err(HostError::Timeout {
                command,
                after: self.timeout,
            });
        };
        let (status, out, err) = result.map_err(|source| HostError::Spawn {
            command: command.clone(),
            source,
        })?;
        if !status.success() {
            let output = String::from_utf8_lossy(if err.is_empty() { &out } else { &err });
            return Err(HostError::Command {
                command,
                status: status.to_string(),
                output: output.trim().to_string(),
            });
        }
        String::from_utf8(out).map_err(|_| HostError::NotUtf8 { command })
    }

    /// What this machine says of itself: nvidia-smi's two answers,
    /// genv's state files and what `/proc` says of the pids involved
    /// (see [`crate::snapshot::assemble`]); a process whose environ
    /// cannot be read is later of unknown ownership, not "no environment"
    /// as in genv.
    ///
    /// # Errors
    /// nvidia-smi fails or hangs; genv's state cannot be locked or read.
    pub async fn fetch(&self) -> Result<super::Fetched, HostError> {
        let (gpus, apps) = tokio::try_join!(
            self.nvidia_smi("--query-gpu=uuid,index,memory.total"),
            self.nvidia_smi("--query-compute-apps=gpu_uuid,pid,used_gpu_memory"),
        )?;
        let host = self.clone();
        // File and NSS reads block: off the async workers.
        let raw = super::off_workers("the state reader", move || host.gather(gpus, apps)).await??;
        Ok(super::Fetched::Local(raw))
    }

    /// What turns [`LocalHost::fetch`] into a snapshot.
    pub fn parser(&self) -> super::Parser {
        super::Parser::new(
            self.state.path.display().to_string(),
            Arc::clone(&self.parsed),
            self.max_records,
        )
    }

    /// The raw parts of a snapshot, given nvidia-smi's answers.
    fn gather(&self, gpus: String, apps: String) -> Result<RawHost<'static>, HostError> {
        let files = self.state.read(self.timeout)?;
        let live = |pid: u32| self.proc_root.join(pid.to_string()).exists();
        let gpu_pids: Vec<u32> = pids_to_read(&apps, None, |_| false, 0);
        let mut procs = BTreeMap::new();
        for pid in pids_to_read(&apps, files.envs.as_deref(), live, self.max_records) {
            let dir = self.proc_root.join(pid.to_string());
            let environ = gpu_pids.binary_search(&pid).is_ok();
            if let Some(p) = proc::identity(|f| std::fs::read(dir.join(f)), environ) {
                procs.insert(pid, p);
            }
        }
        let user_names = procs
            .values()
            .filter_map(|p| match p {
                RawProc::Seen { uid, .. } => *uid,
                RawProc::Unsure(_) => None,
            })
            .collect::<BTreeSet<u32>>()
            .into_iter()
            .filter_map(|uid| {
                let user = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid));
                Some((uid, user.ok()??.name))
            })
            .collect();
        Ok(RawHost {
            gpus: gpus.into(),
            apps: apps.into(),
            envs: files.envs.map(Into::into),
            devices: files.devices.map(Into::into),
            procs,
            user_names,
        })
    }

    /// Facts for `doctor`: privileges, our agent's account of this machine
    /// (run with the local `python3`, as on a remote host), a snapshot.
    pub async fn doctor(&self) -> Facts {
        let request = super::agent::doctor_request(
            &self.state.path.display().to_string(),
            std::slice::from_ref(&self.nvidia_smi),
            super::agent::Limits {
                run: self.timeout,
                step: self.timeout.saturating_sub(Duration::from_millis(500)),
            },
        );
        let agent = self.run_agent(&request).await.and_then(|body| {
            serde_json::from_slice::<AgentFacts>(&body)
                .map_err(|e| format!("the agent's answer is not what we expect: {e}"))
        });
        Facts {
            host: self.id.clone(),
            ssh: None,
            sudo: None,
            login: None,
            python_command: PYTHON.into(),
            agent: Some(agent),
            snapshot: Some(
                async { super::parsed(self.fetch().await?, self.parser()).await }
                    .await
                    .map(|s| doctor::counts(&s))
                    .map_err(|e| error::chain(&e)),
            ),
            skew: None,
            root: Some(rustix::process::geteuid().is_root()),
        }
    }

    /// Runs our host agent here for one request; its answer's body.
    async fn run_agent(&self, request: &serde_json::Value) -> Result<Vec<u8>, String> {
        use tokio::io::AsyncWriteExt;
        let mut child = Command::new(PYTHON)
            .args(super::agent::bootstrap())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot run {PYTHON}: {e}"))?;
        let mut input = super::agent::AGENT.as_bytes().to_vec();
        input.extend(super::agent::encode(request));
        let mut stdin = child.stdin.take().ok_or("no stdin")?;
        let run = async {
            stdin.write_all(&input).await?;
            drop(stdin);
            child.wait_with_output().await
        };
        let out = tokio::time::timeout(self.timeout, run)
            .await
            .map_err(|_| {
                format!(
                    "the agent did not answer within {}",
                    humantime::format_duration(self.timeout)
                )
            })?
            .map_err(|e| format!("the agent failed: {e}"))?;
        let text = &out.stdout;
        let nl = text.iter().position(|&b| b == b'\n');
        let parsed = nl.and_then(|nl| {
            let header = std::str::from_utf8(&text[..nl]).ok()?;
            let (status, len) = super::agent::answer_header(header).ok()?;
            let body = text.get(nl + 1..nl + 1 + usize::try_from(len).ok()?)?;
            (status == 0).then(|| body.to_vec())
        });
        parsed.ok_or_else(|| {
            let said = String::from_utf8_lossy(&out.stderr);
            format!(
                "{PYTHON} could not run the agent ({}): {}",
                out.status,
                said.lines().last().unwrap_or("").trim()
            )
        })
    }

    /// Carries out its plan: all terminations, then all detaches (genv's
    /// order), off the async workers (they read `/proc` and wait on
    /// genv's lock).
    pub async fn execute(&self, plan: &HostPlan) -> Vec<Outcome> {
        let host = self.clone();
        let work = plan.clone();
        let done = tokio::task::spawn_blocking(move || {
            let terminations: Vec<_> = work.terminate.iter().map(|t| host.terminate(t)).collect();
            let pairs: Vec<_> = work
                .detach
                .iter()
                .map(|d| (d.device, d.eid.clone()))
                .collect();
            let detaches = if pairs.is_empty() {
                Vec::new()
            } else {
                host.state.detach(&pairs, host.timeout)
            };
            (terminations, detaches)
        })
        .await;
        let (terminations, detaches) = match done {
            Ok(done) => done,
            Err(source) => {
                let error = error::chain(&HostError::Join {
                    what: "carrying out the plan",
                    source,
                });
                return outcome::failed(&self.id, plan, &error);
            }
        };
        let terminated =
            plan.terminate
                .iter()
                .zip(terminations)
                .map(|(t, outcome)| Outcome::Terminate {
                    host: self.id.clone(),
                    pid: t.pid,
                    outcome,
                });
        let detached = plan
            .detach
            .iter()
            .zip(detaches)
            .map(|(d, outcome)| Outcome::Detach {
                host: self.id.clone(),
                device: d.device,
                eid: d.eid.clone(),
                outcome,
            });
        terminated.chain(detached).collect()
    }

    /// SIGTERMs `t.pid` only if it is still the process the snapshot saw.
    ///
    /// The pid is pinned with a pidfd first, then its start time is
    /// re-read, then the signal goes through the pidfd: a pid reused in
    /// between is caught by the start time, and one reused after the check
    /// cannot be hit because the pidfd still names the old process.
    pub fn terminate(&self, t: &Termination) -> outcome::TerminateResult {
        self.signal(t, Signal::TERM)
    }

    /// See [`Host::escalate`](super::Host::escalate).
    pub async fn escalate(&self, terminations: &[Termination]) -> Vec<Outcome> {
        let host = self.clone();
        let work = terminations.to_vec();
        let results = tokio::task::spawn_blocking(move || {
            work.iter()
                .map(|t| host.signal(t, Signal::KILL))
                .collect::<Vec<_>>()
        })
        .await;
        let results = match results {
            Ok(results) => results,
            Err(source) => {
                let error = error::chain(&HostError::Join {
                    what: "killing",
                    source,
                });
                return outcome::failed_kills(&self.id, terminations, &error);
            }
        };
        terminations
            .iter()
            .zip(results)
            .map(|(t, outcome)| Outcome::Kill {
                host: self.id.clone(),
                pid: t.pid,
                outcome,
            })
            .collect()
    }

    /// Sends `signal` to `t.pid` only if it is still the process the
    /// snapshot saw (see [`LocalHost::terminate`]).
    fn signal(&self, t: &Termination, signal: Signal) -> outcome::TerminateResult {
        use outcome::TerminateResult as T;
        let Some(expected) = t.start_time else {
            return T::NoIdentity;
        };
        let Some(pid) = i32::try_from(t.pid.0)
            .ok()
            .and_then(rustix::process::Pid::from_raw)
        else {
            return T::Failed {
                error: format!("invalid pid {}", t.pid),
            };
        };
        let pidfd = match pidfd_open(pid, PidfdFlags::empty()) {
            Ok(fd) => Some(fd),
            Err(rustix::io::Errno::SRCH) => return T::AlreadyGone,
            Err(rustix::io::Errno::NOSYS) => None,
            Err(e) => {
                return T::Failed {
                    error: format!("pidfd_open: {e}"),
                }
            }
        };
        let found = match std::fs::read(self.proc_root.join(t.pid.to_string()).join("stat")) {
            Ok(stat) if proc::exited(&stat) => return T::AlreadyGone,
            Ok(stat) => proc::start_time(&stat),
            Err(e) if e.kind() == ErrorKind::NotFound => return T::AlreadyGone,
            Err(e) => {
                return T::Failed {
                    error: format!("cannot read /proc/{}/stat: {e}", t.pid),
                }
            }
        };
        match found {
            Some(f) if f == expected => {}
            Some(found) => return T::PidReused { expected, found },
            None => {
                return T::Failed {
                    error: format!("cannot parse /proc/{}/stat", t.pid),
                }
            }
        }
        let sent = match &pidfd {
            Some(fd) => pidfd_send_signal(fd, signal),
            None => rustix::process::kill_process(pid, signal),
        };
        match sent {
            Ok(()) => T::Signalled,
            Err(rustix::io::Errno::SRCH) => T::AlreadyGone,
            Err(rustix::io::Errno::PERM) => T::PermissionDenied,
            Err(e) => T::Failed {
                error: e.to_string(),
            },
        }
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
