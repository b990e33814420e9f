//! A fleet: the hosts of a run, worked on concurrently. Snapshots, plans
//! and closes fan out over them, bounded and unordered: the next host
//! starts as soon as any finishes, so one hung host costs one slot, not the
//! cycle. Every host is handled on its own: a failure is that host's result
//! and never holds back or changes what happens on the others.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures::stream::{self, StreamExt};
use tracing::Instrument;

use crate::audit::{self, AuditLog};
use crate::host::Host;
use crate::host::HostError;
use crate::model::{HostId, HostSnapshot};
use crate::outcome::Outcome;
use crate::plan::{HostPlan, Plan, Termination};
use crate::rules::{self, HostFindings, Orphans, Policy};

/// The hosts of a run.
#[derive(Debug)]
pub struct Fleet {
    pub hosts: Vec<Host>,
    /// At most this many hosts are worked on at once (handshakes included).
    pub concurrency: usize,
    /// Where every action is recorded before it is carried out.
    pub audit: Option<Arc<AuditLog>>,
    /// The epoch its hosts' requests carry (high availability).
    pub fencing: crate::host::fence::Fencing,
    /// `--shard`: each host's place in the whole inventory (empty: the
    /// fleet is the whole inventory).
    pub positions: HashMap<HostId, usize>,
}

/// One host's part of a cycle's first phase.
#[derive(Debug)]
pub struct Round {
    pub host: HostId,
    /// Its snapshot and what it shows on its own, or why it failed.
    pub result: Result<(HostSnapshot, HostFindings), HostError>,
    /// How long the snapshot took (handshake and parsing included).
    pub elapsed: Duration,
    /// How long a new connection took to come up, if one was opened.
    pub connect: Option<Duration>,
    /// What the host's own snapshot decided.
    pub own: Own,
    /// What carrying out its due part right after the snapshot did.
    pub outcomes: Vec<Outcome>,
}

/// What a host's own findings decide, worked out beside its snapshot.
#[derive(Debug, Default)]
pub struct Own {
    /// Its own plan, whole (every rule but those that need every host).
    pub plan: HostPlan,
    /// Split by the ladder when what is due is carried out at once: the
    /// due part (carried out right after the snapshot) and what waits.
    pub early: Option<(HostPlan, Vec<crate::ladder::Waiting>)>,
}

impl Own {
    /// What was carried out right after the snapshot.
    pub fn due(&self) -> Option<&HostPlan> {
        self.early.as_ref().map(|(due, _)| due)
    }
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
    /// A fleet of `hosts`, `concurrency` at a time.
    pub fn new(hosts: Vec<Host>, concurrency: usize) -> Self {
        Fleet {
            hosts,
            concurrency: concurrency.max(1),
            audit: None,
            fencing: crate::host::fence::Fencing::default(),
            positions: HashMap::new(),
        }
    }

    /// Makes every host's requests carry `fencing`'s epoch.
    pub fn set_fencing(&mut self, fencing: &crate::host::fence::Fencing) {
        for h in &mut self.hosts {
            h.set_fencing(fencing);
        }
        self.fencing = fencing.clone();
    }

    /// Carries out `plan` on `h` (see [`Fleet::audited`]).
    async fn execute(&self, cycle: u64, h: &Host, plan: &HostPlan) -> Vec<Outcome> {
        self.audited(
            (cycle, h),
            || audit::decided(SystemTime::now(), cycle, h.id(), plan),
            h.execute(plan),
        )
        .await
    }

    /// Runs `act` on `h`, recorded in the audit log if there is one: the
    /// `decided` lines before and the outcomes after. Enforcement wins
    /// over the record: a log that cannot be written (a full disk, a
    /// read-only file system, a failed sync) is degraded, said loudly, and
    /// the actions are carried out all the same.
    async fn audited<'a>(
        &self,
        (cycle, h): (u64, &Host),
        decided: impl FnOnce() -> Vec<audit::Entry<'a>>,
        act: impl std::future::Future<Output = Vec<Outcome>>,
    ) -> Vec<Outcome> {
        let Some(log) = &self.audit else {
            return act.await;
        };
        let decided = log.bounded(cycle, h.id(), decided());
        if let Err(e) = log.write(&decided) {
            tracing::error!(host = %h.id(), error = %e, "actions not recorded in the audit log: carried out all the same");
        }
        let outcomes = act.await;
        if let Err(e) = log.write(&audit::done(SystemTime::now(), &decided, &outcomes)) {
            tracing::error!(host = %h.id(), error = %e, "cannot record outcomes in the audit log");
        }
        outcomes
    }

    /// Whether every host is a recording.
    pub fn is_recorded(&self) -> bool {
        self.hosts.iter().all(Host::is_recorded)
    }

    /// Snapshots every host and assesses each on its own (parsing and
    /// rules in the blocking pool: a host whose users wrote a huge state
    /// delays only itself), then right after carries out the plan `now`
    /// makes from it, in the same slot: what one host's snapshot alone
    /// decides is enforced without waiting for the slowest host (the due
    /// part of [`Own::early`]). Results in host order, with what each host
    /// decided and the outcomes.
    /// `orphans`: each host's processes seen orphaned before.
    pub async fn snapshots_and<F>(
        &self,
        cycle: u64,
        policy: &Arc<Policy>,
        orphans: &Arc<HashMap<HostId, Orphans>>,
        now: F,
    ) -> Vec<Round>
    where
        F: Fn(&HostId, HostPlan) -> Own + Sync,
    {
        let now = &now;
        fan_out(&self.hosts, self.concurrency, |h| {
            let span = tracing::debug_span!("host", host = %h.id());
            let policy = Arc::clone(policy);
            let orphans = Arc::clone(orphans);
            Box::pin(
                async move {
                    let start = tokio::time::Instant::now();
                    let result = match h.fetch().await {
                        Ok(fetched) => {
                            let parser = h.parser();
                            let id = h.id().clone();
                            crate::host::off_workers("assessing the host", move || {
                                let snap = parser.parse(fetched)?;
                                let none = Orphans::default();
                                let seen = orphans.get(&id).unwrap_or(&none);
                                let findings = rules::assess_host(&id, &snap, &policy, seen);
                                let plan = crate::assess::own_plan(&id, &snap, &findings);
                                Ok(((snap, findings), plan))
                            })
                            .await
                            .and_then(|r| r)
                        }
                        Err(e) => Err(e),
                    };
                    let elapsed = start.elapsed();
                    let (result, own) = match result {
                        Ok((found, plan)) => (Ok(found), now(h.id(), plan)),
                        Err(e) => (Err(e), Own::default()),
                    };
                    let outcomes = match own.due() {
                        Some(due) if !due.is_empty() => self.execute(cycle, h, due).await,
                        _ => Vec::new(),
                    };
                    Round {
                        host: h.id().clone(),
                        result,
                        elapsed,
                        connect: h.take_connect_time(),
                        own,
                        outcomes,
                    }
                }
                .instrument(span),
            )
        })
        .await
    }

    /// Carries out each host's plan, hosts in parallel.
    pub async fn dispatch(&self, cycle: u64, plan: &Plan) -> Vec<Outcome> {
        let work: Vec<_> = plan
            .hosts
            .iter()
            .filter_map(|(id, hp)| Some((self.hosts.iter().find(|h| h.id() == id)?, hp)))
            .collect();
        fan_out(work, self.concurrency, |(h, hp)| {
            Box::pin(self.execute(cycle, h, hp))
        })
        .await
        .into_iter()
        .flatten()
        .collect()
    }

    /// `--kill-after`: SIGKILLs, host by host, the processes still running
    /// with the same identity, each recorded in the audit log first.
    pub async fn escalate(&self, cycle: u64, kills: &[(HostId, Vec<Termination>)]) -> Vec<Outcome> {
        let work: Vec<_> = kills
            .iter()
            .filter_map(|(id, ts)| Some((self.hosts.iter().find(|h| h.id() == id)?, ts)))
            .collect();
        fan_out(work, self.concurrency, |(h, ts)| {
            Box::pin(self.audited(
                (cycle, h),
                move || audit::kills(SystemTime::now(), cycle, h.id(), ts),
                h.escalate(ts),
            ))
        })
        .await
        .into_iter()
        .flatten()
        .collect()
    }

    /// `doctor`'s facts of every host, `progress(done, total)` after each.
    pub async fn doctor(
        &self,
        progress: &(dyn Fn(usize, usize) + Sync),
    ) -> Vec<crate::host::facts::Facts> {
        let done = std::sync::atomic::AtomicUsize::new(0);
        let total = self.hosts.len();
        let done = &done;
        fan_out(&self.hosts, self.concurrency, |h| {
            Box::pin(async move {
                let facts = h.doctor().await;
                progress(
                    done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1,
                    total,
                );
                facts
            })
        })
        .await
        .into_iter()
        .flatten()
        .collect()
    }

    /// Closes every host (in parallel, each bounded); the hosts that could
    /// not be closed cleanly.
    pub async fn close(&self) -> Vec<(HostId, HostError)> {
        fan_out(&self.hosts, self.concurrency, |h| {
            Box::pin(async move { (h.id().clone(), h.close().await) })
        })
        .await
        .into_iter()
        .filter_map(|(h, r)| r.err().map(|e| (h, e)))
        .collect()
    }

    /// Closes every host as [`Fleet::close`] does, each that could not be
    /// closed cleanly said in a warning.
    pub async fn close_said(&self) {
        for (host, e) in self.close().await {
            tracing::warn!(%host, error = %crate::error::chain(&e), "closing the host's connection failed");
        }
    }
}
