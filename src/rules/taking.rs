//! Taking devices under a device cap (per user, per group): what the rules
//! before a cap take this cycle, and the actions that free a held device
//! from its user's count: a detach of their environments there (with
//! their jobs there) and the termination of their other jobs there
//! (strays, jobs of environments not attached there, counted jobs outside
//! genv). Devices are taken in the order given until enough no longer
//! count; a job on several devices frees each of them it alone held.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

use crate::model::{EnvId, GpuIndex, HashMap, HostId, Pid};

use super::{Action, Violation, Withheld};

/// A device counted toward a user's cap.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeldDevice {
    pub index: GpuIndex,
    /// The user's environments attached here, detached together (nearly
    /// always one).
    pub eids: SmallVec<[EnvId; 1]>,
    /// Their member processes here, terminated with the detach.
    pub pids: SmallVec<[Pid; 2]>,
    /// The user's other jobs here, counted by the GPUs they run on (strays,
    /// jobs of environments not attached here, jobs whose environment
    /// cannot be judged, counted jobs outside genv): terminated to free it.
    #[serde(default, skip_serializing_if = "SmallVec::is_empty")]
    pub jobs: SmallVec<[Pid; 2]>,
    /// Environments attached here whose id jobs of several users carry,
    /// this user's among them ([`super::attribution`]: *contested*): each
    /// counts toward every one of those users, as it would toward the one
    /// whose it is, and is never detached under a cap (nothing tells whose
    /// it is). Taken, the device is freed of the user's jobs and bears its
    /// share of the excess where it stands, left counted.
    #[serde(default, skip_serializing_if = "SmallVec::is_empty")]
    pub contested: SmallVec<[EnvId; 1]>,
    /// A job of one of those environments runs here (or another job of
    /// the user's).
    pub working: bool,
    /// Another job of the user's runs here (`jobs`, or one that cannot be
    /// terminated).
    pub stray: bool,
    /// A job of the user's that is never terminated runs here (its
    /// identity not pinned, or its environ unreadable): the device stays
    /// counted.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub kept: bool,
    /// A job of the user's here cannot be judged because its host's genv
    /// state is unusable this cycle (which anyone can cause; it is among
    /// `jobs`): the device is kept, bearing its share of the excess where
    /// it stands under every cap, never passing it on to the user's other
    /// devices, until the host has been unusable [`BLIND_AFTER`] cycles in
    /// a row; then it is taken after every other device ([`Taken::blind`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unseen: bool,
    /// One of the environments lists a live pid of the user
    /// ([`super::attribution::Attribution::vouched`]).
    pub vouched: bool,
    /// When the first of the user's jobs here started (ms since the Unix
    /// epoch, comparable across hosts), if any did and it is known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<u64>,
    /// Of `jobs`, members of the user's environments not attached here
    /// (out of line: [`super::in_line`]). Never published.
    #[serde(skip)]
    pub off: SmallVec<[Pid; 1]>,
    /// When each of those jobs started, where known: the group caps' order
    /// is by the first of them that runs on after what is taken this
    /// cycle ([`Taken::since`]). Never published (`--shard` refuses the
    /// group caps).
    #[serde(skip)]
    pub starts: SmallVec<[(Pid, u64); 2]>,
    /// Where it stood in the group caps' order when their picks were
    /// first held ([`super::max_groups::HeldOrder`]): it stands no more
    /// recent until the hold is over. Never published.
    #[serde(skip)]
    pub held_since: Option<u64>,
    /// In another shard's part: what its waiting actions end here at
    /// their deadline ([`super::shards::Published::mark_soon`]).
    #[serde(default, skip_serializing_if = "SoonHere::is_none")]
    pub soon: SoonHere,
}

/// Of a device in another shard's part, what that shard's waiting actions
/// end at their deadline: every job of the user's there, every member
/// process, every environment attached.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SoonHere {
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub jobs: bool,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pids: bool,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub eids: bool,
}

impl SoonHere {
    fn is_none(&self) -> bool {
        *self == SoonHere::default()
    }
}

impl HeldDevice {
    pub(super) fn new(index: GpuIndex) -> Self {
        HeldDevice {
            index,
            eids: SmallVec::new(),
            pids: SmallVec::new(),
            jobs: SmallVec::new(),
            contested: SmallVec::new(),
            working: false,
            stray: false,
            kept: false,
            unseen: false,
            vouched: false,
            since: None,
            off: SmallVec::new(),
            starts: SmallVec::new(),
            held_since: None,
            soon: SoonHere::default(),
        }
    }

    /// Its job `pid`, started at `started`, runs here.
    pub(super) fn started(&mut self, pid: Pid, started: Option<u64>) {
        if let Some(t) = started {
            self.since = Some(self.since.map_or(t, |s| s.min(t)));
            self.starts.push((pid, t));
        }
    }
}

/// What is taken this cycle: detached (host, device, environment) and
/// terminated (host, pid), only what is carried out in it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Taken {
    pub detached: HashSet<(HostId, GpuIndex, EnvId)>,
    pub terminated: HashSet<(HostId, Pid)>,
    /// What the actions that wait for their deadline take then: a cap
    /// takes those devices first, so that it never takes more than its
    /// excess once they come due.
    pub soon_detached: HashSet<(HostId, GpuIndex, EnvId)>,
    pub soon_terminated: HashSet<(HostId, Pid)>,
    /// The hosts whose genv state has been unusable [`BLIND_AFTER`] cycles
    /// in a row: their unseen jobs are taken, last. A garble anyone can
    /// keep up must not make a host cap-free; one that lasts a cycle or two
    /// must not make a cap pick among a user's jobs blind.
    pub blind: HashSet<HostId>,
    /// What the shares that unseen devices bear stand for: what a cap
    /// would take there were their host's state usable. Never carried out
    /// (no action), it no longer counts for the caps after (a group cap
    /// after the per-user caps), so they take no more elsewhere.
    pub unseen_terminated: HashSet<(HostId, Pid)>,
    pub unseen_detached: HashSet<(HostId, GpuIndex, EnvId)>,
    /// The contested environments of the devices taken, by user: each
    /// user's share borne there (never detached), counted no more for
    /// that user's caps after.
    pub contested_borne: HashSet<(HostId, GpuIndex, EnvId, String)>,
    /// The jobs of unseen hosts whose wait is due this cycle
    /// ([`super::Withheld::unseen_due`]): not freed, but ended for the
    /// order ([`Taken::since`]), as a healthy cycle would end them.
    pub unseen_ending: HashSet<(HostId, Pid)>,
    /// The order as this cycle's snapshot gives it, without a hold's
    /// ([`HeldDevice::held_since`]): the caps worked out again once the
    /// picks a hold kept back are taken ([`super::Released`]).
    pub unheld: bool,
}

/// Cycles in a row a host's genv state is unusable before its unseen jobs
/// are taken under the caps ([`Taken::blind`]).
pub const BLIND_AFTER: u32 = 3;

/// A device's turn under a cap ([`Taken::turn`]): the idle ones first
/// (unvouched, then vouched), then one the actions that wait take at their
/// deadline, then the working ones, then those only a blind host's unseen
/// jobs hold, last the ones that are never taken.
pub const SOON: u8 = 3;
pub const WORKING: u8 = 4;
pub const BLIND: u8 = 5;
pub const KEPT: u8 = 6;

impl Taken {
    /// What `violations` take this cycle, less what `withheld` keeps
    /// waiting (a detach any of whose environments waits terminates none
    /// of its processes).
    pub fn of(violations: &[Violation], withheld: &Withheld) -> Self {
        let mut taken = Taken {
            soon_terminated: withheld.unseen_waiting.clone(),
            unseen_ending: withheld.unseen_due.clone(),
            ..Taken::default()
        };
        taken.add(violations, withheld);
        taken
    }

    /// Adds what `violations` take, as [`Taken::of`].
    pub fn add(&mut self, violations: &[Violation], withheld: &Withheld) {
        for a in violations.iter().flat_map(|v| &v.actions) {
            match a {
                Action::Terminate { host, pid } => {
                    let t = (host.clone(), *pid);
                    if !withheld.terminations.contains(&t) {
                        self.terminated.insert(t);
                    } else if withheld.waiting_terminations.contains(&t) {
                        self.soon_terminated.insert(t);
                    }
                }
                Action::Detach {
                    host,
                    device,
                    eids,
                    pids,
                    ..
                } => {
                    let (mut waits, mut lasts) = (false, false);
                    for e in eids {
                        let d = (host.clone(), *device, e.clone());
                        if !withheld.detaches.contains(&d) {
                            self.detached.insert(d);
                            continue;
                        }
                        waits = true;
                        if withheld.waiting_detaches.contains(&d) {
                            self.soon_detached.insert(d);
                        } else {
                            lasts = true;
                        }
                    }
                    let pids = pids.iter().map(|p| (host.clone(), *p));
                    if !waits {
                        self.terminated.extend(pids);
                    } else if !lasts {
                        self.soon_terminated.extend(pids);
                    }
                }
            }
        }
    }

    /// The user's jobs on `d` that run on after what is taken (and, unless
    /// `really`, after what the unseen devices' shares stand for).
    fn running_if<'d>(
        &'d self,
        host: &'d HostId,
        d: &'d HeldDevice,
        really: bool,
    ) -> impl Iterator<Item = Pid> + 'd {
        (d.jobs.iter())
            .filter(move |p| {
                let t = (host.clone(), **p);
                !self.terminated.contains(&t) && (really || !self.unseen_terminated.contains(&t))
            })
            .copied()
    }

    fn running<'d>(
        &'d self,
        host: &'d HostId,
        d: &'d HeldDevice,
    ) -> impl Iterator<Item = Pid> + 'd {
        self.running_if(host, d, false)
    }

    /// The environments of `d` still attached after what is taken (as
    /// [`Taken::running_if`]).
    fn attached_if<'d>(
        &'d self,
        host: &'d HostId,
        d: &'d HeldDevice,
        really: bool,
    ) -> impl Iterator<Item = &'d EnvId> + 'd {
        (d.eids.iter()).filter(move |e| {
            let t = (host.clone(), d.index, (*e).clone());
            !self.detached.contains(&t) && (really || !self.unseen_detached.contains(&t))
        })
    }

    fn attached<'d>(
        &'d self,
        host: &'d HostId,
        d: &'d HeldDevice,
    ) -> impl Iterator<Item = &'d EnvId> + 'd {
        self.attached_if(host, d, false)
    }

    /// The contested environments of `user`'s device `d` that none of
    /// their caps has borne a share for.
    fn contested<'d>(
        &'d self,
        host: &'d HostId,
        user: &'d str,
        d: &'d HeldDevice,
    ) -> impl Iterator<Item = &'d EnvId> + 'd {
        (d.contested.iter()).filter(move |e| {
            let key = (host.clone(), d.index, (*e).clone(), user.to_string());
            !self.contested_borne.contains(&key)
        })
    }

    /// Whether `d` still counts toward its user (toward their `group`)
    /// after what is carried out (what the shares borne stand for still
    /// counts).
    fn holds_really(&self, host: &HostId, d: &HeldDevice, group: bool) -> bool {
        d.kept
            || (!group && !d.contested.is_empty())
            || self.attached_if(host, d, true).next().is_some()
            || self.running_if(host, d, true).next().is_some()
    }

    /// Whether nothing on `d` is taken: a job there is never terminated,
    /// or cannot be judged on a host not yet blind.
    pub fn kept(&self, host: &HostId, d: &HeldDevice) -> bool {
        d.kept || (d.unseen && !self.blind.contains(host))
    }

    /// When the first of the user's jobs on `d` that run on after what is
    /// carried out this cycle started (`d.since` where its jobs' start
    /// times are not known). Another rule ending the first of them moves
    /// the device up in the same cycle it is carried out, so that a cap
    /// worked out with it done, or a cycle later, orders alike (a job due
    /// on an unseen host, too: [`Taken::unseen_ending`]); while the caps'
    /// picks are held, no more recent than when the hold began.
    pub fn since(&self, host: &HostId, d: &HeldDevice) -> Option<u64> {
        let first = if d.starts.is_empty() {
            d.since
        } else {
            (d.starts.iter())
                .filter(|(p, _)| {
                    let key = (host.clone(), *p);
                    !self.terminated.contains(&key) && !self.unseen_ending.contains(&key)
                })
                .map(|(_, t)| *t)
                .min()
        };
        match (first, d.held_since.filter(|_| !self.unheld)) {
            (Some(now), Some(then)) => Some(now.min(then)),
            (first, _) => first,
        }
    }

    /// Whether anything the caps take is left on `d` after what is taken:
    /// an environment of its user's to detach, or a job to terminate.
    pub fn takeable(&self, host: &HostId, d: &HeldDevice) -> bool {
        !self.kept(host, d)
            && (self.attached(host, d).next().is_some() || self.running(host, d).next().is_some())
    }

    /// Whether `user`'s device `d` still counts toward them after what is
    /// taken.
    pub fn holds(&self, host: &HostId, user: &str, d: &HeldDevice) -> bool {
        self.holds_in_group(host, d) || self.contested(host, user, d).next().is_some()
    }

    /// Whether `d` still counts toward its user's groups after what is
    /// taken: as [`Taken::holds`], but a contested environment counts
    /// toward none of the members whose jobs carry its id (counted for
    /// each, one id would weigh on the group as often as members carry it).
    pub fn holds_in_group(&self, host: &HostId, d: &HeldDevice) -> bool {
        d.kept || self.attached(host, d).next().is_some() || self.running(host, d).next().is_some()
    }

    /// Its turn among a cap's devices: first the idle ones (no job of the
    /// user runs there after what is carried out this cycle), unvouched (1)
    /// before vouched (2); then ([`SOON`]) the working ones that the
    /// actions waiting for their deadline free anyway, or leave holding
    /// only an idle attachment (anyone can write one in the user's name:
    /// it must not move a cap's pick off a device whose jobs end anyway,
    /// onto one where it would join, and hasten, another job's wait); then
    /// the other working ones ([`WORKING`]), a kept one a job that cannot
    /// be judged holds among them (it bears its share there, or stands
    /// soon where the waits kept for its jobs free it); then ([`BLIND`])
    /// those a blind host's unseen jobs hold; last ([`KEPT`]) those a job
    /// that cannot be terminated holds (its identity not pinned), whose
    /// count stays. Idle devices go before the waiting actions' so that a
    /// record bob forges in alice's name is taken before a cap joins (and,
    /// a per-user cap, may hasten) the wait of a job of hers.
    pub fn turn(&self, host: &HostId, d: &HeldDevice) -> u8 {
        if self.kept(host, d) && d.unseen {
            // Where it would stand seen: the waits kept for its jobs
            // ([`super::Withheld::unseen_waiting`]) free it soon, or not.
            if !d.kept && self.freed_soon(host, d) {
                SOON
            } else {
                WORKING
            }
        } else if d.kept {
            KEPT
        } else if self.idle(host, d) {
            if d.vouched {
                2
            } else {
                1
            }
        } else if self.freed_soon(host, d) {
            SOON
        } else if d.unseen {
            BLIND
        } else if self.left_idle(host, d) {
            SOON
        } else {
            WORKING
        }
    }

    /// Whether no job of `d`'s user runs there after what is carried out
    /// this cycle: neither a member process of their environments there
    /// nor another job of theirs.
    fn idle(&self, host: &HostId, d: &HeldDevice) -> bool {
        let ended = |p: &&Pid| self.terminated.contains(&(host.clone(), **p));
        d.pids.iter().all(|p| ended(&p)) && self.running(host, d).next().is_none()
    }

    /// Whether something of `d`'s user works there and every job of theirs
    /// running there ends at a waiting action's deadline, and so does each
    /// member process there unless every environment still attached is
    /// detached then.
    fn left_idle(&self, host: &HostId, d: &HeldDevice) -> bool {
        let soon = |e: &EnvId| {
            d.soon.eids || (self.soon_detached).contains(&(host.clone(), d.index, e.clone()))
        };
        let ends = |p: &Pid| self.soon_terminated.contains(&(host.clone(), *p));
        !self.idle(host, d)
            && self.running(host, d).all(|p| d.soon.jobs || ends(&p))
            && (self.attached(host, d).all(soon) || d.soon.pids || d.pids.iter().all(ends))
    }

    /// Whether the actions that wait free `d` of its user at their
    /// deadline: each environment of theirs still attached there is
    /// detached then, and each job of theirs still running there ends.
    fn freed_soon(&self, host: &HostId, d: &HeldDevice) -> bool {
        let soon = |e: &EnvId| {
            d.soon.eids || (self.soon_detached).contains(&(host.clone(), d.index, e.clone()))
        };
        let ends = |p: Pid| d.soon.jobs || self.soon_terminated.contains(&(host.clone(), p));
        let mut attached = self.attached(host, d).peekable();
        let mut running = self.running(host, d).peekable();
        (attached.peek().is_some() || running.peek().is_some())
            && attached.all(soon)
            && running.all(ends)
    }
}

/// A device a cap may take: its host, its user, what they hold there.
pub type Candidate<'a> = (&'a HostId, &'a str, &'a HeldDevice);

/// Takes `candidates` (each still held, in the order to take them) until
/// `over` of them no longer count, recording what is taken in `taken`:
/// the actions, and how many were freed (fewer than `over` when what is
/// left cannot be freed). A device that is never freed (`kept`) is
/// passed over; with `share` (or when it is `unseen`), it still bears its
/// share of the excess where it stands (a group's excess stays with the
/// member who came last, never passes to another), left unfreed. `share`
/// is a group cap's take: there a contested environment counts toward
/// none of the members ([`Taken::holds_in_group`]).
pub fn take(
    candidates: &[Candidate],
    over: usize,
    taken: &mut Taken,
    share: bool,
) -> (Vec<Action>, usize) {
    let mut by_job: HashMap<(&HostId, Pid), Vec<usize>> = HashMap::default();
    for (k, (host, _, d)) in candidates.iter().enumerate() {
        for p in d.jobs.iter().chain(&d.pids) {
            by_job.entry((host, *p)).or_default().push(k);
        }
    }
    let mut free = vec![false; candidates.len()];
    let (mut freed, mut borne) = (0, 0);
    let mut actions = Vec::new();
    for k in 0..candidates.len() {
        if freed + borne >= over {
            break;
        }
        if free[k] {
            continue;
        }
        let (host, user, d) = candidates[k];
        // Never freed (a job there is never terminated): nothing there is
        // taken for it.
        if d.kept {
            borne += usize::from(share || d.unseen);
            continue;
        }
        // Unseen (its host's state unusable, not yet blind): it bears its
        // share as if it were taken, with every device its jobs alone
        // hold, so that its share is what a healthy cycle would take
        // there; nothing is carried out.
        let unseen = taken.kept(host, d);
        let (eids, jobs, touched) = apply(taken, &by_job, k, (host, user, d), unseen);
        if !unseen {
            if !eids.is_empty() {
                actions.push(Action::Detach {
                    host: host.clone(),
                    device: d.index,
                    eids,
                    pids: d.pids.to_vec(),
                    user: user.to_string(),
                });
            }
            actions.extend(jobs.into_iter().map(|pid| Action::Terminate {
                host: host.clone(),
                pid,
            }));
        }
        for j in touched {
            let (h, _, dj) = candidates[j];
            let holds = if share {
                taken.holds_in_group(h, dj)
            } else {
                taken.holds(h, candidates[j].1, dj)
            };
            if !free[j] && !holds {
                free[j] = true;
                if taken.holds_really(h, dj, share) {
                    borne += 1;
                } else {
                    freed += 1;
                }
            }
        }
    }
    (actions, freed)
}

/// Picks [`take_sparing`] tries to give back, at most: each try takes
/// anew over the user's devices, so a cycle stays linear in the records
/// a user writes (past it, the user may lose more than the excess).
const GIVE_BACK_TRIES: usize = 16;

/// [`take`] for one user's own cap: then each pick that the later ones
/// make needless (a job one of them ends frees that device as well) is
/// given back, first to last, so that the user loses no more than their
/// excess. Never for a group: there a pick given back would be one
/// member's, kept in place of another's.
pub fn take_sparing(
    candidates: &[Candidate],
    over: usize,
    taken: &mut Taken,
) -> (Vec<Action>, usize) {
    // Only a job on two of the devices frees more than the one picked:
    // without one nothing is ever given back, and `taken` is not copied
    // (its copy grows with every user taken from before: a user per
    // record bob writes would make a cycle quadratic).
    let mut seen = HashSet::new();
    let shared = (candidates.iter())
        .flat_map(|(host, _, d)| d.jobs.iter().chain(&d.pids).map(move |p| (*host, *p)))
        .any(|job| !seen.insert(job));
    if !shared {
        return take(candidates, over, taken, false);
    }
    let before = taken.clone();
    let (mut actions, mut freed) = take(candidates, over, taken, false);
    let mut left: Vec<Candidate> = candidates.to_vec();
    let (mut k, mut tries) = (0, 0);
    while freed > over && k < left.len() {
        let picked = |(host, _, d): &Candidate, actions: &[Action]| {
            actions.iter().any(|a| match a {
                Action::Detach {
                    host: h, device, ..
                } => h == *host && *device == d.index,
                Action::Terminate { host: h, pid } => {
                    h == *host && (d.jobs.contains(pid) || d.pids.contains(pid))
                }
            })
        };
        if !picked(&left[k], &actions) {
            k += 1;
            continue;
        }
        if tries == GIVE_BACK_TRIES {
            break;
        }
        tries += 1;
        let mut fewer = left.clone();
        fewer.remove(k);
        let mut t = before.clone();
        let (a, f) = take(&fewer, over, &mut t, false);
        if f >= over && a.len() < actions.len() && a.iter().all(|x| actions.contains(x)) {
            (left, actions, freed, *taken) = (fewer, a, f, t);
        } else {
            k += 1;
        }
    }
    (actions, freed)
}

/// Takes `d` (candidate `k`, on `host`) in `taken`, or only as its share
/// (`unseen`): its user's environments still attached there detached with
/// their processes, their jobs still running there terminated, its
/// contested environments left attached, as a share borne. Returns
/// those environments, those jobs and the candidates touched (whose count
/// may have dropped).
fn apply(
    taken: &mut Taken,
    by_job: &HashMap<(&HostId, Pid), Vec<usize>>,
    k: usize,
    (host, user, d): (&HostId, &str, &HeldDevice),
    unseen: bool,
) -> (Vec<EnvId>, Vec<Pid>, Vec<usize>) {
    let eids: Vec<EnvId> = taken.attached(host, d).cloned().collect();
    let jobs: Vec<Pid> = taken.running(host, d).collect();
    let contested: Vec<EnvId> = taken.contested(host, user, d).cloned().collect();
    (taken.contested_borne).extend(
        contested
            .into_iter()
            .map(|e| (host.clone(), d.index, e, user.to_string())),
    );
    let (terminated, detached) = if unseen {
        (&mut taken.unseen_terminated, &mut taken.unseen_detached)
    } else {
        (&mut taken.terminated, &mut taken.detached)
    };
    let mut touched = vec![k];
    let mut ended = |p: Pid| {
        terminated.insert((host.clone(), p));
        touched.extend(by_job.get(&(host, p)).into_iter().flatten());
    };
    if !eids.is_empty() {
        for p in &d.pids {
            ended(*p);
        }
    }
    for p in &jobs {
        ended(*p);
    }
    detached.extend(eids.iter().map(|e| (host.clone(), d.index, e.clone())));
    (eids, jobs, touched)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::{Finding, Rule};

    #[test]
    fn what_other_rules_terminate_is_every_terminated_pid_and_every_detachs_processes() {
        let h = HostId("h".into());
        let v = Violation {
            rule: Rule::EnvMemory,
            finding: Finding::MaxDevices {
                user: "a".into(),
                devices: 1,
                hosts: 1,
                over: 1,
            },
            actions: smallvec::smallvec![
                Action::Terminate {
                    host: h.clone(),
                    pid: Pid(1),
                },
                Action::Detach {
                    host: h.clone(),
                    device: crate::model::GpuIndex(0),
                    eids: vec![],
                    pids: vec![Pid(2), Pid(3)],
                    user: "a".into(),
                },
            ],
        };
        let t = Taken::of(std::slice::from_ref(&v), &Withheld::default()).terminated;
        assert_eq!(t.len(), 3);
        assert!(t.contains(&(h.clone(), Pid(3))));
        // What waits frees nothing: the termination, or the detach.
        let mut held = Withheld::default();
        held.terminations.insert((h.clone(), Pid(1)));
        let t = Taken::of(std::slice::from_ref(&v), &held).terminated;
        assert_eq!(t.len(), 2);
        assert!(!t.contains(&(h.clone(), Pid(1))));
        held.detaches.insert((
            h.clone(),
            crate::model::GpuIndex(0),
            crate::model::EnvId("e".into()),
        ));
        assert_eq!(
            Taken::of(std::slice::from_ref(&v), &held).terminated.len(),
            2,
            "no eid held"
        );
        let mut v = v;
        if let Action::Detach { eids, .. } = &mut v.actions[1] {
            eids.push(crate::model::EnvId("e".into()));
        }
        assert!(Taken::of(&[v], &held).terminated.is_empty());
    }

    #[test]
    fn what_waits_is_not_taken() {
        let h = HostId("h".into());
        let v = Violation {
            rule: Rule::MaxDevicesPerUser,
            finding: Finding::MaxDevices {
                user: "bob".into(),
                devices: 2,
                hosts: 1,
                over: 2,
            },
            actions: smallvec::smallvec![
                Action::Terminate {
                    host: h.clone(),
                    pid: Pid(1),
                },
                Action::Terminate {
                    host: h.clone(),
                    pid: Pid(2),
                },
                Action::Detach {
                    host: h.clone(),
                    device: GpuIndex(0),
                    eids: vec![EnvId("a".into()), EnvId("b".into())],
                    pids: vec![Pid(3)],
                    user: "bob".into(),
                },
            ],
        };
        let all = Taken::of(std::slice::from_ref(&v), &Withheld::default());
        assert_eq!(all.terminated.len(), 3);
        assert_eq!(all.detached.len(), 2);
        let mut withheld = Withheld::default();
        withheld.terminations.insert((h.clone(), Pid(1)));
        withheld
            .detaches
            .insert((h.clone(), GpuIndex(0), EnvId("b".into())));
        let some = Taken::of(&[v], &withheld);
        // Pid 1 waits; the detach of `b` waits, so its processes stay.
        let pids: Vec<u32> = some.terminated.iter().map(|(_, p)| p.0).collect();
        assert_eq!(pids, [2]);
        assert!(some
            .detached
            .contains(&(h.clone(), GpuIndex(0), EnvId("a".into()))));
        assert!(!some.detached.contains(&(h, GpuIndex(0), EnvId("b".into()))));
    }

    /// Review of stop 48, finding 2: a host whose `envs.json` anyone keeps
    /// garbled is not cap-free for good. Its jobs that cannot be judged
    /// bear their share where they stand for [`BLIND_AFTER`] cycles, then
    /// are taken, after every healthy device.
    #[test]
    fn a_host_kept_unusable_is_judged_blind_and_its_jobs_taken_last() {
        let (ok, garbled) = (HostId("ok".into()), HostId("g".into()));
        let job = |index: u32, pid: u32, unseen: bool| HeldDevice {
            jobs: smallvec::smallvec![Pid(pid)],
            working: true,
            stray: true,
            unseen,
            ..HeldDevice::new(GpuIndex(index))
        };
        let (healthy, first, second) = (job(0, 1, false), job(0, 2, true), job(1, 3, true));
        let run = |blind: bool, over: usize| {
            let mut taken = Taken::default();
            if blind {
                taken.blind.insert(garbled.clone());
            }
            let mut c: Vec<Candidate> = vec![
                (&garbled, "bob", &first),
                (&garbled, "bob", &second),
                (&ok, "bob", &healthy),
            ];
            c.sort_by_key(|(h, _, d)| taken.turn(h, d));
            let turns: Vec<u8> = c.iter().map(|(h, _, d)| taken.turn(h, d)).collect();
            let (_, freed) = take(&c, over, &mut taken, false);
            let mut pids: Vec<u32> = taken.terminated.iter().map(|(_, p)| p.0).collect();
            pids.sort_unstable();
            (pids, freed, turns)
        };
        // Not yet blind: a garbled device stands among the working ones,
        // bearing its share, and nothing there is taken.
        let (pids, freed, turns) = run(false, 2);
        assert_eq!(turns, [WORKING, WORKING, WORKING]);
        assert!(
            pids.is_empty(),
            "the first garbled device bears the first share"
        );
        assert_eq!(freed, 0);
        let (pids, freed, _) = run(false, 3);
        assert_eq!((pids, freed), (vec![1], 1));
        // Blind: the healthy device first, then the garbled ones.
        let (pids, freed, turns) = run(true, 1);
        assert_eq!(turns, [WORKING, BLIND, BLIND]);
        assert_eq!((pids, freed), (vec![1], 1));
        let (pids, freed, _) = run(true, 2);
        assert_eq!((pids, freed), (vec![1, 2], 2));
        // A device a job that is never terminated holds stays kept, blind
        // or not.
        let mut taken = Taken::default();
        taken.blind.insert(garbled.clone());
        let pinned = HeldDevice {
            kept: true,
            ..job(2, 4, true)
        };
        assert!(taken.kept(&garbled, &pinned));
        assert!(!taken.kept(&garbled, &first));
        assert!(Taken::default().kept(&garbled, &first));
        assert!(!Taken::default().kept(&ok, &healthy));
    }

    /// Review of stop 48, finding 3: a record bob forges in alice's name
    /// (idle) is taken before a cap joins the wait of a job of hers, which
    /// would bring its deadline forward.
    #[test]
    fn idle_devices_go_before_those_waiting_actions_free() {
        let h = HostId("h".into());
        let mut taken = Taken::default();
        taken.soon_terminated.insert((h.clone(), Pid(7)));
        let waiting = HeldDevice {
            jobs: smallvec::smallvec![Pid(7)],
            working: true,
            stray: true,
            ..HeldDevice::new(GpuIndex(0))
        };
        let forged = HeldDevice {
            eids: smallvec::smallvec![EnvId("forged".into())],
            vouched: true,
            ..HeldDevice::new(GpuIndex(1))
        };
        let working = HeldDevice {
            jobs: smallvec::smallvec![Pid(8)],
            working: true,
            ..HeldDevice::new(GpuIndex(2))
        };
        let turns = [&forged, &waiting, &working].map(|d| taken.turn(&h, d));
        assert_eq!(turns, [2, SOON, WORKING]);
        let mut c: Vec<Candidate> = vec![
            (&h, "alice", &waiting),
            (&h, "alice", &working),
            (&h, "alice", &forged),
        ];
        c.sort_by_key(|(h, _, d)| taken.turn(h, d));
        let (actions, freed) = take(&c, 1, &mut taken, false);
        assert_eq!(freed, 1);
        assert!(
            matches!(&actions[..], [Action::Detach { eids, .. }] if eids[0].0.as_ref() == "forged")
        );
    }

    /// Seed 19 of the when-and-which property (stop 53): bob attaches
    /// alice's environment where her orphan, waiting out its grace, runs.
    /// Under her own cap the device keeps its turn among those the waits
    /// free (her attachment there left idle), so that the cap does not
    /// move to another device and join, and hasten, another job's wait;
    /// under a group cap it stands among the working ones.
    #[test]
    fn an_attachment_left_idle_keeps_a_device_in_its_turn_under_its_users_cap() {
        let h = HostId("h".into());
        let mut taken = Taken::default();
        taken.soon_terminated.insert((h.clone(), Pid(7)));
        taken.soon_terminated.insert((h.clone(), Pid(9)));
        let device = |pids: &[u32], jobs: &[u32]| HeldDevice {
            eids: smallvec::smallvec![EnvId("a".into())],
            pids: pids.iter().map(|p| Pid(*p)).collect(),
            jobs: jobs.iter().map(|p| Pid(*p)).collect(),
            working: true,
            stray: !jobs.is_empty(),
            ..HeldDevice::new(GpuIndex(0))
        };
        let forged = device(&[], &[7]);
        assert_eq!(taken.turn(&h, &forged), SOON);
        // Its member processes end at their deadline too: idle then.
        let members_end = device(&[9], &[7]);
        assert_eq!(taken.turn(&h, &members_end), SOON);
        // A member that works on, or a job that does, keeps it working.
        for d in [device(&[8], &[7]), device(&[], &[7, 8])] {
            assert_eq!(taken.turn(&h, &d), WORKING);
        }
        // The attachment detached at its deadline as well: freed anyway.
        taken
            .soon_detached
            .insert((h.clone(), GpuIndex(0), EnvId("a".into())));
        assert_eq!(taken.turn(&h, &device(&[8], &[7])), SOON);
        // Nothing running: idle, as before.
        assert_eq!(taken.turn(&h, &device(&[], &[])), 1);
        // Unseen, it stands where the waits kept for its jobs put it: its
        // job and attachment end soon here, so soon; not its own turn.
        let unseen = HeldDevice {
            unseen: true,
            ..forged
        };
        assert_eq!(taken.turn(&h, &unseen), SOON);
        let unseen = HeldDevice {
            jobs: smallvec::smallvec![Pid(8)],
            ..unseen
        };
        assert_eq!(taken.turn(&h, &unseen), WORKING);
        let kept = HeldDevice {
            kept: true,
            jobs: smallvec::smallvec![Pid(7)],
            ..unseen
        };
        assert_eq!(taken.turn(&h, &kept), WORKING, "never terminated");
    }

    /// A wait the ladder keeps for a job on a host unseen this cycle
    /// ([`crate::rules::Withheld::unseen_waiting`]) frees its device soon
    /// for the caps, as it would seen.
    #[test]
    fn a_wait_kept_unseen_frees_its_device_soon() {
        let h = HostId("h".into());
        let withheld = crate::rules::Withheld {
            unseen_waiting: [(h.clone(), Pid(7))].into_iter().collect(),
            ..Default::default()
        };
        let d = HeldDevice {
            jobs: smallvec::smallvec![Pid(7)],
            working: true,
            stray: true,
            unseen: true,
            ..HeldDevice::new(GpuIndex(0))
        };
        assert_eq!(Taken::of(&[], &withheld).turn(&h, &d), SOON);
        assert_eq!(Taken::default().turn(&h, &d), WORKING);
    }

    /// An unseen device's share is borne, never counted as freed: nothing
    /// is carried out there, whatever it holds.
    #[test]
    fn an_unseen_share_is_borne_not_freed() {
        let h = HostId("g".into());
        let d = HeldDevice {
            eids: smallvec::smallvec![EnvId("e".into())],
            jobs: smallvec::smallvec![Pid(3)],
            working: true,
            unseen: true,
            ..HeldDevice::new(GpuIndex(0))
        };
        let mut taken = Taken::default();
        let (actions, freed) = take(&[(&h, "bob", &d)], 1, &mut taken, false);
        assert!(actions.is_empty());
        assert_eq!(freed, 0, "borne");
        assert!(
            !taken.holds(&h, "u", &d),
            "no longer counted by the caps after"
        );
        assert!(taken.holds_really(&h, &d, false));
        assert!(taken.terminated.is_empty() && taken.detached.is_empty());
        let job_only = HeldDevice {
            eids: smallvec::SmallVec::new(),
            ..d.clone()
        };
        assert!(taken.holds_really(&h, &job_only, false));
        let attached_only = HeldDevice {
            jobs: smallvec::SmallVec::new(),
            ..d
        };
        assert!(taken.holds_really(&h, &attached_only, false));
    }

    /// A device a job that is never terminated holds bears its share under
    /// a group cap (and when unseen), and is passed over otherwise.
    #[test]
    fn a_kept_device_bears_its_share_only_where_it_stands() {
        let h = HostId("h".into());
        let kept = |unseen| HeldDevice {
            working: true,
            stray: true,
            kept: true,
            unseen,
            ..HeldDevice::new(GpuIndex(0))
        };
        let working = HeldDevice {
            jobs: smallvec::smallvec![Pid(9)],
            working: true,
            ..HeldDevice::new(GpuIndex(1))
        };
        let run = |d: &HeldDevice, share: bool, over: usize| {
            let mut taken = Taken::default();
            let c = [(&h, "alice", d), (&h, "alice", &working)];
            let (actions, freed) = take(&c, over, &mut taken, share);
            (actions.len(), freed)
        };
        // Per user: passed over, the next device taken.
        assert_eq!(run(&kept(false), false, 1), (1, 1));
        // Under a group cap, or unseen: it bears the share; nothing taken.
        assert_eq!(run(&kept(false), true, 1), (0, 0));
        assert_eq!(run(&kept(true), false, 1), (0, 0));
        // Its share is one: the next device still bears the rest.
        assert_eq!(run(&kept(false), true, 2), (1, 1));
    }

    #[test]
    fn what_is_left_to_take_is_an_attachment_or_a_job_never_a_contested_id() {
        let (h, e) = (HostId("h".into()), EnvId("e".into()));
        let d = HeldDevice {
            eids: smallvec::smallvec![e.clone()],
            jobs: smallvec::smallvec![Pid(7)],
            ..HeldDevice::new(GpuIndex(0))
        };
        let mut taken = Taken::default();
        assert!(taken.takeable(&h, &d));
        taken.detached.insert((h.clone(), GpuIndex(0), e.clone()));
        assert!(taken.takeable(&h, &d), "its job still runs");
        taken.terminated.insert((h.clone(), Pid(7)));
        assert!(!taken.takeable(&h, &d));
        let contested = HeldDevice {
            contested: smallvec::smallvec![e],
            ..HeldDevice::new(GpuIndex(1))
        };
        assert!(!taken.takeable(&h, &contested));
        assert!(taken.holds(&h, "u", &contested), "still counted");
        let kept = HeldDevice {
            kept: true,
            jobs: smallvec::smallvec![Pid(8)],
            ..HeldDevice::new(GpuIndex(2))
        };
        assert!(!taken.takeable(&h, &kept));
    }

    /// The group caps' order: the first job that runs on after what is
    /// carried out, no more recent than where a hold put the device.
    #[test]
    fn a_devices_place_is_its_first_job_that_runs_on() {
        let h = HostId("h".into());
        let mut d = HeldDevice::new(GpuIndex(0));
        let taken = Taken::default();
        assert_eq!(taken.since(&h, &d), None);
        d.since = Some(5);
        assert_eq!(taken.since(&h, &d), Some(5), "no start times: since");
        d.started(Pid(1), Some(10));
        d.started(Pid(2), Some(20));
        d.started(Pid(3), None);
        assert_eq!(d.since, Some(5));
        assert_eq!(&d.starts[..], [(Pid(1), 10), (Pid(2), 20)]);
        assert_eq!(taken.since(&h, &d), Some(10));
        let mut taken = Taken::default();
        taken.terminated.insert((h.clone(), Pid(1)));
        assert_eq!(taken.since(&h, &d), Some(20), "its first job ends");
        taken.terminated.insert((HostId("other".into()), Pid(2)));
        assert_eq!(taken.since(&h, &d), Some(20), "another host's pid 2");
        let mut due = Taken::default();
        due.unseen_ending.insert((h.clone(), Pid(1)));
        assert_eq!(
            due.since(&h, &d),
            Some(20),
            "its first job's wait is due, unseen"
        );
        taken.terminated.insert((h.clone(), Pid(2)));
        assert_eq!(taken.since(&h, &d), None, "all end");
        d.held_since = Some(15);
        assert_eq!(taken.since(&h, &d), None, "all end, held or not");
        assert_eq!(Taken::default().since(&h, &d), Some(10), "older than held");
        d.held_since = Some(7);
        assert_eq!(
            Taken::default().since(&h, &d),
            Some(7),
            "held: no more recent"
        );
    }

    /// A device whose jobs and member processes all end this cycle is
    /// idle; one where either works on is not.
    #[test]
    fn a_device_whose_work_ends_this_cycle_is_idle() {
        let h = HostId("h".into());
        let d = HeldDevice {
            eids: smallvec::smallvec![EnvId("e".into())],
            pids: smallvec::smallvec![Pid(1)],
            jobs: smallvec::smallvec![Pid(2)],
            working: true,
            stray: true,
            ..HeldDevice::new(GpuIndex(0))
        };
        let mut taken = Taken::default();
        assert_eq!(taken.turn(&h, &d), WORKING);
        taken.terminated.insert((h.clone(), Pid(1)));
        assert_eq!(taken.turn(&h, &d), WORKING, "its job runs on");
        taken.terminated.remove(&(h.clone(), Pid(1)));
        taken.terminated.insert((h.clone(), Pid(2)));
        assert_eq!(taken.turn(&h, &d), WORKING, "its member runs on");
        taken.terminated.insert((h.clone(), Pid(1)));
        assert_eq!(taken.turn(&h, &d), 1);
        let vouched = HeldDevice { vouched: true, ..d };
        assert_eq!(taken.turn(&h, &vouched), 2);
    }

    /// Another shard's part says what its waits end: each flag stands for
    /// what this shard's own waits would say.
    #[test]
    fn another_shards_soon_flags_give_a_device_its_turn() {
        let h = HostId("h".into());
        let d = HeldDevice {
            eids: smallvec::smallvec![EnvId("e".into())],
            pids: smallvec::smallvec![Pid(1)],
            jobs: smallvec::smallvec![Pid(2)],
            working: true,
            stray: true,
            ..HeldDevice::new(GpuIndex(0))
        };
        let taken = Taken::default();
        let with = |jobs, pids, eids| HeldDevice {
            soon: SoonHere { jobs, pids, eids },
            ..d.clone()
        };
        assert_eq!(taken.turn(&h, &with(false, false, false)), WORKING);
        assert_eq!(taken.turn(&h, &with(true, false, true)), SOON, "freed");
        assert_eq!(taken.turn(&h, &with(true, true, false)), SOON, "left idle");
        assert_eq!(taken.turn(&h, &with(true, false, false)), WORKING);
        assert_eq!(taken.turn(&h, &with(false, true, true)), WORKING);
        // The same from this shard's own waits.
        let mut own = Taken::default();
        own.soon_terminated.insert((h.clone(), Pid(2)));
        assert_eq!(own.turn(&h, &d), WORKING, "its member works on");
        own.soon_terminated.insert((h.clone(), Pid(1)));
        assert_eq!(own.turn(&h, &d), SOON, "left idle");
        let mut own = Taken::default();
        own.soon_terminated.insert((h.clone(), Pid(2)));
        own.soon_detached
            .insert((h.clone(), GpuIndex(0), EnvId("e".into())));
        assert_eq!(own.turn(&h, &d), SOON, "freed");
        // Nothing left: idle, whatever the flags say.
        let mut done = Taken::default();
        done.terminated
            .extend([(h.clone(), Pid(1)), (h.clone(), Pid(2))]);
        assert_eq!(done.turn(&h, &with(true, true, true)), 1);
    }

    /// Under a user's own cap, a device taken before one whose job frees
    /// it as well is given back: the user loses no more than the excess.
    #[test]
    fn a_users_cap_gives_back_a_pick_a_later_one_makes_needless() {
        let (h0, h1) = (HostId("h0".into()), HostId("h1".into()));
        let attached = |i: u32, e: &str, pid: u32| HeldDevice {
            eids: smallvec::smallvec![EnvId(e.into())],
            pids: smallvec::smallvec![Pid(pid)],
            working: true,
            ..HeldDevice::new(GpuIndex(i))
        };
        let first = attached(0, "b0", 2);
        let spanning = attached(0, "b1", 5);
        let also = HeldDevice {
            jobs: smallvec::smallvec![Pid(5)],
            working: true,
            stray: true,
            ..HeldDevice::new(GpuIndex(1))
        };
        let c: Vec<Candidate> = vec![
            (&h0, "bob", &first),
            (&h1, "bob", &spanning),
            (&h1, "bob", &also),
        ];
        let mut plain = Taken::default();
        let (all, freed) = take(&c, 2, &mut plain, false);
        assert_eq!((all.len(), freed), (2, 3), "{all:?}");
        let mut taken = Taken::default();
        let (spared, freed) = take_sparing(&c, 2, &mut taken);
        assert_eq!(freed, 2);
        assert_eq!(spared.len(), 1, "{spared:?}");
        assert!(spared.iter().all(|a| matches!(a,
            Action::Detach { host, .. } | Action::Terminate { host, .. } if *host == h1)));
        assert!(taken.holds(&h0, "bob", &first), "given back");
        assert!(!taken.terminated.contains(&(h0.clone(), Pid(2))));
        assert!(taken.terminated.contains(&(h1.clone(), Pid(5))));
        // Exactly the excess: nothing given back.
        let mut taken = Taken::default();
        let (exact, freed) = take_sparing(&c, 3, &mut taken);
        assert_eq!((exact.len(), freed), (2, 3));
        // Over by one: the first pick is enough, and kept.
        let mut taken = Taken::default();
        let (one, freed) = take_sparing(&c, 1, &mut taken);
        assert_eq!((one.len(), freed), (1, 1));
        assert!(!taken.holds(&h0, "bob", &first));
    }

    /// Giving a pick back never moves it: a retake that would take a
    /// device not picked before (here h2's, in place of h0's two) is
    /// refused, though it takes fewer actions.
    #[test]
    fn a_pick_given_back_never_moves_onto_a_device_not_picked_before() {
        let (h0, h1, h2) = (
            HostId("h0".into()),
            HostId("h1".into()),
            HostId("h2".into()),
        );
        let attached = |i: u32, e: &str, pids: &[u32], jobs: &[u32]| HeldDevice {
            eids: smallvec::smallvec![EnvId(e.into())],
            pids: pids.iter().map(|&p| Pid(p)).collect(),
            jobs: jobs.iter().map(|&p| Pid(p)).collect(),
            working: true,
            ..HeldDevice::new(GpuIndex(i))
        };
        let stray = |i: u32, job: u32| HeldDevice {
            jobs: smallvec::smallvec![Pid(job)],
            working: true,
            stray: true,
            ..HeldDevice::new(GpuIndex(i))
        };
        // h0 device 0: a member 7 (also on h0 device 3) and a stray 8;
        // h1 device 0: a member 5 (also on h1 device 1); h2 device 0 idle
        // but for its attachment.
        let a = attached(0, "b0", &[7], &[8]);
        let b = attached(0, "b1", &[5], &[]);
        let c = attached(0, "b2", &[], &[]);
        let (z, y) = (stray(3, 7), stray(1, 5));
        let cands: Vec<Candidate> = vec![
            (&h0, "bob", &a),
            (&h1, "bob", &b),
            (&h2, "bob", &c),
            (&h0, "bob", &z),
            (&h1, "bob", &y),
        ];
        let mut plain = Taken::default();
        let (all, freed) = take(&cands, 3, &mut plain, false);
        assert_eq!((all.len(), freed), (3, 4), "{all:?}");
        let mut taken = Taken::default();
        let (spared, freed) = take_sparing(&cands, 3, &mut taken);
        assert_eq!(spared, all, "nothing given back");
        assert_eq!(freed, 4);
        assert!(taken.holds(&h2, "bob", &c), "h2 not taken in h0's place");
    }

    /// Where no job runs on two of the devices, giving back never applies:
    /// the take is the plain one, whatever is taken already.
    #[test]
    fn without_a_shared_job_the_take_is_the_plain_one() {
        let h = HostId("h".into());
        let idle: Vec<HeldDevice> = (0..4)
            .map(|i| HeldDevice {
                eids: smallvec::smallvec![EnvId(format!("e{i}").into())],
                ..HeldDevice::new(GpuIndex(i))
            })
            .collect();
        let c: Vec<Candidate> = idle.iter().map(|d| (&h, "bob", d)).collect();
        let mut before = Taken::default();
        before.terminated.insert((HostId("other".into()), Pid(9)));
        let (mut plain, mut spared) = (before.clone(), before);
        let want = take(&c, 2, &mut plain, false);
        assert_eq!(take_sparing(&c, 2, &mut spared), want);
        assert_eq!(want.1, 2);
        assert_eq!(spared.detached, plain.detached);
        assert_eq!(spared.terminated, plain.terminated);
    }
}
