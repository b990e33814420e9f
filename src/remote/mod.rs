//! Remote hosts over SSH: a [`Fleet`] of persistent connections, its
//! concurrent snapshots and its parallel dispatch of per-host plans.
//!
//! Every host is handled on its own: a failure is that host's result and
//! never holds back or changes what happens on the others.

pub mod script;
pub mod ssh;

use std::time::Duration;

use futures::stream::{self, StreamExt};

use crate::error::HostError;
use crate::inventory::HostSpec;
use crate::model::{Cluster, HostId, HostSnapshot};
use crate::outcome::{self, Outcome};
use crate::plan::{HostPlan, Plan};
use ssh::{Connection, SshOptions};

/// The hosts of a remote run and how to reach them.
#[derive(Debug)]
pub struct Fleet {
    pub hosts: Vec<Connection>,
    pub ssh: SshOptions,
    /// At most this many hosts are worked on at once (handshakes included).
    pub concurrency: usize,
    /// Deadline of each remote command.
    pub command_timeout: Duration,
}

impl Fleet {
    /// A fleet with no connection open yet.
    pub fn new(
        hosts: Vec<HostSpec>,
        ssh: SshOptions,
        concurrency: usize,
        command_timeout: Duration,
    ) -> Self {
        Fleet {
            hosts: hosts.into_iter().map(Connection::new).collect(),
            ssh,
            concurrency: concurrency.max(1),
            command_timeout,
        }
    }

    /// Seconds a command may run on the host: [`script::BOUNDED`] kills it
    /// (1 s grace included) before our own deadline ends.
    fn host_limit(&self) -> u64 {
        self.command_timeout.as_secs().saturating_sub(2).max(1)
    }

    /// Limit for the steps inside a script (nvidia-smi, waiting on genv's
    /// lock), so that they report what hung before the whole is killed.
    fn step_limit(&self) -> u64 {
        self.host_limit().saturating_sub(2).max(1)
    }

    /// Runs `rest` on `c` through the host's sudo, under
    /// [`script::BOUNDED`]: a host-side timeout becomes [`HostError::Timeout`].
    async fn run_bounded(
        &self,
        c: &Connection,
        what: &str,
        rest: impl IntoIterator<Item = String>,
    ) -> Result<std::process::Output, HostError> {
        let argv: Vec<String> = ["sh", "-c", script::BOUNDED, "genv-enforce-bounded"]
            .into_iter()
            .map(String::from)
            .chain([self.host_limit().to_string()])
            .chain(c.spec.sudo.iter().cloned())
            .chain(rest)
            .collect();
        let out = c.run(&argv, None, self.command_timeout, &self.ssh).await?;
        match out.status.code() {
            Some(code) if script::BOUNDED_TIMED_OUT.contains(&code) => Err(HostError::Timeout {
                command: format!("{what} (killed on the host)"),
                after: Duration::from_secs(self.host_limit()),
            }),
            _ => Ok(out),
        }
    }

    /// Snapshots every host, `concurrency` at a time; results in host order.
    pub async fn snapshots(&self) -> Vec<(HostId, Result<HostSnapshot, HostError>)> {
        stream::iter(&self.hosts)
            .map(|c| async move { (c.spec.id.clone(), self.snapshot(c).await) })
            .buffered(self.concurrency)
            .collect()
            .await
    }

    async fn snapshot(&self, c: &Connection) -> Result<HostSnapshot, HostError> {
        let argv = [
            "sh".into(),
            "-c".into(),
            script::SNAPSHOT.into(),
            "genv-enforce-snapshot".into(),
            c.spec.genv_dir.clone(),
            c.spec.nvidia_smi.clone(),
            self.step_limit().to_string(),
        ];
        let out = self.run_bounded(c, "snapshot", argv).await?;
        if !out.status.success() {
            return Err(failed("snapshot", &out));
        }
        let frames = script::parse_frames(&out.stdout, &c.spec.id.0)?;
        script::assemble(&frames, &c.spec.id.0)
    }

    /// Carries out each host's plan, hosts in parallel (`concurrency` at a
    /// time) over the same connections. `cluster` is the snapshot the plan
    /// was made from.
    pub async fn dispatch(&self, plan: &Plan, cluster: &Cluster) -> Vec<Outcome> {
        let work: Vec<_> = plan
            .hosts
            .iter()
            .filter_map(|(host, hp)| {
                let c = self.hosts.iter().find(|c| &c.spec.id == host)?;
                Some((c, hp, cluster.host(host)?))
            })
            .collect();
        let results: Vec<Vec<Outcome>> = stream::iter(work)
            .map(|(c, hp, snap)| self.execute(c, hp, snap))
            .buffered(self.concurrency)
            .collect()
            .await;
        results.into_iter().flatten().collect()
    }

    /// One host: terminations (start time re-checked on the host), then
    /// detaches, as genv does.
    async fn execute(
        &self,
        c: &Connection,
        plan: &HostPlan,
        snapshot: &HostSnapshot,
    ) -> Vec<Outcome> {
        let host = &c.spec.id;
        let mut terminations = vec![outcome::Termination::NoIdentity; plan.terminate.len()];
        let args = script::terminate_args(&plan.terminate);
        if !args.is_empty() {
            let argv = [
                "sh".into(),
                "-c".into(),
                script::TERMINATE.into(),
                "genv-enforce-terminate".into(),
            ];
            terminations = match self
                .run_bounded(c, "terminate", argv.into_iter().chain(args))
                .await
            {
                Ok(out) if out.status.success() => script::read_terminations(
                    &String::from_utf8_lossy(&out.stdout),
                    &plan.terminate,
                ),
                Ok(out) => vec![
                    outcome::Termination::Failed {
                        error: failed("terminate", &out).to_string()
                    };
                    plan.terminate.len()
                ],
                Err(e) => vec![
                    outcome::Termination::Failed {
                        error: e.to_string()
                    };
                    plan.terminate.len()
                ],
            };
        }
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
            // genv's own `usage execute` detaches under genv's lock and
            // rewrites devices.json as genv does; the environments travel as
            // JSON on stdin, so no host data is ever part of a command line.
            let report = script::execute_report(&plan.detach, snapshot);
            let argv: Vec<String> = c
                .spec
                .sudo
                .iter()
                .cloned()
                .chain([
                    "sh".into(),
                    "-c".into(),
                    script::EXECUTE.into(),
                    "genv-enforce-execute".into(),
                    c.spec.genv_dir.clone(),
                    self.step_limit().to_string(),
                ])
                .chain(c.spec.genv.iter().cloned())
                .chain(["usage".into(), "execute".into()])
                .collect();
            let detaches = match c
                .run(
                    &argv,
                    Some(report.as_bytes()),
                    self.command_timeout,
                    &self.ssh,
                )
                .await
            {
                Ok(out) => {
                    let error = if out.status.success() {
                        String::new()
                    } else {
                        failed("genv usage execute", &out).to_string()
                    };
                    script::read_detaches(
                        &String::from_utf8_lossy(&out.stdout),
                        out.status.success(),
                        &error,
                        &plan.detach,
                    )
                }
                Err(e) => vec![
                    outcome::Detach::Failed {
                        error: e.to_string()
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

    /// Closes every master and removes its socket; the hosts that failed to close.
    pub async fn close(&self) -> Vec<(HostId, openssh::Error)> {
        let mut failures = Vec::new();
        for c in &self.hosts {
            if let Err(e) = c.close().await {
                failures.push((c.spec.id.clone(), e));
            }
        }
        failures
    }
}

/// A remote command that exited non-zero, with what it said.
fn failed(what: &str, out: &std::process::Output) -> HostError {
    let said = if out.stderr.is_empty() {
        &out.stdout
    } else {
        &out.stderr
    };
    HostError::Command {
        command: what.to_string(),
        status: out.status.to_string(),
        output: String::from_utf8_lossy(said).trim().replace('\n', " "),
    }
}
