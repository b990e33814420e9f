//! The admin rules beyond genv's four (per-user GPU memory caps, group
//! device caps, idle-GPU reclaim, memory held by no live pid): over the
//! recorded fleet in `fixtures/snapshots/admin/`, and end to end on the
//! sshd fleet with real jobs of real users that really get signalled,
//! the idle rule's utilization written by the test for the fake
//! nvidia-smi's `pmon`.

mod util;

use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;
use util::fleet::Fleet;
use util::{ensure_user, env, repo, Host};

const FLAGS: [&str; 6] = [
    "--max-memory-per-user",
    "48gi",
    "--max-devices-per-group",
    "vision=2",
    "--idle-after",
    "0s",
];

fn json(out: &std::process::Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

#[test]
fn the_recorded_admin_fleet_triggers_each_rule_once() {
    let out = Command::new(env!("CARGO_BIN_EXE_genv-enforce"))
        .args(["remote", "enforce", "--snapshot-dir"])
        .arg(repo().join("fixtures/snapshots/admin"))
        .args(FLAGS)
        .args(["--output", "json"])
        .output()
        .unwrap();
    let report = json(&out);
    let rules: Vec<&str> = report["violations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["rule"].as_str().unwrap())
        .collect();
    assert_eq!(
        rules,
        ["idle-gpu", "max-devices-per-group", "max-memory-per-user"],
        "{report:#}"
    );
    let plan = report["plan"].to_string();
    for want in [
        r#""pid":7002"#,
        r#""pid":7101"#,
        r#""device":2,"eid":"b1","rules":["max-devices-per-group"]"#,
    ] {
        assert!(plan.contains(want), "{want} in {plan}");
    }
    // b1 on device 2 is idle once the idle rule ends 7101, and goes
    // before b2 by host order; b2 stays.
    for not in [
        r#""pid":7001"#,
        r#""pid":8001"#,
        r#""pid":7999"#,
        r#""eid":"b2""#,
    ] {
        assert!(!plan.contains(not), "{not} in {plan}");
    }
    let notices = report["notices"].to_string();
    assert!(
        notices.contains(r#""kind":"unowned_memory""#) && notices.contains(r#""pid":7999"#),
        "{notices}"
    );
    // The text says each.
    let text = Command::new(env!("CARGO_BIN_EXE_genv-enforce"))
        .args(["remote", "enforce", "--snapshot-dir"])
        .arg(repo().join("fixtures/snapshots/admin"))
        .args(FLAGS)
        .output()
        .unwrap();
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&text.stdout),
        String::from_utf8_lossy(&text.stderr)
    );
    for line in [
        "[gpu-a] Process 7101 of user bob holds GPU memory on GPU(s) 2 and has been below 5% utilization for 0s",
        "Group vision is using 3 devices which is 1 more than its maximum of 2",
        "User alice is using 67584mi of GPU memory on 2 hosts which is 18432mi more than the maximum of 49152mi",
        "[gpu-a] [WARNING] 1500mi of GPU memory on device 0 is listed for pid 7999",
    ] {
        assert!(all.contains(line), "{line} in {all}");
    }
}

/// `gpus.csv` with a `utilization.gpu` column, as a real driver answers.
fn set_gpu_utilization(h: &Host, percents: &[u32]) {
    let mut table = String::from("index, uuid, memory.total, utilization.gpu\n");
    for (i, pct) in percents.iter().enumerate() {
        table.push_str(&format!("{i}, {}, 81559, {pct}\n", util::uuid(i as u32)));
    }
    std::fs::write(h.gpu_dir().join("gpus.csv"), table).unwrap();
}

/// `pmon -c 1 -s u` as the H100 prints it: (gpu, pid, sm or `-`).
fn set_pmon(h: &Host, lines: &[(u32, u32, &str)]) {
    let mut text = String::from(
        "# gpu         pid   type     sm    mem    enc    dec    jpg    ofa    command \n\
         # Idx           #    C/G      %      %      %      %      %      %    name \n",
    );
    for (gpu, pid, sm) in lines {
        text.push_str(&format!(
            "    {gpu} {pid:>10}     C {sm:>6} {sm:>6}      -      -      -      -    python3        \n"
        ));
    }
    std::fs::write(h.gpu_dir().join("pmon.txt"), text).unwrap();
}

/// A Unix group with these members, created if missing.
fn ensure_group(name: &str, members: &[&str]) {
    let out = Command::new("groupadd")
        .args(["-f", name])
        .output()
        .unwrap();
    assert!(out.status.success(), "groupadd: {out:?}");
    for m in members {
        ensure_user(m);
        let out = Command::new("usermod")
            .args(["-a", "-G", name, m])
            .output()
            .unwrap();
        assert!(out.status.success(), "usermod: {out:?}");
    }
}

#[test]
fn on_a_real_fleet_each_admin_rule_acts_on_the_right_jobs_and_a_busy_moment_spares_an_idle_one() {
    let Some(mut fleet) = Fleet::up(2) else {
        return;
    };
    ensure_group("gevision", &["gecarol", "gedave"]);
    // h1: alice's old job (GPU 0, 30 GiB, busy), bob's job (GPU 3, 2 GiB,
    // idle as the test says), carol's idle environment on GPUs 1 and 2
    // (her shell listed: the host names her and her groups).
    let old = fleet.host(0).spawn_as("gealice", Some("a1"));
    std::thread::sleep(Duration::from_millis(300));
    let bob = fleet.host(0).spawn_as("gebob", Some("b1"));
    let carol_shell = fleet.host(0).spawn_as("gecarol", None);
    // h2: alice's young job (GPU 0, 20 GiB, alone there: pmon fails, its
    // GPU's 90 % counts), dave's job (GPU 1, busy).
    std::thread::sleep(Duration::from_millis(300));
    let young = fleet.host(1).spawn_as("gealice", Some("a2"));
    let dave = fleet.host(1).spawn_as("gedave", Some("d2"));
    {
        let h = fleet.host(0);
        h.write_envs(&[
            env("a1", Some("gealice"), None, old),
            env("b1", Some("gebob"), None, bob),
            env("c1", Some("gecarol"), None, carol_shell),
        ]);
        h.write_devices(4, &[(0, "a1"), (1, "c1"), (2, "c1"), (3, "b1")]);
        h.set_apps(&[(old, 0, "30720"), (bob, 3, "2048")]);
        set_gpu_utilization(h, &[70, 0, 0, 0]);
        set_pmon(h, &[(0, old, "70"), (3, bob, "-")]);
    }
    {
        let h = fleet.host(1);
        h.write_envs(&[
            env("a2", Some("gealice"), None, young),
            env("d2", Some("gedave"), None, dave),
        ]);
        h.write_devices(4, &[(0, "a2"), (1, "d2")]);
        h.set_apps(&[(young, 0, "20480"), (dave, 1, "1024")]);
        set_gpu_utilization(h, &[90, 80, 0, 0]);
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let db = dir.path().join("state.db");
    // One cycle per run (as cron runs it); the idle windows live in the
    // state database between runs.
    let run = |fleet: &Fleet| {
        let out = fleet.ours(&[
            "enforce",
            "--interval",
            "0",
            "--max-memory-per-user",
            "40gi",
            "--max-devices-per-group",
            "gevision=2",
            "--idle-after",
            "3s",
            "--state-db",
            db.to_str().unwrap(),
            "--output",
            "json",
        ]);
        json(&out)
    };
    let first = Instant::now();
    let report = run(&fleet);
    assert!(
        report["hosts"]
            .as_array()
            .unwrap()
            .iter()
            .all(|h| h["error"].is_null()),
        "{report:#}"
    );
    // Memory: alice holds 50 GiB over both hosts, 10 over: her youngest
    // job goes (on h2), the old one stays.
    assert_eq!(
        fleet.host(1).wait_signal(young, Duration::from_secs(10)),
        Some(15)
    );
    assert!(fleet.host(0).running(old));
    // Group: carol (2) and dave (1) hold 3, 1 over: carol's idle device 1
    // goes; dave's working one stays.
    assert_eq!(fleet.host(0).attached(1), Vec::<String>::new());
    assert_eq!(fleet.host(0).attached(2), ["c1"]);
    assert_eq!(fleet.host(1).attached(1), ["d2"]);
    assert!(fleet.host(1).running(dave));
    // Idle: bob's job started its window; busy for one reading, it starts
    // over, so a run past 3 s from the first spares it.
    std::thread::sleep(Duration::from_millis(1500));
    set_pmon(fleet.host(0), &[(0, old, "70"), (3, bob, "45")]);
    run(&fleet);
    set_pmon(fleet.host(0), &[(0, old, "70"), (3, bob, "-")]);
    std::thread::sleep(
        Duration::from_secs(3).saturating_sub(first.elapsed()) + Duration::from_millis(500),
    );
    let spared = run(&fleet);
    assert!(first.elapsed() > Duration::from_secs(3));
    assert!(
        fleet.host(0).running(bob),
        "spared: busy mid-window: {spared:#}"
    );
    assert!(!spared.to_string().contains("idle-gpu"), "{spared:#}");
    // Idle for a whole window since: reclaimed.
    std::thread::sleep(Duration::from_millis(3500));
    let reclaimed = run(&fleet);
    assert!(reclaimed.to_string().contains("idle-gpu"), "{reclaimed:#}");
    assert_eq!(
        fleet.host(0).wait_signal(bob, Duration::from_secs(10)),
        Some(15)
    );
    assert!(fleet.host(0).running(old), "busy: never idle");
    assert!(fleet.host(1).running(dave));
}
