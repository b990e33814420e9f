//! The enforcement rules, pure functions over host snapshots.
//!
//! Each host is assessed on its own ([`assess_host`]): who runs what
//! ([`attribution`]), the rules that need only that host (non-env-processes,
//! env-devices, env-memory), the notices, and the host's part of the device
//! caps. The caps then need only those parts ([`evaluate_caps`]). Each rule
//! returns [`Violation`]s in genv's order, each carrying the actions it
//! calls for. Merging those actions into per-host plans is
//! [`crate::plan`]'s job, and wording them is [`crate::report`]'s.

pub mod attribution;
mod env_devices;
mod env_memory;
pub mod idle;
pub mod in_line;
pub mod max_devices;
pub mod max_groups;
pub mod max_memory;
mod non_env_processes;
mod orphaned_env_processes;
pub mod shards;
pub mod taking;

use std::collections::{BTreeMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::model::{Cluster, EnvId, GpuIndex, HostId, HostSnapshot, Indices, Owner, Pid};
pub use attribution::Orphans;
use attribution::{Attribution, Standing, Stray, Unconfirmed};
pub use idle::IdleHistory;
pub use in_line::InLine;
use max_devices::HostUsage;
use max_groups::HostGroups;
pub use max_groups::{HeldOrder, Starts};
use max_memory::HostMemory;

/// Which rules run, and the device caps.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Policy {
    pub non_env_processes: bool,
    pub env_devices: bool,
    pub env_memory: bool,
    /// Cap on attached devices for every user (`--max-devices-per-user`).
    pub max_devices_per_user: Option<u32>,
    /// Per-user caps overriding the above (`--max-devices-for-user`); they
    /// apply even without a global cap (genv ignores them then).
    pub max_devices_for_user: BTreeMap<String, u32>,
    /// Cap on the GPU memory each user's processes hold over all hosts, in
    /// bytes (`--max-memory-per-user`).
    pub max_memory_per_user: Option<u64>,
    /// Per-user memory caps overriding the above (`--max-memory-for-user`).
    pub max_memory_for_user: BTreeMap<String, u64>,
    /// Caps on the devices the members of a Unix group hold together
    /// (`--max-devices-per-group`).
    pub max_devices_per_group: BTreeMap<String, u32>,
    /// Idle-GPU reclaim (`--idle-after`, `--idle-below`).
    pub idle: Option<idle::IdlePolicy>,
    /// Under non-env-processes, a job whose environment id names no
    /// environment of the host is taken as outside genv too, after its own
    /// grace (`--orphans-as-non-env`; genv leaves it alone).
    pub orphans_as_non_env: bool,
    /// The devices of a user's GPU jobs outside genv count toward their
    /// device cap (`--count-non-env-devices`; genv counts attachments only).
    pub count_non_env_devices: bool,
}

impl Default for Policy {
    /// genv's defaults: env-devices and env-memory on, no caps.
    fn default() -> Self {
        Policy {
            non_env_processes: false,
            env_devices: true,
            env_memory: true,
            max_devices_per_user: None,
            max_devices_for_user: BTreeMap::new(),
            max_memory_per_user: None,
            max_memory_for_user: BTreeMap::new(),
            max_devices_per_group: BTreeMap::new(),
            idle: None,
            orphans_as_non_env: false,
            count_non_env_devices: false,
        }
    }
}

impl Policy {
    /// Whether any per-user device cap applies.
    pub fn has_caps(&self) -> bool {
        self.max_devices_per_user.is_some() || !self.max_devices_for_user.is_empty()
    }

    /// Whether any memory cap applies.
    pub fn has_memory_caps(&self) -> bool {
        self.max_memory_per_user.is_some() || !self.max_memory_for_user.is_empty()
    }

    /// Whether any cap over all hosts applies (devices, groups, memory):
    /// each host's part of them is then summed up.
    pub fn has_any_cap(&self) -> bool {
        self.has_caps() || self.has_memory_caps() || !self.max_devices_per_group.is_empty()
    }

    /// The memory cap for `user`, if any (bytes).
    pub fn memory_cap_for(&self, user: &str) -> Option<u64> {
        self.max_memory_for_user
            .get(user)
            .copied()
            .or(self.max_memory_per_user)
    }

    /// The cap for `user`, if any.
    pub fn cap_for(&self, user: &str) -> Option<u32> {
        self.max_devices_for_user
            .get(user)
            .copied()
            .or(self.max_devices_per_user)
    }
}

/// A rule, as named in reports.
#[derive(Debug, enumset::EnumSetType, PartialOrd, Ord, Serialize, Deserialize)]
#[enumset(serialize_repr = "list")]
#[serde(rename_all = "kebab-case")]
pub enum Rule {
    NonEnvProcesses,
    EnvDevices,
    EnvMemory,
    MaxDevicesPerUser,
    MaxDevicesPerGroup,
    MaxMemoryPerUser,
    IdleGpu,
    OrphanedEnvProcesses,
}

/// A set of rules, iterated (and serialized, as a list) in [`Rule`]'s
/// order: a bit each, so a plan's many small sets allocate nothing.
pub type Rules = enumset::EnumSet<Rule>;

impl Rule {
    /// Every rule: genv's four in its order, then ours.
    pub const ALL: [Rule; 8] = [
        Rule::NonEnvProcesses,
        Rule::EnvDevices,
        Rule::EnvMemory,
        Rule::MaxDevicesPerUser,
        Rule::MaxDevicesPerGroup,
        Rule::MaxMemoryPerUser,
        Rule::IdleGpu,
        Rule::OrphanedEnvProcesses,
    ];

    /// The rule of this name ([`Rule::name`]).
    pub fn from_name(name: &str) -> Option<Rule> {
        Rule::ALL.into_iter().find(|r| r.name() == name)
    }

    /// Its name, as in genv's flags and our reports.
    pub fn name(self) -> &'static str {
        match self {
            Rule::NonEnvProcesses => "non-env-processes",
            Rule::EnvDevices => "env-devices",
            Rule::EnvMemory => "env-memory",
            Rule::MaxDevicesPerUser => "max-devices-per-user",
            Rule::MaxDevicesPerGroup => "max-devices-per-group",
            Rule::MaxMemoryPerUser => "max-memory-per-user",
            Rule::IdleGpu => "idle-gpu",
            Rule::OrphanedEnvProcesses => "orphaned-env-processes",
        }
    }
}

/// Something a rule wants done.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    /// SIGTERM a process.
    Terminate { host: HostId, pid: Pid },
    /// Detach environments from a device, and terminate their member
    /// processes there (`pids`).
    Detach {
        host: HostId,
        device: GpuIndex,
        eids: Vec<EnvId>,
        #[serde(skip)]
        pids: Vec<Pid>,
        /// The user they are detached from (whose count they lower).
        #[serde(skip)]
        user: String,
    },
}

/// What was found, with the figures genv prints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Finding {
    /// A GPU process outside any environment.
    NonEnvProcess { host: HostId, pid: Pid },
    /// A GPU process whose environment id names no environment
    /// (`--orphans-as-non-env`).
    OrphanedEnvProcess {
        host: HostId,
        pid: Pid,
        eid: EnvId,
        user: Option<String>,
    },
    /// A process on devices its environment is not attached to.
    NonAttachedDevices {
        host: HostId,
        pid: Pid,
        eid: EnvId,
        devices: Indices,
    },
    /// An environment over its `gpu_memory` on one device (bytes).
    EnvMemory {
        host: HostId,
        eid: EnvId,
        device: GpuIndex,
        used: u64,
        over: u64,
        capacity: String,
    },
    /// A user over their device cap, across all hosts seen this cycle.
    MaxDevices {
        user: String,
        devices: usize,
        hosts: usize,
        over: usize,
    },
    /// A group's members over its device cap, across all hosts.
    MaxGroupDevices {
        group: String,
        devices: usize,
        cap: u32,
        over: usize,
    },
    /// A user's processes over their GPU memory cap, across all hosts
    /// (bytes).
    MaxMemory {
        user: String,
        used: u64,
        cap: u64,
        over: u64,
        hosts: usize,
    },
    /// A process holding GPU memory whose GPUs stayed below the idle
    /// threshold for the whole window.
    Idle {
        host: HostId,
        pid: Pid,
        user: Option<String>,
        devices: Indices,
        /// Since when (ms since the Unix epoch), and for how long (ms).
        since_ms: u64,
        idle_ms: u64,
        below: u32,
        /// Whose utilization it was judged by.
        source: idle::Source,
    },
}

impl Finding {
    /// The host it was found on; `None` for the cluster-wide per-user cap.
    pub fn host(&self) -> Option<&HostId> {
        match self {
            Finding::NonEnvProcess { host, .. }
            | Finding::OrphanedEnvProcess { host, .. }
            | Finding::NonAttachedDevices { host, .. }
            | Finding::EnvMemory { host, .. }
            | Finding::Idle { host, .. } => Some(host),
            Finding::MaxDevices { .. }
            | Finding::MaxGroupDevices { .. }
            | Finding::MaxMemory { .. } => None,
        }
    }
}

/// A broken rule and what it calls for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Violation {
    pub rule: Rule,
    pub finding: Finding,
    /// Nearly always one: kept inline.
    pub actions: smallvec::SmallVec<[Action; 1]>,
}

impl Violation {
    /// `rule`'s `finding`, answered by terminating `pid` on `host`.
    pub fn terminating(rule: Rule, finding: Finding, host: &HostId, pid: Pid) -> Self {
        Violation {
            rule,
            finding,
            actions: smallvec::smallvec![Action::Terminate {
                host: host.clone(),
                pid,
            }],
        }
    }
}

/// Something worth an admin's eye that no rule acts on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Notice {
    /// A GPU process whose environment or user could not be read: never
    /// terminated.
    UnknownOwner {
        host: HostId,
        pid: Pid,
        gpus: Vec<GpuIndex>,
        reason: String,
    },
    /// A GPU process that carries an environment id but is no member of
    /// that environment: left alone (see [`attribution`]).
    Stray {
        host: HostId,
        pid: Pid,
        /// With the pid, what identifies the process from cycle to cycle.
        start_time: Option<u64>,
        eid: EnvId,
        /// Its user, where the host says.
        user: Option<String>,
        gpus: Vec<GpuIndex>,
        #[serde(flatten)]
        why: Stray,
    },
    /// A process whose usage nvidia-smi could not measure, in an
    /// environment with a memory cap: it is left out of the sums.
    UnmeasuredUsage {
        host: HostId,
        pid: Pid,
        eid: EnvId,
        device: GpuIndex,
    },
    /// Under a device cap: an environment with devices whose processes are
    /// another user's than its record says; it counts as theirs.
    Recharged {
        host: HostId,
        eid: EnvId,
        recorded: Option<String>,
        charged: String,
    },
    /// Under a device cap: an environment with devices that counts toward
    /// no user's cap.
    Uncharged {
        host: HostId,
        eid: EnvId,
        recorded: Option<String>,
        #[serde(flatten)]
        why: Unconfirmed,
    },
    /// A user over their cap by devices no detach frees (strays of theirs
    /// hold them): they stay over by `left`.
    ExcessKept { user: String, left: usize },
    /// A group over its cap by devices no detach frees.
    GroupExcessKept { group: String, left: usize },
    /// A user over their memory cap by memory no process can be picked
    /// for (its usage unknown, or its identity not pinned): `left` bytes.
    MemoryExcessKept { user: String, left: u64 },
    /// GPU memory the driver lists for a pid that is not alive: held by
    /// no live process (or one that ended during the snapshot). Never
    /// acted on.
    UnownedMemory {
        host: HostId,
        device: GpuIndex,
        pid: Pid,
        /// `None` where the driver could not say how much.
        bytes: Option<u64>,
    },
    /// Under the idle rule: a process whose utilization is unknown (pmon
    /// has no line for it and it shares its GPU): never reclaimed.
    UtilizationUnknown {
        host: HostId,
        pid: Pid,
        gpus: Vec<GpuIndex>,
    },
    /// A GPU process judged as carrying no environment because its
    /// environ cannot be read for a reason it controls.
    HiddenEnviron {
        host: HostId,
        pid: Pid,
        user: Option<String>,
        gpus: Vec<GpuIndex>,
        reason: String,
    },
    /// The host's genv state cannot be used this cycle: the host is
    /// degraded, and only what needs no genv state is judged there.
    StateUnusable { host: HostId, reason: String },
    /// genv's lock was held past the agent's short wait; the state was
    /// read without it.
    LockHeld { host: HostId, holders: String },
    /// Records or attachments of genv's state holding an id or user name
    /// too long to be anyone's: ignored (see
    /// [`crate::snapshot::genv::bound`]).
    GarbledRecords { host: HostId, records: usize },
    /// The machine's shared CUDA MPS server on one of its GPUs: never
    /// judged; its memory there is overhead, in no one's count (see
    /// [`crate::model::MpsServer`]).
    MpsServer {
        host: HostId,
        device: GpuIndex,
        pid: Pid,
        /// The user it runs as (its first client's).
        user: Option<String>,
        /// `None` where the driver could not say how much.
        bytes: Option<u64>,
    },
    /// A GPU process that runs the driver's MPS server file but is not
    /// the machine's shared server (a user's own): judged as any process.
    OwnMpsServer {
        host: HostId,
        pid: Pid,
        user: Option<String>,
        gpus: Vec<GpuIndex>,
        /// Why it is not the shared one.
        reason: String,
    },
    /// A uid seen that has no name on the host and is in no single
    /// sub-uid range: counted as its own user.
    UnresolvedUid {
        host: HostId,
        uid: u32,
        reason: String,
    },
}

/// What one host's snapshot shows on its own.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostFindings {
    /// The per-host rules' violations, in genv's order.
    pub violations: Vec<Violation>,
    pub notices: Vec<Notice>,
    /// The host's part of the device caps (empty when no cap applies).
    pub usage: HostUsage,
    /// Its part of the memory caps (empty when none applies).
    pub memory: HostMemory,
    /// Its word on its users' capped groups (empty when no group is).
    pub groups: HostGroups,
    /// Its processes seen orphaned, to remember for the next cycle.
    pub orphans: Orphans,
    /// Whose each process is, for the idle rule (empty when it is off).
    pub idle_owners: Vec<idle::IdleOwner>,
}

/// Assesses one host: who runs what, the rules that need only this host
/// (all but the caps and the idle rule, which need every host or the
/// cycles before), its notices and its part of the caps. What it decides
/// can be enforced as soon as the host's snapshot is in. `orphans`: its
/// processes seen orphaned in earlier cycles.
pub fn assess_host(
    host: &HostId,
    snap: &HostSnapshot,
    policy: &Policy,
    orphans: &Orphans,
) -> HostFindings {
    let a = Attribution::of(snap, orphans);
    let mut violations = Vec::new();
    if policy.non_env_processes {
        violations.extend(non_env_processes::evaluate(host, &a));
        if policy.orphans_as_non_env {
            violations.extend(orphaned_env_processes::evaluate(host, &a));
        }
    }
    if policy.env_devices {
        violations.extend(env_devices::evaluate(host, &a));
    }
    if policy.env_memory {
        violations.extend(env_memory::evaluate(host, &a));
    }
    let usage = if policy.has_caps() || !policy.max_devices_per_group.is_empty() {
        HostUsage::of(&a, policy.count_non_env_devices)
    } else {
        HostUsage::default()
    };
    let groups = if policy.max_devices_per_group.is_empty() {
        HostGroups::default()
    } else {
        HostGroups::of(snap, &usage, policy)
    };
    HostFindings {
        violations,
        idle_owners: match (&policy.idle, orphans.is_empty()) {
            (None, _) => Vec::new(),
            (Some(_), true) => idle::owners(&a),
            // Who a process is for the idle rule does not hang on its past
            // orphanhood: a known orphan whose uid cannot be read now stays
            // unknown, never reclaimed.
            (Some(_), false) => idle::owners(&Attribution::of(snap, &Orphans::default())),
        },
        notices: notices(host, &a, policy),
        memory: if policy.has_memory_caps() {
            HostMemory::of(&a)
        } else {
            HostMemory::default()
        },
        usage,
        groups,
        orphans: if snap.state_problem().is_some() {
            // Unjudged while the state cannot be read: what was known of
            // its live processes is kept (garbling the state once must not
            // make a job's orphanhood forgotten).
            let live: HashSet<(Pid, u64)> = snap
                .processes
                .iter()
                .filter_map(|p| Some((p.pid, p.start_time?)))
                .collect();
            orphans.intersection(&live).cloned().collect()
        } else {
            a.orphans()
        },
    }
}

/// The caps over the hosts' parts, in host order: the per-user device
/// caps, then the group caps, then the memory caps, each counting what the
/// ones before (and `earlier`, the other rules' violations) already take;
/// violations and the notices of what cannot be taken.
/// With `shards`, the per-user device caps count the other shards' hosts
/// too, and only the actions on ours are kept. `release` names, of the
/// picks, those a hold kept back that are carried out now ([`Released`]):
/// they come first, and the caps are worked out again after them.
pub fn evaluate_caps(
    hosts: &[(&HostId, &HostFindings)],
    policy: &Policy,
    earlier: &[Violation],
    shards: Option<shards::Shards>,
    (held, release): (&Withheld, &mut Release),
    blind: &[HostId],
) -> (Vec<Violation>, Vec<Notice>) {
    let (picks, notices) = caps_once(hosts, policy, earlier, shards, held, blind, false);
    let released = release(earlier, &picks);
    // The picks a hold kept back, as done in the cycle they came due;
    // then what the caps still need, in this cycle's order.
    let first: Vec<Violation> = picks.iter().filter_map(|v| released.of(v)).collect();
    if first.is_empty() {
        return (picks, notices);
    }
    let before: Vec<Violation> = earlier.iter().chain(&first).cloned().collect();
    let (then, notices) = caps_once(hosts, policy, &before, shards, held, blind, true);
    (first.into_iter().chain(then).collect(), notices)
}

/// [`evaluate_caps`] once, in the order a hold keeps unless `unheld`.
fn caps_once(
    hosts: &[(&HostId, &HostFindings)],
    policy: &Policy,
    earlier: &[Violation],
    shards: Option<shards::Shards>,
    held: &Withheld,
    blind: &[HostId],
    unheld: bool,
) -> (Vec<Violation>, Vec<Notice>) {
    // Blind: ours, and the other shards' hosts their parts say are.
    let theirs = shards
        .iter()
        .flat_map(|s| s.others.iter().filter(|p| p.blind));
    let blind: HashSet<HostId> = (blind.iter().cloned())
        .chain(theirs.map(|p| p.host.clone()))
        .collect();
    let fresh = || taking::Taken {
        blind: blind.clone(),
        unheld,
        ..taking::Taken::of(earlier, held)
    };
    let mut taken = fresh();
    let (mut violations, mut notices) = if policy.has_caps() {
        let usage: Vec<(&HostId, &HostUsage)> = hosts.iter().map(|(h, f)| (*h, &f.usage)).collect();
        match shards {
            Some(s) => {
                let (mut v, n) = max_devices::evaluate(&s.in_order(&usage), policy, &mut taken);
                s.ours_only(&mut v);
                (v, n)
            }
            None => max_devices::evaluate(&usage, policy, &mut taken),
        }
    } else {
        (Vec::new(), Vec::new())
    };
    // What the per-user caps take, but what is never carried out.
    let lasting = held.lasting();
    let unseen = (
        std::mem::take(&mut taken.unseen_terminated),
        std::mem::take(&mut taken.unseen_detached),
    );
    taken = fresh();
    (taken.unseen_terminated, taken.unseen_detached) = unseen;
    taken.add(&violations, &lasting);
    if !policy.max_devices_per_group.is_empty() {
        let parts: Vec<(&HostId, &HostUsage, &HostGroups)> = hosts
            .iter()
            .map(|(h, f)| (*h, &f.usage, &f.groups))
            .collect();
        let (v, n) = max_groups::evaluate(&parts, policy, &mut taken);
        violations.extend(v);
        notices.extend(n);
    }
    if policy.has_memory_caps() {
        let parts: Vec<(&HostId, &HostMemory)> =
            hosts.iter().map(|(h, f)| (*h, &f.memory)).collect();
        let mut freed = fresh();
        freed.add(&violations, &lasting);
        let (v, n) = max_memory::evaluate(&parts, policy, &freed.terminated);
        violations.extend(v);
        notices.extend(n);
    }
    (violations, notices)
}

/// The actions asked for this cycle that are not carried out in it (they
/// wait out a grace, are warned only, or are exempt: the ladder's say).
/// What they would free stays counted by the caps after them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Withheld {
    /// Terminations, by host and pid.
    pub terminations: HashSet<(HostId, Pid)>,
    /// Detaches, by host, device and environment.
    pub detaches: HashSet<(HostId, GpuIndex, EnvId)>,
    /// Of the terminations, those that only wait for their deadline or
    /// confirmation (carried out then), unlike warn-only and exempt ones.
    pub waiting_terminations: HashSet<(HostId, Pid)>,
    /// Of the detaches, those that only wait.
    pub waiting_detaches: HashSet<(HostId, GpuIndex, EnvId)>,
    /// Processes of hosts whose genv state is unusable this cycle whose
    /// wait (asked for by a rule that acts, not a cap) the ladder keeps
    /// through the absence ([`crate::ladder::Ladder::unseen_waits`]):
    /// carried out once their host is seen again, so the caps count them
    /// as waiting actions free a device (`SOON`), as a healthy cycle
    /// would, never as freed.
    pub unseen_waiting: HashSet<(HostId, Pid)>,
    /// Of those, the ones due this cycle ([`crate::ladder::Ladder::unseen_due`]):
    /// the group caps' order counts them as ended ([`Taken::since`]).
    pub unseen_due: HashSet<(HostId, Pid)>,
}

impl Withheld {
    /// Whether every action of `self` is in `other`, waiting as there.
    fn within(&self, other: &Withheld) -> bool {
        self.terminations.is_subset(&other.terminations)
            && self.detaches.is_subset(&other.detaches)
            && self
                .waiting_terminations
                .is_subset(&other.waiting_terminations)
            && self.waiting_detaches.is_subset(&other.waiting_detaches)
            && self.unseen_waiting.is_subset(&other.unseen_waiting)
            && self.unseen_due.is_subset(&other.unseen_due)
    }

    fn extend(&mut self, other: Withheld) {
        self.terminations.extend(other.terminations);
        self.detaches.extend(other.detaches);
        self.waiting_terminations.extend(other.waiting_terminations);
        self.waiting_detaches.extend(other.waiting_detaches);
        self.unseen_waiting.extend(other.unseen_waiting);
        self.unseen_due.extend(other.unseen_due);
    }

    /// What is never carried out while it stands (warn-only, exempt): a
    /// cap's action that only waits is taken for the caps after it, which
    /// would otherwise take more than the excess, all due together.
    pub fn lasting(&self) -> Withheld {
        Withheld {
            terminations: (self.terminations.difference(&self.waiting_terminations))
                .cloned()
                .collect(),
            detaches: (self.detaches.difference(&self.waiting_detaches))
                .cloned()
                .collect(),
            ..Withheld::default()
        }
    }
}

/// Of the violations so far and the caps' picks, the picks released
/// ([`Released`]).
pub type Release<'a> = dyn FnMut(&[Violation], &[Violation]) -> Released + 'a;

/// The caps' picks a hold kept back that this cycle carries out
/// ([`crate::ladder::Ladder::released`]): worked out first, as if done in
/// the cycle they came due (where, alone, they would have been), so that a
/// pick coming due only now is kept only if the caps still need it once
/// those are done. Without it, bob's one garble had the caps take, in the
/// cycle the hold ends, what alone they no longer needed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Released {
    pub terminations: HashSet<(HostId, Pid)>,
    pub detaches: HashSet<(HostId, GpuIndex, EnvId)>,
}

impl Released {
    /// `v` with only its released actions, if it has any.
    fn of(&self, v: &Violation) -> Option<Violation> {
        let actions: smallvec::SmallVec<[Action; 1]> = (v.actions.iter())
            .filter(|a| match a {
                Action::Terminate { host, pid } => {
                    self.terminations.contains(&(host.clone(), *pid))
                }
                Action::Detach {
                    host, device, eids, ..
                } => (eids.iter())
                    .all(|e| self.detaches.contains(&(host.clone(), *device, e.clone()))),
            })
            .cloned()
            .collect();
        (!actions.is_empty()).then(|| Violation {
            actions,
            ..v.clone()
        })
    }
}

/// What the rules that look past this cycle's snapshots need: the idle
/// windows (tracked through this cycle) and the time.
#[derive(Debug, Clone, Copy)]
pub struct Moment<'a> {
    pub idle: &'a IdleHistory,
    pub now_ms: u64,
    /// `--shard`: the other shards' parts of the per-user device caps.
    pub shards: Option<shards::Shards<'a>>,
    /// The hosts whose genv state has been unusable
    /// [`taking::BLIND_AFTER`] cycles in a row ([`taking::Taken::blind`]).
    pub blind: &'a [HostId],
}

static NO_WINDOWS: IdleHistory = IdleHistory {
    windows: std::collections::BTreeMap::new(),
};

impl Moment<'static> {
    /// No idle window yet, at the epoch: one cycle on its own.
    pub fn none() -> Self {
        Moment {
            idle: &NO_WINDOWS,
            now_ms: 0,
            shards: None,
            blind: &[],
        }
    }
}

/// Every host's findings, the idle rule and the caps, merged in genv's
/// order (rule by rule, each over the hosts in order; ours after):
/// violations and notices. `snapshots`: each host's, in the same order.
pub fn merge(
    hosts: Vec<(&HostId, HostFindings)>,
    snapshots: &[&HostSnapshot],
    policy: &Policy,
    moment: Moment,
) -> (Vec<Violation>, Vec<Notice>) {
    let (mut held, mut release) = (
        |_: &[Violation]| Withheld::default(),
        |_: &[Violation], _: &[Violation]| Released::default(),
    );
    merge_held(hosts, snapshots, policy, moment, &mut held, &mut release)
}

/// [`merge`], where only what is carried out this cycle frees room under
/// the caps: `held` says, of every violation so far, which actions wait
/// (the ladder's say over their plan), and the caps are worked out again
/// until what waits is what they were worked out with (a few passes at
/// most: each adds to what waits). `release`: of the caps' picks, those a
/// hold kept back, carried out now ([`evaluate_caps`]).
pub fn merge_held(
    hosts: Vec<(&HostId, HostFindings)>,
    snapshots: &[&HostSnapshot],
    policy: &Policy,
    moment: Moment,
    held: &mut dyn FnMut(&[Violation]) -> Withheld,
    release: &mut Release,
) -> (Vec<Violation>, Vec<Notice>) {
    let mut hosts = hosts;
    let mut by_rule: [Vec<Violation>; 3] = Default::default();
    let mut notices = Vec::new();
    let mut idle_violations = Vec::new();
    for ((host, f), snap) in hosts.iter_mut().zip(snapshots) {
        // Taken, not copied: the caps below read the hosts' usage only.
        for v in std::mem::take(&mut f.violations) {
            let slot = match v.rule {
                Rule::NonEnvProcesses | Rule::OrphanedEnvProcesses => 0,
                Rule::EnvDevices => 1,
                // Per-host rules only: the rest come below.
                _ => 2,
            };
            by_rule[slot].push(v);
        }
        notices.append(&mut f.notices);
        if let Some(idle) = &policy.idle {
            let (v, n) =
                idle::evaluate(host, snap, &f.idle_owners, moment.idle, idle, moment.now_ms);
            idle_violations.extend(v);
            notices.extend(n);
        }
    }
    let mut violations: Vec<Violation> = by_rule.into_iter().flatten().collect();
    violations.extend(idle_violations);
    let parts: Vec<(&HostId, &HostFindings)> = hosts.iter().map(|(h, f)| (*h, f)).collect();
    let (ruled, noticed) = (violations.len(), notices.len());
    let mut waits = Withheld::default();
    for pass in 0.. {
        let (caps, kept) = evaluate_caps(
            &parts,
            policy,
            &violations,
            moment.shards,
            (&waits, &mut *release),
            moment.blind,
        );
        violations.extend(caps);
        notices.extend(kept);
        if pass == 3 || !policy.has_any_cap() {
            break;
        }
        let now = held(&violations);
        if now.within(&waits) {
            break;
        }
        waits.extend(now);
        violations.truncate(ruled);
        notices.truncate(noticed);
    }
    (violations, notices)
}

/// Every rule over `cluster` (no idle window before it): violations and
/// notices in genv's order.
pub fn assess_cluster(cluster: &Cluster, policy: &Policy) -> (Vec<Violation>, Vec<Notice>) {
    assess_cluster_at(cluster, policy, &IdleHistory::default(), 0)
}

/// Every rule over `cluster` at `now_ms`, the idle windows before it
/// given: violations and notices in genv's order.
pub fn assess_cluster_at(
    cluster: &Cluster,
    policy: &Policy,
    idle: &IdleHistory,
    now_ms: u64,
) -> (Vec<Violation>, Vec<Notice>) {
    let hosts = cluster
        .hosts
        .iter()
        .map(|(h, s)| (h, assess_host(h, s, policy, &Orphans::default())))
        .collect();
    let snapshots: Vec<&HostSnapshot> = cluster.hosts.iter().map(|(_, s)| s).collect();
    let tracked = match &policy.idle {
        Some(p) => {
            let seen: Vec<(&HostId, &HostSnapshot)> =
                cluster.hosts.iter().map(|(h, s)| (h, s)).collect();
            idle.track(&seen, p.below, now_ms, None)
        }
        None => IdleHistory::default(),
    };
    merge(
        hosts,
        &snapshots,
        policy,
        Moment {
            idle: &tracked,
            now_ms,
            shards: None,
            blind: &[],
        },
    )
}

/// Runs the rules `policy` turns on, in genv's order.
pub fn evaluate(cluster: &Cluster, policy: &Policy) -> Vec<Violation> {
    assess_cluster(cluster, policy).0
}

/// What the rules leave alone on one host but an admin should know about.
fn notices(host: &HostId, a: &Attribution, policy: &Policy) -> Vec<Notice> {
    let snap = a.snapshot();
    let mut out = Vec::new();
    if let Some(truth) = &snap.truth {
        if let Some(reason) = &truth.state_problem {
            out.push(Notice::StateUnusable {
                host: host.clone(),
                reason: reason.clone(),
            });
        }
        if truth.garbled_records > 0 {
            out.push(Notice::GarbledRecords {
                host: host.clone(),
                records: truth.garbled_records,
            });
        }
        if let Some(holders) = &truth.lock_held {
            out.push(Notice::LockHeld {
                host: host.clone(),
                holders: holders.clone(),
            });
        }
        out.extend(truth.mps_servers.iter().flat_map(|s| {
            s.gpus.iter().map(|g| Notice::MpsServer {
                host: host.clone(),
                device: g.index,
                pid: s.pid,
                user: s.user.as_deref().map(str::to_string),
                bytes: g.usage.bytes(),
            })
        }));
        out.extend(
            snap.processes
                .iter()
                .filter_map(|p| Some((p, truth.own_mps_servers.get(&p.pid)?)))
                .map(|(p, why)| Notice::OwnMpsServer {
                    host: host.clone(),
                    pid: p.pid,
                    user: p.user.as_deref().map(str::to_string),
                    gpus: p.indices().collect(),
                    reason: why.clone(),
                }),
        );
        out.extend(
            truth
                .unresolved_uids
                .iter()
                .map(|(uid, reason)| Notice::UnresolvedUid {
                    host: host.clone(),
                    uid: *uid,
                    reason: reason.clone(),
                }),
        );
    }
    if policy.has_caps() {
        out.extend(charge_notices(host, a));
    }
    for (pi, p) in snap.processes.iter().enumerate() {
        match (a.standing(pi), &p.owner) {
            (Standing::Unknown, Owner::Unknown(reason)) if reason == crate::model::EXITED => {
                out.extend(p.gpus.iter().map(|g| Notice::UnownedMemory {
                    host: host.clone(),
                    device: g.index,
                    pid: p.pid,
                    bytes: g.usage.bytes(),
                }));
            }
            (Standing::Unknown, Owner::Unknown(reason)) => out.push(Notice::UnknownOwner {
                host: host.clone(),
                pid: p.pid,
                gpus: p.indices().collect(),
                reason: reason.clone(),
            }),
            (Standing::Unknown, Owner::Env(eid)) if snap.state_problem().is_some() => {
                out.push(Notice::UnknownOwner {
                    host: host.clone(),
                    pid: p.pid,
                    gpus: p.indices().collect(),
                    reason: format!(
                        "it carries environment {eid}, which cannot be judged while genv's state cannot be read"
                    ),
                })
            }
            (Standing::Unknown, _) => out.push(Notice::UnknownOwner {
                host: host.clone(),
                pid: p.pid,
                gpus: p.indices().collect(),
                reason: "its user could not be read".into(),
            }),
            (_, Owner::Hidden(reason)) => out.push(Notice::HiddenEnviron {
                host: host.clone(),
                pid: p.pid,
                user: a.user_of(pi).map(|u| u.into_owned()),
                gpus: p.indices().collect(),
                reason: reason.clone(),
            }),
            (Standing::Stray(why), Owner::Env(eid)) => out.push(Notice::Stray {
                host: host.clone(),
                pid: p.pid,
                start_time: p.start_time,
                eid: eid.clone(),
                user: a.user_of(pi).map(|u| u.into_owned()),
                gpus: p.indices().collect(),
                why: why.clone(),
            }),
            (Standing::Member(i), Owner::Env(eid)) if snap.envs[*i].gpu_memory.is_some() => {
                for g in p.gpus.iter().filter(|g| g.usage.bytes().is_none()) {
                    out.push(Notice::UnmeasuredUsage {
                        host: host.clone(),
                        pid: p.pid,
                        eid: eid.clone(),
                        device: g.index,
                    });
                }
            }
            _ => {}
        }
    }
    out
}

/// Environments with devices whose charge is not what their record says.
fn charge_notices(host: &HostId, a: &Attribution) -> Vec<Notice> {
    let snap = a.snapshot();
    snap.envs
        .iter()
        .enumerate()
        .filter(|(i, _)| !a.attached(*i).is_empty())
        .filter_map(|(i, e)| {
            let recorded = e.username.as_deref().filter(|u| !u.is_empty());
            if let Some(charged) = a.charged(i) {
                return (recorded != Some(charged)).then(|| Notice::Recharged {
                    host: host.clone(),
                    eid: e.eid.clone(),
                    recorded: recorded.map(String::from),
                    charged: charged.to_string(),
                });
            }
            match a.uncharged(i)? {
                Unconfirmed::Nameless | Unconfirmed::Duplicate => None,
                why => Some(Notice::Uncharged {
                    host: host.clone(),
                    eid: e.eid.clone(),
                    recorded: recorded.map(String::from),
                    why: why.clone(),
                }),
            }
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod test_support {
    //! Small builders for rule and plan tests.
    use crate::model::*;

    /// A recorded nvidia-smi output, `fixtures/nvidia-smi/<path>`, without
    /// its `# exit N` line (not the driver's).
    pub fn recorded(path: &str) -> String {
        let file = format!("{}/fixtures/nvidia-smi/{path}", env!("CARGO_MANIFEST_DIR"));
        std::fs::read_to_string(file)
            .unwrap()
            .lines()
            .filter(|l| !l.starts_with("# exit"))
            .map(|l| format!("{l}\n"))
            .collect()
    }

    pub fn mib(n: u64) -> Usage {
        Usage::Known(n * 1024 * 1024)
    }

    pub fn proc_(pid: u32, eid: Option<&str>, gpus: &[(u32, Usage)]) -> Process {
        Process {
            pid: Pid(pid),
            owner: match eid {
                Some(e) => Owner::Env(EnvId(e.into())),
                None => Owner::NoEnv,
            },
            gpus: gpus
                .iter()
                .map(|(i, u)| DeviceUsage {
                    index: GpuIndex(*i),
                    usage: *u,
                })
                .collect(),
            start_time: Some(1000 + u64::from(pid)),
            uid: Some(1000),
            user: Some("alice".into()),
            sub_uid: None,
        }
    }

    pub fn env(eid: &str, user: Option<&str>, gpu_memory: Option<&str>) -> Env {
        Env {
            eid: EnvId(eid.into()),
            uid: 1000,
            username: user.map(String::from),
            creation: "22/11/2026 15:04:05".into(),
            name: None,
            gpu_memory: gpu_memory.map(|t| Memory {
                text: t.into(),
                bytes: crate::snapshot::memory::parse(t).unwrap(),
            }),
            gpus: None,
            pids: vec![1],
            kernel_ids: vec![],
        }
    }

    /// What the kernel says on a live host where uid 1001 is alice and
    /// 1002 bob: `pid_uids`, the owners of pids that records list.
    pub fn alice_and_bob(pid_uids: &[(i64, u32)]) -> HostTruth {
        HostTruth {
            pid_uids: pid_uids.iter().copied().collect(),
            user_names: [(1001, "alice"), (1002, "bob")]
                .into_iter()
                .map(|(k, v)| (k, v.into()))
                .collect(),
            ..HostTruth::default()
        }
    }

    pub fn devices(n: u32, attachments: &[(u32, &str)]) -> Vec<Device> {
        (0..n)
            .map(|i| Device {
                index: GpuIndex(i),
                total_memory: "81559mi".into(),
                attachments: attachments
                    .iter()
                    .filter(|(d, _)| *d == i)
                    .map(|(_, e)| Attachment {
                        eid: EnvId((*e).into()),
                        gpu_memory: None,
                        time: "22/11/2026 15:04:06".into(),
                    })
                    .collect(),
            })
            .collect()
    }

    pub fn local(snapshot: HostSnapshot) -> Cluster {
        Cluster::local(HostId("localhost".into()), snapshot)
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::*;
    use super::*;
    use crate::model::*;

    #[test]
    fn a_degraded_host_keeps_only_the_orphans_that_still_run_as_they_were() {
        let host = HostId("h".into());
        let mut kept = proc_(7, Some("gone"), &[(0, mib(1))]);
        kept.start_time = Some(100);
        // Pid 8 was an orphan started at 200; a new process has it now.
        let mut reused = proc_(8, Some("gone"), &[(0, mib(1))]);
        reused.start_time = Some(300);
        let snap = HostSnapshot {
            processes: vec![kept, reused],
            truth: Some(HostTruth {
                state_problem: Some("envs.json: garbled".into()),
                ..HostTruth::default()
            }),
            ..Default::default()
        };
        let known: Orphans = [(Pid(7), 100), (Pid(8), 200), (Pid(9), 5)]
            .into_iter()
            .collect();
        let f = assess_host(&host, &snap, &Policy::default(), &known);
        assert_eq!(f.orphans, [(Pid(7), 100)].into_iter().collect());
        // No cap asked for: no usage counted for one.
        assert_eq!(f.usage, HostUsage::default());
        let capped = Policy {
            max_devices_per_user: Some(1),
            ..Policy::default()
        };
        let f = assess_host(&host, &snap, &capped, &known);
        assert_ne!(f.usage, HostUsage::default());
    }

    #[test]
    fn violations_come_in_genvs_order_of_rules_whatever_each_host_found_first() {
        let host = HostId("h".into());
        let snap = HostSnapshot {
            processes: vec![
                proc_(1, Some("a"), &[(1, mib(1))]),
                proc_(2, None, &[(0, mib(1))]),
            ],
            envs: vec![env("a", Some("alice"), None)].into(),
            devices: devices(2, &[(0, "a")]).into(),
            ..Default::default()
        };
        let policy = Policy {
            non_env_processes: true,
            env_devices: true,
            ..Policy::default()
        };
        let mut f = assess_host(&host, &snap, &policy, &Orphans::default());
        // A host's own order does not matter: the merge puts genv's.
        f.violations.reverse();
        let (v, _) = merge(vec![(&host, f)], &[&snap], &policy, Moment::none());
        let rules: Vec<Rule> = v.iter().map(|v| v.rule).collect();
        assert_eq!(rules, [Rule::NonEnvProcesses, Rule::EnvDevices]);
    }

    #[test]
    fn a_job_of_an_environment_on_a_degraded_host_is_reported_as_such() {
        let host = HostId("h".into());
        let snap = HostSnapshot {
            processes: vec![proc_(1, Some("a"), &[(0, mib(1))])],
            truth: Some(HostTruth {
                state_problem: Some("envs.json: garbled".into()),
                ..HostTruth::default()
            }),
            ..Default::default()
        };
        let f = assess_host(&host, &snap, &Policy::default(), &Orphans::default());
        assert!(
            f.notices
                .iter()
                .any(|n| matches!(n, Notice::UnknownOwner { reason, .. }
                if reason.contains("carries environment a, which cannot be judged"))),
            "{:?}",
            f.notices
        );
    }

    #[test]
    fn a_known_orphan_whose_uid_cannot_be_read_is_never_idle_reclaimable() {
        let host = HostId("h".into());
        let mut p = proc_(7, Some("gone"), &[(0, mib(1))]);
        (p.uid, p.user) = (None, None);
        let snap = HostSnapshot {
            processes: vec![p],
            truth: Some(HostTruth::default()),
            ..Default::default()
        };
        let policy = Policy {
            idle: Some(idle::IdlePolicy {
                after: std::time::Duration::ZERO,
                below: 5,
            }),
            ..Policy::default()
        };
        let known: Orphans = [(Pid(7), 1007)].into_iter().collect();
        for orphans in [Orphans::default(), known] {
            let f = assess_host(&host, &snap, &policy, &orphans);
            assert_eq!(f.idle_owners, [idle::IdleOwner::Unknown], "{orphans:?}");
        }
    }

    /// One host with one process or environment behind each notice.
    fn noticed() -> (HostId, HostSnapshot) {
        let mut unknown = proc_(10, None, &[(0, mib(1))]);
        unknown.owner = Owner::Unknown("its environ is unreadable".into());
        let mut nameless = proc_(11, Some("m"), &[(0, mib(1))]);
        (nameless.uid, nameless.user) = (None, None);
        let stray = proc_(12, Some("gone"), &[(0, mib(1))]);
        let unmeasured = proc_(13, Some("m"), &[(0, Usage::Unknown)]);
        let uncapped = proc_(14, Some("n"), &[(3, Usage::Unknown)]);
        let recharged = proc_(15, Some("r"), &[(1, mib(1))]);
        let outside = proc_(16, None, &[(3, mib(1))]);
        // Two users' jobs in one environment: charged to neither.
        let shared = proc_(17, Some("c"), &[(2, mib(1))]);
        let mut bobs = proc_(18, Some("c"), &[(2, mib(1))]);
        (bobs.uid, bobs.user) = (Some(1001), Some("bob".into()));
        let snap = HostSnapshot {
            processes: vec![
                unknown, nameless, stray, unmeasured, uncapped, recharged, outside, shared, bobs,
            ],
            envs: vec![
                env("m", Some("alice"), Some("1gi")),
                env("n", Some("alice"), None),
                env("r", Some("bob"), None),
                // Idle and nameless: charged to nobody, as in genv, silently.
                env("u", None, None),
                env("c", Some("alice"), None),
            ]
            .into(),
            devices: devices(4, &[(0, "m"), (3, "n"), (1, "r"), (2, "u"), (2, "c")]).into(),
            truth: Some(HostTruth {
                user_names: [(1000, "alice".to_string()), (1001, "bob".to_string())]
                    .into_iter()
                    .map(|(k, v)| (k, v.into()))
                    .collect(),
                ..HostTruth::default()
            }),
            ..Default::default()
        };
        (HostId("h".into()), snap)
    }

    #[test]
    fn each_thing_left_alone_is_noticed_and_charges_only_under_a_cap() {
        let (host, snap) = noticed();
        let kinds = |policy: &Policy| -> Vec<String> {
            assess_host(&host, &snap, policy, &Orphans::default())
                .notices
                .iter()
                .map(|n| match n {
                    Notice::UnknownOwner { pid, reason, .. } => {
                        format!("unknown {} {reason}", pid.0)
                    }
                    Notice::Stray { pid, eid, .. } => format!("stray {} {}", pid.0, eid.0),
                    Notice::UnmeasuredUsage { pid, device, .. } => {
                        format!("unmeasured {} on {}", pid.0, device.0)
                    }
                    Notice::Recharged {
                        eid,
                        recorded,
                        charged,
                        ..
                    } => format!("recharged {} {recorded:?} -> {charged}", eid.0),
                    Notice::Uncharged { eid, .. } => format!("uncharged {}", eid.0),
                    Notice::ExcessKept { user, .. } => format!("kept {user}"),
                    other => format!("{other:?}"),
                })
                .collect()
        };
        let plain = Policy::default();
        let capped = Policy {
            max_devices_per_user: Some(8),
            ..Policy::default()
        };
        let per_host = [
            "unknown 10 its environ is unreadable",
            "unknown 11 its user could not be read",
            "stray 12 gone",
            "unmeasured 13 on 0",
            "stray 17 c",
            "stray 18 c",
        ];
        assert_eq!(kinds(&plain), per_host);
        let mut under_cap = vec![
            "recharged r Some(\"bob\") -> alice".to_string(),
            "uncharged c".to_string(),
        ];
        under_cap.extend(per_host.iter().map(|s| s.to_string()));
        assert_eq!(kinds(&capped), under_cap);
    }

    #[test]
    fn memory_of_a_pid_no_live_process_has_is_noticed_per_gpu_never_acted_on() {
        let mut gone = proc_(40, None, &[(0, mib(700)), (1, Usage::Unknown)]);
        (gone.owner, gone.start_time, gone.uid, gone.user) = (
            Owner::Unknown(crate::model::EXITED.into()),
            None,
            None,
            None,
        );
        let snap = HostSnapshot {
            processes: vec![gone],
            devices: devices(2, &[]).into(),
            truth: Some(HostTruth::default()),
            ..Default::default()
        };
        let host = HostId("h".into());
        let every = Policy {
            non_env_processes: true,
            max_memory_per_user: Some(0),
            idle: Some(idle::IdlePolicy {
                after: std::time::Duration::ZERO,
                below: 100,
            }),
            ..Policy::default()
        };
        let (v, n) = assess_cluster(&Cluster::local(host.clone(), snap), &every);
        assert!(v.is_empty(), "{v:?}");
        assert_eq!(
            n,
            [
                Notice::UnownedMemory {
                    host: host.clone(),
                    device: GpuIndex(0),
                    pid: Pid(40),
                    bytes: Some(700 << 20)
                },
                Notice::UnownedMemory {
                    host,
                    device: GpuIndex(1),
                    pid: Pid(40),
                    bytes: None
                }
            ]
        );
    }

    #[test]
    fn caps_are_on_with_either_flag() {
        assert!(!Policy::default().has_caps());
        let per_user = Policy {
            max_devices_per_user: Some(1),
            ..Policy::default()
        };
        let for_one = Policy {
            max_devices_for_user: [("bob".to_string(), 0)].into_iter().collect(),
            ..Policy::default()
        };
        assert!(per_user.has_caps() && for_one.has_caps());
    }

    #[test]
    fn a_finding_names_its_host_but_the_cap_names_none() {
        let (host, snap) = noticed();
        let policy = Policy {
            non_env_processes: true,
            max_devices_per_user: Some(0),
            ..Policy::default()
        };
        let v = assess_cluster(
            &Cluster {
                mode: Mode::Remote,
                hosts: vec![(host.clone(), snap)],
            },
            &policy,
        )
        .0;
        assert!(v.iter().any(|v| v.finding.host() == Some(&host)));
        assert!(v
            .iter()
            .any(|v| v.rule == Rule::MaxDevicesPerUser && v.finding.host().is_none()));
    }

    #[test]
    fn a_detach_is_told_to_its_user_only_when_the_kernel_vouches_for_them() {
        let (host, mut snap) = noticed();
        std::sync::Arc::make_mut(&mut snap.envs).push(env("idle", Some("carol"), None));
        // Group exemptions asked the host for its users' groups.
        if let Some(t) = snap.truth.as_mut() {
            t.groups.insert(1000, vec!["alice".into(), "lab".into()]);
        }
        snap.devices = devices(
            4,
            &[
                (0, "m"),
                (3, "n"),
                (1, "r"),
                (2, "u"),
                (2, "c"),
                (1, "idle"),
            ],
        )
        .into();
        let policy = Policy {
            max_devices_per_user: Some(0),
            ..Policy::default()
        };
        let cluster = Cluster {
            mode: Mode::Remote,
            hosts: vec![(host.clone(), snap)],
        };
        let v = assess_cluster(&cluster, &policy).0;
        let plan = crate::plan::build(&cluster, &v);
        let detach = &plan.hosts[0].1.detach;
        let of = |eid: &str| {
            detach
                .iter()
                .find(|d| *d.eid.0 == *eid)
                .unwrap_or_else(|| panic!("{eid} not in {detach:?}"))
        };
        // `n`: alice's job (uid 1000) carries it: she is told.
        assert_eq!(of("n").charged.as_deref(), Some("alice"));
        assert_eq!(of("n").owner.as_deref(), Some("alice"));
        // `idle`: no process, charged by its record's username alone: the
        // admins only.
        assert_eq!(of("idle").charged.as_deref(), Some("carol"));
        assert_eq!(of("idle").owner, None);
        // `r`: recorded as bob's, carried by alice's job: alice.
        assert_eq!(of("r").charged.as_deref(), Some("alice"));
        assert_eq!(of("r").owner.as_deref(), Some("alice"));
        // The charged user's groups on the host go with each action.
        assert_eq!(of("n").groups, ["alice", "lab"]);
        assert!(of("idle").groups.is_empty(), "carol: no groups said");
        let terminate = &plan.hosts[0].1.terminate;
        assert!(!terminate.is_empty());
        for t in terminate {
            let want: &[&str] = match t.user.as_deref() {
                Some("alice") => &["alice", "lab"],
                _ => &[],
            };
            assert_eq!(t.groups, want, "{t:?}");
        }
    }
}
