//! The pure core at fleet scale: parsing nvidia-smi output and a genv
//! snapshot, assessing a synthetic 500-host cluster (rules + plan), one
//! host whose user wrote 100,000 environments and attachments (in his name,
//! and in the names of users he made up), and the
//! whole pure path of a remote cycle over 1,000 hosts (8,000 GPUs, 24,000
//! processes): the agents' answers parsed, assembled and assessed, and
//! each host's own plan made, host by host (on one worker, the calling
//! thread, and spread over the machine's cores on threads that outlive the
//! cycle, as the blocking pool's do), then the caps and the plan.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use criterion::{black_box, criterion_group, criterion_main, Criterion};

use genv_enforce::assess::{assess_found, assess_planned, own_plan, Assessment, HostResult};
use genv_enforce::model::{Cluster, FailureKind, HostFailure, HostId, HostSnapshot, Mode};
use genv_enforce::plan::{self, HostPlan};
use genv_enforce::rules::{self, evaluate, Moment, Policy};
use genv_enforce::snapshot::assemble::{assemble, ParsedState};
use genv_enforce::snapshot::frames;
use genv_enforce::snapshot::{genv, nvidia_smi};
use genv_enforce::{view, view_json};

/// A busy 8-GPU host: 8 environments (4 users), 24 processes, some stray,
/// some on unattached GPUs, some over memory.
fn host_json(h: usize) -> String {
    let mut procs = Vec::new();
    let mut envs = Vec::new();
    let mut devices = Vec::new();
    for e in 0..8 {
        envs.push(format!(
            r#"{{"eid": "{h}-{e}", "uid": {e}, "creation": "22/11/2026 15:04:05", "username": "user{}", "config": {{"name": null, "gpu_memory": "{}", "gpus": 1}}, "pids": [{}], "kernel_ids": []}}"#,
            e % 4,
            if e % 2 == 0 { "20gi" } else { "80gi" },
            10_000 + e
        ));
    }
    for d in 0..8 {
        devices.push(format!(
            r#"{{"index": {d}, "total_memory": "81559mi", "attachments": [{{"eid": "{h}-{d}", "gpu_memory": null, "time": "22/11/2026 15:04:06"}}]}}"#
        ));
    }
    for p in 0..24 {
        let eid = if p % 7 == 0 {
            "null".to_string()
        } else {
            format!("\"{h}-{}\"", p % 8)
        };
        procs.push(format!(
            r#"{{"pid": {}, "used_gpu_memory": [{{"index": {}, "gpu_memory": "{}mi"}}], "eid": {eid}, "start_time": {}}}"#,
            20_000 + p,
            (p + p / 8) % 8,
            4096 * (1 + p % 5),
            1000 + p
        ));
    }
    format!(
        r#"{{"processes": {{"processes": [{}]}}, "envs": {{"envs": [{}]}}, "devices": {{"devices": [{}]}}}}"#,
        procs.join(","),
        envs.join(","),
        devices.join(",")
    )
}

fn cluster(hosts: usize) -> Cluster {
    let hosts: Vec<(HostId, HostSnapshot)> = (0..hosts)
        .map(|h| {
            (
                HostId(format!("gpu{h}").into()),
                genv::parse_snapshot(&host_json(h), "bench").unwrap(),
            )
        })
        .collect();
    Cluster {
        mode: Mode::Remote,
        hosts,
    }
}

/// What our agent answers for one busy 8-GPU host: 6 environments of 3
/// users (each attached to its devices), 24 GPU processes in them (one a
/// stray, one on a device its environment lacks), and the identity of
/// every process and listed shell.
fn agent_answer(h: usize) -> Vec<u8> {
    let mut out = Vec::new();
    let mut frame = |kind: &str, arg: Option<String>, body: &[u8]| {
        match arg {
            Some(a) => out.extend(format!("@{kind} {a} {}\n", body.len()).bytes()),
            None => out.extend(format!("@{kind} {}\n", body.len()).bytes()),
        }
        out.extend_from_slice(body);
    };
    let uuid = |g: usize| format!("GPU-{g:08x}-{h:04x}-4c3b-9a8f-7e6d5c4b3a29");
    let gpus: String = (0..8)
        .map(|g| format!("{}, {g}, 81559\n", uuid(g)))
        .collect();
    frame("gpus", None, gpus.as_bytes());
    let user = |e: usize| 1000 + (h * 3 + e / 2) % 150;
    let mut apps = String::new();
    for p in 0..24 {
        let env = p / 4;
        let gpu = if p == 23 { 7 } else { env + (p % 2) * (p / 12) };
        apps.push_str(&format!(
            "{}, {}, {}\n",
            uuid(gpu % 8),
            20_000 + p,
            1000 + p * 10
        ));
    }
    frame("apps", None, apps.as_bytes());
    let envs: Vec<String> = (0..6)
        .map(|e| {
            format!(
                r#"{{"eid": "{h}-{e}", "uid": {}, "creation": "22/11/2026 15:04:05", "username": "user{}", "config": {{"name": null, "gpu_memory": null, "gpus": 1}}, "pids": [{}], "kernel_ids": []}}"#,
                user(e),
                user(e),
                10_000 + e
            )
        })
        .collect();
    frame(
        "envs",
        None,
        format!(r#"{{"envs": [{}]}}"#, envs.join(", ")).as_bytes(),
    );
    let devices: Vec<String> = (0..8)
        .map(|d| {
            let attached = if d < 6 {
                format!(
                    r#"{{"eid": "{h}-{d}", "gpu_memory": null, "time": "22/11/2026 15:04:06"}}"#
                )
            } else {
                String::new()
            };
            format!(r#"{{"index": {d}, "total_memory": "81559mi", "attachments": [{attached}]}}"#)
        })
        .collect();
    frame(
        "devices",
        None,
        format!(r#"{{"devices": [{}]}}"#, devices.join(", ")).as_bytes(),
    );
    for e in 0..6 {
        frame(
            "proc",
            Some((10_000 + e).to_string()),
            format!("seen {} {} notread\n", 500 + e, user(e)).as_bytes(),
        );
    }
    for p in 0..24 {
        let mut body = format!("seen {} {} ", 9000 + p, user(p / 4)).into_bytes();
        if p == 5 {
            body.extend_from_slice(b"novar\n");
        } else {
            body.extend_from_slice(format!("var\n{h}-{}", p / 4).as_bytes());
        }
        frame("proc", Some((20_000 + p).to_string()), &body);
    }
    for e in 0..6 {
        frame(
            "user",
            Some(user(e).to_string()),
            format!("user{}", user(e)).as_bytes(),
        );
    }
    out
}

/// One host's part of a cycle: its answer parsed, assembled and assessed,
/// and the plan its own findings make (what runs in the blocking pool,
/// host by host).
fn host_part(
    host: &HostId,
    bytes: &[u8],
    parsed: &mut ParsedState,
    policy: &Policy,
) -> (HostResult, HostPlan) {
    let snap = frames::parse_frames(bytes, &host.0)
        .map_err(|e| e.to_string())
        .and_then(|f| frames::raw_host(&f, &host.0).map_err(|e| e.to_string()))
        .and_then(|raw| {
            assemble(&raw, &host.0, parsed, genv::DEFAULT_MAX_RECORDS).map_err(|e| e.to_string())
        })
        .map_err(|e| HostFailure::new(FailureKind::Parse, e));
    match snap {
        Ok(snap) => {
            let findings = rules::assess_host(host, &snap, policy, &Default::default());
            let own = own_plan(host, &snap, &findings);
            (Ok((snap, findings)), own)
        }
        Err(e) => (Err(e), HostPlan::default()),
    }
}

/// The hosts' parts in host order, as the cycle hands them on: results,
/// and the own plans of those that answered.
fn gathered(
    parts: Vec<(HostId, (HostResult, HostPlan))>,
) -> (Vec<(HostId, HostResult)>, Vec<HostPlan>) {
    let mut own = Vec::with_capacity(parts.len());
    let results = parts
        .into_iter()
        .map(|(h, (r, plan))| {
            if r.is_ok() {
                own.push(plan);
            }
            (h, r)
        })
        .collect();
    (results, own)
}

/// One host's part: its id, its result and its own plan.
type Part = (HostId, (HostResult, HostPlan));

/// What needs every host's part: the caps and the plan.
fn assessed(parts: Vec<Part>, policy: &Policy) -> Assessment {
    let (results, own) = gathered(parts);
    assess_planned(
        1,
        Mode::Remote,
        false,
        policy,
        results,
        own,
        Moment::none(),
        None,
    )
}

/// The count of hosts with something to do, the assessment freed here.
fn planned(parts: Vec<Part>, policy: &Policy) -> usize {
    assessed(parts, policy).plan.hosts.len()
}

/// The pure path of one remote cycle over `answers` on one worker, the
/// calling thread (as `1a75ad2`'s bench ran it), with each host's state
/// as parsed last cycle in `parsed`.
fn pure_path(answers: &[(HostId, Vec<u8>)], parsed: &mut [ParsedState], policy: &Policy) -> usize {
    let parts = answers
        .iter()
        .zip(parsed.iter_mut())
        .map(|((host, bytes), p)| (host.clone(), host_part(host, bytes, p, policy)))
        .collect();
    planned(parts, policy)
}

/// Worker threads that outlive a cycle, as the blocking pool's do. As
/// there, hosts are handed out one at a time, to whichever worker is free
/// (a host's answer is parsed and assessed in a task of its own), and each
/// host's state as parsed last cycle is under a lock of its own (as
/// `host::Parser`'s is). Each cycle's assessment is freed on a thread of
/// its own, as the service frees its report in the blocking pool.
struct Pool {
    go: Vec<mpsc::Sender<()>>,
    parts: mpsc::Receiver<Vec<(usize, Part)>>,
    next: Arc<AtomicUsize>,
    threads: Vec<std::thread::JoinHandle<()>>,
    free: Option<mpsc::Sender<Assessment>>,
    freeing: Option<std::thread::JoinHandle<()>>,
}

impl Pool {
    fn new(answers: &[(HostId, Vec<u8>)], policy: &Policy, workers: usize) -> Pool {
        let (done, parts) = mpsc::channel();
        let answers: Arc<[(HostId, Vec<u8>)]> = answers.into();
        let parsed: Arc<[Mutex<ParsedState>]> = answers.iter().map(|_| Mutex::default()).collect();
        let next = Arc::new(AtomicUsize::new(0));
        let (mut go, mut threads) = (Vec::new(), Vec::new());
        for _ in 0..workers.max(1) {
            let (start, started) = mpsc::channel::<()>();
            let (answers, parsed, next) = (answers.clone(), parsed.clone(), next.clone());
            let (policy, done) = (policy.clone(), done.clone());
            threads.push(std::thread::spawn(move || {
                while started.recv().is_ok() {
                    let mut mine = Vec::new();
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        let Some((h, bytes)) = answers.get(k) else {
                            break;
                        };
                        let mut p = parsed[k].lock().unwrap();
                        mine.push((k, (h.clone(), host_part(h, bytes, &mut p, &policy))));
                    }
                    if done.send(mine).is_err() {
                        break;
                    }
                }
            }));
            go.push(start);
        }
        let (free, freed) = mpsc::channel::<Assessment>();
        let freeing = std::thread::spawn(move || freed.into_iter().for_each(drop));
        Pool {
            go,
            parts,
            next,
            threads,
            free: Some(free),
            freeing: Some(freeing),
        }
    }

    /// One cycle's pure path: the hosts' parts on the workers, then, in
    /// host order, what needs them all on the calling thread.
    fn cycle(&self, policy: &Policy) -> usize {
        self.next.store(0, Ordering::Relaxed);
        for g in &self.go {
            g.send(()).unwrap();
        }
        let mut parts: Vec<(usize, Part)> = Vec::new();
        for _ in &self.go {
            parts.extend(self.parts.recv().unwrap());
        }
        parts.sort_unstable_by_key(|(k, _)| *k);
        let a = assessed(parts.into_iter().map(|(_, p)| p).collect(), policy);
        let planned = a.plan.hosts.len();
        self.free.as_ref().unwrap().send(a).unwrap();
        planned
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.go.clear();
        self.free = None;
        for t in self.threads.drain(..).chain(self.freeing.take()) {
            let _ = t.join();
        }
    }
}

/// One host whose user wrote `n` environments, each listing his shell and
/// attached to a device, beside a few real jobs; record `i` names user
/// `username(i)`.
fn huge_state(n: usize, username: impl Fn(usize) -> String) -> (String, String) {
    let envs: Vec<String> = (0..n)
        .map(|i| {
            let user = username(i);
            format!(
                r#"{{"eid": "x{i}", "uid": 1002, "creation": "", "username": "{user}", "config": {{"name": null, "gpu_memory": "1gi", "gpus": 1}}, "pids": [10], "kernel_ids": []}}"#
            )
        })
        .collect();
    let devices: Vec<String> = (0..8)
        .map(|d| {
            let att: Vec<String> = (0..n)
                .filter(|i| i % 8 == d)
                .map(|i| format!(r#"{{"eid": "x{i}", "gpu_memory": null, "time": ""}}"#))
                .collect();
            format!(
                r#"{{"index": {d}, "total_memory": "81559mi", "attachments": [{}]}}"#,
                att.join(",")
            )
        })
        .collect();
    (
        format!(r#"{{"envs": [{}]}}"#, envs.join(",")),
        format!(r#"{{"devices": [{}]}}"#, devices.join(",")),
    )
}

/// One 8-GPU host of `state` (genv's two files), 24 jobs of bob's, some
/// in his environments, and his shell (pid 10), as the agent reads it.
fn huge_raw(
    (envs, devices): (String, String),
) -> genv_enforce::snapshot::assemble::RawHost<'static> {
    let mut apps = String::new();
    let mut gpus = String::new();
    for g in 0..8 {
        gpus.push_str(&format!("GPU-{g}, {g}, 81559\n"));
    }
    let mut procs = std::collections::BTreeMap::new();
    for p in 0..24u32 {
        apps.push_str(&format!("GPU-{}, {}, 1000\n", p % 8, 100 + p));
        procs.insert(
            100 + p,
            genv_enforce::snapshot::assemble::RawProc::Seen {
                start_time: 1,
                uid: Some(1002),
                environ: genv_enforce::snapshot::assemble::Environ::Var(
                    format!("x{p}").into_bytes().into(),
                ),
            },
        );
    }
    procs.insert(
        10,
        genv_enforce::snapshot::assemble::RawProc::Seen {
            start_time: 1,
            uid: Some(1002),
            environ: genv_enforce::snapshot::assemble::Environ::NotRead,
        },
    );
    genv_enforce::snapshot::assemble::RawHost {
        groups: Default::default(),
        gpus: gpus.into(),
        apps: apps.into(),
        envs: Some(envs.into_bytes().into()),
        devices: Some(devices.into_bytes().into()),
        procs,
        user_names: [(1002, "bob".into())].into_iter().collect(),
        ..Default::default()
    }
}

fn benches(c: &mut Criterion) {
    let mut apps = String::new();
    for i in 0..10_000 {
        apps.push_str(&format!(
            "GPU-{:08x}-1e2d-4c3b-9a8f-7e6d5c4b3a29, {}, {}\n",
            i % 8,
            1000 + i,
            100 + i % 7000
        ));
    }
    c.bench_function("parse 10k compute-app lines", |b| {
        b.iter(|| nvidia_smi::parse_compute_apps(black_box(&apps), "bench").unwrap())
    });

    let json = host_json(0);
    c.bench_function("parse one 8-GPU host snapshot", |b| {
        b.iter(|| genv::parse_snapshot(black_box(&json), "bench").unwrap())
    });

    let big = cluster(500);
    let policy = Policy {
        non_env_processes: true,
        max_devices_per_user: Some(100),
        ..Policy::default()
    };
    c.bench_function("assess 500 hosts (rules + plan)", |b| {
        b.iter(|| {
            let v = evaluate(black_box(&big), &policy);
            plan::build(&big, &v)
        })
    });

    // One host, 100,000 environments and attachments of bob's (over any
    // cap), and 24 jobs, some in his environments.
    let raw = huge_raw(huge_state(100_000, |_| "bob".into()));
    let host = HostId("gpu0".into());
    let snap = assemble(
        &raw,
        "bench",
        &mut ParsedState::default(),
        genv::DEFAULT_MAX_RECORDS,
    )
    .unwrap();
    assert_eq!(snap.envs.len(), 100_000);
    let capped = Policy {
        non_env_processes: true,
        max_devices_per_user: Some(2),
        ..Policy::default()
    };
    let mut group = c.benchmark_group("one host, 100,000 environments and attachments");
    group.sample_size(10);
    group.bench_function("assess (attribution, rules, caps, plan)", |b| {
        b.iter(|| {
            let findings =
                rules::assess_host(&host, black_box(&snap), &capped, &Default::default());
            let a = assess_found(
                1,
                Mode::Remote,
                false,
                &capped,
                vec![(host.clone(), Ok((snap.clone(), findings)))],
                Moment::none(),
            );
            assert_eq!(a.plan.hosts[0].1.detach.len(), 75_000);
            a.plan.hosts.len()
        })
    });
    group.bench_function("parse and assemble (first cycle)", |b| {
        b.iter(|| {
            assemble(
                black_box(&raw),
                "bench",
                &mut ParsedState::default(),
                genv::DEFAULT_MAX_RECORDS,
            )
            .unwrap()
            .envs
            .len()
        })
    });
    group.finish();

    // Forged records: each three in the name of a user of bob's making,
    // over a cap of 2, for 3k to 90k records. Each such user is taken
    // from once; the cost per record stays flat (no copy of what is
    // taken per user: `take_sparing`).
    let mut group = c.benchmark_group("one host, a made-up user per 3 forged records");
    group.sample_size(10);
    for n in [3_000usize, 30_000, 90_000] {
        let raw = huge_raw(huge_state(n, |i| format!("u{}", i / 3)));
        let snap = assemble(
            &raw,
            "bench",
            &mut ParsedState::default(),
            genv::DEFAULT_MAX_RECORDS,
        )
        .unwrap();
        group.bench_function(format!("assess, {n} records"), |b| {
            b.iter(|| {
                let findings =
                    rules::assess_host(&host, black_box(&snap), &capped, &Default::default());
                let a = assess_found(
                    1,
                    Mode::Remote,
                    false,
                    &capped,
                    vec![(host.clone(), Ok((snap.clone(), findings)))],
                    Moment::none(),
                );
                // One per made-up user, and those of the records bob's
                // jobs carry.
                assert!(a.plan.hosts[0].1.detach.len() >= n / 3);
                a.plan.hosts.len()
            })
        });
    }
    group.finish();
}

fn fleet_benches(c: &mut Criterion) {
    let answers: Vec<(HostId, Vec<u8>)> = (0..1000)
        .map(|h| (HostId(format!("gpu{h}").into()), agent_answer(h)))
        .collect();
    let policy = Policy {
        non_env_processes: true,
        max_devices_per_user: Some(60),
        ..Policy::default()
    };
    let fresh = || {
        (0..answers.len())
            .map(|_| ParsedState::default())
            .collect::<Vec<_>>()
    };
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let mut steady = fresh();
    let planned = pure_path(&answers, &mut steady, &policy);
    assert!(
        planned > 0 && planned <= 1000,
        "{planned} hosts with a plan"
    );
    let pool = Pool::new(&answers, &policy, cores);
    assert_eq!(pool.cycle(&policy), planned, "the pool plans as one worker");
    let mut group = c.benchmark_group("1000 hosts, 8000 GPUs, 24000 processes");
    group.sample_size(20);
    group.bench_function(
        "pure path, steady state (state files unchanged), 1 worker",
        |b| b.iter(|| pure_path(black_box(&answers), &mut steady, &policy)),
    );
    group.bench_function(
        format!("pure path, steady state (state files unchanged), {cores} workers"),
        |b| b.iter(|| pool.cycle(black_box(&policy))),
    );
    drop(pool);
    group.bench_function(
        "pure path, first cycle (every state file parsed), 1 worker",
        |b| {
            b.iter_batched_ref(
                fresh,
                |p| pure_path(black_box(&answers), p, &policy),
                criterion::BatchSize::LargeInput,
            )
        },
    );
    // The serial part: what needs every host (the caps, the plan, the
    // report's statuses), the hosts' parts done beforehand.
    let results = |steady: &mut [ParsedState]| {
        answers
            .iter()
            .zip(steady.iter_mut())
            .map(|((h, bytes), p)| (h.clone(), host_part(h, bytes, p, &policy)))
            .collect::<Vec<_>>()
    };
    group.bench_function("cluster-wide part only (merge, caps, plan)", |b| {
        b.iter_batched(
            || gathered(results(&mut steady)),
            |(r, own)| {
                assess_planned(
                    1,
                    Mode::Remote,
                    false,
                    &policy,
                    r,
                    own,
                    Moment::none(),
                    None,
                )
            },
            criterion::BatchSize::LargeInput,
        )
    });
    // The view a cycle publishes (status, top: issue 43), built from its
    // report and snapshots and written as JSON, once per cycle: from
    // scratch, and by the service's writer, which keeps each unchanged
    // host's part (steady state: every host as the cycle before).
    let a = assessed(results(&mut steady), &policy);
    let cluster = a.cluster.clone();
    let outcomes = genv_enforce::outcome::dry_run(&a.plan);
    let report = genv_enforce::report::CycleReport::new(a, outcomes, None);
    let counted: Vec<(HostId, view::Counted)> = results(&mut steady)
        .iter()
        .map(|(h, (r, _))| {
            let (snap, findings) = r.as_ref().unwrap();
            (
                h.clone(),
                view::counted(&findings.usage, Some(snap), &policy),
            )
        })
        .collect();
    let built = view::of(&report, &cluster, &counted, &policy, Some(1));
    let written = serde_json::to_vec(&built).unwrap();
    println!(
        "the view of 1000 hosts as JSON: {} bytes; {} actions",
        written.len(),
        built.actions.len()
    );
    group.bench_function("view built and written as JSON, from scratch", |b| {
        b.iter(|| {
            let v = view::of(black_box(&report), &cluster, &counted, &policy, Some(1));
            serde_json::to_vec(&v).unwrap().len()
        })
    });
    group.bench_function("view built only, from scratch", |b| {
        b.iter(|| {
            view::of(black_box(&report), &cluster, &counted, &policy, Some(1))
                .hosts
                .len()
        })
    });
    group.bench_function("view written as JSON only, from scratch", |b| {
        b.iter(|| serde_json::to_vec(black_box(&built)).unwrap().len())
    });
    // The service's writer, each cycle as the one before: this fleet's
    // 7,000 findings and actions re-planned every cycle (a dry run), and a
    // fleet with nothing to do (an enforcing service's steady state).
    let mut calm = report.clone();
    calm.violations.clear();
    calm.outcomes.clear();
    calm.waiting.clear();
    for (name, report) in [("7,000 actions a cycle", &report), ("nothing to do", &calm)] {
        let mut writer = view_json::Writer::default();
        let mut n = 0;
        let mut cycle = |writer: &mut view_json::Writer, cluster: &Cluster| {
            n += 1;
            let mut r = report.clone();
            r.cycle = n;
            (writer.write(&r, cluster, &counted, &policy, Some(n)), r)
        };
        let (first, _) = cycle(&mut writer, &cluster);
        let full = first.line(b"");
        let (second, _) = cycle(&mut writer, &cluster);
        let delta = second.delta(b"").unwrap().1;
        println!(
            "{name}: the whole line {} bytes, the delta of a steady cycle {} bytes",
            full.len(),
            delta.len()
        );
        group.bench_function(
            format!("view by the service's writer, steady, {name}"),
            |b| {
                // Each cycle's jobs are new values, equal to the last's
                // (freed with the cycle's report, not by the writer).
                b.iter_batched(
                    || cluster.clone(),
                    |c| {
                        let w = writer.write(black_box(report), &c, &counted, &policy, Some(2));
                        (w.delta(b"").map(|d| d.1.len()), c)
                    },
                    criterion::BatchSize::LargeInput,
                )
            },
        );
        group.bench_function(format!("the whole line assembled, {name}"), |b| {
            b.iter(|| black_box(&second).line(b"").len())
        });
        // Served to one reader: written to its socket (the reader drains
        // it on another thread): the whole line, and a steady delta.
        let (mut out, mut into) = std::os::unix::net::UnixStream::pair().unwrap();
        let drain = std::thread::spawn(move || std::io::copy(&mut into, &mut std::io::sink()));
        for (what, bytes) in [("whole", &full), ("delta", &delta)] {
            group.bench_function(format!("served to one reader, {what}, {name}"), |b| {
                use std::io::Write;
                b.iter(|| out.write_all(black_box(bytes)).unwrap())
            });
        }
        drop(out);
        let _ = drain.join();
    }
    // `top` (issue 43): a view taken from its JSON, and a redraw of each
    // tab on a 200 x 60 terminal.
    group.bench_function("top: the view parsed from its JSON", |b| {
        b.iter(|| {
            serde_json::from_slice::<view::View>(black_box(&written))
                .unwrap()
                .hosts
                .len()
        })
    });
    let mut top = genv_enforce::top::Top::new("bench".into(), true);
    top.take(built.clone());
    let mut term = ratatui::Terminal::new(ratatui::backend::TestBackend::new(200, 60)).unwrap();
    for (key, tab) in [
        ('1', "fleet"),
        ('2', "users"),
        ('3', "waiting"),
        ('4', "actions"),
    ] {
        top.key(ratatui::crossterm::event::KeyEvent::new(
            ratatui::crossterm::event::KeyCode::Char(key),
            ratatui::crossterm::event::KeyModifiers::NONE,
        ));
        group.bench_function(format!("top: a redraw of the {tab} tab, 200 x 60"), |b| {
            b.iter(|| term.draw(|f| top.draw(f, black_box(2))).unwrap().area.width)
        });
    }
    group.bench_function("answers split into frames only", |b| {
        b.iter(|| {
            answers
                .iter()
                .map(|(h, bytes)| frames::parse_frames(black_box(bytes), &h.0).unwrap().len())
                .sum::<usize>()
        })
    });
    group.bench_function("parse + assemble only, steady state", |b| {
        b.iter(|| {
            answers
                .iter()
                .zip(steady.iter_mut())
                .map(|((h, bytes), p)| {
                    let f = frames::parse_frames(black_box(bytes), &h.0).unwrap();
                    assemble(
                        &frames::raw_host(&f, &h.0).unwrap(),
                        &h.0,
                        p,
                        genv::DEFAULT_MAX_RECORDS,
                    )
                    .unwrap()
                })
                .count()
        })
    });
    group.finish();
}

criterion_group!(core, benches, fleet_benches);
criterion_main!(core);

/// As the binary does (src/main.rs).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
