//! Assessment, pure: the hosts' snapshots (or failures) -> the merged
//! cluster, its violations and notices, and the plan that answers them.

use serde::Serialize;

use crate::confirm::Waiting;
use crate::model::{Cluster, HostId, HostSnapshot, Mode};
use crate::plan::{self, HostPlan, Plan};
use crate::rules::{self, Notice, Policy, Violation};

/// How one host fared this cycle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HostStatus {
    pub host: HostId,
    /// Why its snapshot failed, if it did.
    pub error: Option<String>,
    pub processes: usize,
    pub envs: usize,
    pub devices: usize,
    /// A recorded snapshot, not a live host (for the wording of errors).
    #[serde(skip)]
    pub recorded: bool,
}

/// What one cycle found and decides.
#[derive(Debug, Clone)]
pub struct Assessment {
    pub cycle: u64,
    pub mode: Mode,
    /// Nothing is to be carried out.
    pub dry_run: bool,
    pub hosts: Vec<HostStatus>,
    pub cluster: Cluster,
    pub notices: Vec<Notice>,
    pub violations: Vec<Violation>,
    pub plan: Plan,
    /// Actions held back until their violation is confirmed.
    pub waiting: Vec<Waiting>,
}

/// Assesses the hosts' results (a failed host's error as text): rules and
/// plan over the merged snapshots.
pub fn assess(
    cycle: u64,
    mode: Mode,
    dry_run: bool,
    policy: &Policy,
    results: Vec<(HostId, Result<HostSnapshot, String>)>,
) -> Assessment {
    let mut a = statuses(cycle, mode, dry_run, results);
    let charges = rules::Charges::of(&a.cluster, policy);
    a.violations = rules::evaluate_with(&a.cluster, policy, &charges);
    a.plan = plan::build(&a.cluster, &a.violations);
    a.notices = rules::notices_with(&a.cluster, &charges);
    a
}

/// The hosts' results without the rules: what genv's `-e` reports when a
/// host failed (it raises before any rule runs).
pub fn statuses(
    cycle: u64,
    mode: Mode,
    dry_run: bool,
    results: Vec<(HostId, Result<HostSnapshot, String>)>,
) -> Assessment {
    let hosts = results
        .iter()
        .map(|(host, r)| match r {
            Ok(s) => HostStatus {
                host: host.clone(),
                error: None,
                processes: s.processes.len(),
                envs: s.envs.len(),
                devices: s.devices.len(),
                recorded: false,
            },
            Err(e) => HostStatus {
                host: host.clone(),
                error: Some(e.clone()),
                processes: 0,
                envs: 0,
                devices: 0,
                recorded: false,
            },
        })
        .collect();
    Assessment {
        cycle,
        mode,
        dry_run,
        hosts,
        cluster: Cluster::merge(mode, results),
        notices: Vec::new(),
        violations: Vec::new(),
        plan: Plan::default(),
        waiting: Vec::new(),
    }
}

/// What one host's snapshot decides on its own (every rule but the
/// cluster-wide per-user cap): it can be carried out before the other
/// hosts have answered.
pub fn own_plan(host: &HostId, snap: &HostSnapshot, policy: &Policy) -> HostPlan {
    plan::for_host(host, snap, &rules::evaluate_host(host, snap, policy))
}

/// `plan` less what `done` already carried out, host by host.
pub fn remaining(plan: &Plan, done: &Plan) -> Plan {
    Plan {
        hosts: plan
            .hosts
            .iter()
            .map(|(h, p)| match done.hosts.iter().find(|(d, _)| d == h) {
                Some((_, d)) => (h.clone(), p.without(d)),
                None => (h.clone(), p.clone()),
            })
            .filter(|(_, p)| !p.is_empty())
            .collect(),
    }
}
