//! Whose cap an environment's devices count toward.
//!
//! genv charges an environment to the `username` recorded in `envs.json`,
//! a file every user can write: bob could name alice in his own record (and
//! get away with his devices), or forge an environment in alice's name
//! (and get alice's real jobs killed by her cap). So where the host can say
//! who runs an environment, it decides, not the record:
//!
//! - the owners (real uid) of the environment's live listed `pids`, and of
//!   the GPU processes that carry its `GENV_ENVIRONMENT_ID`, are its users;
//! - a pid listed by several environments on the host is evidence for none
//!   of them (genv lists an activating shell in one environment only);
//! - one user: the environment is charged to that user, under the host's
//!   name for the uid (whatever the record says);
//! - no live process, or several users: it is charged to nobody and
//!   reported, so a forged record can never charge someone else.
//!
//! A recorded genv snapshot carries no host truth; there the record is all
//! there is and genv's rule applies (environments without a username
//! count for nobody).

use serde::Serialize;

use crate::model::{Env, HostSnapshot};

/// To whom an environment's attached devices count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Charge {
    /// This user's cap.
    User(String),
    /// No one's: the host cannot confirm a single user.
    Nobody(Unconfirmed),
}

/// Why an environment counts toward no user's cap.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "why", rename_all = "snake_case")]
pub enum Unconfirmed {
    /// A recorded snapshot's environment without a username (as genv).
    Nameless,
    /// No live process of the environment says whose it is.
    NoLiveProcess,
    /// Its processes belong to several users.
    SeveralUsers { users: Vec<String> },
}

/// The charge of `env`, one of `snap`'s environments.
pub fn charge(snap: &HostSnapshot, env: &Env) -> Charge {
    let i = snap
        .envs
        .iter()
        .position(|e| std::ptr::eq(e, env))
        .expect("env is one of snap's environments");
    charges(snap).swap_remove(i)
}

/// The charge of each of `snap`'s environments, in order, in one pass.
pub fn charges(snap: &HostSnapshot) -> Vec<Charge> {
    let Some(truth) = &snap.truth else {
        return snap
            .envs
            .iter()
            .map(
                |env| match env.username.as_deref().filter(|u| !u.is_empty()) {
                    Some(u) => Charge::User(u.to_string()),
                    None => Charge::Nobody(Unconfirmed::Nameless),
                },
            )
            .collect();
    };
    // Hosts hold a handful of environments and a few dozen processes:
    // plain scans beat hashing here.
    let name = |uid: &u32| {
        truth
            .user_names
            .get(uid)
            .cloned()
            .unwrap_or_else(|| format!("uid {uid}"))
    };
    snap.envs
        .iter()
        .map(|env| {
            let listed_alone = |pid: &&i64| {
                !snap
                    .envs
                    .iter()
                    .any(|other| !std::ptr::eq(other, env) && other.pids.contains(pid))
            };
            let mut uids: Vec<u32> = env
                .pids
                .iter()
                .filter(listed_alone)
                .filter_map(|pid| truth.pid_uids.get(pid).copied())
                .chain(snap.processes_of(&env.eid).filter_map(|p| p.uid))
                .collect();
            uids.sort_unstable();
            uids.dedup();
            match uids.len() {
                0 => Charge::Nobody(Unconfirmed::NoLiveProcess),
                1 => Charge::User(name(&uids[0])),
                _ => Charge::Nobody(Unconfirmed::SeveralUsers {
                    users: uids.iter().map(name).collect(),
                }),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;
    use crate::model::HostTruth;

    /// A host where uid 1001 is alice and 1002 bob; pid 10 is alice's
    /// shell, 20 bob's; GPU process 30 is bob's, in env `b`.
    fn host(envs: Vec<Env>) -> HostSnapshot {
        let mut p = proc_(30, Some("b"), &[(0, mib(1))]);
        p.uid = Some(1002);
        HostSnapshot {
            processes: vec![p],
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

    fn listing(eid: &str, user: Option<&str>, pids: &[i64]) -> Env {
        Env {
            pids: pids.to_vec(),
            ..env(eid, user, None)
        }
    }

    fn charge_of(snap: &HostSnapshot, eid: &str) -> Charge {
        charge(snap, snap.envs.iter().find(|e| e.eid.0 == eid).unwrap())
    }

    #[test]
    fn consistent_records_are_charged_as_genv_does() {
        let s = host(vec![listing("a", Some("alice"), &[10])]);
        assert_eq!(charge_of(&s, "a"), Charge::User("alice".into()));
    }

    #[test]
    fn a_relabelled_env_stays_its_owners() {
        // bob names alice in his own record: his shell and his GPU process say bob.
        let s = host(vec![listing("b", Some("alice"), &[20])]);
        assert_eq!(charge_of(&s, "b"), Charge::User("bob".into()));
        let s = host(vec![listing("b", None, &[])]);
        assert_eq!(
            charge_of(&s, "b"),
            Charge::User("bob".into()),
            "its GPU process is bob's"
        );
    }

    #[test]
    fn a_forged_env_never_charges_its_victim() {
        // Listing alice's shell, which her real env lists too: evidence for neither.
        let s = host(vec![
            listing("real", Some("alice"), &[10]),
            listing("forged", Some("alice"), &[10]),
        ]);
        assert!(matches!(
            charge_of(&s, "forged"),
            Charge::Nobody(Unconfirmed::NoLiveProcess)
        ));
        // Listing alice's shell beside bob's own pid: several users, nobody.
        let s = host(vec![listing("forged", Some("alice"), &[10, 20])]);
        assert_eq!(
            charge_of(&s, "forged"),
            Charge::Nobody(Unconfirmed::SeveralUsers {
                users: vec!["alice".into(), "bob".into()]
            })
        );
        // Listing a dead or unknown pid: no evidence at all.
        let s = host(vec![listing("forged", Some("alice"), &[99])]);
        assert_eq!(
            charge_of(&s, "forged"),
            Charge::Nobody(Unconfirmed::NoLiveProcess)
        );
        // bob's GPU process in an env listing only alice's pid: several users.
        let s = host(vec![listing("b", Some("alice"), &[10])]);
        assert!(matches!(
            charge_of(&s, "b"),
            Charge::Nobody(Unconfirmed::SeveralUsers { .. })
        ));
    }

    #[test]
    fn uids_without_a_name_and_recorded_snapshots() {
        let mut s = host(vec![listing("a", Some("alice"), &[10])]);
        s.truth.as_mut().unwrap().user_names.clear();
        assert_eq!(charge_of(&s, "a"), Charge::User("uid 1001".into()));
        s.truth = None;
        assert_eq!(charge_of(&s, "a"), Charge::User("alice".into()));
        let s = HostSnapshot {
            truth: None,
            ..host(vec![
                listing("n", None, &[10]),
                listing("e", Some(""), &[10]),
            ])
        };
        assert_eq!(charge_of(&s, "n"), Charge::Nobody(Unconfirmed::Nameless));
        assert_eq!(charge_of(&s, "e"), Charge::Nobody(Unconfirmed::Nameless));
    }
}
