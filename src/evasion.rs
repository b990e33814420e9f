//! No evasion, as a property of the pure core (assembly, attribution, the
//! rules' per-host parts, notices): from any host a user can make (jobs of
//! any uid, their own or a sub-uid of theirs, with any environment id or
//! an environment that cannot be read, pids that change hands, any bytes
//! in genv's state files, a refused or unreadable state), every live GPU
//! process is either judged under its owner (sub-uids resolved) or
//! reported as unjudgeable with its reason, and counts toward its owner's
//! per-user caps whenever the kernel names its owner. And nothing bob
//! writes into the state files changes whose alice's processes are, nor
//! takes any of them out of her count.
//!
//! Cases: 1,024 per run (`PROPTEST_CASES` overrides).

use std::borrow::Cow;
use std::collections::BTreeMap;

use proptest::prelude::*;

use crate::model::{HostId, HostSnapshot, Pid};
use crate::rules::attribution::{Attribution, Standing};
use crate::rules::max_memory::HostMemory;
use crate::rules::{assess_host, Notice, Orphans, Policy};
use crate::snapshot::assemble::{assemble, Environ, ParsedState, RawHost, RawProc};

const ALICE: u32 = 1001;
const BOB: u32 = 1002;
/// One of bob's sub-uids (his range starts at 300000).
const BOBS_SUB: u32 = 300_001;
/// A uid in two users' ranges: nobody's to charge.
const SHARED_SUB: u32 = 400_000;

/// The uid a job runs as.
fn uid() -> impl Strategy<Value = Option<u32>> {
    prop_oneof![
        3 => Just(Some(ALICE)),
        3 => Just(Some(BOB)),
        2 => Just(Some(BOBS_SUB)),
        1 => Just(Some(SHARED_SUB)),
        1 => Just(None),
    ]
}

/// What `/proc` said of a GPU pid.
fn proc_() -> impl Strategy<Value = Option<RawProc<'static>>> {
    let environ = prop_oneof![
        4 => prop_oneof![Just("a"), Just("b"), Just("ghost"), Just("")]
            .prop_map(|e| Environ::Var(e.as_bytes().to_vec().into())),
        2 => Just(Environ::NoVar),
        1 => Just(Environ::Hidden("hung".into())),
        1 => Just(Environ::Unreadable("permissions".into())),
    ];
    prop_oneof![
        8 => (1u64..1000, uid(), environ).prop_map(|(start_time, uid, environ)| Some(RawProc::Seen {
            start_time,
            uid,
            environ,
        })),
        1 => Just(Some(RawProc::Unsure("it started after nvidia-smi was asked".into()))),
        // Not alive (it ended, or the driver lists a pid no process has).
        1 => Just(None),
    ]
}

/// genv's state as a user may leave it: honest records, forged ones, or
/// any bytes.
fn state() -> impl Strategy<Value = State> {
    let record = |eid: &'static str, user: &'static str, uid: u32, pid: u32| {
        format!(
            r#"{{"eid": "{eid}", "uid": {uid}, "creation": "x", "username": "{user}", "config": {{"name": null, "gpu_memory": "1gi", "gpus": null}}, "pids": [{pid}], "kernel_ids": []}}"#
        )
    };
    let honest = (
        Just(format!(
            r#"{{"envs": [{}, {}]}}"#,
            record("a", "alice", ALICE, 100),
            record("b", "bob", BOB, 101)
        )),
        Just(r#"{"devices": [{"index": 0, "total_memory": "1mi", "attachments": [{"eid": "a", "gpu_memory": null, "time": "t"}]}, {"index": 1, "total_memory": "1mi", "attachments": [{"eid": "b", "gpu_memory": null, "time": "t"}]}]}"#.to_string()),
    );
    let forged = (
        Just(format!(
            r#"{{"envs": [{}, {}]}}"#,
            record("a", "bob", BOB, 101),
            record("ghost", "alice", ALICE, 100)
        )),
        Just(r#"{"devices": [{"index": 0, "total_memory": "1mi", "attachments": [{"eid": "ghost", "gpu_memory": null, "time": "t"}, {"eid": "a", "gpu_memory": null, "time": "t"}]}]}"#.to_string()),
    );
    prop_oneof![
        3 => honest.prop_map(|(e, d)| (Some(e), Some(d))),
        2 => forged.prop_map(|(e, d)| (Some(e), Some(d))),
        1 => ".{0,40}".prop_map(|junk| (Some(junk), None)),
        1 => Just((None, None)),
    ]
}

/// GPU processes (what `/proc` said, their GPU, their MiB).
type Procs = Vec<(Option<RawProc<'static>>, u32, u64)>;
/// `envs.json` and `devices.json`.
type State = (Option<String>, Option<String>);

/// A host: GPU processes on 4 GPUs, genv's state, and whether the agent
/// refused a state file.
fn raw() -> impl Strategy<Value = (Procs, State, bool)> {
    (
        proptest::collection::vec((proc_(), 0u32..4, 1u64..5000), 0..8),
        state(),
        // The agent refused a state file.
        proptest::bool::weighted(0.1),
    )
}

fn host(procs: &Procs, (envs, devices): &State, refused: bool) -> RawHost<'static> {
    let mut apps = String::new();
    let mut seen = BTreeMap::new();
    for (i, (p, gpu, mib)) in procs.iter().enumerate() {
        let pid = 200 + i as u32;
        apps.push_str(&format!("GPU-{gpu}, {pid}, {mib}\n"));
        if let Some(p) = p {
            seen.insert(pid, p.clone());
        }
    }
    // The pids the honest records list: alice's and bob's shells.
    for (pid, uid) in [(100, ALICE), (101, BOB)] {
        seen.insert(
            pid,
            RawProc::Seen {
                start_time: 1,
                uid: Some(uid),
                environ: Environ::NotRead,
            },
        );
    }
    RawHost {
        gpus: Cow::Owned(
            "GPU-0, 0, 81559\nGPU-1, 1, 81559\nGPU-2, 2, 81559\nGPU-3, 3, 81559\n".into(),
        ),
        apps: Cow::Owned(apps),
        envs: envs.clone().map(|e| Cow::Owned(e.into_bytes())),
        devices: devices.clone().map(|d| Cow::Owned(d.into_bytes())),
        procs: seen,
        user_names: [(ALICE, "alice".to_string()), (BOB, "bob".to_string())]
            .into_iter()
            .map(|(k, v)| (k, v.into()))
            .collect(),
        sub_uids: [
            (BOBS_SUB, Ok(BOB)),
            (
                SHARED_SUB,
                Err("in the sub-uid ranges of bob, carol".to_string()),
            ),
        ]
        .into_iter()
        .collect(),
        state_errors: if refused {
            [(
                "envs".to_string(),
                "envs.json is a FIFO: refused".to_string(),
            )]
            .into_iter()
            .collect()
        } else {
            BTreeMap::new()
        },
        ..RawHost::default()
    }
}

fn snapshot(raw: &RawHost) -> HostSnapshot {
    assemble(raw, "h", &mut ParsedState::default(), 1000).expect("nvidia-smi's answers parse")
}

/// Whom each GPU process counts toward (its pid, its user), and the total
/// each user's processes hold, as the memory caps count them.
fn counted(snap: &HostSnapshot) -> BTreeMap<String, (Vec<Pid>, u64)> {
    let a = Attribution::of(snap, &Orphans::default());
    HostMemory::of(&a)
        .users
        .into_iter()
        .map(|(user, held)| {
            let pids = held.iter().map(|h| h.pid).collect();
            (user, (pids, held.iter().map(|h| h.bytes).sum()))
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(1024)
    ))]

    /// Every live GPU process is judged under its owner, or reported as
    /// unjudgeable with its reason; never invisible.
    #[test]
    fn every_gpu_process_is_judged_under_its_owner_or_reported((procs, state, refused) in raw()) {
        let raw = host(&procs, &state, refused);
        let snap = snapshot(&raw);
        let host_id = HostId("h".into());
        let policy = Policy {
            non_env_processes: true,
            max_memory_per_user: Some(1),
            ..Policy::default()
        };
        let findings = assess_host(&host_id, &snap, &policy, &Orphans::default());
        let a = Attribution::of(&snap, &Orphans::default());
        let counted = counted(&snap);
        for (pi, p) in snap.processes.iter().enumerate() {
            let reported = findings.notices.iter().any(|n| match n {
                Notice::UnknownOwner { pid, reason, .. } => *pid == p.pid && !reason.is_empty(),
                Notice::UnownedMemory { pid, .. } => *pid == p.pid,
                _ => false,
            });
            let judged = matches!(a.standing(pi), Standing::Member(_) | Standing::NoEnv | Standing::Stray(_));
            prop_assert!(judged || reported, "{:?} neither judged nor reported", p);
            let raw_uid = match raw.procs.get(&p.pid.0) {
                Some(RawProc::Seen { uid, .. }) => *uid,
                _ => None,
            };
            match raw_uid {
                // The kernel names its owner: it counts toward their caps,
                // whatever else is unknown, under its range's owner.
                Some(uid) => {
                    let owner = match uid {
                        ALICE => "alice".to_string(),
                        BOB | BOBS_SUB => "bob".to_string(),
                        other => format!("uid {other}"),
                    };
                    let user = a.user_of(pi);
                    prop_assert_eq!(user.as_deref(), Some(owner.as_str()));
                    prop_assert!(
                        counted.get(&owner).is_some_and(|(pids, _)| pids.contains(&p.pid)),
                        "{:?} not in {}'s count", p, owner
                    );
                    if uid == SHARED_SUB {
                        let said = findings.notices.iter().any(|n| matches!(n, Notice::UnresolvedUid { uid: u, .. } if *u == SHARED_SUB));
                        prop_assert!(said, "uid {} unresolved and unsaid", SHARED_SUB);
                    }
                }
                None => prop_assert!(reported || judged),
            }
            // What a process did to its own environment is said, and
            // judged as carrying none: never a way out.
            if matches!(p.owner, crate::model::Owner::Hidden(_)) {
                prop_assert_eq!(a.standing(pi), &Standing::NoEnv);
                let said = findings.notices.iter().any(|n| matches!(n, Notice::HiddenEnviron { pid, .. } if *pid == p.pid));
                prop_assert!(said, "{:?} hidden and unsaid", p);
            }
        }
        if snap.state_problem().is_some() {
            let said = findings.notices.iter().any(|n| matches!(n, Notice::StateUnusable { .. }));
            prop_assert!(said, "a degraded host unsaid");
            prop_assert!(findings.orphans.is_empty(), "a garbled file makes no orphan for life");
        }
    }

    /// Nothing bob writes into genv's state changes whose alice's
    /// processes are, nor takes any of them out of her count.
    #[test]
    fn bobs_edits_to_the_state_never_change_alices_count(
        (procs, state, refused) in raw(),
        (edited, edited_refused) in (state(), proptest::bool::weighted(0.1)),
    ) {
        let before = snapshot(&host(&procs, &state, refused));
        let after = snapshot(&host(&procs, &edited, edited_refused));
        let alice = |s: &HostSnapshot| counted(s).remove("alice");
        prop_assert_eq!(alice(&before), alice(&after));
        for s in [&before, &after] {
            let a = Attribution::of(s, &Orphans::default());
            for (pi, p) in s.processes.iter().enumerate() {
                if p.uid == Some(ALICE) {
                    let user = a.user_of(pi);
                    prop_assert_eq!(user.as_deref(), Some("alice"));
                }
            }
        }
    }
}
