//! This machine as a host: its snapshot (nvidia-smi, genv's state files,
//! `/proc`) and carrying out its plan (SIGTERM, detach).

use std::collections::HashMap;
use std::io::ErrorKind;
use std::path::PathBuf;
use std::time::Duration;

use rustix::process::{pidfd_open, pidfd_send_signal, PidfdFlags, Signal};
use tokio::process::Command;

use crate::error::HostError;
use crate::model::{HostId, HostSnapshot, Owner, Pid, Process};
use crate::outcome::{self, Outcome};
use crate::plan::{HostPlan, Termination};
use crate::snapshot::{genv, nvidia_smi, proc};
use crate::state::StateDir;

/// How to reach this machine's GPUs and genv state.
#[derive(Debug, Clone)]
pub struct LocalHost {
    pub state: StateDir,
    /// The nvidia-smi command (a path or a name on PATH).
    pub nvidia_smi: String,
    /// Where procfs is mounted.
    pub proc_root: PathBuf,
    /// Deadline of each command and of waiting for genv's lock.
    pub timeout: Duration,
}

impl LocalHost {
    /// genv's defaults, from the environment.
    pub fn from_env(timeout: Duration) -> Self {
        LocalHost {
            state: StateDir::from_env(),
            nvidia_smi: "nvidia-smi".to_string(),
            proc_root: PathBuf::from("/proc"),
            timeout,
        }
    }

    async fn nvidia_smi(&self, query: &str) -> Result<String, HostError> {
        let command = format!("{} {query} --format=csv,noheader,nounits", self.nvidia_smi);
        let child = Command::new(&self.nvidia_smi)
            .arg(query)
            .arg("--format=csv,noheader,nounits")
            .env("GENV_BYPASS", "1")
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(self.timeout, child)
            .await
            .map_err(|_| HostError::Timeout {
                command: command.clone(),
                after: self.timeout,
            })?
            .map_err(|source| HostError::Spawn {
                command: command.clone(),
                source,
            })?;
        if !out.status.success() {
            let output = String::from_utf8_lossy(if out.stderr.is_empty() {
                &out.stdout
            } else {
                &out.stderr
            });
            return Err(HostError::Command {
                command,
                status: out.status.to_string(),
                output: output.trim().to_string(),
            });
        }
        String::from_utf8(out.stdout).map_err(|_| HostError::NotUtf8 { command })
    }

    /// Takes a snapshot as `genv usage snapshot` would, plus each process's
    /// start time and owner; a process whose environ cannot be read gets
    /// [`Owner::Unknown`] instead of genv's "no environment".
    ///
    /// # Errors
    /// nvidia-smi fails, hangs or prints what cannot be parsed; genv's
    /// state cannot be locked, read or parsed.
    pub async fn snapshot(&self) -> Result<HostSnapshot, HostError> {
        let (gpus, apps) = tokio::try_join!(
            self.nvidia_smi("--query-gpu=uuid,index,memory.total"),
            self.nvidia_smi("--query-compute-apps=gpu_uuid,pid,used_gpu_memory"),
        )?;
        let gpus = nvidia_smi::parse_gpus(&gpus, "nvidia-smi --query-gpu")?;
        let apps = nvidia_smi::parse_compute_apps(&apps, "nvidia-smi --query-compute-apps")?;
        let by_pid = nvidia_smi::processes(&gpus, &apps, "nvidia-smi")?;

        let state = self.state.clone();
        let wait = self.timeout;
        let files = tokio::task::spawn_blocking(move || state.read(wait))
            .await
            .map_err(|e| HostError::Spawn {
                command: "state reader".into(),
                source: std::io::Error::other(e),
            })??;
        let envs_src = self.state.path.join("envs.json").display().to_string();
        let devices_src = self.state.path.join("devices.json").display().to_string();
        let mut envs = match &files.envs {
            Some(text) => genv::parse_envs(text, &envs_src)?,
            None => Vec::new(),
        };
        let mut devices = match &files.devices {
            Some(text) => genv::parse_devices(text, &devices_src)?,
            None => nvidia_smi::devices(&gpus),
        };
        // Kernels are taken as alive: genv asks `jupyter` for them, and
        // dropping a live kernel's environment would expose its processes.
        genv::clean_up(&mut envs, &mut devices, |p| self.pid_alive(p), |_| true);

        let mut users = HashMap::new();
        let processes = by_pid
            .into_iter()
            .map(|(pid, gpus)| self.process(pid, gpus, &mut users))
            .collect();
        Ok(HostSnapshot {
            processes,
            envs,
            devices,
        })
    }

    fn pid_alive(&self, pid: i64) -> bool {
        i32::try_from(pid).is_ok_and(|p| p > 0 && self.proc_root.join(p.to_string()).exists())
    }

    fn process(
        &self,
        pid: Pid,
        gpus: Vec<crate::model::DeviceUsage>,
        users: &mut HashMap<u32, Option<String>>,
    ) -> Process {
        let dir = self.proc_root.join(pid.to_string());
        let owner = match std::fs::read(dir.join("environ")) {
            Ok(bytes) => match proc::environment_id(&bytes) {
                Some(eid) => Owner::Env(crate::model::EnvId(eid)),
                None => Owner::NoEnv,
            },
            Err(e) if e.kind() == ErrorKind::PermissionDenied => {
                Owner::Unknown("not enough permissions to read its environment".into())
            }
            Err(e) if e.kind() == ErrorKind::NotFound => {
                Owner::Unknown("it exited during the snapshot".into())
            }
            Err(e) => Owner::Unknown(format!("cannot read its environment: {e}")),
        };
        let start_time = std::fs::read(dir.join("stat"))
            .ok()
            .and_then(|s| proc::start_time(&s));
        let uid = std::fs::read_to_string(dir.join("status"))
            .ok()
            .and_then(|s| proc::real_uid(&s));
        let user = uid.and_then(|u| {
            users
                .entry(u)
                .or_insert_with(|| {
                    nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(u))
                        .ok()
                        .flatten()
                        .map(|u| u.name)
                })
                .clone()
        });
        Process {
            pid,
            owner,
            gpus,
            start_time,
            uid,
            user,
        }
    }

    /// Carries out one host's plan: all terminations, then all detaches
    /// (genv's order).
    pub async fn execute(&self, host: &HostId, plan: &HostPlan) -> Vec<Outcome> {
        let mut out: Vec<Outcome> = plan
            .terminate
            .iter()
            .map(|t| Outcome::Terminate {
                host: host.clone(),
                pid: t.pid,
                outcome: self.terminate(t),
            })
            .collect();
        if !plan.detach.is_empty() {
            let pairs: Vec<_> = plan
                .detach
                .iter()
                .map(|d| (d.device, d.eid.clone()))
                .collect();
            let state = self.state.clone();
            let wait = self.timeout;
            let results = tokio::task::spawn_blocking(move || state.detach(&pairs, wait))
                .await
                .unwrap_or_else(|e| {
                    vec![
                        outcome::Detach::Failed {
                            error: e.to_string()
                        };
                        plan.detach.len()
                    ]
                });
            out.extend(
                plan.detach
                    .iter()
                    .zip(results)
                    .map(|(d, outcome)| Outcome::Detach {
                        host: host.clone(),
                        device: d.device,
                        eid: d.eid.clone(),
                        outcome,
                    }),
            );
        }
        out
    }

    /// SIGTERMs `t.pid` only if it is still the process the snapshot saw.
    ///
    /// The pid is pinned with a pidfd first, then its start time is
    /// re-read, then the signal goes through the pidfd: a pid reused in
    /// between is caught by the start time, and one reused after the check
    /// cannot be hit because the pidfd still names the old process.
    pub fn terminate(&self, t: &Termination) -> outcome::Termination {
        use outcome::Termination as T;
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
            Some(fd) => pidfd_send_signal(fd, Signal::TERM),
            None => rustix::process::kill_process(pid, Signal::TERM),
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
