//! Property tests of the pure core: parsers never panic, and the rule and
//! plan invariants hold on arbitrary clusters.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use crate::cycle::assess;
use crate::model::*;
use crate::plan::{self, Plan};
use crate::rules::{evaluate, Policy};
use crate::snapshot::{genv, memory, nvidia_smi, proc};

proptest! {
    #[test]
    fn parsers_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        let text = String::from_utf8_lossy(&bytes);
        let _ = genv::parse_snapshot(&text, "p");
        let _ = genv::parse_envs(&text, "p");
        let _ = genv::parse_devices(&text, "p");
        let _ = nvidia_smi::parse_gpus(&text, "p");
        let _ = nvidia_smi::parse_compute_apps(&text, "p");
        let _ = memory::parse(&text);
        let _ = proc::start_time(&bytes);
        let _ = proc::environment_id(&bytes);
        let _ = proc::real_uid(&text);
    }

    #[test]
    fn csv_like_input_never_panics(lines in proptest::collection::vec("[A-Z0-9a-z\\-\\[\\]/ ,]{0,40}", 0..8)) {
        let text = lines.join("\n");
        let _ = nvidia_smi::parse_gpus(&text, "p");
        let _ = nvidia_smi::parse_compute_apps(&text, "p");
    }

    #[test]
    fn snapshot_json_round_trips(c in cluster()) {
        for (_, s) in &c.hosts {
            let text = serde_json::to_string(&genv::to_json(s)).unwrap();
            let back = genv::parse_snapshot(&text, "p").unwrap();
            prop_assert_eq!(back.processes.len(), s.processes.len());
            prop_assert_eq!(&back.devices, &s.devices);
        }
    }

    #[test]
    fn plan_invariants(c in cluster(), policy in policy()) {
        let plan = plan::build(&c, &evaluate(&c, &policy));
        for (host, hp) in &plan.hosts {
            let snap = c.host(host).unwrap();
            let mut seen = BTreeSet::new();
            for t in &hp.terminate {
                let p = snap.process(t.pid);
                prop_assert!(p.is_some(), "terminates a pid not in its host's snapshot");
                prop_assert!(!matches!(p.unwrap().owner, Owner::Unknown(_)), "terminates a pid of unknown owner");
                prop_assert!(seen.insert(t.pid), "pid planned twice");
            }
            for d in &hp.detach {
                prop_assert!(snap.devices.iter().any(|dev| dev.index == d.device && dev.has(&d.eid)));
            }
        }
        // After the detaches, nobody is over their cap.
        for (user, count) in attached_per_user(&c, &plan) {
            if let Some(cap) = policy.cap_for(&user) {
                prop_assert!(count <= cap as usize, "{} still has {} > {}", user, count, cap);
            }
        }
    }

    #[test]
    fn per_host_rules_do_not_depend_on_host_order(c in cluster(), policy in policy()) {
        let policy = Policy { max_devices_per_user: None, max_devices_for_user: BTreeMap::new(), ..policy };
        let mut reversed = c.clone();
        reversed.hosts.reverse();
        let a: BTreeMap<_, _> = plan::build(&c, &evaluate(&c, &policy)).hosts.into_iter().collect();
        let b: BTreeMap<_, _> = plan::build(&reversed, &evaluate(&reversed, &policy)).hosts.into_iter().collect();
        prop_assert_eq!(a, b);
    }

    #[test]
    fn dry_run_plan_equals_real_plan(c in cluster(), policy in policy()) {
        let results = |c: &Cluster| c.hosts.iter().map(|(h, s)| (h.clone(), Ok::<_, String>(s.clone()))).collect::<Vec<_>>();
        let (_, dry) = assess(1, c.mode, true, &policy, results(&c));
        let (_, real) = assess(1, c.mode, false, &policy, results(&c));
        prop_assert_eq!(dry.plan, real.plan);
        prop_assert_eq!(dry.violations, real.violations);
    }
}

/// (user, devices still attached) after carrying out the plan's detaches.
fn attached_per_user(c: &Cluster, plan: &Plan) -> BTreeMap<String, usize> {
    let mut count = BTreeMap::new();
    for (host, snap) in &c.hosts {
        let detached: Vec<_> = plan
            .hosts
            .iter()
            .filter(|(h, _)| h == host)
            .flat_map(|(_, p)| p.detach.iter().map(|d| (d.device, d.eid.clone())))
            .collect();
        for user in snap
            .envs
            .iter()
            .filter_map(|e| e.username.clone())
            .collect::<BTreeSet<_>>()
        {
            let eids: Vec<_> = snap
                .envs
                .iter()
                .filter(|e| e.username.as_deref() == Some(user.as_str()))
                .map(|e| &e.eid)
                .collect();
            let n = snap
                .devices
                .iter()
                .filter(|d| {
                    d.attachments.iter().any(|a| {
                        eids.contains(&&a.eid) && !detached.contains(&(d.index, a.eid.clone()))
                    })
                })
                .count();
            *count.entry(user).or_insert(0) += n;
        }
    }
    count
}

fn policy() -> impl Strategy<Value = Policy> {
    (
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        proptest::option::of(0u32..4),
        proptest::collection::btree_map("u[0-3]", 0u32..3, 0..3),
    )
        .prop_map(|(n, d, m, cap, per)| Policy {
            non_env_processes: n,
            env_devices: d,
            env_memory: m,
            max_devices_per_user: cap,
            max_devices_for_user: per,
        })
}

/// Hosts with up to 4 GPUs, 4 environments (some nameless) and 6 processes
/// whose owners may be an env, a missing env, none, or unknown.
fn host() -> impl Strategy<Value = HostSnapshot> {
    let envs = proptest::collection::vec(
        (
            proptest::option::of("u[0-3]"),
            proptest::option::of(0u64..3000),
        ),
        0..4,
    );
    let attach = proptest::collection::vec((0u32..4, 0usize..4), 0..8);
    let procs = proptest::collection::vec(
        (
            0u8..4,
            0usize..5,
            proptest::collection::vec((0u32..4, proptest::option::of(0u64..2000)), 1..3),
        ),
        0..6,
    );
    (1u32..5, envs, attach, procs).prop_map(|(ngpu, envs, attach, procs)| {
        let envs: Vec<Env> = envs
            .into_iter()
            .enumerate()
            .map(|(i, (user, mib))| Env {
                eid: EnvId(format!("e{i}")),
                uid: 0,
                username: user,
                creation: String::new(),
                created: None,
                name: None,
                gpu_memory: mib.map(|m| Memory {
                    text: format!("{m}mi"),
                    bytes: m << 20,
                }),
                gpus: None,
                pids: vec![1],
                kernel_ids: vec![],
            })
            .collect();
        let devices = (0..ngpu)
            .map(|i| Device {
                index: GpuIndex(i),
                total_memory: "81559mi".into(),
                attachments: attach
                    .iter()
                    .filter(|(d, e)| *d == i && *e < envs.len())
                    .map(|(_, e)| Attachment {
                        eid: envs[*e].eid.clone(),
                        gpu_memory: None,
                        time: String::new(),
                    })
                    .collect::<Vec<_>>()
                    .into_iter()
                    .fold(Vec::new(), |mut v: Vec<Attachment>, a| {
                        if !v.iter().any(|x| x.eid == a.eid) {
                            v.push(a);
                        }
                        v
                    }),
            })
            .collect();
        let processes = procs
            .into_iter()
            .enumerate()
            .map(|(i, (kind, e, gpus))| {
                let owner = match kind {
                    0 => Owner::NoEnv,
                    1 => Owner::Unknown("hidden".into()),
                    _ if e < envs.len() => Owner::Env(envs[e].eid.clone()),
                    _ => Owner::Env(EnvId("ghost".into())),
                };
                let mut seen = BTreeSet::new();
                let gpus = gpus
                    .into_iter()
                    .filter(|(g, _)| *g < ngpu && seen.insert(*g))
                    .map(|(g, m)| DeviceUsage {
                        index: GpuIndex(g),
                        usage: m.map_or(Usage::Unknown, |m| Usage::Known(m << 20)),
                    })
                    .collect();
                Process {
                    pid: Pid(100 + i as u32),
                    owner,
                    gpus,
                    start_time: Some(7),
                    uid: Some(0),
                    user: None,
                }
            })
            .collect();
        HostSnapshot {
            processes,
            envs,
            devices,
            truth: None,
        }
    })
}

fn cluster() -> impl Strategy<Value = Cluster> {
    proptest::collection::vec(host(), 1..4).prop_map(|hosts| Cluster {
        mode: Mode::Remote,
        hosts: hosts
            .into_iter()
            .enumerate()
            .map(|(i, s)| (HostId(format!("h{i}")), s))
            .collect(),
    })
}
