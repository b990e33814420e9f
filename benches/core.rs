//! The pure core at fleet scale: parsing nvidia-smi output and a genv
//! snapshot, and assessing a synthetic 500-host cluster (rules + plan).

use criterion::{black_box, criterion_group, criterion_main, Criterion};

use genv_enforce::model::{Cluster, HostId, HostSnapshot, Mode};
use genv_enforce::plan;
use genv_enforce::rules::{evaluate, Policy};
use genv_enforce::snapshot::{genv, nvidia_smi};

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
                HostId(format!("gpu{h}")),
                genv::parse_snapshot(&host_json(h), "bench").unwrap(),
            )
        })
        .collect();
    Cluster {
        mode: Mode::Remote,
        hosts,
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
}

criterion_group!(core, benches);
criterion_main!(core);
