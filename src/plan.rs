//! Violations -> per-host plans: the pids to terminate and the
//! (device, environment) detaches, each once, in genv's order.
//!
//! genv's order: terminations in snapshot process order; detaches by device
//! in the order devices were first named, environments in snapshot order.
//! Detaching an environment from a device also terminates its processes
//! there. A process whose ownership is unknown is never planned, whatever
//! named it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::model::{Cluster, EnvId, GpuIndex, HostId, HostSnapshot, Indices, Owner, Pid};
use crate::rules::{Action, Rule, Rules, Violation};

/// A process to SIGTERM, with what identifies it and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Termination {
    pub pid: Pid,
    /// Start time at snapshot; the pid is signalled only if it still matches.
    pub start_time: Option<u64>,
    pub eid: Option<EnvId>,
    /// Its GPUs, kept inline up to four.
    pub gpus: Indices,
    pub uid: Option<u32>,
    pub user: Option<Arc<str>>,
    /// Its real uid, where that is a sub-uid of `uid`'s range.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sub_uid: Option<u32>,
    pub rules: Rules,
    /// Its user's groups on the host, when asked for (group exemptions);
    /// not in the JSON plan.
    #[serde(skip)]
    pub groups: Vec<String>,
    /// The GPU memory it holds (bytes, over its GPUs) when nvidia-smi
    /// measured all of it, for messages; not in the JSON plan.
    #[serde(skip)]
    pub memory: Option<u64>,
}

impl Termination {
    /// A termination of `pid`, identified by `start_time`, with nothing else
    /// known (no environment, GPUs, owner or rule).
    pub fn of(pid: Pid, start_time: Option<u64>) -> Self {
        Termination {
            pid,
            start_time,
            eid: None,
            gpus: smallvec::SmallVec::new(),
            uid: None,
            user: None,
            sub_uid: None,
            rules: Rules::new(),
            groups: Vec::new(),
            memory: None,
        }
    }
}

/// The signal of a termination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// genv's SIGTERM.
    Term,
    /// `--kill-after`'s SIGKILL.
    Kill,
}

/// An environment to detach from a device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Detach {
    pub device: GpuIndex,
    pub eid: EnvId,
    /// The rules behind it (a device cap's: per user, per group); none in
    /// what an older run kept, which the per-user cap asked for.
    #[serde(default, skip_serializing_if = "Rules::is_empty")]
    pub rules: Rules,
    /// The record's username, as genv's line says it (anyone can write it).
    pub username: Option<String>,
    /// The user whose cap it is detached for, as attribution charges it
    /// (what exemptions and reports go by); not in the JSON plan.
    #[serde(skip)]
    pub charged: Option<String>,
    /// The charged user when the kernel vouches for it (a live process
    /// of theirs carries the environment), else none: whom notifications
    /// tell (an idle environment is charged by its record's `username`,
    /// which anyone writes). Not in the JSON plan.
    #[serde(skip)]
    pub owner: Option<String>,
    /// The charged user's groups on the host, when asked for and the host
    /// knows the user (a live process of theirs); not in the JSON plan.
    #[serde(skip)]
    pub groups: Vec<String>,
    /// A process of the owner runs in the environment on this device: the
    /// detach costs them work (rate limits tell it from an attachment
    /// anyone could have written in their name). Not in the JSON plan.
    #[serde(skip)]
    pub working: bool,
}

impl Detach {
    /// A detach of `eid` from `device`, with nothing else known (no rule,
    /// user or groups).
    pub fn of(device: GpuIndex, eid: EnvId) -> Self {
        Detach {
            device,
            eid,
            rules: Rules::new(),
            username: None,
            charged: None,
            owner: None,
            groups: Vec::new(),
            working: false,
        }
    }
}

/// Everything to do on one host.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct HostPlan {
    pub terminate: Vec<Termination>,
    pub detach: Vec<Detach>,
}

impl HostPlan {
    /// Whether there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.terminate.is_empty() && self.detach.is_empty()
    }
}

/// The plans of the hosts that have something to do, in host order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Plan {
    #[serde(serialize_with = "host_objects")]
    pub hosts: Vec<(HostId, HostPlan)>,
}

impl Plan {
    /// Each (host, pid) the plan terminates.
    pub fn terminated(&self) -> impl Iterator<Item = (&HostId, Pid)> {
        (self.hosts.iter()).flat_map(|(h, p)| p.terminate.iter().map(move |t| (h, t.pid)))
    }
}

/// Serializes `(host, plan)` pairs as `{"host": .., "terminate": .., "detach": ..}`.
fn host_objects<S: serde::Serializer>(
    hosts: &[(HostId, HostPlan)],
    s: S,
) -> Result<S::Ok, S::Error> {
    #[derive(Serialize)]
    struct Entry<'a> {
        host: &'a HostId,
        #[serde(flatten)]
        plan: &'a HostPlan,
    }
    s.collect_seq(hosts.iter().map(|(host, plan)| Entry { host, plan }))
}

/// What a host's violations ask for, before ordering.
#[derive(Default)]
struct Wanted {
    pids: BTreeMap<Pid, Rules>,
    /// Devices in first-named order, with the eids to detach there.
    detach: Vec<(GpuIndex, BTreeSet<EnvId>)>,
    /// Each device's place in `detach`.
    slots: HashMap<GpuIndex, usize>,
    /// The user each environment is detached for.
    charged: HashMap<EnvId, String>,
    /// The rules behind each (device, environment) detach.
    detach_rules: HashMap<(GpuIndex, EnvId), Rules>,
}

impl Wanted {
    fn terminate(&mut self, pid: Pid, rule: Rule) {
        self.pids.entry(pid).or_default().insert(rule);
    }

    fn detach(&mut self, device: GpuIndex, eids: &[EnvId], rule: Rule) {
        let slot = *self.slots.entry(device).or_insert_with(|| {
            self.detach.push((device, BTreeSet::new()));
            self.detach.len() - 1
        });
        self.detach[slot].1.extend(eids.iter().cloned());
        for e in eids {
            self.detach_rules
                .entry((device, e.clone()))
                .or_default()
                .insert(rule);
        }
    }
}

/// What `violations` ask for, host by host.
fn wanted_by(violations: &[Violation]) -> BTreeMap<&HostId, Wanted> {
    let mut wanted: BTreeMap<&HostId, Wanted> = BTreeMap::new();
    for v in violations {
        for action in &v.actions {
            match action {
                Action::Terminate { host, pid } => {
                    wanted.entry(host).or_default().terminate(*pid, v.rule);
                }
                Action::Detach {
                    host,
                    device,
                    eids,
                    pids,
                    user,
                } => {
                    let w = wanted.entry(host).or_default();
                    w.detach(*device, eids, v.rule);
                    for e in eids {
                        w.charged.insert(e.clone(), user.clone());
                    }
                    for pid in pids {
                        w.terminate(*pid, v.rule);
                    }
                }
            }
        }
    }
    wanted
}

/// Builds the plan for `violations` found in `cluster`.
pub fn build(cluster: &Cluster, violations: &[Violation]) -> Plan {
    let mut wanted = wanted_by(violations);
    let hosts = cluster
        .hosts
        .iter()
        .filter_map(|(host, snap)| {
            let w = wanted.remove(host)?;
            let plan = host_plan(snap, w);
            (!plan.is_empty()).then(|| (host.clone(), plan))
        })
        .collect();
    Plan { hosts }
}

/// The whole plan over `cluster`: each host's `own` plan (built beside its
/// snapshot by [`for_host`], in `cluster`'s host order) with what the
/// `more` violations (the idle rule, the caps) add there; the same plan as
/// [`build`] over all the violations, each host's own part not built again.
/// Also the hosts `more` added to.
pub fn whole(cluster: &Cluster, own: Vec<HostPlan>, more: &[Violation]) -> (Plan, Vec<HostId>) {
    let mut wanted = wanted_by(more);
    let mut added = Vec::new();
    let hosts = cluster
        .hosts
        .iter()
        .zip(own)
        .filter_map(|((host, snap), own)| {
            let plan = match wanted.remove(host) {
                Some(w) => {
                    added.push(host.clone());
                    merged(snap, own, host_plan(snap, w))
                }
                None => own,
            };
            (!plan.is_empty()).then(|| (host.clone(), plan))
        })
        .collect();
    (Plan { hosts }, added)
}

/// One host's two plans as one: terminations in the snapshot's order (a
/// pid in both: once, for the rules of both), `own`'s detaches (it has
/// none: [`for_host`] plans terminations only) then `more`'s. Both are in
/// the snapshot's order already (see [`host_plan`]).
fn merged(snap: &HostSnapshot, own: HostPlan, more: HostPlan) -> HostPlan {
    if own.is_empty() {
        return more;
    }
    let mut terminate = Vec::with_capacity(own.terminate.len() + more.terminate.len());
    let mut a = own.terminate.into_iter().peekable();
    let mut b = more.terminate.into_iter().peekable();
    for p in &snap.processes {
        let x = a.next_if(|t| t.pid == p.pid);
        let y = b.next_if(|t| t.pid == p.pid);
        match (x, y) {
            (Some(mut x), Some(y)) => {
                x.rules.extend(y.rules);
                terminate.push(x);
            }
            (Some(t), None) | (None, Some(t)) => terminate.push(t),
            (None, None) => {}
        }
    }
    // None is left where both follow the snapshot; were one not to, its
    // actions stay all the same.
    terminate.extend(a.chain(b));
    let mut detach = own.detach;
    detach.extend(more.detach);
    HostPlan { terminate, detach }
}

/// The plan for one host's own violations (those of
/// [`crate::rules::assess_host`]: terminations only).
pub fn for_host(host: &HostId, snap: &HostSnapshot, violations: &[Violation]) -> HostPlan {
    let mut w = Wanted::default();
    for v in violations {
        for action in &v.actions {
            if let Action::Terminate { host: h, pid } = action {
                if h == host {
                    w.terminate(*pid, v.rule);
                }
            }
        }
    }
    host_plan(snap, w)
}

impl HostPlan {
    /// What is left of this plan once `done` has been carried out: the
    /// terminations of pids `done` did not terminate, and every detach.
    pub fn without(&self, done: &HostPlan) -> HostPlan {
        let done: std::collections::HashSet<Pid> = done.terminate.iter().map(|d| d.pid).collect();
        HostPlan {
            terminate: self
                .terminate
                .iter()
                .filter(|t| !done.contains(&t.pid))
                .cloned()
                .collect(),
            detach: self.detach.clone(),
        }
    }
}

fn host_plan(snap: &HostSnapshot, mut w: Wanted) -> HostPlan {
    if w.pids.is_empty() && w.detach.is_empty() {
        return HostPlan::default();
    }
    let terminate = snap
        .processes
        .iter()
        // Never a process whose identity is not pinned; one whose
        // environment is unknown only for a rule that needs none of it.
        .filter(|p| p.start_time.is_some() || !matches!(p.owner, Owner::Unknown(_)))
        .filter_map(|p| {
            let rules = w.pids.remove(&p.pid)?;
            Some(Termination {
                pid: p.pid,
                start_time: p.start_time,
                eid: p.owner.eid().cloned(),
                gpus: p.indices().collect(),
                uid: p.uid,
                user: p.user.clone(),
                sub_uid: p.sub_uid,
                rules,
                groups: match (&snap.truth, p.uid) {
                    (Some(t), Some(uid)) => t.groups_of(uid).to_vec(),
                    _ => Vec::new(),
                },
                memory: p
                    .gpus
                    .iter()
                    .map(|g| g.usage.bytes())
                    .sum::<Option<u64>>()
                    .filter(|_| !p.gpus.is_empty()),
            })
        })
        .collect();
    // Each eid's first record (genv's environment of that id), when
    // something is to be detached.
    let mut records: HashMap<&EnvId, usize> = HashMap::new();
    // Who the kernel says carries each environment (live hosts only): the
    // uid of a process of theirs.
    let mut carried: HashMap<(&EnvId, &str), u32> = HashMap::new();
    // The devices each such process runs on, by environment and uid.
    let mut working: std::collections::HashSet<(&EnvId, GpuIndex, u32)> = Default::default();
    if !w.detach.is_empty() {
        records.reserve(snap.envs.len());
        for (i, e) in snap.envs.iter().enumerate() {
            records.entry(&e.eid).or_insert(i);
        }
        if snap.truth.is_some() {
            for p in &snap.processes {
                if let (Some(eid), Some(user), Some(uid)) =
                    (p.owner.eid(), p.user.as_deref(), p.uid)
                {
                    carried.insert((eid, user), uid);
                    working.extend(p.indices().map(|g| (eid, g, uid)));
                }
            }
        }
    }
    let detach = w
        .detach
        .iter()
        .flat_map(|(device, eids)| {
            // In snapshot order.
            let mut order: Vec<usize> = eids
                .iter()
                .filter_map(|e| records.get(e).copied())
                .collect();
            order.sort_unstable();
            let (w, carried, working) = (&w, &carried, &working);
            order.into_iter().map(move |i| {
                let eid = &snap.envs[i].eid;
                let charged = w.charged.get(eid).cloned();
                let uid = charged
                    .as_deref()
                    .and_then(|u| carried.get(&(eid, u)).copied());
                Detach {
                    device: *device,
                    eid: eid.clone(),
                    rules: w
                        .detach_rules
                        .get(&(*device, eid.clone()))
                        .cloned()
                        .unwrap_or_default(),
                    username: snap.envs[i].username.clone(),
                    working: uid.is_some_and(|u| working.contains(&(eid, *device, u))),
                    owner: charged.clone().filter(|_| uid.is_some()),
                    // Only a user the kernel vouches for: a record naming a
                    // group's member never borrows their exemption.
                    groups: match (&snap.truth, uid) {
                        (Some(t), Some(uid)) => t.groups_of(uid).to_vec(),
                        _ => Vec::new(),
                    },
                    charged,
                }
            })
        })
        .collect();
    HostPlan { terminate, detach }
}
