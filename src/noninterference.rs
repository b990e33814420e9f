//! Non-interference, as a property of the pure core (attribution, rules,
//! plan): start from an honest cluster in which alice's jobs and
//! attachments comply; let bob start jobs of his own carrying any
//! environment id and make any edit to both state files (add, forge,
//! relabel and remove records, list any pid in any record, attach any
//! environment to more devices, split device entries). Then:
//!
//! 1. no alice process is terminated;
//! 2. no attachment of one of alice's environments is detached from a
//!    device on which an alice process of that environment runs;
//! 3. every device bob's genv jobs run on counts toward his cap, but where
//!    the job is a member of an environment of his own that is not
//!    attached there (that is env-devices' business).
//!
//! Two edits stay outside, because genv's world-writable design makes them
//! indistinguishable from alice's own: removing one of her attachments
//! while her record stays, and lowering her record's `gpu_memory` (also
//! through a second record with her id). The enforcer has seen the honest
//! cluster once before bob's edits (a cycle), as a running enforcer has:
//! that is how it knows her orphaned jobs (see
//! [`crate::rules::attribution::Orphans`]). The state goes through what a
//! host's assembly does (genv's clean-up, then [`genv::normalize`]) before
//! the rules, as on a live host.
//!
//! Cases: 2,048 per run (`PROPTEST_CASES` overrides).

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use crate::model::*;
use crate::plan;
use crate::rules::attribution::Attribution;
use crate::rules::max_devices::HostUsage;
use crate::rules::{self, Orphans, Policy};
use crate::snapshot::genv;

const ALICE: u32 = 1001;
const BOB: u32 = 1002;
const CAROL: u32 = 1003;
/// A pid no process has.
const DEAD: i64 = 99_999;

/// Alice's honest environment: the devices it is attached to, its
/// `gpu_memory` (MiB), and its jobs (devices among its own, usage).
#[derive(Debug, Clone)]
struct AliceEnv {
    devices: BTreeSet<u32>,
    gpu_memory: Option<u64>,
    jobs: Vec<(Vec<u32>, Option<u64>)>,
}

/// Bob's own environment and jobs (anywhere: he need not comply).
#[derive(Debug, Clone)]
struct BobEnv {
    devices: BTreeSet<u32>,
    jobs: Vec<(Vec<u32>, Option<u64>)>,
}

#[derive(Debug, Clone)]
struct HonestHost {
    gpus: u32,
    alice: Vec<AliceEnv>,
    /// GPUs of alice's jobs whose environment's record is gone (nohup).
    orphans: Vec<u32>,
    /// GPUs of alice's jobs outside genv (no id): non-env-processes'
    /// business, honest where that rule is off.
    plain: Vec<u32>,
    bob: Vec<BobEnv>,
    /// Alice's jobs of her environment `k` (modulo) on a GPU it may not be
    /// attached to: her own business (env-devices, her caps), which only
    /// the sequences have.
    elsewhere: Vec<(usize, u32)>,
}

/// Which environment id bob's job or record takes.
#[derive(Debug, Clone, Copy)]
enum Eid {
    Alice(usize),
    /// The id of one of alice's orphaned jobs.
    Orphan(usize),
    Bob(usize),
    Forged(usize),
    Missing,
    Unset,
}

/// Which username bob writes.
#[derive(Debug, Clone, Copy)]
enum Name {
    Alice,
    Bob,
    Carol,
    Null,
    Empty,
}

/// Which pid bob lists.
#[derive(Debug, Clone, Copy)]
enum PidRef {
    AliceShell(usize),
    AliceJob(usize),
    BobShell(usize),
    BobJob(usize),
    Init,
    Dead,
}

/// What bob does.
#[derive(Debug, Clone)]
enum Edit {
    /// Starts a job of his own carrying `eid` on `gpus`.
    Job {
        host: usize,
        eid: Eid,
        gpus: Vec<u32>,
        mib: Option<u64>,
    },
    /// Writes a record (a forged one, or a second one with an existing id).
    Forge {
        host: usize,
        eid: Eid,
        name: Name,
        pids: Vec<PidRef>,
        gpu_memory: Option<u64>,
        first: bool,
    },
    /// Renames the user of record `env`.
    Relabel { host: usize, env: usize, name: Name },
    /// Lists pids in record `env` (instead of its own, or beside them).
    List {
        host: usize,
        env: usize,
        pids: Vec<PidRef>,
        replace: bool,
    },
    /// Attaches record `env`'s environment to `device` (maybe no real GPU).
    Attach {
        host: usize,
        env: usize,
        device: u32,
    },
    /// Removes record `env` whole.
    Remove { host: usize, env: usize },
    /// Splits device entry `device` in two entries with the same index.
    Split { host: usize, device: usize },
    /// Sets record `env`'s `gpu_memory` (alice's: only ever raised).
    Memory {
        host: usize,
        env: usize,
        mib: Option<u64>,
    },
    /// Removes an attachment (never one of alice's environments').
    Detach {
        host: usize,
        env: usize,
        device: u32,
    },
}

/// One host as built: its state before clean-up, processes, live pids.
#[derive(Debug, Clone)]
struct World {
    gpus: u32,
    envs: Vec<Env>,
    devices: Vec<Device>,
    processes: Vec<Process>,
    /// Every live pid and its uid.
    live: BTreeMap<i64, u32>,
    alice_envs: Vec<EnvId>,
    alice_orphans: Vec<EnvId>,
    alice_gpu_memory: BTreeMap<EnvId, Option<u64>>,
    alice_shells: Vec<i64>,
    alice_jobs: Vec<i64>,
    /// Her jobs outside genv.
    alice_plain: Vec<i64>,
    bob_envs: Vec<EnvId>,
    bob_shells: Vec<i64>,
    bob_jobs: Vec<i64>,
    next_pid: u32,
}

fn record(eid: &str, user: Option<&str>, uid: u32, pids: Vec<i64>, mib: Option<u64>) -> Env {
    Env {
        eid: EnvId(eid.into()),
        uid,
        username: user.map(String::from),
        creation: String::new(),
        name: None,
        gpu_memory: mib.map(|m| Memory {
            text: format!("{m}mi"),
            bytes: m << 20,
        }),
        gpus: None,
        pids,
        kernel_ids: Vec::new(),
    }
}

fn job(pid: u32, eid: Option<&EnvId>, uid: u32, gpus: &[u32], mib: Option<u64>) -> Process {
    let mut seen = BTreeSet::new();
    Process {
        pid: Pid(pid),
        owner: eid.map_or(Owner::NoEnv, |e| Owner::Env(e.clone())),
        gpus: gpus
            .iter()
            .filter(|g| seen.insert(**g))
            .map(|g| DeviceUsage {
                index: GpuIndex(*g),
                usage: mib.map_or(Usage::Unknown, |m| Usage::Known(m << 20)),
            })
            .collect(),
        start_time: Some(u64::from(pid)),
        uid: Some(uid),
        // As a host's assembly names it.
        user: match uid {
            ALICE => Some("alice".into()),
            BOB => Some("bob".into()),
            _ => None,
        },
        sub_uid: None,
    }
}

impl World {
    fn honest(h: usize, host: &HonestHost) -> World {
        let gpus = host.gpus;
        let mut w = World {
            gpus,
            envs: Vec::new(),
            devices: (0..gpus)
                .map(|i| Device {
                    index: GpuIndex(i),
                    total_memory: "81559mi".into(),
                    attachments: Vec::new(),
                })
                .collect(),
            processes: Vec::new(),
            live: [(1, 0)].into_iter().collect(),
            alice_envs: Vec::new(),
            alice_orphans: Vec::new(),
            alice_gpu_memory: BTreeMap::new(),
            alice_shells: Vec::new(),
            alice_jobs: Vec::new(),
            alice_plain: Vec::new(),
            bob_envs: Vec::new(),
            bob_shells: Vec::new(),
            bob_jobs: Vec::new(),
            next_pid: 100,
        };
        for (k, e) in host.alice.iter().enumerate() {
            let eid = EnvId(format!("a{h}.{k}").into());
            let shell = w.pid(ALICE);
            w.alice_shells.push(shell);
            w.envs.push(record(
                &eid.0,
                Some("alice"),
                ALICE,
                vec![shell],
                e.gpu_memory,
            ));
            for d in &e.devices {
                w.attach(*d, &eid);
            }
            for (gpus, mib) in &e.jobs {
                let pid = w.pid(ALICE);
                w.alice_jobs.push(pid);
                w.processes
                    .push(job(pid as u32, Some(&eid), ALICE, gpus, *mib));
            }
            w.alice_gpu_memory.insert(eid.clone(), e.gpu_memory);
            w.alice_envs.push(eid);
        }
        for (j, g) in host.orphans.iter().enumerate() {
            let pid = w.pid(ALICE);
            w.alice_jobs.push(pid);
            let eid = EnvId(format!("gone{h}.{j}").into());
            w.processes
                .push(job(pid as u32, Some(&eid), ALICE, &[*g], Some(100)));
            w.alice_orphans.push(eid);
        }
        for g in &host.plain {
            let pid = w.pid(ALICE);
            w.alice_plain.push(pid);
            w.processes
                .push(job(pid as u32, None, ALICE, &[*g], Some(100)));
        }
        for (k, g) in &host.elsewhere {
            let Some(eid) = w.alice_envs.get(k % w.alice_envs.len().max(1)).cloned() else {
                continue;
            };
            let pid = w.pid(ALICE);
            w.alice_jobs.push(pid);
            w.processes
                .push(job(pid as u32, Some(&eid), ALICE, &[*g], Some(100)));
        }
        for (k, e) in host.bob.iter().enumerate() {
            let eid = EnvId(format!("b{h}.{k}").into());
            let shell = w.pid(BOB);
            w.bob_shells.push(shell);
            w.envs
                .push(record(&eid.0, Some("bob"), BOB, vec![shell], None));
            for d in &e.devices {
                w.attach(*d, &eid);
            }
            for (gpus, mib) in &e.jobs {
                let pid = w.pid(BOB);
                w.bob_jobs.push(pid);
                w.processes
                    .push(job(pid as u32, Some(&eid), BOB, gpus, *mib));
            }
            w.bob_envs.push(eid);
        }
        w
    }

    /// A new live pid of `uid`.
    fn pid(&mut self, uid: u32) -> i64 {
        self.next_pid += 1;
        self.live.insert(i64::from(self.next_pid), uid);
        i64::from(self.next_pid)
    }

    fn attach(&mut self, device: u32, eid: &EnvId) {
        let d = match self.devices.iter_mut().find(|d| d.index.0 == device) {
            Some(d) => d,
            None => {
                self.devices.push(Device {
                    index: GpuIndex(device),
                    total_memory: "81559mi".into(),
                    attachments: Vec::new(),
                });
                self.devices.last_mut().expect("just pushed")
            }
        };
        d.attachments.push(Attachment {
            eid: eid.clone(),
            gpu_memory: None,
            time: String::new(),
        });
    }

    fn eid(&self, e: Eid, h: usize) -> Option<EnvId> {
        let pick = |list: &[EnvId], i: usize| list.get(i % list.len().max(1)).cloned();
        match e {
            Eid::Alice(i) => pick(&self.alice_envs, i),
            Eid::Orphan(i) => pick(&self.alice_orphans, i),
            Eid::Bob(i) => pick(&self.bob_envs, i),
            Eid::Forged(i) => Some(EnvId(format!("f{h}.{}", i % 3).into())),
            Eid::Missing => Some(EnvId(format!("nowhere{h}").into())),
            Eid::Unset => None,
        }
    }

    fn pid_of(&self, p: PidRef) -> i64 {
        let pick =
            |list: &[i64], i: usize| list.get(i % list.len().max(1)).copied().unwrap_or(DEAD);
        match p {
            PidRef::AliceShell(i) => pick(&self.alice_shells, i),
            PidRef::AliceJob(i) => pick(&self.alice_jobs, i),
            PidRef::BobShell(i) => pick(&self.bob_shells, i),
            PidRef::BobJob(i) => pick(&self.bob_jobs, i),
            PidRef::Init => 1,
            PidRef::Dead => DEAD,
        }
    }

    fn is_alices(&self, eid: &EnvId) -> bool {
        self.alice_envs.contains(eid)
    }

    /// The lowest `gpu_memory` a record with `eid` may have: alice's own.
    fn floor(&self, eid: &EnvId, mib: Option<u64>) -> Option<u64> {
        match self.alice_gpu_memory.get(eid) {
            None => mib,
            Some(None) => None,
            Some(Some(m)) => mib.map(|x| x.max(*m)),
        }
    }

    fn apply(&mut self, edit: &Edit, h: usize) {
        let at = |list_len: usize, i: usize| (list_len > 0).then(|| i % list_len);
        match edit {
            Edit::Job { eid, gpus, mib, .. } => {
                let eid = self.eid(*eid, h);
                let pid = self.pid(BOB);
                self.bob_jobs.push(pid);
                let gpus: Vec<u32> = gpus.iter().map(|g| g % (self.gpus + 1)).collect();
                self.processes
                    .push(job(pid as u32, eid.as_ref(), BOB, &gpus, *mib));
            }
            Edit::Forge {
                eid,
                name,
                pids,
                gpu_memory,
                first,
                ..
            } => {
                let Some(eid) = self.eid(*eid, h) else { return };
                let mib = self.floor(&eid, *gpu_memory);
                let pids = pids.iter().map(|p| self.pid_of(*p)).collect();
                let (user, uid) = name.user();
                let r = record(&eid.0, user, uid, pids, mib);
                if *first {
                    self.envs.insert(0, r);
                } else {
                    self.envs.push(r);
                }
            }
            Edit::Relabel { env, name, .. } => {
                if let Some(i) = at(self.envs.len(), *env) {
                    let (user, uid) = name.user();
                    self.envs[i].username = user.map(String::from);
                    self.envs[i].uid = uid;
                }
            }
            Edit::List {
                env, pids, replace, ..
            } => {
                if let Some(i) = at(self.envs.len(), *env) {
                    let pids: Vec<i64> = pids.iter().map(|p| self.pid_of(*p)).collect();
                    if *replace {
                        self.envs[i].pids = pids;
                    } else {
                        self.envs[i].pids.extend(pids);
                    }
                }
            }
            Edit::Attach { env, device, .. } => {
                if let Some(i) = at(self.envs.len(), *env) {
                    let eid = self.envs[i].eid.clone();
                    self.attach(device % (self.gpus + 1), &eid);
                }
            }
            Edit::Remove { env, .. } => {
                if let Some(i) = at(self.envs.len(), *env) {
                    self.envs.remove(i);
                }
            }
            Edit::Split { device, .. } => {
                if let Some(i) = at(self.devices.len(), *device) {
                    let half = self.devices[i].attachments.len() / 2;
                    let rest = self.devices[i].attachments.split_off(half);
                    let copy = Device {
                        attachments: rest,
                        ..self.devices[i].clone()
                    };
                    self.devices.push(copy);
                }
            }
            Edit::Memory { env, mib, .. } => {
                if let Some(i) = at(self.envs.len(), *env) {
                    let eid = self.envs[i].eid.clone();
                    let mib = self.floor(&eid, *mib);
                    self.envs[i].gpu_memory = mib.map(|m| Memory {
                        text: format!("{m}mi"),
                        bytes: m << 20,
                    });
                }
            }
            Edit::Detach { env, device, .. } => {
                if let Some(i) = at(self.envs.len(), *env) {
                    let eid = self.envs[i].eid.clone();
                    if self.is_alices(&eid) {
                        return; // a documented limit
                    }
                    for d in self.devices.iter_mut().filter(|d| d.index.0 == *device) {
                        d.attachments.retain(|a| a.eid != eid);
                    }
                }
            }
        }
    }

    /// What a live host's assembly makes of it.
    fn snapshot(&self) -> HostSnapshot {
        let mut envs = self.envs.clone();
        let mut devices = self.devices.clone();
        genv::clean_up(
            &mut envs,
            &mut devices,
            |p| self.live.contains_key(&p),
            |_| true,
        );
        genv::normalize(&mut envs, &mut devices);
        let pid_uids = envs
            .iter()
            .flat_map(|e| &e.pids)
            .filter_map(|p| Some((*p, *self.live.get(p)?)))
            .collect();
        HostSnapshot {
            processes: self.processes.clone(),
            envs: envs.into(),
            devices: devices.into(),
            truth: Some(HostTruth {
                // Alice and bob share a lab (its cap, when set).
                groups: [
                    (ALICE, vec!["lab".to_string()]),
                    (BOB, vec!["lab".to_string()]),
                ]
                .into_iter()
                .collect(),
                pid_uids,
                // Start times comparable (a Linux host's agent says its
                // clock): the group caps take the most recent work first.
                boot: Some(Boot {
                    btime: 1_795_000_000,
                    hz: 100,
                }),
                user_names: [
                    (0, "root"),
                    (ALICE, "alice"),
                    (BOB, "bob"),
                    (CAROL, "carol"),
                ]
                .into_iter()
                .map(|(u, n)| (u, n.to_string()))
                .map(|(k, v)| (k, v.into()))
                .collect(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }
}

impl Name {
    fn user(self) -> (Option<&'static str>, u32) {
        match self {
            Name::Alice => (Some("alice"), ALICE),
            Name::Bob => (Some("bob"), BOB),
            Name::Carol => (Some("carol"), CAROL),
            Name::Null => (None, 0),
            Name::Empty => (Some(""), 0),
        }
    }
}

impl Edit {
    fn host(&self) -> usize {
        match self {
            Edit::Job { host, .. }
            | Edit::Forge { host, .. }
            | Edit::Relabel { host, .. }
            | Edit::List { host, .. }
            | Edit::Attach { host, .. }
            | Edit::Remove { host, .. }
            | Edit::Split { host, .. }
            | Edit::Memory { host, .. }
            | Edit::Detach { host, .. } => *host,
        }
    }
}

fn devices(gpus: u32) -> impl Strategy<Value = BTreeSet<u32>> {
    proptest::collection::btree_set(0..gpus, 1..=gpus as usize)
}

fn honest_host() -> impl Strategy<Value = HonestHost> {
    (1u32..=4).prop_flat_map(|gpus| {
        let alice = proptest::collection::vec(
            (devices(gpus), proptest::option::of(1000u64..4000)).prop_flat_map(
                |(devices, gpu_memory)| {
                    let mine: Vec<u32> = devices.iter().copied().collect();
                    // At most two jobs per environment, 400 MiB each: within
                    // any gpu_memory it has.
                    let jobs = proptest::collection::vec(
                        (
                            proptest::sample::subsequence(mine.clone(), 1..=mine.len()),
                            proptest::option::of(1u64..400),
                        ),
                        0..=2,
                    );
                    jobs.prop_map(move |jobs| AliceEnv {
                        devices: devices.clone(),
                        gpu_memory,
                        jobs,
                    })
                },
            ),
            0..=2,
        );
        let orphans = proptest::collection::vec(0..gpus, 0..=2);
        let plain = proptest::collection::vec(0..gpus, 0..=2);
        let bob = proptest::collection::vec(
            (
                devices(gpus),
                proptest::collection::vec(
                    (
                        proptest::collection::vec(0..gpus, 1..=2),
                        proptest::option::of(1u64..3000),
                    ),
                    0..=2,
                ),
            )
                .prop_map(|(devices, jobs)| BobEnv { devices, jobs }),
            0..=2,
        );
        (Just(gpus), alice, orphans, plain, bob).prop_map(|(gpus, alice, orphans, plain, bob)| {
            HonestHost {
                gpus,
                alice,
                orphans,
                plain,
                bob,
                elsewhere: Vec::new(),
            }
        })
    })
}

fn eid() -> impl Strategy<Value = Eid> {
    prop_oneof![
        3 => (0usize..3).prop_map(Eid::Alice),
        2 => (0usize..2).prop_map(Eid::Orphan),
        1 => (0usize..3).prop_map(Eid::Bob),
        2 => (0usize..3).prop_map(Eid::Forged),
        1 => Just(Eid::Missing),
        1 => Just(Eid::Unset),
    ]
}

fn name() -> impl Strategy<Value = Name> {
    prop_oneof![
        3 => Just(Name::Alice),
        2 => Just(Name::Bob),
        1 => Just(Name::Carol),
        1 => Just(Name::Null),
        1 => Just(Name::Empty),
    ]
}

fn pid_ref() -> impl Strategy<Value = PidRef> {
    prop_oneof![
        (0usize..3).prop_map(PidRef::AliceShell),
        (0usize..3).prop_map(PidRef::AliceJob),
        (0usize..3).prop_map(PidRef::BobShell),
        (0usize..3).prop_map(PidRef::BobJob),
        Just(PidRef::Init),
        Just(PidRef::Dead),
    ]
}

fn edit() -> impl Strategy<Value = Edit> {
    let host = 0usize..3;
    let env = 0usize..6;
    prop_oneof![
        3 => (host.clone(), eid(), proptest::collection::vec(0u32..5, 1..=2), proptest::option::of(1u64..9000))
            .prop_map(|(host, eid, gpus, mib)| Edit::Job { host, eid, gpus, mib }),
        3 => (host.clone(), eid(), name(), proptest::collection::vec(pid_ref(), 0..=2), proptest::option::of(0u64..3000), any::<bool>())
            .prop_map(|(host, eid, name, pids, gpu_memory, first)| Edit::Forge { host, eid, name, pids, gpu_memory, first }),
        2 => (host.clone(), env.clone(), name()).prop_map(|(host, env, name)| Edit::Relabel { host, env, name }),
        2 => (host.clone(), env.clone(), proptest::collection::vec(pid_ref(), 0..=2), any::<bool>())
            .prop_map(|(host, env, pids, replace)| Edit::List { host, env, pids, replace }),
        3 => (host.clone(), env.clone(), 0u32..5).prop_map(|(host, env, device)| Edit::Attach { host, env, device }),
        1 => (host.clone(), env.clone()).prop_map(|(host, env)| Edit::Remove { host, env }),
        1 => (host.clone(), 0usize..5).prop_map(|(host, device)| Edit::Split { host, device }),
        1 => (host.clone(), env.clone(), proptest::option::of(0u64..5000)).prop_map(|(host, env, mib)| Edit::Memory { host, env, mib }),
        1 => (host, env, 0u32..5).prop_map(|(host, env, device)| Edit::Detach { host, env, device }),
    ]
}

fn base_policy() -> impl Strategy<Value = Policy> {
    (
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        proptest::option::of(0u32..4),
        proptest::option::of(0u32..3),
        // A memory cap on bob (MiB): his jobs over it never make alice's
        // the ones terminated.
        proptest::option::of(0u64..9000),
    )
        .prop_map(|(n, d, m, cap, bob, bob_memory)| Policy {
            non_env_processes: n,
            env_devices: d,
            env_memory: m,
            max_devices_per_user: cap,
            max_devices_for_user: bob.map(|b| ("bob".to_string(), b)).into_iter().collect(),
            max_memory_for_user: bob_memory
                .map(|b| ("bob".to_string(), b << 20))
                .into_iter()
                .collect(),
            ..Default::default()
        })
}

/// Alice's honest count: (host, device) pairs her environments are
/// attached to or her orphaned jobs run on.
fn alice_count(hosts: &[HonestHost]) -> u32 {
    let mut pairs = BTreeSet::new();
    for (h, host) in hosts.iter().enumerate() {
        for e in &host.alice {
            pairs.extend(e.devices.iter().map(|d| (h, *d)));
        }
        pairs.extend(host.orphans.iter().map(|d| (h, *d)));
    }
    pairs.len() as u32
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(2048),
        max_shrink_iters: 20_000,
        ..ProptestConfig::default()
    })]

    #[test]
    fn nothing_bob_writes_or_runs_gets_alices_jobs_killed(
        honest in proptest::collection::vec(honest_host(), 1..=3),
        edits in proptest::collection::vec(edit(), 0..=8),
        policy in base_policy(),
    ) {
        // Alice complies with her cap.
        let mut policy = policy;
        let count = alice_count(&honest);
        if policy.cap_for("alice").is_some_and(|c| c < count) {
            policy.max_devices_for_user.insert("alice".into(), count);
        }
        let mut worlds: Vec<World> = honest.iter().enumerate().map(|(h, host)| World::honest(h, host)).collect();
        let n = worlds.len();
        let id = |h: usize| HostId(format!("h{h}").into());
        // A cycle over the honest cluster: what the enforcer remembers.
        let memory: Vec<Orphans> = worlds
            .iter()
            .enumerate()
            .map(|(h, w)| rules::assess_host(&id(h), &w.snapshot(), &policy, &Orphans::default()).orphans)
            .collect();
        for e in &edits {
            let h = e.host() % n;
            worlds[h].apply(e, h);
        }
        let cluster = Cluster {
            mode: Mode::Remote,
            hosts: worlds.iter().enumerate().map(|(h, w)| (id(h), w.snapshot())).collect(),
        };
        let found = cluster
            .hosts
            .iter()
            .zip(&memory)
            .map(|((h, s), m)| (h, rules::assess_host(h, s, &policy, m)))
            .collect();
        let snaps: Vec<_> = cluster.hosts.iter().map(|(_, s)| s).collect();
        let found: Vec<(&HostId, rules::HostFindings)> = found;
        let own: Vec<plan::HostPlan> = found
            .iter()
            .zip(&snaps)
            .map(|((h, f), s)| plan::for_host(h, s, &f.violations))
            .collect();
        let owned: usize = found.iter().map(|(_, f)| f.violations.len()).sum();
        let violations = rules::merge(found, &snaps, &policy, rules::Moment::none()).0;
        let plan = plan::build(&cluster, &violations);
        // The plan a cycle builds (each host's own, then what the caps
        // add) is the plan of every violation at once.
        prop_assert_eq!(&plan::whole(&cluster, own, &violations[owned..]).0, &plan);
        for (host, hp) in &plan.hosts {
            let h: usize = host.0[1..].parse().unwrap();
            let (w, snap) = (&worlds[h], &cluster.hosts[h].1);
            // 1. No alice process is terminated (one outside genv only by
            // non-env-processes).
            for t in &hp.terminate {
                let pid = i64::from(t.pid.0);
                prop_assert!(
                    !w.alice_jobs.contains(&pid)
                        && (policy.non_env_processes || !w.alice_plain.contains(&pid)),
                    "alice's job {} on {} terminated for {:?}", t.pid, host, t.rules
                );
            }
            // 2. No attachment of hers is detached where a job of it runs.
            for d in &hp.detach {
                let working = snap.processes.iter().any(|p| {
                    p.uid == Some(ALICE) && p.owner.eid() == Some(&d.eid) && p.usage_on(d.device).is_some()
                });
                prop_assert!(
                    !(w.is_alices(&d.eid) && working),
                    "alice's environment {} detached from device {} on {} where her job runs", d.eid, d.device, host
                );
            }
        }
        // 3. bob's jobs count toward his cap.
        for (h, (_, snap)) in cluster.hosts.iter().enumerate() {
            let usage = HostUsage::of(&Attribution::of(snap, &Default::default()), false);
            let counted: BTreeSet<GpuIndex> = usage
                .users
                .get("bob")
                .map(|b| b.devices.iter().map(|d| d.index).collect())
                .unwrap_or_default();
            let attached = |eid: &EnvId, d: GpuIndex| snap.devices.iter().any(|x| x.index == d && x.has(eid));
            for p in snap.processes.iter().filter(|p| p.uid == Some(BOB)) {
                let Some(eid) = p.owner.eid() else { continue };
                let exists = snap.envs.iter().any(|e| &e.eid == eid);
                let shared = snap.processes.iter().any(|q| q.uid != Some(BOB) && q.owner.eid() == Some(eid));
                for d in p.indices() {
                    let own_business = exists && !shared && !attached(eid, d);
                    prop_assert!(
                        own_business || counted.contains(&d),
                        "bob's job {} in {} on h{} device {} is not in his count", p.pid, eid, h, d
                    );
                }
            }
        }
    }
}

mod sequences;
