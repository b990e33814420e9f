//! Remote hosts over SSH: a [`Fleet`] of persistent connections, its
//! concurrent snapshots and its parallel dispatch of per-host plans, each
//! through our host agent ([`agent`]).
//!
//! Every host is handled on its own: a failure is that host's result and
//! never holds back or changes what happens on the others. Fan-out is
//! bounded and unordered: the next host starts as soon as any finishes, so
//! one hung host costs one slot, not the cycle.

pub mod agent;
pub mod ssh;

use std::time::Duration;

use futures::stream::{self, StreamExt};
use tracing::Instrument;

use crate::error::HostError;
use crate::inventory::HostSpec;
use crate::model::{HostId, HostSnapshot};
use crate::outcome::{self, Outcome};
use crate::plan::{HostPlan, Plan};
use crate::snapshot::assemble::assemble;
use agent::Limits;
use ssh::{Answer, Connection, PeerStart, SshOptions};

/// The hosts of a remote run and how to reach them.
#[derive(Debug)]
pub struct Fleet {
    pub hosts: Vec<Connection>,
    pub ssh: SshOptions,
    /// At most this many hosts are worked on at once (handshakes included).
    pub concurrency: usize,
    /// Deadline of each remote command.
    pub command_timeout: Duration,
    /// One cycle only (`--interval 0`): agents need not outlive it.
    pub once: bool,
}

/// One host's part of a cycle's first phase.
#[derive(Debug)]
pub struct Round {
    pub host: HostId,
    pub snapshot: Result<HostSnapshot, HostError>,
    /// How long the snapshot took (handshake included).
    pub elapsed: Duration,
    /// How long a new master took to come up, if one was opened.
    pub connect: Option<Duration>,
    /// What the host's own snapshot decided, carried out right after it.
    pub plan: HostPlan,
    pub outcomes: Vec<Outcome>,
}

/// Runs `work` over `items`, at most `n` at a time, starting the next as
/// soon as any finishes; results in the order of `items`.
async fn fan_out<'a, T: 'a, R, F>(items: impl IntoIterator<Item = T>, n: usize, work: F) -> Vec<R>
where
    F: Fn(T) -> futures::future::BoxFuture<'a, R>,
{
    let mut done: Vec<(usize, R)> = stream::iter(items.into_iter().enumerate())
        .map(|(i, item)| {
            let f = work(item);
            async move { (i, f.await) }
        })
        .buffer_unordered(n.max(1))
        .collect()
        .await;
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, r)| r).collect()
}

impl Fleet {
    /// A fleet with no connection open yet.
    pub fn new(
        hosts: Vec<HostSpec>,
        ssh: SshOptions,
        concurrency: usize,
        command_timeout: Duration,
        once: bool,
    ) -> Self {
        Fleet {
            hosts: hosts.into_iter().map(Connection::new).collect(),
            ssh,
            concurrency: concurrency.max(1),
            command_timeout,
            once,
        }
    }

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

    /// How our agent is started on `c`, as root through the host's sudo.
    /// A run of one cycle starts it under [`agent::BOUNDED`] (a sudo that
    /// hangs is killed on the host, and so is the agent past the limit); a
    /// looping run, whose agent stays, tries sudo first under that bound.
    fn agent_start(&self, c: &Connection) -> PeerStart {
        let bounded = |rest: Vec<String>| -> Vec<String> {
            ["sh", "-c", agent::BOUNDED, "genv-enforce"]
                .into_iter()
                .map(String::from)
                .chain([self.host_limit().to_string()])
                .chain(rest)
                .collect()
        };
        let sudo = c.spec.sudo.iter().cloned();
        let agent: Vec<String> = sudo
            .clone()
            .chain(c.spec.python.iter().cloned())
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

    /// Asks our agent on `c` (started if needed) to carry out `request`.
    async fn ask(
        &self,
        c: &Connection,
        what: &str,
        request: &serde_json::Value,
    ) -> Result<Answer, HostError> {
        c.exchange(
            what,
            &self.agent_start(c),
            &agent::encode(request),
            self.command_timeout,
            &self.ssh,
        )
        .await
    }

    /// Snapshots every host, `concurrency` at a time; results in host order.
    pub async fn snapshots(&self) -> Vec<(HostId, Result<HostSnapshot, HostError>)> {
        self.snapshots_and(|_, _| HostPlan::default())
            .await
            .into_iter()
            .map(|r| (r.host, r.snapshot))
            .collect()
    }

    /// Snapshots every host, `concurrency` at a time, and right after each
    /// host's snapshot carries out the plan `now` makes from it, in the same
    /// slot and over the same connection: what one host's snapshot alone
    /// decides is enforced without waiting for the slowest host. Results in
    /// host order, with those early plans and their outcomes.
    pub async fn snapshots_and<F>(&self, now: F) -> Vec<Round>
    where
        F: Fn(&HostId, &HostSnapshot) -> HostPlan + Sync,
    {
        let now = &now;
        fan_out(&self.hosts, self.concurrency, |c| {
            let span = tracing::debug_span!("host", host = %c.spec.id);
            Box::pin(
                async move {
                    let start = tokio::time::Instant::now();
                    let snapshot = self.snapshot(c).await;
                    let elapsed = start.elapsed();
                    let plan = match &snapshot {
                        Ok(snap) => now(&c.spec.id, snap),
                        Err(_) => HostPlan::default(),
                    };
                    let outcomes = if plan.is_empty() {
                        Vec::new()
                    } else {
                        self.execute(c, &plan).await
                    };
                    Round {
                        host: c.spec.id.clone(),
                        snapshot,
                        elapsed,
                        connect: c.take_connect_time(),
                        plan,
                        outcomes,
                    }
                }
                .instrument(span),
            )
        })
        .await
    }

    async fn snapshot(&self, c: &Connection) -> Result<HostSnapshot, HostError> {
        let request = agent::snapshot_request(&c.spec.genv_dir, &c.spec.nvidia_smi, self.limits());
        let answer = self.ask(c, "snapshot", &request).await?;
        if answer.status != 0 {
            return Err(HostError::Remote {
                what: "snapshot".into(),
                message: String::from_utf8_lossy(&answer.body).trim().to_string(),
            });
        }
        let frames = agent::parse_frames(&answer.body, &c.spec.id.0)?;
        let raw = agent::raw_host(&frames, &c.spec.id.0)?;
        let mut parsed = c.parsed.lock().unwrap_or_else(|e| e.into_inner());
        Ok(assemble(&raw, &c.spec.id.0, &mut parsed)?)
    }

    /// Carries out each host's plan, hosts in parallel (`concurrency` at a
    /// time) over the same connections.
    pub async fn dispatch(&self, plan: &Plan) -> Vec<Outcome> {
        let work: Vec<_> = plan
            .hosts
            .iter()
            .filter_map(|(host, hp)| {
                let c = self.hosts.iter().find(|c| &c.spec.id == host)?;
                Some((c, hp))
            })
            .collect();
        fan_out(work, self.concurrency, |(c, hp)| {
            Box::pin(self.execute(c, hp))
        })
        .await
        .into_iter()
        .flatten()
        .collect()
    }

    /// One host: terminations (start time re-checked on the host), then
    /// detaches, as genv does.
    async fn execute(&self, c: &Connection, plan: &HostPlan) -> Vec<Outcome> {
        let host = &c.spec.id;
        let mut terminations = vec![outcome::Termination::NoIdentity; plan.terminate.len()];
        if let Some(request) = agent::terminate_request(&plan.terminate, self.limits()) {
            terminations = match self.ask(c, "terminate", &request).await {
                // Kills that happened are answered even if a later one failed.
                Ok(answer) => agent::read_terminations(
                    &String::from_utf8_lossy(&answer.body),
                    &plan.terminate,
                ),
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
            let request = agent::detach_request(&c.spec.genv_dir, &plan.detach, self.limits());
            let detaches = match self.ask(c, "detach", &request).await {
                Ok(answer) if answer.status == 0 => {
                    agent::read_detaches(&String::from_utf8_lossy(&answer.body), &plan.detach)
                }
                Ok(answer) => vec![
                    outcome::Detach::Failed {
                        error: String::from_utf8_lossy(&answer.body)
                            .trim()
                            .replace('\n', " ")
                    };
                    plan.detach.len()
                ],
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

    /// Closes every master (hosts in parallel, each bounded) and removes
    /// its socket, or with `--control-persist` leaves it for the next run;
    /// the hosts whose master had to be killed.
    pub async fn close(&self) -> Vec<(HostId, HostError)> {
        if self.ssh.reuse {
            for c in &self.hosts {
                c.release().await;
            }
            return Vec::new();
        }
        fan_out(&self.hosts, self.concurrency, |c| {
            Box::pin(async move { (c.spec.id.clone(), c.close().await) })
        })
        .await
        .into_iter()
        .filter_map(|(h, r)| r.err().map(|e| (h, e)))
        .collect()
    }
}
