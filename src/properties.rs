//! Property tests of the pure core: parsers never panic, and the rule and
//! plan invariants hold on arbitrary clusters.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use proptest::prelude::*;

use crate::assess::assess;
use crate::model::*;
use crate::plan;
use crate::rules::{self, evaluate, Notice, Policy};
use crate::snapshot::assemble::{assemble, Environ, ParsedState, RawHost, RawProc};
use crate::snapshot::frames;
use crate::snapshot::{genv, memory, nvidia_smi};
use crate::{inventory, plan::Termination};

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
        let overrides = inventory::Overrides::default();
        let _ = inventory::parse_inventory(&text, "p", &overrides);
        let _ = inventory::parse_hostfile(&text, "p", &overrides);
        let _ = inventory::parse_host_list(&text, &overrides);
        let _ = inventory::parse_host(&text, &overrides);
        if let Ok(frames) = frames::parse_frames(&bytes, "p") {
            let _ = frames::raw_host(&frames, "p");
        }
        let _ = crate::host::protocol::answer_header(&text);
        let _ = crate::host::protocol::Hello::read(&bytes);
        let _ = crate::host::protocol::Failure::read(&bytes);
        let _ = serde_json::from_slice::<crate::host::protocol::Kills>(&bytes);
        let _ = serde_json::from_slice::<crate::host::protocol::Request>(&bytes);
        let _ = serde_json::from_slice::<crate::doctor::AgentFacts>(&bytes);
        let _ = crate::cli::parse_duration(&text);
        let _ = crate::cli::parse_user_cap(&text);
    }

    #[test]
    fn frames_of_any_bytes_never_panic(
        parts in proptest::collection::vec(
            (
                prop_oneof!["gpus", "apps", "envs", "devices", "proc", "user", "fail", "x"],
                proptest::option::of("[0-9x-]{0,6}"),
                proptest::collection::vec(any::<u8>(), 0..60),
            ),
            0..8,
        ),
        trailer in proptest::collection::vec(any::<u8>(), 0..8),
    ) {
        let mut bytes = Vec::new();
        for (kind, arg, body) in &parts {
            let head = match arg {
                Some(a) => format!("@{kind} {a} {}\n", body.len()),
                None => format!("@{kind} {}\n", body.len()),
            };
            bytes.extend_from_slice(head.as_bytes());
            bytes.extend_from_slice(body);
        }
        bytes.extend_from_slice(&trailer);
        if let Ok(frames) = frames::parse_frames(&bytes, "p") {
            if let Ok(raw) = frames::raw_host(&frames, "p") {
                let _ = assemble(&raw, "p", &mut ParsedState::default(), 1000);
            }
        }
    }

    #[test]
    fn assembly_of_any_parts_never_panics(
        gpus in "[A-Z0-9a-z\\-\\[\\]/ ,\n]{0,60}",
        apps in "[A-Z0-9a-z\\-\\[\\]/ ,\n]{0,60}",
        envs in proptest::option::of(".{0,80}"),
        devices in proptest::option::of(proptest::collection::vec(any::<u8>(), 0..80)),
        pids in proptest::collection::btree_map(0u32..400, (any::<u64>(), proptest::option::of(any::<u32>()), proptest::collection::vec(any::<u8>(), 0..8)), 0..6),
    ) {
        let raw = RawHost {
            groups: Default::default(),
            gpus: gpus.into(),
            apps: apps.clone().into(),
            envs: envs.clone().map(|e| e.into_bytes().into()),
            devices: devices.map(Into::into),
            procs: pids
                .into_iter()
                .map(|(pid, (start_time, uid, eid))| (pid, RawProc::Seen { start_time, uid, environ: Environ::Var(eid.into()) }))
                .collect(),
            user_names: BTreeMap::new(),
         ..Default::default()
};
        let _ = assemble(&raw, "p", &mut ParsedState::default(), 1000);
    }

    #[test]
    fn answers_to_any_plan_never_panic(
        results in proptest::collection::vec((any::<Option<u64>>(), 0u8..6, any::<Option<u64>>()), 0..6),
        pids in proptest::collection::vec((any::<u32>(), proptest::option::of(any::<u64>())), 0..5),
        detached in proptest::collection::vec(any::<bool>(), 0..6),
        n in 0usize..5,
    ) {
        use crate::host::protocol::{self, Kill, KillResult};
        let kills: Vec<Kill> = results
            .into_iter()
            .map(|(pid, r, found)| Kill {
                pid,
                result: [KillResult::Signalled, KillResult::Gone, KillResult::Reused, KillResult::Denied, KillResult::Invalid][usize::from(r % 5)],
                found,
            })
            .collect();
        let terminations: Vec<Termination> = pids
            .into_iter()
            .map(|(pid, start_time)| Termination::of(Pid(pid), start_time))
            .collect();
        prop_assert_eq!(protocol::read_terminations(&kills, &terminations, "x").len(), terminations.len());
        prop_assert_eq!(protocol::read_detaches(&detached, n, "x").len(), n);
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
        // After the plan, nobody is over their cap (as this cycle counts
        // it), unless all that is left of their excess is held by jobs that
        // are never terminated.
        let mut taken = rules::taking::Taken::default();
        for (host, hp) in &plan.hosts {
            taken.terminated.extend(hp.terminate.iter().map(|t| (host.clone(), t.pid)));
            taken.detached.extend(hp.detach.iter().map(|d| (host.clone(), d.device, d.eid.clone())));
        }
        let (_, notices) = rules::assess_cluster(&c, &policy);
        let mut held: BTreeMap<String, (usize, usize)> = BTreeMap::new();
        for (h, snap) in &c.hosts {
            let f = rules::assess_host(h, snap, &policy, &Default::default());
            for (user, u) in f.usage.users {
                let left: Vec<_> = (u.devices.iter()).filter(|d| taken.holds(h, &user, d)).collect();
                let e = held.entry(user).or_default();
                for d in left {
                    // One held only by contested environments bears its
                    // share where it stands, left counted.
                    let takeable = taken.takeable(h, d);
                    e.0 += usize::from(takeable || d.kept || d.contested.is_empty());
                    e.1 += usize::from(takeable);
                }
            }
        }
        for (user, (count, takeable)) in held {
            if let Some(cap) = policy.cap_for(&user) {
                prop_assert!(
                    count <= cap as usize || takeable == 0,
                    "{} still has {} > {} with {} to take", user, count, cap, takeable
                );
            }
        }
        let kept = notices.iter().any(|n| matches!(n, Notice::ExcessKept { .. }));
        prop_assert!(!kept || policy.has_caps(), "excess kept without a cap");
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
    fn where_processes_run_records_cannot_redirect_a_charge(
        c in cluster(),
        policy in policy(),
        names in proptest::collection::vec(proptest::option::of("u[0-3]"), 16),
    ) {
        // Any user may rewrite every username in envs.json: on a live host,
        // the environments processes run in fare no differently.
        prop_assume!(c.hosts.iter().all(|(_, s)| s.truth.is_some()));
        let mut forged = c.clone();
        let mut names = names.into_iter().cycle();
        for (_, s) in &mut forged.hosts {
            let carried: BTreeSet<EnvId> = s
                .processes
                .iter()
                .filter(|p| p.uid.is_some())
                .filter_map(|p| p.owner.eid().cloned())
                .collect();
            for e in Arc::make_mut(&mut s.envs) {
                let name = names.next().flatten();
                if carried.contains(&e.eid) {
                    e.username = name;
                }
            }
        }
        let actions = |c: &Cluster| {
            let plan = plan::build(c, &evaluate(c, &policy));
            plan.hosts
                .into_iter()
                .map(|(h, p)| {
                    let pids: Vec<Pid> = p.terminate.iter().map(|t| t.pid).collect();
                    let detached: Vec<(GpuIndex, EnvId)> = p.detach.into_iter().map(|d| (d.device, d.eid)).collect();
                    (h, pids, detached)
                })
                .collect::<Vec<_>>()
        };
        prop_assert_eq!(actions(&c), actions(&forged));
    }

    #[test]
    fn dry_run_plan_equals_real_plan(c in cluster(), policy in policy()) {
        let results = |c: &Cluster| c.hosts.iter().map(|(h, s)| (h.clone(), Ok::<_, crate::model::HostFailure>(s.clone()))).collect::<Vec<_>>();
        let dry = assess(1, c.mode, true, &policy, results(&c));
        let real = assess(1, c.mode, false, &policy, results(&c));
        prop_assert_eq!(dry.plan, real.plan);
        prop_assert_eq!(dry.violations, real.violations);
    }
}

/// `c` with the plan's detaches carried out.
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
            ..Default::default()
        })
}

/// Hosts with up to 4 GPUs, 4 environments (some nameless) and 6 processes
/// whose owners may be an env, a missing env, none, or unknown.
///
/// With host truth (most of the time), processes run as uids 0..3, of
/// which 0..2 have names (`u0`..`u2`), so a record naming `u1` may or may
/// not agree with the host; environment `i` lists pid `1000 + i`, owned by
/// a uid of 0..3 or dead.
fn host() -> impl Strategy<Value = HostSnapshot> {
    let envs = proptest::collection::vec(
        (
            proptest::option::of("u[0-3]"),
            proptest::option::of(0u64..3000),
            proptest::option::of(0u32..4),
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
    let truth = proptest::bool::weighted(0.8);
    let uids = proptest::collection::vec(0u32..4, 6);
    (1u32..5, envs, attach, procs, truth, uids).prop_map(
        |(ngpu, envs, attach, procs, truth, uids)| {
            let owners: BTreeMap<i64, u32> = envs
                .iter()
                .enumerate()
                .filter_map(|(i, (_, _, owner))| Some((1000 + i as i64, (*owner)?)))
                .collect();
            let truth = truth.then(|| HostTruth {
                groups: Default::default(),
                pid_uids: owners,
                user_names: (0..3)
                    .map(|u| (u, format!("u{u}")))
                    .map(|(k, v)| (k, v.into()))
                    .collect(),
                ..Default::default()
            });
            let envs: Vec<Env> = envs
                .into_iter()
                .enumerate()
                .map(|(i, (user, mib, _))| Env {
                    eid: EnvId(format!("e{i}").into()),
                    uid: 0,
                    username: user,
                    creation: String::new(),
                    name: None,
                    gpu_memory: mib.map(|m| Memory {
                        text: format!("{m}mi"),
                        bytes: m << 20,
                    }),
                    gpus: None,
                    pids: vec![1000 + i as i64],
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
                .collect::<Vec<_>>()
                .into();
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
                        uid: Some(uids[i]),
                        user: None,
                        sub_uid: None,
                    }
                })
                .collect();
            HostSnapshot {
                processes,
                envs: envs.into(),
                devices,
                truth,
                ..Default::default()
            }
        },
    )
}

fn cluster() -> impl Strategy<Value = Cluster> {
    proptest::collection::vec(host(), 1..4).prop_map(|hosts| Cluster {
        mode: Mode::Remote,
        hosts: hosts
            .into_iter()
            .enumerate()
            .map(|(i, s)| (HostId(format!("h{i}").into()), s))
            .collect(),
    })
}
