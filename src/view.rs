//! What the enforcer sees after a cycle, for `status` and `top`: each
//! host, its GPUs and the jobs on them, each user's GPUs and memory
//! against their caps, what waits and what was done, each with the rule
//! that asks for it and why. Pure: built from a cycle's report and its
//! snapshots; nothing a user wrote is in it beyond ids and names, bounded
//! where they are parsed, and no environ. [`crate::view_json`] writes it
//! once a cycle, each unchanged host's part kept from the cycle before.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::assess::HostStatus;
use crate::ladder::Waiting;
use crate::model::{
    comma_list, Cluster, GpuIndex, HashMap, HostId, HostSnapshot, Mode, Pid, Process, SMALL,
};
use crate::outcome::{DetachResult, Outcome, TerminateResult};
use crate::report::{violation_line, CycleReport};
use crate::rules::max_devices::HostUsage;
use crate::rules::{Action, Policy, Violation};

/// The view's schema version (`status --output json`'s `schema`).
pub const SCHEMA: u32 = 2;

/// How many done actions a running service keeps in [`View::recent`].
pub const RECENT: usize = 200;

/// The most environments a host's view lists, and a GPU's: genv's state
/// files are anyone's to write, and a record's flood must not swell the
/// view (those left out are counted).
pub const MAX_ENVS: usize = 256;
pub const MAX_GPU_ENVS: usize = 32;
/// The most users a host counts in the view (a record names anyone).
pub const MAX_USERS: usize = 256;
/// The most actions of a host the view lists as waiting, and as done
/// this cycle (a flood of records can make thousands).
pub const MAX_HOST_ACTIONS: usize = 256;
/// The most GPUs a host's view shows that only genv's records name (no
/// job on it, no utilization: anyone can write an index), and the most
/// an environment's view lists.
pub const MAX_GPUS: usize = 64;

/// One cycle's view of the fleet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct View {
    pub schema: u32,
    pub cycle: u64,
    /// When the cycle ran (ms since the Unix epoch; none for a replay).
    pub at_ms: Option<u64>,
    /// Nothing was carried out (`--dry-run`, a replay, a follower).
    pub dry_run: bool,
    /// Every host, in the inventory's order (empty in a delta).
    pub hosts: Vec<HostView>,
    pub users: Vec<UserView>,
    /// Users past [`MAX_USERS`] on a host whose counts there are left out
    /// (summed over hosts): the users' counts are partial.
    #[serde(default, skip_serializing_if = "crate::model::is_zero")]
    pub counted_left_out: u32,
    /// Each capped group (`--max-devices-per-group`): its members' GPUs
    /// against its cap.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<GroupView>,
    /// Actions that wait: for their deadline, for more sightings, or for
    /// ever (warned only, exempt).
    pub waiting: Vec<ActionView>,
    /// What this cycle did (or, in a dry run, would do).
    pub actions: Vec<ActionView>,
    /// Waiting actions past [`MAX_HOST_ACTIONS`] of a host, and done ones.
    #[serde(default, skip_serializing_if = "crate::model::is_zero")]
    pub waiting_left_out: u32,
    #[serde(default, skip_serializing_if = "crate::model::is_zero")]
    pub actions_left_out: u32,
    /// What the service carried out (or tried) in its last cycles, newest
    /// first, at most [`RECENT`]; not what a dry run would do (re-planned
    /// each cycle, it is in `actions`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recent: Vec<DoneView>,
    /// Each notification channel's messages waiting to go, held back by
    /// the rate limits and dropped.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notifications: Vec<ChannelView>,
    /// A delta (on the socket, for a reader that asked for them): the
    /// cycle whose view it changes; `hosts` is then empty and `changed`
    /// holds the hosts that changed, by position, the rest whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta_of: Option<u64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub changed: Vec<(usize, HostView)>,
}

impl View {
    /// That the users' counts are partial, in words, where they are.
    pub fn counted_left_out_said(&self) -> Option<String> {
        (self.counted_left_out > 0).then(|| {
            format!(
                "(counts partial: {} user(s) left out over {MAX_USERS} a host)",
                self.counted_left_out
            )
        })
    }

    /// `delta` applied to this view, the one it changes.
    ///
    /// # Errors
    /// It changes another cycle's view, or a host this view lacks.
    pub fn apply(&mut self, delta: View) -> Result<(), String> {
        if delta.delta_of != Some(self.cycle) {
            return Err(format!(
                "a delta of cycle {:?} for the view of cycle {}",
                delta.delta_of, self.cycle
            ));
        }
        let mut hosts = std::mem::take(&mut self.hosts);
        for (i, h) in delta.changed {
            let n = hosts.len();
            let slot = hosts
                .get_mut(i)
                .ok_or_else(|| format!("a delta for host {i} of {n}"))?;
            *slot = h;
        }
        *self = View {
            hosts,
            delta_of: None,
            changed: Vec::new(),
            ..delta
        };
        Ok(())
    }
}

/// Whether a host answered, and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum HostState {
    Ok,
    /// It answered, but its genv state could not be used.
    Degraded,
    Failed,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct HostView {
    pub host: String,
    pub state: HostState,
    /// Why it is degraded or failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
    pub gpus: Vec<GpuView>,
    /// Its environments attached to a GPU or with a job on one, in
    /// genv's order, at most [`MAX_ENVS`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub envs: Vec<EnvView>,
    /// Those past [`MAX_ENVS`].
    #[serde(default, skip_serializing_if = "crate::model::is_zero")]
    pub envs_left_out: u32,
    /// The GPUs past [`MAX_GPUS`] that only genv's records name.
    #[serde(default, skip_serializing_if = "crate::model::is_zero")]
    pub gpus_left_out: u32,
}

/// A genv environment, as its record says: any user can write one, so
/// its user is the record's claim, not the kernel's word (the jobs'
/// users are).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct EnvView {
    pub env: String,
    /// The user its record names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// The GPUs it is attached to, at most [`MAX_GPUS`].
    pub devices: Vec<u32>,
    /// Those past [`MAX_GPUS`].
    #[serde(default, skip_serializing_if = "crate::model::is_zero")]
    pub devices_left_out: u32,
    /// The GPU memory it sets aside on each (`genv config gpu-memory`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_memory: Option<String>,
    /// Its jobs on the GPUs: the processes that carry its id.
    pub pids: Vec<u32>,
}

impl HostView {
    /// Its GPUs past [`MAX_GPUS`], in words.
    pub fn gpus_more(&self) -> Option<String> {
        (self.gpus_left_out > 0).then(|| {
            format!(
                "and {} GPU(s) more that only genv's records name",
                self.gpus_left_out
            )
        })
    }

    /// Its environments past [`MAX_ENVS`], in words.
    pub fn envs_more(&self) -> Option<String> {
        (self.envs_left_out > 0).then(|| format!("and {} environment(s) more", self.envs_left_out))
    }
}

impl GpuView {
    /// Its environments' ids, `a, b`: an id that could read as more than
    /// one, or as none (anyone picks an id: `x, alice-train`), quoted.
    pub fn envs_listed(&self) -> String {
        let one = |id: &String| {
            let odd = id.is_empty() || id.contains([',', '"']) || id.contains(char::is_whitespace);
            if odd {
                format!("{id:?}")
            } else {
                id.clone()
            }
        };
        self.envs.iter().map(one).collect::<Vec<_>>().join(", ")
    }

    /// Its environments past [`MAX_GPU_ENVS`], in words (` and N more`).
    pub fn envs_more(&self) -> String {
        match self.envs_left_out {
            0 => String::new(),
            n => format!(" and {n} more"),
        }
    }
}

impl EnvView {
    /// It in words: whose its record says it is, where it is attached,
    /// its memory, its jobs.
    pub fn words(&self) -> String {
        let attached = if self.devices.is_empty() {
            "attached to no GPU".to_string()
        } else {
            format!(
                "attached to GPU(s) {}{}",
                comma_list(&self.devices),
                match self.devices_left_out {
                    0 => String::new(),
                    n => format!(" and {n} more"),
                }
            )
        };
        format!(
            "{}, {attached}{}, {} job(s){}",
            self.user.as_deref().map_or_else(
                || "its record names no user".to_string(),
                |u| format!("its record names {u}")
            ),
            self.gpu_memory
                .as_deref()
                .map(|m| format!(", {m} set aside on each"))
                .unwrap_or_default(),
            self.pids.len(),
            if self.pids.is_empty() {
                String::new()
            } else {
                format!(" (pid {})", comma_list(&self.pids))
            }
        )
    }
}

/// A GPU at a glance, the most pressing last: nothing on it, an
/// environment holds it and works, an environment holds it idle, a job
/// outside its environments runs on it, a rule finds against it, an
/// action waits on it.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum GpuState {
    Free,
    InEnv,
    /// Environments are attached and none of the jobs runs on it (an
    /// attachment held idle), or its jobs did no work when last sampled
    /// (utilization 0%, where asked: `--idle-after`).
    Idle,
    Stray,
    Violating,
    Waiting,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct GpuView {
    pub index: u32,
    pub state: GpuState,
    /// The environments attached to it (as `devices.json` says), at most
    /// [`MAX_GPU_ENVS`].
    pub envs: Vec<String>,
    /// Those past [`MAX_GPU_ENVS`].
    #[serde(default, skip_serializing_if = "crate::model::is_zero")]
    pub envs_left_out: u32,
    pub processes: Vec<ProcessView>,
    /// GPU memory its jobs hold (bytes), as nvidia-smi tells.
    #[serde(default)]
    pub memory_bytes: u64,
    /// How busy it was (percent), where asked (`--idle-after`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub utilization_percent: Option<u32>,
}

/// A capped group over the fleet: its members (as the hosts name them)
/// and the GPUs counted toward their caps (where a device cap counts
/// them, else those their jobs run on), against its cap.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct GroupView {
    pub group: String,
    pub devices: u32,
    pub device_cap: u32,
    pub users: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ProcessView {
    pub pid: u32,
    /// Its owner, as the kernel says (in a recording, as its
    /// environment's record says).
    pub user: Option<String>,
    /// The environment it carries.
    pub env: Option<String>,
    /// GPU memory it holds here (bytes), where nvidia-smi could tell.
    pub memory_bytes: Option<u64>,
}

/// One user over the fleet: the GPUs their jobs run on, the memory those
/// hold, what their device caps count, and their caps.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct UserView {
    pub user: String,
    /// The GPUs their jobs run on.
    pub devices: u32,
    pub memory_bytes: u64,
    pub processes: u32,
    /// The GPUs their device caps count (per user and per group), each
    /// once: where an environment of theirs is attached or a job of
    /// theirs runs; none where no device cap is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counted: Option<u32>,
    /// Of those, the ones none of their jobs runs on (attachments held
    /// idle).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counted_idle: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_cap: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_cap: Option<u64>,
}

impl UserView {
    /// What their device cap is held against: its count where one is
    /// kept, else the GPUs their jobs run on.
    pub fn cap_count(&self) -> u32 {
        self.counted.unwrap_or(self.devices)
    }
}

/// What an action is on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Target {
    Terminate { pid: u32 },
    Detach { device: u32, env: String },
}

impl Target {
    /// What the action does, in words (`terminate pid 42`), the
    /// environment's id escaped.
    pub fn words(&self) -> String {
        match self {
            Target::Terminate { pid } => format!("terminate pid {pid}"),
            Target::Detach { device, env } => {
                format!("detach {} from gpu {device}", crate::report::clean(env))
            }
        }
    }
}

/// An action, waiting or done, with the rule behind it and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ActionView {
    pub host: String,
    #[serde(flatten)]
    pub target: Target,
    /// Whose it is, as the kernel says: the job's user (for a detach, a
    /// job's that carries the environment there), where one runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// The rules behind it, and the report's line for each.
    pub rules: Vec<String>,
    pub why: Vec<String>,
    /// When it is due (ms since the Unix epoch), if it waits for a time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<u64>,
    /// Warned only: never carried out.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub warn_only: bool,
    /// Why it is exempt, if it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exempt: Option<String>,
    /// Waiting for more sightings: seen so far, and needed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seen: Option<(u32, u32)>,
    /// What came of it (done actions only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
}

/// An action the service carried out (or tried), with its cycle and
/// when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct DoneView {
    pub cycle: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at_ms: Option<u64>,
    pub action: ActionView,
}

/// A notification channel (mail, webhook): what waits to go, and what the
/// rate limits held back and full lines dropped since the service began.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ChannelView {
    pub channel: String,
    /// Messages queued now, not yet delivered.
    pub queued: u64,
    pub held_back: u64,
    pub dropped: u64,
    /// The last messages held back or dropped, newest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub last: Vec<HeldBackView>,
}

/// A message not sent: to whom (the owner's user name, or empty), about
/// what, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct HeldBackView {
    pub at_ms: u64,
    pub to: String,
    pub what: String,
    pub why: String,
}

/// What the device caps count on one host: each user's name, the devices
/// counted, and of those the ones none of their jobs runs on; and how many
/// users past [`MAX_USERS`] are left out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counted {
    pub users: Vec<(String, u32, u32)>,
    pub left_out: u32,
}

/// What `usage` (a host's part of the device caps) counts for each user,
/// as the caps count them (a record's user among them). At most
/// [`MAX_USERS`] users a host: a flood of records in made-up names would
/// swell the view at their writer's will; past that, the names the host's
/// kernel knows (`snap`'s) and those `policy` names come first, then
/// those counting most.
pub fn counted(usage: &HostUsage, snap: Option<&HostSnapshot>, policy: &Policy) -> Counted {
    let n = |c: usize| u32::try_from(c).unwrap_or(u32::MAX);
    let mut all: Vec<(String, u32, u32)> = (usage.users.iter())
        .filter(|(_, held)| !held.devices.is_empty())
        .map(|(user, held)| {
            let idle = held.devices.iter().filter(|d| !d.working).count();
            (user.clone(), n(held.devices.len()), n(idle))
        })
        .collect();
    if all.len() > MAX_USERS {
        let names: std::collections::HashSet<&str> = (snap.and_then(|s| s.truth.as_ref()))
            .map(|t| t.user_names.values().map(AsRef::as_ref).collect())
            .unwrap_or_default();
        all.sort_by(|a, b| {
            let unknown = |u: &str| {
                !(names.contains(u)
                    || policy.max_devices_for_user.contains_key(u)
                    || policy.max_memory_for_user.contains_key(u))
            };
            (unknown(&a.0), std::cmp::Reverse(a.1), &a.0).cmp(&(
                unknown(&b.0),
                std::cmp::Reverse(b.1),
                &b.0,
            ))
        });
        let left_out = n(all.len() - MAX_USERS);
        all.truncate(MAX_USERS);
        all.sort_by(|a, b| a.0.cmp(&b.0));
        return Counted {
            users: all,
            left_out,
        };
    }
    Counted {
        users: all,
        left_out: 0,
    }
}

/// The view of `report`'s cycle over `cluster`, under `policy`'s caps,
/// with what the device caps counted on each host (`counted`, none where
/// no device cap is set).
pub fn of(
    report: &CycleReport,
    cluster: &Cluster,
    counted: &[(HostId, Counted)],
    policy: &Policy,
    at_ms: Option<u64>,
) -> View {
    let by_host = snapshots(cluster);
    let why = Why::of(report.mode, &report.violations, &by_host);
    let pressed = pressed(&report.violations, &report.waiting);
    let mut parts = Vec::with_capacity(report.hosts.len());
    let hosts = (report.hosts.iter())
        .map(|status| {
            let snap = by_host.get(&status.host).copied();
            let on = pressed.get(&status.host).map_or(&[][..], Vec::as_slice);
            parts.push(snap.map(host_users).unwrap_or_default());
            host_view(status, snap, on)
        })
        .collect();
    let users = users(parts.iter().map(Vec::as_slice), counted, policy);
    let (waiting, waiting_left_out) = per_host(&report.waiting, Waiting::host);
    let (outcomes, actions_left_out) = per_host(&report.outcomes, Outcome::host);
    View {
        schema: SCHEMA,
        cycle: report.cycle,
        at_ms,
        dry_run: report.dry_run,
        hosts,
        groups: groups(cluster.hosts.iter().map(|(_, s)| s), &users, policy),
        users,
        counted_left_out: counted_left_out(counted),
        waiting: waiting.into_iter().map(|w| why.waiting(w)).collect(),
        actions: outcomes.into_iter().map(|o| why.done(o)).collect(),
        waiting_left_out,
        actions_left_out,
        recent: Vec::new(),
        notifications: Vec::new(),
        delta_of: None,
        changed: Vec::new(),
    }
}

/// The users left out of `counted`, over every host.
pub(crate) fn counted_left_out(counted: &[(HostId, Counted)]) -> u32 {
    (counted.iter()).fold(0, |sum, (_, c)| sum.saturating_add(c.left_out))
}

/// Of `items`, at most [`MAX_HOST_ACTIONS`] a host, and how many more.
pub(crate) fn per_host<T>(items: &[T], host: fn(&T) -> &HostId) -> (Vec<&T>, u32) {
    let mut on: HashMap<&HostId, usize> = HashMap::default();
    let mut left_out = 0u32;
    let mut kept = Vec::with_capacity(items.len().min(MAX_HOST_ACTIONS));
    for item in items {
        let n = on.entry(host(item)).or_default();
        if *n == MAX_HOST_ACTIONS {
            left_out = left_out.saturating_add(1);
        } else {
            *n += 1;
            kept.push(item);
        }
    }
    (kept, left_out)
}

/// Each host's snapshot by id, found once (a scan per host is quadratic
/// over a large fleet).
pub(crate) fn snapshots(cluster: &Cluster) -> HashMap<&HostId, &HostSnapshot> {
    let mut by_host = HashMap::with_capacity_and_hasher(cluster.hosts.len(), Default::default());
    for (h, s) in &cluster.hosts {
        by_host.entry(h).or_insert(s);
    }
    by_host
}

/// A host as the view shows it: how it answered, and its GPUs (none if
/// it gave no snapshot), each marked by what presses `on` it.
pub(crate) fn host_view(
    status: &HostStatus,
    snap: Option<&HostSnapshot>,
    on: &[Press],
) -> HostView {
    let (state, why) = host_state(status);
    let (envs, envs_left_out) = snap.map_or_else(Default::default, envs);
    let (gpus, gpus_left_out) = snap.map_or_else(Default::default, |s| gpus(s, on));
    HostView {
        host: status.host.to_string(),
        state,
        why,
        gpus,
        envs,
        envs_left_out,
        gpus_left_out,
    }
}

/// A host's environments attached to a GPU or with a job on one, at most
/// [`MAX_ENVS`], and how many more.
fn envs(snap: &HostSnapshot) -> (Vec<EnvView>, u32) {
    let mut devices: HashMap<&crate::model::EnvId, Vec<u32>> = HashMap::default();
    for d in snap.devices.iter() {
        for a in &d.attachments {
            devices.entry(&a.eid).or_default().push(d.index.0);
        }
    }
    let mut pids: HashMap<&crate::model::EnvId, Vec<u32>> = HashMap::default();
    for p in &snap.processes {
        if let Some(e) = p.owner.eid() {
            pids.entry(e).or_default().push(p.pid.0);
        }
    }
    let mut all = Vec::new();
    for e in snap.envs.iter() {
        let (on, jobs) = (devices.remove(&e.eid), pids.remove(&e.eid));
        if on.is_some() || jobs.is_some() {
            all.push((e, on.unwrap_or_default(), jobs.unwrap_or_default()));
        }
    }
    // Past the bound, those with jobs first: a flood of records written
    // ahead of them pushes out only records.
    let working = all.iter().filter(|(.., jobs)| !jobs.is_empty()).count();
    let mut room = (working.min(MAX_ENVS), MAX_ENVS.saturating_sub(working));
    let (total, mut shown) = (all.len(), Vec::new());
    for (e, mut on, pids) in all {
        let room = if pids.is_empty() {
            &mut room.1
        } else {
            &mut room.0
        };
        if *room == 0 {
            continue;
        }
        *room -= 1;
        let devices_left_out = on.len().saturating_sub(MAX_GPUS);
        on.truncate(MAX_GPUS);
        shown.push(EnvView {
            env: e.eid.to_string(),
            user: e.username.clone(),
            devices: on,
            devices_left_out: u32::try_from(devices_left_out).unwrap_or(u32::MAX),
            gpu_memory: e.gpu_memory.as_ref().map(|m| m.text.clone()),
            pids,
        });
    }
    let left_out = u32::try_from(total - shown.len()).unwrap_or(u32::MAX);
    (shown, left_out)
}

/// How a host answered, and why not well.
pub(crate) fn host_state(status: &HostStatus) -> (HostState, Option<String>) {
    match (&status.error, &status.degraded) {
        (Some(e), _) => (HostState::Failed, Some(e.to_string())),
        (None, Some(d)) => (HostState::Degraded, Some(d.clone())),
        (None, None) => (HostState::Ok, None),
    }
}

/// The capped groups: their members as the hosts say, and the GPUs
/// counted toward each member's caps.
pub(crate) fn groups<'s>(
    snaps: impl Iterator<Item = &'s HostSnapshot>,
    users: &[UserView],
    policy: &Policy,
) -> Vec<GroupView> {
    if policy.max_devices_per_group.is_empty() {
        return Vec::new();
    }
    let mut members: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for snap in snaps {
        for (user, groups) in crate::rules::max_groups::said(snap) {
            let capped = groups
                .into_iter()
                .filter(|g| policy.max_devices_per_group.contains_key(*g));
            for g in capped {
                members.entry(g).or_default().insert(user);
            }
        }
    }
    let devices: std::collections::HashMap<&str, u32> = (users.iter())
        .map(|u| (u.user.as_str(), u.cap_count()))
        .collect();
    let devices_of = |u: &str| devices.get(u).copied().unwrap_or(0);
    (policy.max_devices_per_group.iter())
        .map(|(group, cap)| {
            let users = members.get(group.as_str()).cloned().unwrap_or_default();
            GroupView {
                group: group.clone(),
                devices: users.iter().map(|u| devices_of(u)).sum(),
                device_cap: *cap,
                users: users.into_iter().map(String::from).collect(),
            }
        })
        .collect()
}

/// What presses on a host's GPUs: a finding or a wait, on a job or a
/// device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Press {
    ViolatingPid(u32),
    ViolatingGpu(u32),
    WaitingPid(u32),
    WaitingGpu(u32),
}

/// What the cycle's findings and waits press on, by host, each host's
/// sorted and once.
pub(crate) fn pressed<'r>(
    violations: &'r [Violation],
    waiting: &'r [Waiting],
) -> HashMap<&'r HostId, Vec<Press>> {
    let mut by: HashMap<&HostId, Vec<Press>> = HashMap::default();
    for a in violations.iter().flat_map(|v| &v.actions) {
        let (host, p) = match a {
            Action::Terminate { host, pid } => (host, Press::ViolatingPid(pid.0)),
            Action::Detach { host, device, .. } => (host, Press::ViolatingGpu(device.0)),
        };
        by.entry(host).or_default().push(p);
    }
    for w in waiting {
        let (host, p) = match w {
            Waiting::Terminate { host, pid, .. } => (host, Press::WaitingPid(pid.0)),
            Waiting::Detach { host, device, .. } => (host, Press::WaitingGpu(device.0)),
        };
        by.entry(host).or_default().push(p);
    }
    for v in by.values_mut() {
        v.sort_unstable();
        v.dedup();
    }
    by
}

/// Each GPU of a host, by index: those `devices.json` lists and those a
/// job runs on, each marked by what presses `on` it.
fn gpus(snap: &HostSnapshot, on: &[Press]) -> (Vec<GpuView>, u32) {
    fn gpu(by_index: &mut BTreeMap<u32, GpuView>, index: GpuIndex) -> &mut GpuView {
        by_index.entry(index.0).or_insert_with(|| GpuView {
            index: index.0,
            state: GpuState::Free,
            envs: Vec::new(),
            envs_left_out: 0,
            processes: Vec::new(),
            memory_bytes: 0,
            utilization_percent: None,
        })
    }
    // nvidia-smi's GPUs first: those with jobs, those it sampled.
    let mut by_index: BTreeMap<u32, GpuView> = BTreeMap::new();
    for p in &snap.processes {
        for u in &p.gpus {
            let g = gpu(&mut by_index, u.index);
            g.memory_bytes = g.memory_bytes.saturating_add(u.usage.bytes().unwrap_or(0));
            g.processes.push(ProcessView {
                pid: p.pid.0,
                user: user_of(snap, p).map(str::to_string),
                env: p.owner.eid().map(|e| e.to_string()),
                memory_bytes: u.usage.bytes(),
            });
        }
    }
    if let Some(u) = &snap.utilization {
        for (index, percent) in &u.gpus {
            gpu(&mut by_index, *index).utilization_percent = Some(*percent);
        }
    }
    // Then those genv's records name, any index anyone wrote: bounded.
    let (mut named_only, mut left_out) = (0usize, 0u32);
    let mut attached: BTreeMap<u32, Vec<&str>> = BTreeMap::new();
    for d in snap.devices.iter() {
        if !by_index.contains_key(&d.index.0) {
            if named_only == MAX_GPUS {
                left_out = left_out.saturating_add(1);
                continue;
            }
            named_only += 1;
            gpu(&mut by_index, d.index);
        }
        (attached.entry(d.index.0).or_default())
            .extend(d.attachments.iter().map(|a| a.eid.0.as_ref()));
    }
    let pressed = |p: Press| on.binary_search(&p).is_ok();
    for g in by_index.values_mut() {
        let mut envs = attached.remove(&g.index).unwrap_or_default();
        let on_it = |press: fn(u32) -> Press| g.processes.iter().any(|p| pressed(press(p.pid)));
        // Linear in what is attached, however many that is.
        let all: std::collections::HashSet<&str> = envs.iter().copied().collect();
        let stray = (g.processes.iter()).any(|p| p.env.as_deref().is_none_or(|e| !all.contains(e)));
        let idle = if g.processes.is_empty() {
            !envs.is_empty()
        } else {
            g.utilization_percent == Some(0)
        };
        g.state = if on_it(Press::WaitingPid) || pressed(Press::WaitingGpu(g.index)) {
            GpuState::Waiting
        } else if on_it(Press::ViolatingPid) || pressed(Press::ViolatingGpu(g.index)) {
            GpuState::Violating
        } else if stray {
            GpuState::Stray
        } else if idle {
            GpuState::Idle
        } else if g.processes.is_empty() {
            // Attached it would be idle: nothing on it.
            GpuState::Free
        } else {
            GpuState::InEnv
        };
        if envs.len() > MAX_GPU_ENVS {
            // Past the bound, those its jobs carry first: a flood of
            // records ahead of them pushes out only records.
            let carried: std::collections::HashSet<&str> = g
                .processes
                .iter()
                .filter_map(|p| p.env.as_deref())
                .collect();
            envs.sort_by_key(|e| !carried.contains(e));
            g.envs_left_out = u32::try_from(envs.len() - MAX_GPU_ENVS).unwrap_or(u32::MAX);
            envs.truncate(MAX_GPU_ENVS);
        }
        g.envs = envs.into_iter().map(str::to_string).collect();
    }
    (by_index.into_values().collect(), left_out)
}

/// Whose a process is: as the kernel says, or in a recording (which has
/// no kernel's word) as its environment's record says.
fn user_of<'s>(snap: &'s HostSnapshot, p: &'s Process) -> Option<&'s str> {
    match (&p.user, &snap.truth) {
        (Some(user), _) => Some(user),
        (None, Some(_)) => None,
        (None, None) => snap.env(p.owner.eid()?)?.username.as_deref(),
    }
}

/// What one user's jobs use on one host: the GPUs they run on, the memory
/// they hold, how many there are.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Use {
    pub devices: u32,
    pub memory: u64,
    pub processes: u32,
}

/// Each user's jobs on one host, by name.
pub(crate) fn host_users(snap: &HostSnapshot) -> Vec<(Arc<str>, Use)> {
    let mut by_user: BTreeMap<&str, (BTreeSet<GpuIndex>, u64, u32)> = BTreeMap::new();
    for p in &snap.processes {
        let Some(user) = user_of(snap, p) else {
            continue;
        };
        let (devices, memory, processes) = by_user.entry(user).or_default();
        *processes += 1;
        for u in &p.gpus {
            devices.insert(u.index);
            *memory = memory.saturating_add(u.usage.bytes().unwrap_or(0));
        }
    }
    (by_user.into_iter())
        .map(|(user, (devices, memory, processes))| {
            let u = Use {
                devices: u32::try_from(devices.len()).unwrap_or(u32::MAX),
                memory,
                processes,
            };
            (Arc::from(user), u)
        })
        .collect()
}

/// Each user whose jobs run on a GPU or whom a device cap counts, over
/// every host (each host's part of their jobs in `parts`), with their
/// caps.
pub(crate) fn users<'p>(
    parts: impl Iterator<Item = &'p [(Arc<str>, Use)]>,
    counted: &[(HostId, Counted)],
    policy: &Policy,
) -> Vec<UserView> {
    /// A user's jobs' use, and what their caps count (and of it, idle).
    type Sum = (Use, Option<(u32, u32)>);
    let mut by_user: HashMap<&str, Sum> = HashMap::default();
    for (user, u) in parts.flatten() {
        let (sum, _) = by_user.entry(user).or_default();
        sum.devices = sum.devices.saturating_add(u.devices);
        sum.memory = sum.memory.saturating_add(u.memory);
        sum.processes = sum.processes.saturating_add(u.processes);
    }
    for (user, n, idle) in counted.iter().flat_map(|(_, c)| &c.users) {
        let (_, held) = by_user.entry(user).or_default();
        let (sum, sum_idle) = held.get_or_insert((0, 0));
        *sum = sum.saturating_add(*n);
        *sum_idle = sum_idle.saturating_add(*idle);
    }
    let keeps = policy.has_caps() || !policy.max_devices_per_group.is_empty();
    let mut users: Vec<UserView> = (by_user.into_iter())
        .map(|(user, (u, held))| {
            let held = held.or(keeps.then_some((0, 0)));
            UserView {
                user: user.to_string(),
                devices: u.devices,
                memory_bytes: u.memory,
                processes: u.processes,
                counted: held.map(|h| h.0),
                counted_idle: held.map(|h| h.1),
                device_cap: (policy.max_devices_for_user.get(user).copied())
                    .or(policy.max_devices_per_user),
                memory_cap: (policy.max_memory_for_user.get(user).copied())
                    .or(policy.max_memory_per_user),
            }
        })
        .collect();
    users.sort_unstable_by(|a, b| a.user.cmp(&b.user));
    users
}

/// Which violations ask for each action, and the report's line for each;
/// the hosts' snapshots, for whose each action is.
pub(crate) struct Why<'s> {
    snaps: &'s HashMap<&'s HostId, &'s HostSnapshot>,
    terminate: BTreeMap<(HostId, Pid), Vec<(String, String)>>,
    detach: BTreeMap<(HostId, GpuIndex, String), Vec<(String, String)>>,
    /// Each host's owners looked up so far, and past [`SMALL`] lookups
    /// its index: a scan of its jobs for each of thousands of actions
    /// would be quadratic, an index for a few costs more than scans.
    owners: std::cell::RefCell<HashMap<&'s HostId, (usize, Option<Owners<'s>>)>>,
}

/// Whose a host's jobs are, and its environments' (where one user's).
#[derive(Default)]
struct Owners<'s> {
    jobs: HashMap<Pid, Option<&'s str>>,
    /// The one user of every job that carries the id; `None` where they
    /// are several or one is unknown.
    envs: HashMap<&'s str, Option<&'s str>>,
}

impl<'s> Owners<'s> {
    fn of(snap: &'s HostSnapshot) -> Self {
        let mut owners = Owners::default();
        for p in &snap.processes {
            let user = user_of(snap, p);
            owners.jobs.entry(p.pid).or_insert(user);
            if let Some(e) = p.owner.eid() {
                let one = owners.envs.entry(e.0.as_ref()).or_insert(user);
                if *one != user {
                    *one = None;
                }
            }
        }
        owners
    }
}

impl<'s> Why<'s> {
    pub(crate) fn of(
        mode: Mode,
        violations: &[Violation],
        snaps: &'s HashMap<&'s HostId, &'s HostSnapshot>,
    ) -> Self {
        let mut why = Why {
            snaps,
            terminate: BTreeMap::new(),
            detach: BTreeMap::new(),
            owners: Default::default(),
        };
        for v in violations {
            let said = (v.rule.name().to_string(), violation_line(mode, v));
            for a in &v.actions {
                match a {
                    Action::Terminate { host, pid } => {
                        why.terminate
                            .entry((host.clone(), *pid))
                            .or_default()
                            .push(said.clone());
                    }
                    Action::Detach {
                        host,
                        device,
                        eids,
                        pids,
                        ..
                    } => {
                        // Its member processes there end with it.
                        for pid in pids {
                            let said = said.clone();
                            why.terminate
                                .entry((host.clone(), *pid))
                                .or_default()
                                .push(said);
                        }
                        for eid in eids {
                            let key = (host.clone(), *device, eid.to_string());
                            why.detach.entry(key).or_default().push(said.clone());
                        }
                    }
                }
            }
        }
        why
    }

    fn action(&self, host: &HostId, target: Target) -> ActionView {
        let said = match &target {
            Target::Terminate { pid } => self.terminate.get(&(host.clone(), Pid(*pid))),
            Target::Detach { device, env } => {
                self.detach
                    .get(&(host.clone(), GpuIndex(*device), env.clone()))
            }
        };
        let (rules, why) = said.into_iter().flatten().cloned().unzip();
        ActionView {
            host: host.to_string(),
            owner: self.owner(host, &target),
            target,
            rules,
            why,
            deadline_ms: None,
            warn_only: false,
            exempt: None,
            seen: None,
            result: None,
        }
    }

    /// The kernel's user of the job `target` is on, where one runs on
    /// `host`; a detach's: the user of every job that carries its
    /// environment there, where they are one (anyone can carry any id).
    fn owner(&self, host: &HostId, target: &Target) -> Option<String> {
        let (host, snap) = self.snaps.get_key_value(host)?;
        let mut owners = self.owners.borrow_mut();
        let (asked, index) = owners.entry(host).or_default();
        *asked += 1;
        if index.is_none() && *asked > SMALL {
            *index = Some(Owners::of(snap));
        }
        let user = match (index, target) {
            (Some(o), Target::Terminate { pid }) => o.jobs.get(&Pid(*pid)).copied().flatten(),
            (Some(o), Target::Detach { env, .. }) => o.envs.get(env.as_str()).copied().flatten(),
            (None, Target::Terminate { pid }) => user_of(snap, snap.process(Pid(*pid))?),
            (None, Target::Detach { env, .. }) => {
                let mut carriers = (snap.processes.iter())
                    .filter(|p| p.owner.eid().is_some_and(|e| e.0.as_ref() == env))
                    .map(|p| user_of(snap, p));
                let first = carriers.next()??;
                carriers.all(|u| u == Some(first)).then_some(first)
            }
        };
        user.map(str::to_string)
    }

    pub(crate) fn waiting(&self, w: &Waiting) -> ActionView {
        match w {
            Waiting::Terminate {
                host,
                pid,
                seen,
                needed,
                deadline_ms,
                warn_only,
                exempt,
            } => ActionView {
                deadline_ms: *deadline_ms,
                warn_only: *warn_only,
                exempt: exempt.clone(),
                seen: (seen < needed).then_some((*seen, *needed)),
                ..self.action(host, Target::Terminate { pid: pid.0 })
            },
            Waiting::Detach {
                host,
                device,
                eid,
                seen,
                needed,
                deadline_ms,
                warn_only,
                exempt,
            } => ActionView {
                deadline_ms: *deadline_ms,
                warn_only: *warn_only,
                exempt: exempt.clone(),
                seen: (seen < needed).then_some((*seen, *needed)),
                ..self.action(
                    host,
                    Target::Detach {
                        device: device.0,
                        env: eid.to_string(),
                    },
                )
            },
        }
    }

    pub(crate) fn done(&self, o: &Outcome) -> ActionView {
        let (host, target, result) = match o {
            Outcome::Terminate { host, pid, outcome } | Outcome::Kill { host, pid, outcome } => {
                (host, Target::Terminate { pid: pid.0 }, terminated(outcome))
            }
            Outcome::Detach {
                host,
                device,
                eid,
                outcome,
            } => {
                let target = Target::Detach {
                    device: device.0,
                    env: eid.to_string(),
                };
                (host, target, detached(outcome))
            }
        };
        ActionView {
            result: Some(result),
            ..self.action(host, target)
        }
    }
}

fn terminated(t: &TerminateResult) -> String {
    match t {
        TerminateResult::Signalled => "signalled".into(),
        TerminateResult::DryRun => "dry run".into(),
        TerminateResult::AlreadyGone => "already gone".into(),
        TerminateResult::PidReused { .. } => "pid reused: left alone".into(),
        TerminateResult::NoIdentity => "no start time: left alone".into(),
        TerminateResult::PermissionDenied => "permission denied".into(),
        TerminateResult::Failed { error } => format!("failed: {error}"),
    }
}

fn detached(d: &DetachResult) -> String {
    match d {
        DetachResult::Detached => "detached".into(),
        DetachResult::DryRun => "dry run".into(),
        DetachResult::NotAttached => "not attached".into(),
        DetachResult::Failed { error } => format!("failed: {error}"),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::assess::assess;
    use crate::snapshot::genv;

    /// The recorded fleet's view (for `top`'s tests).
    pub(crate) fn recorded_view() -> View {
        let (report, cluster, policy) = recorded();
        of(
            &report,
            &cluster,
            &counted_on(&cluster, &policy),
            &policy,
            None,
        )
    }

    /// What the device caps count on each host of `cluster`.
    pub(crate) fn counted_on(cluster: &Cluster, policy: &Policy) -> Vec<(HostId, Counted)> {
        (cluster.hosts.iter())
            .map(|(h, s)| {
                let f = crate::rules::assess_host(h, s, policy, &Default::default());
                (h.clone(), counted(&f.usage, Some(s), policy))
            })
            .collect()
    }

    /// `recorded()`'s gpu2 failed, `why`, gone from the cluster.
    pub(crate) fn gpu2_failed(report: &mut CycleReport, cluster: &mut Cluster, why: &str) {
        report.hosts[1].error = Some(crate::model::HostFailure::new(
            crate::model::FailureKind::Timeout,
            why,
        ));
        cluster.hosts.retain(|(h, _)| h.0.as_ref() != "gpu2");
    }

    /// The recorded 3-host fleet under the README's main job
    /// (non-env-processes, 2 devices a user), and its report.
    pub(crate) fn recorded() -> (CycleReport, Cluster, Policy) {
        let hosts = [
            ("gpu1", include_str!("../fixtures/snapshots/gpu1.json")),
            ("gpu2", include_str!("../fixtures/snapshots/gpu2.json")),
            ("gpu3", include_str!("../fixtures/snapshots/gpu3.json")),
        ];
        let policy = Policy {
            non_env_processes: true,
            max_devices_per_user: Some(2),
            ..Policy::default()
        };
        let snaps = (hosts.iter())
            .map(|(h, text)| {
                (
                    HostId((*h).into()),
                    Ok(genv::parse_snapshot(text, h).unwrap()),
                )
            })
            .collect();
        let a = assess(1, Mode::Remote, true, &policy, snaps);
        let cluster = a.cluster.clone();
        let outcomes = crate::outcome::dry_run(&a.plan);
        (CycleReport::new(a, outcomes, None), cluster, policy)
    }

    /// A capped group: its members as the hosts say, their GPUs summed,
    /// against its cap; a group without a cap is not in the view.
    #[test]
    fn each_capped_group_counts_its_members_gpus() {
        let (report, mut cluster, mut policy) = recorded();
        policy.max_devices_per_group.insert("lab".into(), 3);
        let said = [("alice", "lab"), ("bob", "lab"), ("carol", "other")];
        cluster.hosts[0].1.recorded_groups = (said.iter())
            .map(|(u, g)| (u.to_string(), vec![g.to_string()]))
            .collect();
        let counted = counted_on(&cluster, &policy);
        let view = of(&report, &cluster, &counted, &policy, None);
        let devices = |u: &str| {
            let u = view.users.iter().find(|v| v.user == u).unwrap();
            assert!(u.counted.is_some(), "a group cap counts: {u:?}");
            u.cap_count()
        };
        assert!(devices("alice") > 0);
        assert_eq!(
            view.groups,
            [GroupView {
                group: "lab".into(),
                devices: devices("alice") + devices("bob"),
                device_cap: 3,
                users: vec!["alice".into(), "bob".into()],
            }]
        );
        assert!(of(&report, &cluster, &[], &Policy::default(), None)
            .groups
            .is_empty());
    }

    /// A user's count is their device cap's: attachments held idle
    /// count, each GPU once over the hosts (alice: 4 on 2 hosts, as the
    /// report says), and such a GPU is shown idle.
    #[test]
    fn a_users_count_is_their_caps_with_attachments_held_idle() {
        let view = recorded_view();
        let alice = view.users.iter().find(|u| u.user == "alice").unwrap();
        assert_eq!(alice.counted, Some(4));
        assert_eq!(alice.cap_count(), 4);
        assert_eq!(alice.device_cap, Some(2));
        let idle_held = (view.hosts.iter().flat_map(|h| &h.gpus))
            .filter(|g| g.state == GpuState::Idle)
            .collect::<Vec<_>>();
        assert!(!idle_held.is_empty());
        assert!(idle_held
            .iter()
            .all(|g| !g.envs.is_empty() && g.processes.is_empty()));
        // Her job on gpu3 gone: its three GPUs stay counted, held idle.
        let (report, mut cluster, policy) = recorded();
        let (_, gpu3) = (cluster.hosts.iter_mut())
            .find(|(h, _)| h.0.as_ref() == "gpu3")
            .unwrap();
        gpu3.processes.retain(|p| p.pid != Pid(9120));
        let view = of(
            &report,
            &cluster,
            &counted_on(&cluster, &policy),
            &policy,
            None,
        );
        let alice = view.users.iter().find(|u| u.user == "alice").unwrap();
        assert_eq!((alice.counted, alice.counted_idle), (Some(4), Some(3)));
        // A cap with nothing counted on any host: each user counts none.
        let (report, cluster, policy) = recorded();
        let bare = of(&report, &cluster, &[], &policy, None);
        assert!(
            bare.users.iter().all(|u| u.counted == Some(0)),
            "{:?}",
            bare.users
        );
        // Without a device cap, nothing counts but the jobs' GPUs.
        let (report, cluster, _) = recorded();
        let plain = of(&report, &cluster, &[], &Policy::default(), None);
        assert!(plain.users.iter().all(|u| u.counted.is_none()));
        assert!(plain.users.iter().all(|u| u.cap_count() == u.devices));
    }

    /// What the caps count is in the view, a record's user too (alice's
    /// attachment held idle with no job of hers: the caps count it); but
    /// a flood of made-up names is bounded, the host's own names first.
    #[test]
    fn what_the_caps_count_is_in_the_view_a_flood_of_names_bounded() {
        let held = |index: u32, working: bool| {
            serde_json::json!({"index": index, "eids": ["e"], "pids": [], "working": working,
                               "stray": false, "vouched": false})
        };
        let mut users = serde_json::Map::new();
        users.insert(
            "alice".into(),
            serde_json::json!({"envs": true, "devices": [held(1, false)]}),
        );
        users.insert(
            "carol".into(),
            serde_json::json!({"envs": true, "devices": [held(0, true), held(1, false)]}),
        );
        let usage = |users: &serde_json::Map<String, serde_json::Value>| -> HostUsage {
            serde_json::from_value(serde_json::json!({ "users": users })).unwrap()
        };
        let mut snap = HostSnapshot {
            truth: Some(crate::model::HostTruth::default()),
            ..HostSnapshot::default()
        };
        snap.truth
            .as_mut()
            .unwrap()
            .user_names
            .insert(1000, "carol".into());
        let none = Policy::default();
        assert_eq!(
            counted(&usage(&users), Some(&snap), &none).users,
            [("alice".to_string(), 1, 1), ("carol".to_string(), 2, 1)]
        );
        for k in 0..2 * MAX_USERS {
            let devices: Vec<_> = (0..=(k % 3) as u32).map(|i| held(i, false)).collect();
            users.insert(
                format!("made-up-{k:04}"),
                serde_json::json!({"envs": true, "devices": devices}),
            );
        }
        let counts = counted(&usage(&users), Some(&snap), &none);
        assert_eq!(counts.left_out as usize, 2 + 2 * MAX_USERS - MAX_USERS);
        let shown = counts.users;
        assert_eq!(shown.len(), MAX_USERS);
        assert!(
            shown.iter().any(|(u, ..)| u == "carol"),
            "the host's own name first"
        );
        let threes = (0..2 * MAX_USERS).filter(|k| k % 3 == 2).count();
        assert_eq!(
            shown.iter().filter(|(_, n, _)| *n == 3).count(),
            threes,
            "then the most counted"
        );
        assert!(
            !shown.iter().any(|(u, n, _)| *n == 1 && u != "carol"),
            "{shown:?}"
        );
        assert!(shown.windows(2).all(|w| w[0].0 < w[1].0), "by name");
        // A user the policy names is kept too, kernel-known or not.
        let naming = Policy {
            max_devices_for_user: [("alice".to_string(), 1)].into(),
            ..Policy::default()
        };
        let kept = counted(&usage(&users), Some(&snap), &naming).users;
        assert!(
            kept.iter().any(|(u, ..)| u == "alice"),
            "named by the policy"
        );
        assert!(kept.iter().any(|(u, ..)| u == "carol"));
        // Of another shard's host, no kernel's names: the policy's still.
        let theirs = counted(&usage(&users), None, &naming).users;
        assert!(theirs.iter().any(|(u, ..)| u == "alice"));
    }

    /// A flood of records on one host is bounded in the view (the GPU's
    /// environments, the host's, GPUs only records name, an environment's
    /// GPUs), those left out counted; the environment a job carries,
    /// written last, is shown first, and its job is not a stray.
    #[test]
    fn a_flood_of_records_is_bounded_in_the_view() {
        use crate::model::{Attachment, Device, DeviceUsage, Env, EnvId, Owner, Usage};
        let (n, fake) = (1000, 200u32);
        let eid = |i: usize| EnvId(format!("f{i}").into());
        let envs = (0..n)
            .map(|i| Env {
                eid: eid(i),
                uid: 1001,
                username: Some("bob".into()),
                creation: String::new(),
                name: None,
                gpu_memory: None,
                gpus: None,
                pids: Vec::new(),
                kernel_ids: Vec::new(),
            })
            .collect();
        let attachments = (0..n)
            .map(|i| Attachment {
                eid: eid(i),
                gpu_memory: None,
                time: String::new(),
            })
            .collect();
        let snap = HostSnapshot {
            processes: vec![Process {
                pid: Pid(7),
                owner: Owner::Env(eid(n - 1)),
                gpus: [DeviceUsage {
                    index: GpuIndex(0),
                    usage: Usage::Known(1 << 20),
                }]
                .into_iter()
                .collect(),
                start_time: Some(1),
                uid: Some(1001),
                user: Some("bob".into()),
                sub_uid: None,
            }],
            envs: Arc::new(envs),
            devices: Arc::new(
                std::iter::once(Device {
                    index: GpuIndex(0),
                    total_memory: "80gi".into(),
                    attachments,
                })
                .chain((1..=fake).map(|i| Device {
                    index: GpuIndex(i),
                    total_memory: "80gi".into(),
                    attachments: vec![Attachment {
                        eid: eid(n - 1),
                        gpu_memory: None,
                        time: String::new(),
                    }],
                }))
                .collect(),
            ),
            truth: Some(crate::model::HostTruth::default()),
            ..HostSnapshot::default()
        };
        let status = HostStatus {
            host: HostId("h".into()),
            error: None,
            degraded: None,
            processes: 1,
            envs: n,
            devices: 1,
            recorded: false,
        };
        let h = host_view(&status, Some(&snap), &[]);
        assert_eq!(h.gpus[0].envs.len(), MAX_GPU_ENVS);
        assert_eq!(h.gpus[0].envs_left_out as usize, n - MAX_GPU_ENVS);
        assert_eq!(h.gpus[0].state, GpuState::InEnv);
        assert_eq!(h.envs.len(), MAX_ENVS);
        assert_eq!(h.envs_left_out as usize, n - MAX_ENVS);
        assert_eq!(h.gpus[0].envs[0], "f999", "the carried first");
        let carried = h.envs.iter().find(|e| e.env == "f999").unwrap();
        assert_eq!(carried.pids, [7]);
        assert_eq!(h.gpus.len(), 1 + MAX_GPUS);
        assert_eq!(h.gpus_left_out as usize, fake as usize - MAX_GPUS);
        assert_eq!(carried.devices.len(), MAX_GPUS);
        assert_eq!(
            carried.devices_left_out as usize,
            1 + fake as usize - MAX_GPUS
        );
        assert!(carried
            .words()
            .contains(&format!("and {} more", 1 + fake as usize - MAX_GPUS)));
        assert!(h.gpus_more().unwrap().contains("136 GPU(s) more"));
        assert!(serde_json::to_vec(&h).unwrap().len() < 64 << 10);
    }

    /// An id that reads as two, or as none, is quoted where ids are
    /// listed; a plain one is not.
    #[test]
    fn an_id_that_reads_as_two_is_quoted_in_a_list() {
        let (report, cluster, policy) = recorded();
        let mut g = of(&report, &cluster, &[], &policy, None).hosts[0].gpus[0].clone();
        g.envs = ["x, alice-train", "plain", "", "a,b", "a b", "q\"", "a\tb"]
            .map(String::from)
            .into();
        assert_eq!(
            g.envs_listed(),
            r#""x, alice-train", plain, "", "a,b", "a b", "q\"", "a\tb""#
        );
    }

    /// A GPU whose jobs did no work when sampled is idle; one that worked
    /// is in its environment.
    #[test]
    fn a_gpu_whose_jobs_did_no_work_is_idle() {
        let (report, cluster, policy) = recorded();
        let view = of(&report, &cluster, &[], &policy, None);
        let (at, gpu) = (view.hosts.iter().enumerate())
            .find_map(|(i, h)| {
                let g = h.gpus.iter().find(|g| g.state == GpuState::InEnv)?;
                Some((i, g.index))
            })
            .expect("a GPU at work in its environment");
        assert!(!view.hosts[at]
            .gpus
            .iter()
            .any(|g| g.index == gpu && g.processes.is_empty()));
        let host = cluster
            .hosts
            .iter()
            .position(|(h, _)| h.0.as_ref() == view.hosts[at].host)
            .unwrap();
        let state = |cluster: &Cluster, busy: u32| {
            let mut cluster = cluster.clone();
            let mut u = crate::model::Utilization::default();
            u.gpus.insert(GpuIndex(gpu), busy);
            cluster.hosts[host].1.utilization = Some(u);
            let v = of(&report, &cluster, &[], &policy, None);
            v.hosts[at]
                .gpus
                .iter()
                .find(|g| g.index == gpu)
                .unwrap()
                .state
        };
        assert_eq!(state(&cluster, 0), GpuState::Idle);
        assert_eq!(state(&cluster, 30), GpuState::InEnv);
    }

    /// An action's owner is the kernel's user of its job; a detach's, of
    /// every job carrying its environment there, none where they differ
    /// (bob can carry alice's id); the same past a host's first
    /// [`SMALL`] actions (found in its index then).
    #[test]
    fn an_actions_owner_is_its_jobs_and_a_shared_id_names_none() {
        use crate::model::{EnvId, Owner};
        let (report, mut cluster, policy) = recorded();
        let mut many = report.clone();
        many.outcomes = (report.outcomes.iter())
            .flat_map(|o| std::iter::repeat_n(o.clone(), SMALL + 2))
            .collect();
        let same_when_many = |cluster: &Cluster| {
            let owners = |r: &CycleReport| -> Vec<Option<String>> {
                let view = of(r, cluster, &[], &policy, None);
                view.actions.into_iter().map(|a| a.owner).collect()
            };
            let one: Vec<_> = (owners(&report).into_iter())
                .flat_map(|o| std::iter::repeat_n(o, SMALL + 2))
                .collect();
            assert_eq!(owners(&many), one);
        };
        same_when_many(&cluster);
        let detach = |view: &View| {
            (view.actions.iter())
                .find(|a| matches!(a.target, Target::Detach { .. }))
                .cloned()
                .unwrap()
        };
        let theirs = detach(&of(&report, &cluster, &[], &policy, None));
        assert_eq!(theirs.owner.as_deref(), Some("alice"));
        let terminate = of(&report, &cluster, &[], &policy, None).actions[0].clone();
        assert!(matches!(terminate.target, Target::Terminate { .. }));
        assert!(terminate.owner.is_some(), "{terminate:?}");
        let Target::Detach { env, .. } = &theirs.target else {
            unreachable!()
        };
        let (_, snap) = (cluster.hosts.iter_mut())
            .find(|(h, _)| h.0.as_ref() == theirs.host)
            .unwrap();
        let mut his = snap.processes[0].clone();
        his.pid = Pid(4242);
        his.owner = Owner::Env(EnvId(env.as_str().into()));
        his.user = Some("bob".into());
        snap.processes.push(his);
        assert_eq!(
            detach(&of(&report, &cluster, &[], &policy, None)).owner,
            None
        );
        same_when_many(&cluster);
    }

    /// A wait says its own deadline, warning, exemption and sightings, a
    /// termination's as a detach's.
    #[test]
    fn a_wait_says_its_deadline_warning_exemption_and_sightings() {
        let (mut report, cluster, policy) = recorded();
        let detach = report
            .outcomes
            .iter()
            .find_map(|o| match o {
                Outcome::Detach {
                    host, device, eid, ..
                } => Some((host.clone(), *device, eid.clone())),
                _ => None,
            })
            .unwrap();
        let Outcome::Terminate { host, pid, .. } = report.outcomes[0].clone() else {
            panic!("a termination first")
        };
        report.waiting = vec![
            Waiting::Terminate {
                host,
                pid,
                seen: 1,
                needed: 3,
                deadline_ms: Some(7),
                warn_only: true,
                exempt: Some("a deadline".into()),
            },
            Waiting::Detach {
                host: detach.0,
                device: detach.1,
                eid: detach.2,
                seen: 2,
                needed: 4,
                deadline_ms: Some(9),
                warn_only: true,
                exempt: Some("lab".into()),
            },
        ];
        let view = of(&report, &cluster, &[], &policy, None);
        let said = |a: &ActionView| (a.deadline_ms, a.warn_only, a.exempt.clone(), a.seen);
        assert_eq!(
            said(&view.waiting[0]),
            (Some(7), true, Some("a deadline".into()), Some((1, 3)))
        );
        assert_eq!(
            said(&view.waiting[1]),
            (Some(9), true, Some("lab".into()), Some((2, 4)))
        );
        assert!(view.waiting.iter().all(|a| !a.rules.is_empty()));
        for w in &mut report.waiting {
            match w {
                Waiting::Terminate { seen, needed, .. } | Waiting::Detach { seen, needed, .. } => {
                    *seen = *needed
                }
            }
        }
        let view = of(&report, &cluster, &[], &policy, None);
        assert!(
            view.waiting.iter().all(|a| a.seen.is_none()),
            "sightings all made are not said"
        );
    }

    /// A delta applies to the view of its cycle only, and to its hosts.
    #[test]
    fn a_delta_applies_to_its_own_cycle_only() {
        let mut view = recorded_view();
        let mut next = view.clone();
        next.cycle = view.cycle + 1;
        next.hosts[1].why = Some("changed".into());
        let delta = View {
            delta_of: Some(view.cycle),
            changed: vec![(1, next.hosts[1].clone())],
            hosts: Vec::new(),
            ..next.clone()
        };
        let stale = View {
            delta_of: Some(view.cycle + 5),
            ..delta.clone()
        };
        assert!(view.clone().apply(stale).is_err());
        let outside = View {
            changed: vec![(99, next.hosts[1].clone())],
            ..delta.clone()
        };
        assert!(view.clone().apply(outside).is_err());
        view.apply(delta).unwrap();
        assert_eq!(view, next);
    }

    #[test]
    fn the_recorded_fleets_view() {
        let view = recorded_view();
        insta::assert_snapshot!(serde_json::to_string_pretty(&view).unwrap());
    }

    /// Every action done is in the view with the rule that asked for it,
    /// and every GPU it falls on is marked violating.
    #[test]
    fn each_action_says_its_rule_and_marks_its_gpu() {
        let (report, cluster, policy) = recorded();
        let view = of(&report, &cluster, &[], &policy, None);
        assert_eq!(view.actions.len(), report.outcomes.len());
        assert!(!view.actions.is_empty());
        for a in &view.actions {
            assert!(!a.rules.is_empty(), "{a:?}");
            assert_eq!(a.rules.len(), a.why.len());
            assert_eq!(a.result.as_deref(), Some("dry run"));
            let host = view.hosts.iter().find(|h| h.host == a.host).unwrap();
            let marked = host.gpus.iter().any(|g| {
                g.state == GpuState::Violating
                    && match &a.target {
                        Target::Terminate { pid } => g.processes.iter().any(|p| p.pid == *pid),
                        Target::Detach { device, .. } => g.index == *device,
                    }
            });
            assert!(marked, "{a:?}");
        }
    }

    /// A wait is shown as waiting, with its deadline, on its GPU.
    #[test]
    fn a_wait_marks_its_gpu_and_keeps_its_deadline() {
        let (mut report, cluster, policy) = recorded();
        let done = report.outcomes.remove(0);
        let Outcome::Terminate { host, pid, .. } = done else {
            panic!("a termination first: {done:?}");
        };
        report.waiting.push(Waiting::Terminate {
            host: host.clone(),
            pid,
            seen: 1,
            needed: 1,
            deadline_ms: Some(1_800_000_000_000),
            warn_only: false,
            exempt: None,
        });
        let view = of(&report, &cluster, &[], &policy, Some(1_799_999_000_000));
        let w = &view.waiting[0];
        assert_eq!(w.deadline_ms, Some(1_800_000_000_000));
        assert_eq!(w.seen, None);
        assert!(!w.rules.is_empty());
        let on = (view.hosts.iter().find(|h| h.host == host.to_string()))
            .unwrap()
            .gpus
            .iter()
            .filter(|g| g.processes.iter().any(|p| p.pid == pid.0));
        assert!(on.clone().count() > 0);
        assert!(on.into_iter().all(|g| g.state == GpuState::Waiting));
    }

    /// A host that failed is shown failed, with why, and no GPUs.
    #[test]
    fn a_failed_host_says_why() {
        let (mut report, mut cluster, policy) = recorded();
        let why = "ssh: connect to host gpu2: Connection refused";
        gpu2_failed(&mut report, &mut cluster, why);
        let view = of(&report, &cluster, &[], &policy, None);
        assert_eq!(view.hosts[1].state, HostState::Failed);
        assert!(view.hosts[1].why.as_deref().unwrap().contains("refused"));
        assert!(view.hosts[1].gpus.is_empty());
        assert_eq!(view.hosts[0].state, HostState::Ok);
    }

    /// The view reads back as written (`status` reads the service's).
    #[test]
    fn the_view_reads_back_as_written() {
        let (report, cluster, policy) = recorded();
        let view = of(&report, &cluster, &[], &policy, Some(5));
        let json = serde_json::to_string(&view).unwrap();
        assert_eq!(serde_json::from_str::<View>(&json).unwrap(), view);
    }
}
