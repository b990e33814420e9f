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
//! - The pids an environment lists only keep it alive (genv's clean-up);
//!   they never say whose it is.
//!
//! A recorded genv snapshot says nothing of uids: there, as in genv,
//! membership is by id and an environment is its recorded user's.
//!
//! Every pass here is linear in the host's state: records and processes are
//! indexed once.

use std::collections::HashMap;

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
    /// Processes of several users carry the id.
    Contested { users: Vec<String> },
}

/// Who runs what on one host, worked out once from its snapshot.
#[derive(Debug, Clone)]
pub struct Attribution<'a> {
    snap: &'a HostSnapshot,
    /// The first record of each id (index into `snap.envs`).
    index: HashMap<&'a EnvId, usize>,
    /// Per record: whose cap it counts toward.
    charges: Vec<Charge>,
    /// Per process of the snapshot: where it stands.
    standing: Vec<Standing>,
    /// Per record: its member processes (indices), in snapshot order.
    members: Vec<Vec<usize>>,
    /// Per record: whether it lists a live pid of its charged user.
    vouched: Vec<bool>,
}

impl<'a> Attribution<'a> {
    /// Works out memberships and charges of `snap`.
    pub fn of(snap: &'a HostSnapshot) -> Self {
        let mut index = HashMap::with_capacity(snap.envs.len());
        for (i, e) in snap.envs.iter().enumerate() {
            index.entry(&e.eid).or_insert(i);
        }
        let first = |i: usize, e: &EnvId| index.get(e) == Some(&i);
        // The uids of the processes carrying each record's id.
        let mut carriers: Vec<Vec<u32>> = vec![Vec::new(); snap.envs.len()];
        if snap.truth.is_some() {
            for p in &snap.processes {
                if let (Some(eid), Some(uid)) = (p.owner.eid(), p.uid) {
                    if let Some(&i) = index.get(eid) {
                        carriers[i].push(uid);
                    }
                }
            }
        }
        let name = |uid: u32| user_name(snap, uid);
        let recorded = |i: usize| {
            snap.envs[i]
                .username
                .as_deref()
                .filter(|u| !u.is_empty())
                .map(str::to_string)
        };
        let mut charges = Vec::with_capacity(snap.envs.len());
        let mut owners = Vec::with_capacity(snap.envs.len());
        for (i, (e, uids)) in snap.envs.iter().zip(&mut carriers).enumerate() {
            uids.sort_unstable();
            uids.dedup();
            let (owner, charge) = if !first(i, &e.eid) {
                (None, Charge::Nobody(Unconfirmed::Duplicate))
            } else {
                match uids.as_slice() {
                    [] => (
                        None,
                        recorded(i).map_or(Charge::Nobody(Unconfirmed::Nameless), Charge::User),
                    ),
                    [uid] => (Some(*uid), Charge::User(name(*uid))),
                    several => {
                        let mut users: Vec<String> = several.iter().map(|u| name(*u)).collect();
                        users.sort_unstable();
                        (None, Charge::Nobody(Unconfirmed::Contested { users }))
                    }
                }
            };
            owners.push(owner);
            charges.push(charge);
        }
        let mut members = vec![Vec::new(); snap.envs.len()];
        let standing = snap
            .processes
            .iter()
            .enumerate()
            .map(|(pi, p)| {
                let s = match &p.owner {
                    Owner::Unknown(_) => Standing::Unknown,
                    Owner::NoEnv => Standing::NoEnv,
                    Owner::Env(eid) => match (index.get(eid), snap.truth.is_some(), p.uid) {
                        (None, true, None) => Standing::Unknown,
                        (None, _, _) => Standing::Stray(Stray::Orphaned),
                        (Some(&i), false, _) => Standing::Member(i),
                        (Some(_), true, None) => Standing::Unknown,
                        (Some(&i), true, Some(uid)) => match (owners[i], &charges[i]) {
                            (Some(o), _) if o == uid => Standing::Member(i),
                            (None, Charge::Nobody(Unconfirmed::Contested { users })) => {
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
                    members[i].push(pi);
                }
                s
            })
            .collect();
        let vouched = snap
            .envs
            .iter()
            .zip(&charges)
            .map(|(e, charge)| {
                let (Some(truth), Charge::User(user)) = (&snap.truth, charge) else {
                    return false;
                };
                e.pids
                    .iter()
                    .filter_map(|p| truth.pid_uids.get(p))
                    .any(|uid| name(*uid) == *user)
            })
            .collect();
        Attribution {
            snap,
            index,
            charges,
            standing,
            members,
            vouched,
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
    pub fn charge(&self, i: usize) -> &Charge {
        &self.charges[i]
    }

    /// Where process `pi` (an index into the snapshot's processes) stands.
    pub fn standing(&self, pi: usize) -> &Standing {
        &self.standing[pi]
    }

    /// The member processes of record `i`, in snapshot order.
    pub fn members(&self, i: usize) -> impl Iterator<Item = &'a crate::model::Process> + '_ {
        self.members[i].iter().map(|&pi| &self.snap.processes[pi])
    }

    /// The user a process belongs to, as the caps count users: the host's
    /// name for its uid on a live host; on a recording, its environment's.
    pub fn user_of(&self, pi: usize) -> Option<String> {
        match (&self.snap.truth, self.snap.processes[pi].uid) {
            (Some(_), Some(uid)) => Some(user_name(self.snap, uid)),
            (Some(_), None) => None,
            (None, _) => match &self.standing[pi] {
                Standing::Member(i) => match &self.charges[*i] {
                    Charge::User(u) => Some(u.clone()),
                    Charge::Nobody(_) => None,
                },
                _ => None,
            },
        }
    }

    /// Per record, the devices it is attached to, in device order, in one
    /// pass over the attachments.
    pub fn attachments(&self) -> Vec<Vec<GpuIndex>> {
        let mut out = vec![Vec::new(); self.snap.envs.len()];
        for d in &self.snap.devices {
            for a in &d.attachments {
                if let Some(i) = self.env(&a.eid) {
                    if out[i].last() != Some(&d.index) {
                        out[i].push(d.index);
                    }
                }
            }
        }
        out
    }

    /// Whether record `i` lists a live pid of the user it is charged to.
    /// Any user can list any pid, so this never says whose it is; a device
    /// cap takes environments that lack it first (a record forged in
    /// someone's name, listing none of their processes, goes before theirs).
    pub fn vouched(&self, i: usize) -> bool {
        self.vouched[i]
    }

    /// The member pids of record `i` that run on `device`.
    pub fn members_on(&self, i: usize, device: GpuIndex) -> Vec<Pid> {
        self.members(i)
            .filter(|p| p.usage_on(device).is_some())
            .map(|p| p.pid)
            .collect()
    }
}

/// The host's name for `uid` (`uid N` when it has none).
pub fn user_name(snap: &HostSnapshot, uid: u32) -> String {
    snap.truth
        .as_ref()
        .and_then(|t| t.user_names.get(&uid).cloned())
        .unwrap_or_else(|| format!("uid {uid}"))
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;
    use crate::model::{Env, HostTruth, Process};

    /// A live host where uid 1001 is alice and 1002 bob.
    fn host(envs: Vec<Env>, processes: Vec<Process>) -> HostSnapshot {
        HostSnapshot {
            processes,
            envs,
            devices: devices(2, &[]),
            truth: Some(HostTruth {
                pid_uids: [(10, 1001), (20, 1002)].into_iter().collect(),
                user_names: [(1001, "alice".to_string()), (1002, "bob".to_string())]
                    .into_iter()
                    .collect(),
            }),
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
        let a = Attribution::of(snap);
        a.charge(a.env(&EnvId(eid.into())).unwrap()).clone()
    }

    fn standing_of(snap: &HostSnapshot, pid: u32) -> Standing {
        let a = Attribution::of(snap);
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
            let a = Attribution::of(&s);
            assert_eq!(a.members(0).count(), 0);
            assert_eq!(a.user_of(1).as_deref(), Some("bob"));
        }
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
        let a = Attribution::of(&s);
        assert_eq!(a.charge(0), &Charge::User("alice".into()));
        assert_eq!(a.charge(1), &Charge::Nobody(Unconfirmed::Duplicate));
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
        let a = Attribution::of(&s);
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
        let a = Attribution::of(&s);
        assert!(a.vouched(0));
        assert!(!a.vouched(1), "bob's shell and a dead pid");
        assert!(!a.vouched(2), "alice's shell");
        let mut r = s.clone();
        r.truth = None;
        assert!(!Attribution::of(&r).vouched(0), "a recording says nothing");
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
