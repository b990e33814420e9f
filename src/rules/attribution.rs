//! Who runs what on one host: which environment each GPU process is a
//! member of, and whose device cap each environment counts toward.
//!
//! genv's records are written by anyone: `envs.json` names any user and
//! lists any pid, and a process may carry any `GENV_ENVIRONMENT_ID` its
//! owner chose. What no user can fake about another is the uid of a
//! process and the environment that process was started with. So, where
//! the host says who runs each process (a live host):
//!
//! - An environment's **owner** is the user whose GPU processes carry its
//!   id. When none does (an idle environment), its record says whose it
//!   is, as in genv: that costs nobody a job, since no process runs in it.
//!   When processes of several users carry it, nothing the host shows
//!   tells whose it is (any user can start a job with any id, and rewrite
//!   any record): it is *contested*, nobody's.
//! - A GPU process is a **member** of the environment its id names only if
//!   its user is that environment's owner. Any other process carrying an
//!   id is a **stray**: its environment is gone (*orphaned*, such as a
//!   `nohup` job whose shell ended) or contested. A stray is judged as its
//!   own user's process outside any environment: reported, never
//!   terminated by a rule, and its GPUs count toward its user's device cap
//!   (letting a record die, or sharing an id, frees no room under a cap).
//!   So a job of bob's carrying alice's id never makes her jobs the ones
//!   terminated: it only makes the environment nobody's, which gains bob
//!   nothing a made-up id would not.
//! - A process once seen orphaned stays a stray for life ([`Orphans`],
//!   remembered from cycle to cycle): a record that appears later with its
//!   id (anyone can write one) never makes it a member again, and counts
//!   toward the orphan's owner (when no job that may be a member carries
//!   the id), whatever user it names, or none.
//! - The pids an environment lists only keep it alive (genv's clean-up);
//!   they never say whose it is.
//!
//! A recorded genv snapshot says nothing of uids: there, as in genv,
//! membership is by id and an environment is its recorded user's.
//!
//! Every pass here is linear in the host's state: records and processes are
//! indexed once.

use std::borrow::Cow;
use std::collections::HashSet;

use crate::model::HashMap;

use serde::Serialize;

use crate::model::{EnvId, GpuIndex, HostSnapshot, Owner, Pid};

/// To whom an environment's attached devices count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Charge {
    /// This user's cap.
    User(String),
    /// No one's.
    Nobody(Unconfirmed),
}

/// Why an environment counts toward no user's cap.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "why", rename_all = "snake_case")]
pub enum Unconfirmed {
    /// No process runs in it and its record names no user (as genv).
    Nameless,
    /// Processes of several users carry its id.
    Contested { users: Vec<String> },
    /// A later record with the id of an earlier one: the first is the
    /// environment, this one is ignored.
    Duplicate,
}

/// Where a GPU process stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Standing {
    /// A member of this environment (an index into the host's `envs`).
    Member(usize),
    /// Outside any environment (no `GENV_ENVIRONMENT_ID`).
    NoEnv,
    /// Its environment or its user could not be read: never acted on.
    Unknown,
    /// It carries an environment id but is no member of it.
    Stray(Stray),
}

/// Why a process that carries an environment id is no member of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "why", rename_all = "snake_case")]
pub enum Stray {
    /// No environment with its id exists on the host.
    Orphaned,
    /// It was orphaned when first seen so; a record with its id appeared
    /// since, and is not taken for its own.
    Reclaimed,
    /// Processes of several users carry the id.
    Contested { users: Vec<String> },
}

/// Processes of one host seen orphaned, by pid and start time: they stay
/// strays while they live (a cycle passes on those still seen).
pub type Orphans = HashSet<(Pid, u64)>;

/// Who runs what on one host, worked out once from its snapshot.
///
/// Built with a handful of allocations whatever the host holds (it runs
/// for every host every cycle): names are borrowed from the snapshot,
/// members and attachments kept as offsets into two flat lists.
#[derive(Debug, Clone)]
pub struct Attribution<'a> {
    snap: &'a HostSnapshot,
    /// The first record of each id (index into `snap.envs`).
    index: HashMap<&'a EnvId, usize>,
    /// Per record: whose cap it counts toward.
    charges: Vec<Charged<'a>>,
    /// Per process of the snapshot: where it stands.
    standing: Vec<Standing>,
    /// Record `i`'s members are `member_list[member_at[i]..member_at[i + 1]]`
    /// (process indices, in snapshot order).
    member_at: Vec<usize>,
    member_list: Vec<usize>,
    /// Record `i`'s devices are `attached_list[attached_at[i]..attached_at[i + 1]]`,
    /// in device order; `attached_sorted` holds the same groups sorted.
    attached_at: Vec<usize>,
    attached_list: Vec<GpuIndex>,
    attached_sorted: Vec<GpuIndex>,
    /// (record, device, process index) of every member on each of its GPUs,
    /// sorted by record and device, processes in snapshot order.
    member_gpus: Vec<(usize, GpuIndex, usize)>,
}

/// A record's charge, its user's name borrowed where it can be.
#[derive(Debug, Clone)]
enum Charged<'a> {
    User {
        name: Cow<'a, str>,
        uid: Option<u32>,
    },
    Nobody(Unconfirmed),
}

/// Offsets and a flat list grouping `items` (group, item) by group, in
/// the order given, for `groups` groups.
fn grouped<T: Copy>(groups: usize, items: &[(usize, T)]) -> (Vec<usize>, Vec<T>) {
    let mut at = vec![0; groups + 1];
    for (g, _) in items {
        at[g + 1] += 1;
    }
    for g in 0..groups {
        at[g + 1] += at[g];
    }
    let mut next = at.clone();
    let mut list = Vec::with_capacity(items.len());
    list.extend(items.iter().map(|(_, t)| *t));
    for (g, t) in items {
        list[next[*g]] = *t;
        next[*g] += 1;
    }
    (at, list)
}

/// What the processes carrying one id say of its owner.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Carriers {
    None,
    One(u32),
    Several,
}

impl<'a> Attribution<'a> {
    /// Works out memberships and charges of `snap`, whose processes of
    /// `orphans` (seen orphaned earlier) stay strays.
    pub fn of(snap: &'a HostSnapshot, orphans: &Orphans) -> Self {
        let n = snap.envs.len();
        let mut index = HashMap::with_capacity_and_hasher(n, Default::default());
        for (i, e) in snap.envs.iter().enumerate() {
            index.entry(&e.eid).or_insert(i);
        }
        let live = snap.truth.is_some();
        let degraded = snap.state_problem().is_some();
        let orphaned =
            |p: &crate::model::Process| p.start_time.is_some_and(|t| orphans.contains(&(p.pid, t)));
        // Who carries each id: jobs that may be members, then (for a
        // record no such job carries) jobs seen orphaned. A record written
        // for an orphan's id is its owner's, whatever it names.
        let mut carriers = vec![Carriers::None; n];
        let mut by_orphans = vec![Carriers::None; n];
        if live {
            for p in &snap.processes {
                if let (Some(eid), Some(uid)) = (p.owner.eid(), p.uid) {
                    if let Some(&i) = index.get(eid) {
                        let c = if orphaned(p) {
                            &mut by_orphans[i]
                        } else {
                            &mut carriers[i]
                        };
                        *c = match *c {
                            Carriers::None => Carriers::One(uid),
                            Carriers::One(u) if u == uid => Carriers::One(u),
                            _ => Carriers::Several,
                        };
                    }
                }
            }
            for (c, o) in carriers.iter_mut().zip(by_orphans) {
                if *c == Carriers::None {
                    *c = o;
                }
            }
        }
        let mut contested = contesting(snap, &index, &carriers);
        let charges: Vec<Charged> = snap
            .envs
            .iter()
            .enumerate()
            .map(|(i, e)| {
                if index.get(&e.eid) != Some(&i) {
                    return Charged::Nobody(Unconfirmed::Duplicate);
                }
                match carriers[i] {
                    Carriers::None => match e.username.as_deref().filter(|u| !u.is_empty()) {
                        Some(u) => Charged::User {
                            name: Cow::Borrowed(u),
                            uid: None,
                        },
                        None => Charged::Nobody(Unconfirmed::Nameless),
                    },
                    Carriers::One(uid) => Charged::User {
                        name: name_of(snap, uid),
                        uid: Some(uid),
                    },
                    Carriers::Several => Charged::Nobody(Unconfirmed::Contested {
                        users: contested.remove(&i).unwrap_or_default(),
                    }),
                }
            })
            .collect();
        let mut members = Vec::with_capacity(snap.processes.len());
        let standing = snap
            .processes
            .iter()
            .enumerate()
            .map(|(pi, p)| {
                let s = match &p.owner {
                    Owner::Unknown(_) => Standing::Unknown,
                    // Judged as carrying none, as it could have by unsetting it.
                    Owner::NoEnv | Owner::Hidden(_) => Standing::NoEnv,
                    // Its environment cannot be judged while genv's state
                    // cannot be read: no member, no stray (never remembered
                    // as orphaned for a garbled file).
                    Owner::Env(_) if degraded => Standing::Unknown,
                    Owner::Env(_) if orphaned(p) => {
                        match index.get(p.owner.eid().expect("an Env owner")) {
                            Some(_) => Standing::Stray(Stray::Reclaimed),
                            None => Standing::Stray(Stray::Orphaned),
                        }
                    }
                    Owner::Env(eid) => match (index.get(eid), live, p.uid) {
                        (None, true, None) => Standing::Unknown,
                        (None, _, _) => Standing::Stray(Stray::Orphaned),
                        (Some(&i), false, _) => Standing::Member(i),
                        (Some(_), true, None) => Standing::Unknown,
                        (Some(&i), true, Some(uid)) => match &charges[i] {
                            Charged::User { uid: Some(o), .. } if *o == uid => Standing::Member(i),
                            Charged::Nobody(Unconfirmed::Contested { users }) => {
                                Standing::Stray(Stray::Contested {
                                    users: users.clone(),
                                })
                            }
                            // Not reached: every carrier's uid made the owner.
                            _ => Standing::Unknown,
                        },
                    },
                };
                if let Standing::Member(i) = s {
                    members.push((i, pi));
                }
                s
            })
            .collect();
        let (member_at, member_list) = grouped(n, &members);
        let mut attached = Vec::with_capacity(n);
        let mut last: Vec<Option<GpuIndex>> = vec![None; n];
        for d in snap.devices.iter() {
            for a in &d.attachments {
                if let Some(&i) = index.get(&a.eid) {
                    // Once per device entry, even if it lists the id twice.
                    if last[i] != Some(d.index) {
                        last[i] = Some(d.index);
                        attached.push((i, d.index));
                    }
                }
            }
        }
        let (attached_at, attached_list) = grouped(n, &attached);
        let mut attached_sorted = attached_list.clone();
        for i in 0..n {
            attached_sorted[attached_at[i]..attached_at[i + 1]].sort_unstable();
        }
        let mut member_gpus: Vec<(usize, GpuIndex, usize)> = Vec::with_capacity(members.len());
        member_gpus.extend(
            members
                .iter()
                .flat_map(|&(i, pi)| snap.processes[pi].indices().map(move |d| (i, d, pi))),
        );
        // Stable: each (record, device)'s processes stay in snapshot order.
        member_gpus.sort_by_key(|&(i, d, _)| (i, d));
        Attribution {
            snap,
            index,
            charges,
            standing,
            member_at,
            member_list,
            attached_at,
            attached_list,
            attached_sorted,
            member_gpus,
        }
    }

    /// The snapshot it is about.
    pub fn snapshot(&self) -> &'a HostSnapshot {
        self.snap
    }

    /// The index of the environment with id `eid` (its first record).
    pub fn env(&self, eid: &EnvId) -> Option<usize> {
        self.index.get(eid).copied()
    }

    /// Whose cap record `i` counts toward.
    pub fn charge(&self, i: usize) -> Charge {
        match &self.charges[i] {
            Charged::User { name, .. } => Charge::User(name.to_string()),
            Charged::Nobody(why) => Charge::Nobody(why.clone()),
        }
    }

    /// The user record `i` counts toward, if any.
    pub fn charged(&self, i: usize) -> Option<&str> {
        match &self.charges[i] {
            Charged::User { name, .. } => Some(name),
            Charged::Nobody(_) => None,
        }
    }

    /// Why record `i` counts toward nobody, if it does.
    pub fn uncharged(&self, i: usize) -> Option<&Unconfirmed> {
        match &self.charges[i] {
            Charged::User { .. } => None,
            Charged::Nobody(why) => Some(why),
        }
    }

    /// Where process `pi` (an index into the snapshot's processes) stands.
    pub fn standing(&self, pi: usize) -> &Standing {
        &self.standing[pi]
    }

    /// The member processes of record `i`, in snapshot order.
    pub fn members(&self, i: usize) -> impl Iterator<Item = &'a crate::model::Process> + '_ {
        self.member_list[self.member_at[i]..self.member_at[i + 1]]
            .iter()
            .map(|&pi| &self.snap.processes[pi])
    }

    /// The member processes of record `i`, as indices into the snapshot's
    /// processes, in snapshot order.
    pub fn member_indices(&self, i: usize) -> &[usize] {
        &self.member_list[self.member_at[i]..self.member_at[i + 1]]
    }

    /// The devices record `i` is attached to, in device order.
    pub fn attached(&self, i: usize) -> &[GpuIndex] {
        &self.attached_list[self.attached_at[i]..self.attached_at[i + 1]]
    }

    /// Whether record `i` is attached to `device` (a binary search).
    pub fn is_attached(&self, i: usize, device: GpuIndex) -> bool {
        self.attached_sorted[self.attached_at[i]..self.attached_at[i + 1]]
            .binary_search(&device)
            .is_ok()
    }

    /// The member processes of record `i` that run on `device`, in
    /// snapshot order (a binary search).
    pub fn members_on(
        &self,
        i: usize,
        device: GpuIndex,
    ) -> impl Iterator<Item = &'a crate::model::Process> + '_ {
        let from = self
            .member_gpus
            .partition_point(|&(j, d, _)| (j, d) < (i, device));
        let to = self
            .member_gpus
            .partition_point(|&(j, d, _)| (j, d) <= (i, device));
        self.member_gpus[from..to]
            .iter()
            .map(|&(_, _, pi)| &self.snap.processes[pi])
    }

    /// The user a process belongs to, as the caps count users: the host's
    /// name for its uid on a live host; on a recording, its environment's.
    pub fn user_of(&self, pi: usize) -> Option<Cow<'a, str>> {
        match (&self.snap.truth, self.snap.processes[pi].uid) {
            (Some(_), Some(uid)) => Some(name_of(self.snap, uid)),
            (Some(_), None) => None,
            (None, _) => match &self.standing[pi] {
                Standing::Member(i) => match &self.charges[*i] {
                    Charged::User { name, .. } => Some(name.clone()),
                    Charged::Nobody(_) => None,
                },
                _ => None,
            },
        }
    }

    /// Whether record `i` lists a live pid of the user it is charged to.
    /// Any user can list any pid, so this never says whose it is; a device
    /// cap takes environments that lack it first (a record forged in
    /// someone's name, listing none of their processes, goes before theirs).
    /// Linear in the record's pids: callers ask once per record.
    pub fn vouched(&self, i: usize) -> bool {
        let (Some(truth), Charged::User { name, .. }) = (&self.snap.truth, &self.charges[i]) else {
            return false;
        };
        self.snap.envs[i]
            .pids
            .iter()
            .filter_map(|p| truth.pid_uids.get(p))
            .any(|uid| name_of(self.snap, *uid) == *name)
    }

    /// The processes seen orphaned, now or before, that still run: what
    /// the next cycle is to remember.
    pub fn orphans(&self) -> Orphans {
        self.snap
            .processes
            .iter()
            .zip(&self.standing)
            .filter(|(_, s)| matches!(s, Standing::Stray(Stray::Orphaned | Stray::Reclaimed)))
            .filter_map(|(p, _)| Some((p.pid, p.start_time?)))
            .collect()
    }
}

/// The host's name for `uid`, borrowed (`uid N` when it has none).
fn name_of(snap: &HostSnapshot, uid: u32) -> Cow<'_, str> {
    match snap.truth.as_ref().and_then(|t| t.user_names.get(&uid)) {
        Some(n) => Cow::Borrowed(n),
        None => Cow::Owned(format!("uid {uid}")),
    }
}

/// The users whose processes carry each contested record's id, by name
/// (rare): one pass over the processes, however many ids are contested.
fn contesting(
    snap: &HostSnapshot,
    index: &HashMap<&EnvId, usize>,
    carriers: &[Carriers],
) -> HashMap<usize, Vec<String>> {
    let mut users: HashMap<usize, Vec<String>> = HashMap::default();
    if !carriers.contains(&Carriers::Several) {
        return users;
    }
    for p in &snap.processes {
        let (Some(eid), Some(uid)) = (p.owner.eid(), p.uid) else {
            continue;
        };
        match index.get(eid) {
            Some(&i) if carriers[i] == Carriers::Several => {
                users
                    .entry(i)
                    .or_default()
                    .push(name_of(snap, uid).into_owned());
            }
            _ => {}
        }
    }
    for names in users.values_mut() {
        names.sort_unstable();
        names.dedup();
    }
    users
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;
    use crate::model::{Env, Process};

    /// A live host where uid 1001 is alice and 1002 bob.
    fn host(envs: Vec<Env>, processes: Vec<Process>) -> HostSnapshot {
        HostSnapshot {
            processes,
            envs: envs.into(),
            devices: devices(2, &[]).into(),
            truth: Some(alice_and_bob(&[(10, 1001), (20, 1002)])),
            ..Default::default()
        }
    }

    fn job(pid: u32, eid: Option<&str>, uid: u32) -> Process {
        let mut p = proc_(pid, eid, &[(0, mib(1))]);
        p.uid = Some(uid);
        p
    }

    fn listing(eid: &str, user: Option<&str>, pids: &[i64]) -> Env {
        Env {
            pids: pids.to_vec(),
            ..env(eid, user, None)
        }
    }

    fn charge_of(snap: &HostSnapshot, eid: &str) -> Charge {
        let a = Attribution::of(snap, &Orphans::default());
        a.charge(a.env(&EnvId(eid.into())).unwrap())
    }

    fn standing_of(snap: &HostSnapshot, pid: u32) -> Standing {
        let a = Attribution::of(snap, &Orphans::default());
        let pi = snap.processes.iter().position(|p| p.pid.0 == pid).unwrap();
        a.standing(pi).clone()
    }

    #[test]
    fn an_environment_is_its_processes_users_whatever_its_record_says() {
        let s = host(
            vec![listing("a", Some("bob"), &[1])],
            vec![job(30, Some("a"), 1001)],
        );
        assert_eq!(charge_of(&s, "a"), Charge::User("alice".into()));
        assert_eq!(standing_of(&s, 30), Standing::Member(0));
    }

    #[test]
    fn several_jobs_of_one_user_are_all_members_of_their_environment() {
        let s = host(
            vec![listing("a", Some("alice"), &[1])],
            vec![job(30, Some("a"), 1001), job(31, Some("a"), 1001)],
        );
        assert_eq!(charge_of(&s, "a"), Charge::User("alice".into()));
        assert_eq!(standing_of(&s, 30), Standing::Member(0));
        assert_eq!(standing_of(&s, 31), Standing::Member(0));
    }

    #[test]
    fn an_orphan_stays_a_stray_when_a_record_for_its_id_appears() {
        let s = host(
            vec![listing("a", Some("bob"), &[1])],
            vec![job(30, Some("a"), 1001), job(31, Some("gone"), 1001)],
        );
        let orphans: Orphans = [(Pid(30), 1030), (Pid(31), 1031)].into_iter().collect();
        let a = Attribution::of(&s, &orphans);
        assert_eq!(a.standing(0), &Standing::Stray(Stray::Reclaimed));
        assert_eq!(a.standing(1), &Standing::Stray(Stray::Orphaned));
        // The record written for its id is the orphan's owner's, whatever
        // it names (even no one): it counts toward her cap.
        assert_eq!(a.charge(0), Charge::User("alice".into()));
        let mut nameless = s.clone();
        std::sync::Arc::make_mut(&mut nameless.envs)[0].username = None;
        let a = Attribution::of(&nameless, &orphans);
        assert_eq!(a.charge(0), Charge::User("alice".into()));
        assert_eq!(a.standing(0), &Standing::Stray(Stray::Reclaimed));
        // Orphans of two users carry it: nobody's.
        let mut two = nameless.clone();
        two.processes.push(job(32, Some("a"), 1002));
        let orphans: Orphans = [(Pid(30), 1030), (Pid(32), 1032)].into_iter().collect();
        let a = Attribution::of(&two, &orphans);
        assert!(
            matches!(a.charge(0), Charge::Nobody(Unconfirmed::Contested { .. })),
            "{:?}",
            a.charge(0)
        );
        // A job that may be a member comes first: the record is its user's.
        let orphans: Orphans = [(Pid(30), 1030)].into_iter().collect();
        let a = Attribution::of(&two, &orphans);
        assert_eq!(a.charge(0), Charge::User("bob".into()));
        assert_eq!(a.standing(2), &Standing::Member(0));
    }

    #[test]
    fn attachments_are_found_whatever_order_devices_json_lists_devices_in() {
        // devices.json lists device 1 before device 0; alice's job on 0.
        let mut s = host(
            vec![listing("a", Some("alice"), &[1])],
            vec![job(30, Some("a"), 1001)],
        );
        s.devices = devices(3, &[(0, "a"), (1, "a"), (2, "a")]).into();
        std::sync::Arc::make_mut(&mut s.devices).reverse();
        let a = Attribution::of(&s, &Orphans::default());
        for d in 0..3 {
            assert!(a.is_attached(0, GpuIndex(d)), "device {d}");
        }
        assert!(crate::rules::evaluate(
            &crate::rules::test_support::local(s),
            &crate::rules::Policy::default()
        )
        .is_empty());
    }

    #[test]
    fn an_idle_environment_is_its_records_user_as_in_genv() {
        let s = host(vec![listing("a", Some("alice"), &[1])], vec![]);
        assert_eq!(charge_of(&s, "a"), Charge::User("alice".into()));
        let s = host(
            vec![listing("n", None, &[1]), listing("e", Some(""), &[1])],
            vec![],
        );
        assert_eq!(charge_of(&s, "n"), Charge::Nobody(Unconfirmed::Nameless));
        assert_eq!(charge_of(&s, "e"), Charge::Nobody(Unconfirmed::Nameless));
    }

    #[test]
    fn listed_pids_say_nothing_of_whose_an_environment_is() {
        // bob's env lists alice's GPU job and pid 1: still bob's (his record,
        // no process of its own), and alice's job stays in her own env.
        let s = host(
            vec![
                listing("a", Some("alice"), &[10]),
                listing("b", Some("bob"), &[30, 1]),
            ],
            vec![job(30, Some("a"), 1001)],
        );
        assert_eq!(charge_of(&s, "b"), Charge::User("bob".into()));
        assert_eq!(standing_of(&s, 30), Standing::Member(0));
    }

    #[test]
    fn an_id_carried_by_several_users_is_contested_and_nobodys() {
        // bob runs a job with alice's id: whatever the record says, neither
        // job is a member, and the env counts toward nobody's cap.
        for recorded in [Some("alice"), Some("bob"), Some("carol"), None] {
            let s = host(
                vec![listing("a", recorded, &[10])],
                vec![job(30, Some("a"), 1001), job(31, Some("a"), 1002)],
            );
            let users = vec!["alice".to_string(), "bob".to_string()];
            assert_eq!(
                charge_of(&s, "a"),
                Charge::Nobody(Unconfirmed::Contested {
                    users: users.clone()
                })
            );
            for pid in [30, 31] {
                assert_eq!(
                    standing_of(&s, pid),
                    Standing::Stray(Stray::Contested {
                        users: users.clone()
                    })
                );
            }
            let a = Attribution::of(&s, &Orphans::default());
            assert_eq!(a.members(0).count(), 0);
            assert_eq!(a.user_of(1).as_deref(), Some("bob"));
        }
    }

    #[test]
    fn only_contested_ids_have_their_carriers_named() {
        // "a" is contested, "b" is alice's alone: one pass names a's
        // carriers (each once, in order) and nobody for b.
        let s = host(
            vec![listing("a", None, &[10]), listing("b", None, &[11])],
            vec![
                job(30, Some("a"), 1002),
                job(31, Some("b"), 1001),
                job(32, Some("a"), 1001),
                job(33, Some("a"), 1002),
            ],
        );
        let index = s
            .envs
            .iter()
            .enumerate()
            .map(|(i, e)| (&e.eid, i))
            .collect();
        let named = contesting(&s, &index, &[Carriers::Several, Carriers::One(1001)]);
        assert_eq!(named.len(), 1);
        assert_eq!(named[&0], ["alice", "bob"]);
        let none = contesting(&s, &index, &[Carriers::One(1002), Carriers::One(1001)]);
        assert!(none.is_empty());
    }

    #[test]
    fn orphans_unknowns_and_duplicates() {
        let mut unknown_uid = job(32, Some("a"), 1);
        unknown_uid.uid = None;
        let mut hidden = job(33, None, 1001);
        hidden.owner = Owner::Unknown("permission denied".into());
        let s = host(
            vec![
                listing("a", Some("alice"), &[10]),
                listing("a", Some("bob"), &[20]),
            ],
            vec![
                job(30, Some("gone"), 1001),
                job(31, None, 1002),
                unknown_uid,
                hidden,
            ],
        );
        assert_eq!(standing_of(&s, 30), Standing::Stray(Stray::Orphaned));
        assert_eq!(standing_of(&s, 31), Standing::NoEnv);
        assert_eq!(standing_of(&s, 32), Standing::Unknown);
        assert_eq!(standing_of(&s, 33), Standing::Unknown);
        let a = Attribution::of(&s, &Orphans::default());
        assert_eq!(a.charge(0), Charge::User("alice".into()));
        assert_eq!(a.charge(1), Charge::Nobody(Unconfirmed::Duplicate));
        assert_eq!(a.env(&EnvId("a".into())), Some(0));
    }

    #[test]
    fn recordings_go_by_id_and_record_as_genv() {
        let mut s = host(
            vec![listing("a", Some("alice"), &[10])],
            vec![job(30, Some("a"), 1002), job(31, Some("x"), 1002)],
        );
        s.truth = None;
        assert_eq!(charge_of(&s, "a"), Charge::User("alice".into()));
        assert_eq!(standing_of(&s, 30), Standing::Member(0));
        assert_eq!(standing_of(&s, 31), Standing::Stray(Stray::Orphaned));
        let a = Attribution::of(&s, &Orphans::default());
        assert_eq!(a.user_of(0).as_deref(), Some("alice"));
        assert_eq!(a.user_of(1), None);
    }

    #[test]
    fn a_record_is_vouched_for_by_a_live_pid_of_its_charged_user() {
        let s = host(
            vec![
                listing("a", Some("alice"), &[10]),
                listing("f", Some("alice"), &[20, 99]),
                listing("b", Some("bob"), &[10]),
            ],
            vec![],
        );
        let a = Attribution::of(&s, &Orphans::default());
        assert!(a.vouched(0));
        assert!(!a.vouched(1), "bob's shell and a dead pid");
        assert!(!a.vouched(2), "alice's shell");
        let mut r = s.clone();
        r.truth = None;
        assert!(
            !Attribution::of(&r, &Orphans::default()).vouched(0),
            "a recording says nothing"
        );
    }

    #[test]
    fn uids_without_a_name() {
        let mut s = host(
            vec![listing("a", None, &[10])],
            vec![job(30, Some("a"), 1003)],
        );
        assert_eq!(charge_of(&s, "a"), Charge::User("uid 1003".into()));
        s.processes[0].uid = Some(1001);
        assert_eq!(charge_of(&s, "a"), Charge::User("alice".into()));
        s.truth.as_mut().unwrap().user_names.clear();
        assert_eq!(charge_of(&s, "a"), Charge::User("uid 1001".into()));
    }
}
