//! Regressions of issue 26: no user slips a GPU job past the rules, blinds
//! a host's enforcement, or multiplies their own caps. One test per row of
//! the table, with real processes of real users (C jobs doing what
//! a few lines of C can, `unshare` with a real `/etc/subuid` range, `flock`),
//! on this machine and through real sshd; each failed before the fix.
//! Row 11 came later, from a hostile review of the device cap.

mod util;

use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

use serde_json::Value;
use util::fleet::Fleet;
use util::{env, lines, wait_until, Host};

const SIGTERM: i32 = 15;
const WAIT: Duration = Duration::from_secs(10);

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn root() -> bool {
    util::prerequisite(
        rustix::process::geteuid().is_root(),
        "jobs of other users, and their signals, need root",
    )
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

/// The JSON report of a run with `--output json`.
fn report(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

/// The pids the report's plan terminates on its first host.
fn terminated(r: &Value) -> Vec<u64> {
    let mut pids: Vec<u64> = r["plan"]["hosts"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|h| h["terminate"].as_array().cloned().unwrap_or_default())
        .map(|t| t["pid"].as_u64().unwrap())
        .collect();
    pids.sort_unstable();
    pids
}

/// A field of `/proc/<pid>/status` (as this machine numbers pids).
fn status_field(pid: u32, name: &str) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| {
            l.strip_prefix(&format!("{name}:"))
                .map(|v| v.trim().to_string())
        })
}

/// env_end - env_start of `pid` (fields 50 and 51 of its stat).
fn environ_size(pid: u32) -> Option<u64> {
    let stat = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    let close = stat.iter().rposition(|&b| b == b')')?;
    let fields: Vec<u64> = std::str::from_utf8(&stat[close + 1..])
        .ok()?
        .split_ascii_whitespace()
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    Some(fields.get(48)? - fields.get(47)?)
}

// Row 1: a job whose main thread exited (pthread_exit) while a worker
// thread runs: state Z, its own /proc/PID/environ answers for nobody.

#[test]
fn row1_a_job_whose_main_thread_exited_is_judged_and_signalled_as_a_whole() {
    if !root() {
        return;
    }
    let exe = util::job("exitlead");
    let exe = exe.to_str().unwrap();
    let mut h = Host::new(2);
    let shell = h.spawn_as("evbob", Some("bobs"));
    let outside = h.start("evbob", None, &[exe]);
    let inside = h.start("evbob", Some("bobs"), &[exe]);
    for p in [outside, inside] {
        assert!(
            wait_until(WAIT, || util::proc_state(p) == Some('Z')),
            "{p}: its main thread did not exit"
        );
    }
    h.write_envs(&[env("bobs", Some("evbob"), None, shell)]);
    h.write_devices(2, &[(0, "bobs")]);
    h.set_apps(&[(outside, 0, "3000"), (inside, 1, "3000")]);
    let out = h.ours(&["enforce", "--interval", "0", "--non-env-processes"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(
        sorted(lines(&out)),
        sorted(vec![
            format!("Process {outside} is not running in a GPU environment"),
            format!("Process {inside} from environment bobs is using non-attached GPU(s) 1"),
            format!(
                "Terminating process {outside} from environment N/A that is running on GPU(s) 0"
            ),
            format!(
                "Terminating process {inside} from environment bobs that is running on GPU(s) 1"
            ),
        ])
    );
    // The signal reached the thread group: both whole processes ended.
    assert_eq!(h.wait_signal(outside, WAIT), Some(SIGTERM));
    assert_eq!(h.wait_signal(inside, WAIT), Some(SIGTERM));
    // Their memory counts toward their owner's cap: the youngest goes.
    let first = h.start("evbob", None, &[exe]);
    std::thread::sleep(Duration::from_millis(20));
    let second = h.start("evbob", None, &[exe]);
    for p in [first, second] {
        assert!(wait_until(WAIT, || util::proc_state(p) == Some('Z')));
    }
    h.set_apps(&[(first, 0, "3000"), (second, 1, "3000")]);
    let out = h.ours(&["enforce", "--interval", "0", "--max-memory-per-user", "4gi"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(h.wait_signal(second, WAIT), Some(SIGTERM));
    assert!(h.running(first));
}

// Row 2: a user's jobs under their sub-uids (a user namespace).

/// `user`'s subordinate range in `/etc/subuid` and `/etc/subgid` (added if
/// missing, as Debian's adduser gives every user one): its first id.
fn sub_range(user: &str, start: u64) -> u64 {
    for file in ["/etc/subuid", "/etc/subgid"] {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        if let Some(line) = text.lines().find(|l| l.starts_with(&format!("{user}:"))) {
            let at: u64 = line.split(':').nth(1).unwrap().parse().unwrap();
            assert_eq!(at, start, "{file}: {line}");
            continue;
        }
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(file)
            .unwrap();
        std::io::Write::write_all(&mut f, format!("{user}:{start}:65536\n").as_bytes()).unwrap();
    }
    start
}

/// Starts `sleep` as `user`'s sub-uid `start + k` in a user namespace of
/// their own (unshare through newuidmap, as a rootless container does).
fn sub_uid_job(h: &mut Host, user: &str, start: u64, k: u32) -> u32 {
    let users = format!("--map-users={start},0,65536");
    let groups = format!("--map-groups={start},0,65536");
    let id = k.to_string();
    h.start(
        user,
        None,
        &[
            "unshare", "--user", &users, &groups, "--setuid", &id, "--setgid", &id, "--", "sleep",
            "1000",
        ],
    )
}

#[test]
fn row2_jobs_under_sub_uids_are_charged_to_the_ranges_owner() {
    if !root() {
        return;
    }
    let found = std::path::Path::new("/usr/bin/newuidmap").exists();
    if !util::prerequisite(found, "newuidmap (package uidmap) is not installed") {
        return;
    }
    util::ensure_user("evsub");
    let start = sub_range("evsub", 2_000_000_000);
    let mut h = Host::new(4);
    // Started a few clock ticks apart: the youngest are taken first.
    let jobs: Vec<u32> = (1..=3)
        .map(|k| {
            std::thread::sleep(Duration::from_millis(50));
            sub_uid_job(&mut h, "evsub", start, k)
        })
        .collect();
    for (k, p) in jobs.iter().enumerate() {
        let want = (start + k as u64 + 1).to_string();
        assert!(
            wait_until(WAIT, || status_field(*p, "Uid")
                .is_some_and(|u| u.starts_with(&want))),
            "job {p} never ran as {want}: {:?}",
            status_field(*p, "Uid")
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    h.set_apps(&[
        (jobs[0], 0, "3000"),
        (jobs[1], 1, "3000"),
        (jobs[2], 2, "3000"),
    ]);
    let out = h.ours(&[
        "enforce",
        "--interval",
        "0",
        "--max-memory-per-user",
        "4gi",
        "--output",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let r = report(&out);
    // 9000 MiB of one user over 4 GiB: the two youngest go.
    assert_eq!(
        terminated(&r),
        sorted(vec![jobs[1].to_string(), jobs[2].to_string()])
            .iter()
            .map(|p| p.parse::<u64>().unwrap())
            .collect::<Vec<_>>()
    );
    let plan = &r["plan"]["hosts"][0]["terminate"];
    for t in plan.as_array().unwrap() {
        assert_eq!(t["user"], "evsub", "{t}");
        assert!(t["sub_uid"].as_u64().unwrap() > start, "{t}");
    }
    assert_eq!(h.wait_signal(jobs[2], WAIT), Some(SIGTERM));
    assert_eq!(h.wait_signal(jobs[1], WAIT), Some(SIGTERM));
    assert!(h.running(jobs[0]));
}

// Row 3: GPU jobs with 16 MiB environments (prctl PR_SET_MM_MAP).

#[test]
fn row3_fat_environs_cost_their_owner_only_and_every_job_is_judged() {
    if !root() {
        return;
    }
    let exe = util::job("fatenv");
    let exe = exe.to_str().unwrap();
    let mut h = Host::new(4);
    let shell = h.spawn_as("evbob", Some("bobs"));
    let mut fat = Vec::new();
    for _ in 0..30 {
        fat.push(h.start("evbob", None, &[exe, "16", "last", "bobs"]));
    }
    // A big environment any program can be started with, its variable
    // last: read, and a member of its environment.
    let big = h.start("evbob", None, &[exe, "5", "last", "bobs"]);
    let stray = h.spawn_as("evcarol", None);
    for p in fat.iter().chain([&big]) {
        assert!(
            wait_until(WAIT, || environ_size(*p).is_some_and(|s| s >= 5 << 20)),
            "{p}: no fat environ"
        );
    }
    h.write_envs(&[env("bobs", Some("evbob"), None, shell)]);
    h.write_devices(4, &[(0, "bobs"), (1, "bobs"), (2, "bobs"), (3, "bobs")]);
    let mut apps: Vec<(u32, u32, &str)> = fat
        .iter()
        .enumerate()
        .map(|(i, p)| (*p, i as u32 % 4, "100"))
        .collect();
    apps.push((big, 0, "100"));
    apps.push((stray, 1, "100"));
    h.set_apps(&apps);
    let started = Instant::now();
    let out = h.ours(&[
        "enforce",
        "--interval",
        "0",
        "--non-env-processes",
        "--output",
        "json",
    ]);
    let took = started.elapsed();
    eprintln!("a cycle over 30 jobs with 16 MiB environs and a stray took {took:?}");
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let r = report(&out);
    let mut want: Vec<u64> = fat.iter().chain([&stray]).map(|p| u64::from(*p)).collect();
    want.sort_unstable();
    assert_eq!(terminated(&r), want, "every fat job and the stray judged");
    let hidden = r["notices"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["kind"] == "hidden_environ")
        .inspect(|n| {
            assert!(
                n["reason"]
                    .as_str()
                    .unwrap()
                    .contains("more than any program can be started with"),
                "{n}"
            );
            assert_eq!(n["user"], "evbob");
        })
        .count();
    assert_eq!(hidden, 30);
    for p in fat.iter().chain([&stray]) {
        assert_eq!(h.wait_signal(*p, WAIT), Some(SIGTERM), "{p}");
    }
    assert!(h.running(big), "read to its variable: a member of bobs");
    assert!(took < Duration::from_secs(15), "took {took:?}");
}

// Row 4: any user writes `x` into envs.json.

/// One cycle with non-env-processes and a 2 GiB memory cap per user.
const ROW4: [&str; 6] = [
    "enforce",
    "--interval",
    "0",
    "--non-env-processes",
    "--max-memory-per-user",
    "2gi",
];

/// A host where evbob runs a job outside genv (GPU 0, 100 MiB) and one in
/// his environment "bobs" (GPU 1, 3000 MiB); `None` without root.
fn bobs_stray_and_job() -> Option<(Host, u32, u32)> {
    if !root() {
        return None;
    }
    let mut h = Host::new(2);
    let stray = h.spawn_as("evbob", None);
    let job = h.spawn_as("evbob", Some("bobs"));
    h.set_apps(&[(stray, 0, "100"), (job, 1, "3000")]);
    Some((h, stray, job))
}

fn sorted_pids(pids: &[u32]) -> Vec<u64> {
    let mut v: Vec<u64> = pids.iter().map(|&p| u64::from(p)).collect();
    v.sort_unstable();
    v
}

#[test]
fn row4_a_garbled_state_file_stops_only_what_needs_genv_state() {
    let Some((mut h, stray, job)) = bobs_stray_and_job() else {
        return;
    };
    std::fs::write(h.state_dir().join("envs.json"), "x").unwrap();
    let out = h.ours(&[&ROW4[..], &["--output", "json"]].concat());
    assert_eq!(out.status.code(), Some(1), "degraded: {}", stderr(&out));
    let r = report(&out);
    assert!(
        r["hosts"][0]["degraded"]
            .as_str()
            .unwrap()
            .starts_with("envs.json: "),
        "{}",
        r["hosts"][0]
    );
    assert!(r["hosts"][0]["error"].is_null());
    // The job outside genv and the user's memory cap are still enforced.
    assert_eq!(terminated(&r), sorted_pids(&[stray, job]));
    let unjudged = r["notices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["kind"] == "unknown_owner")
        .unwrap();
    assert!(
        unjudged["reason"]
            .as_str()
            .unwrap()
            .contains("carries environment bobs, which cannot be judged"),
        "{unjudged}"
    );
    assert_eq!(h.wait_signal(stray, WAIT), Some(SIGTERM));
    assert_eq!(h.wait_signal(job, WAIT), Some(SIGTERM));
}

#[test]
fn row4_state_files_and_process_names_that_are_not_utf8_blind_nothing() {
    let Some((mut h, stray, job)) = bobs_stray_and_job() else {
        return;
    };
    // envs.json and devices.json are anyone's to write: one byte that is
    // not UTF-8 in each makes genv's state unusable, not the host.
    std::fs::write(h.state_dir().join("envs.json"), b"{\"envs\": [\xff]}").unwrap();
    std::fs::write(h.state_dir().join("devices.json"), b"\xc3").unwrap();
    // pmon's last column is each process's name, which its user picks.
    let mut pmon = format!("# gpu pid type sm mem command\n    0 {stray} C - - ").into_bytes();
    pmon.extend_from_slice(b"\xff) x (y\n");
    std::fs::write(h.gpu_dir().join("pmon.txt"), pmon).unwrap();
    let gpus = format!(
        "index, uuid, memory.total, utilization.gpu\n0, {}, 81559, 0\n1, {}, 81559, 0\n",
        util::uuid(0),
        util::uuid(1)
    );
    std::fs::write(h.gpu_dir().join("gpus.csv"), gpus).unwrap();
    let dir = util::private_dir();
    let db = dir.path().join("state.db");
    let idle = [
        "--idle-after",
        "1h",
        "--state-db",
        db.to_str().unwrap(),
        "--output",
        "json",
    ];
    let out = h.ours(&[&ROW4[..], &idle].concat());
    assert_eq!(out.status.code(), Some(1), "degraded: {}", stderr(&out));
    let r = report(&out);
    assert!(r["hosts"][0]["error"].is_null(), "{}", r["hosts"][0]);
    assert_eq!(
        r["hosts"][0]["degraded"], "envs.json: byte 10: not UTF-8",
        "{}",
        r["hosts"][0]
    );
    assert_eq!(terminated(&r), sorted_pids(&[stray, job]));
    assert_eq!(h.wait_signal(stray, WAIT), Some(SIGTERM));
    assert_eq!(h.wait_signal(job, WAIT), Some(SIGTERM));
}

// Row 5: a user holds genv.lock (`flock -s ... sleep inf`).

#[test]
fn row5_a_lock_a_user_holds_neither_blocks_nor_stretches_a_cycle() {
    if !root() {
        return;
    }
    let mut h = Host::new(2);
    let p = h.spawn_as("evbob", Some("bobs"));
    h.write_envs(&[env("bobs", Some("evbob"), None, p)]);
    h.write_devices(2, &[(0, "bobs"), (1, "bobs")]);
    h.set_apps(&[(p, 0, "100")]);
    let lock = h.state_dir().join("genv.lock");
    std::fs::write(&lock, "").unwrap();
    std::fs::set_permissions(&lock, std::os::unix::fs::PermissionsExt::from_mode(0o666)).unwrap();
    let holder = h.start(
        "evbob",
        None,
        &["flock", "-s", lock.to_str().unwrap(), "sleep", "1000"],
    );
    assert!(wait_until(WAIT, || std::fs::read_to_string("/proc/locks")
        .unwrap_or_default()
        .lines()
        .any(
            |l| l.split_whitespace().nth(4) == Some(&holder.to_string())
        )));
    let started = Instant::now();
    let out = h.ours(&["enforce", "--interval", "0", "--max-devices-per-user", "1"]);
    let took = started.elapsed();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains(&format!(
            "genv.lock held for over 1s by pid {holder} (evbob): devices.json was written without it"
        )),
        "{err}"
    );
    assert!(took < Duration::from_secs(8), "took {took:?}");
    assert_eq!(h.attached(1), Vec::<String>::new(), "the idle device went");
    assert_eq!(h.attached(0), ["bobs"]);
    assert!(h.running(p));
}

// Row 6: a job started with GENV_ENVIRONMENT_ID=bogus123.

#[test]
fn row6_a_made_up_environment_id_is_no_way_around_non_env_processes() {
    if !root() {
        return;
    }
    let mut h = Host::new(2);
    let shell = h.spawn_as("evbob", Some("bobs"));
    h.write_envs(&[env("bobs", Some("evbob"), None, shell)]);
    h.write_devices(2, &[(0, "bobs")]);
    let job = h.spawn_as("evbob", Some("bogus123"));
    h.set_apps(&[(job, 1, "3000")]);
    // genv's default: a real orphan must not die for a record genv
    // cleaned up; said.
    let base = ["enforce", "--interval", "0", "--non-env-processes"];
    let out = h.ours(&base);
    assert!(lines(&out).is_empty(), "{:?}", lines(&out));
    assert!(
        stderr(&out).contains("carries environment bogus123, which does not exist"),
        "{}",
        stderr(&out)
    );
    // Opted in: its owner has the grace to act on a warning...
    let mut waiting = base.to_vec();
    waiting.extend(["--orphans-as-non-env", "1h"]);
    let out = h.ours(&waiting);
    assert!(
        stderr(&out).contains(&format!("Process {job}")),
        "{}",
        stderr(&out)
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(h.running(job));
    // ... after which it is outside genv.
    let mut due = base.to_vec();
    due.extend(["--orphans-as-non-env", "0s"]);
    let out = h.ours(&due);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(
        lines(&out),
        [
            format!("Process {job} (user evbob) carries environment bogus123, which does not exist: it is not running in a GPU environment"),
            format!("Terminating process {job} from environment bogus123 that is running on GPU(s) 1"),
        ]
    );
    assert_eq!(h.wait_signal(job, WAIT), Some(SIGTERM));
    // Without --non-env-processes the flag is refused.
    let out = h.ours(&["enforce", "--interval", "0", "--orphans-as-non-env", "0s"]);
    assert_eq!(out.status.code(), Some(2));
}

// Row 7: bob's job's pid goes to alice's next fork while nvidia-smi is
// asked.

#[test]
fn row7_a_pid_that_changed_hands_while_nvidia_smi_was_asked_is_not_judged() {
    if !root() {
        return;
    }
    let (uid, gid) = util::ensure_user("evalice");
    let h = Host::new(1);
    let hooked = h.gpu_dir().join("hooked.pid");
    // The driver listed bob's job's pid, which alice's fresh process has
    // by the time /proc is read: here, the pid listed is that of a process
    // of hers started while nvidia-smi was asked.
    util::write_executable(
        &h.gpu_dir().join("on-apps"),
        &format!(
            "#!/bin/sh\nsetpriv --reuid={uid} --regid={gid} --clear-groups sleep 1000 </dev/null >/dev/null 2>&1 &\necho $! > '{}'\nprintf 'gpu_uuid, pid, used_gpu_memory\\n%s, %s, 3000\\n' '{}' $! > '{}'\n",
            hooked.display(),
            util::uuid(0),
            h.gpu_dir().join("apps.csv").display()
        ),
    );
    let out = h.ours(&["enforce", "--interval", "0", "--non-env-processes"]);
    let pid: u32 = std::fs::read_to_string(&hooked)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let alive = Path::new(&format!("/proc/{pid}")).exists();
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status();
    assert!(lines(&out).is_empty(), "{:?}", lines(&out));
    assert!(alive, "alice's process was terminated");
    assert!(
        stderr(&out).contains(&format!(
            "Process {pid} on GPU(s) 0 has unknown ownership (it started after nvidia-smi was asked"
        )),
        "{}",
        stderr(&out)
    );
}

// Row 9: devices.json bloated with arrays nested 120 deep.

#[test]
fn row9_a_rewrite_of_a_bloated_state_file_stays_bounded() {
    if !root() {
        return;
    }
    let mut h = Host::new(2);
    let p = h.spawn_as("evbob", Some("bobs"));
    h.write_envs(&[env("bobs", Some("evbob"), None, p)]);
    h.write_devices(2, &[(0, "bobs"), (1, "bobs")]);
    h.set_apps(&[(p, 0, "100")]);
    let path = h.state_dir().join("devices.json");
    let mut devices: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let numbers: Vec<Value> = (0..1300).map(Value::from).collect();
    let mut deep = Value::Array(numbers);
    for _ in 0..119 {
        deep = Value::Array(vec![deep]);
    }
    devices["x"] = Value::Array(vec![deep; 120]);
    std::fs::write(&path, serde_json::to_string(&devices).unwrap()).unwrap();
    let before = std::fs::metadata(&path).unwrap().len();
    let out = h.ours(&["enforce", "--interval", "0", "--max-devices-per-user", "1"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(h.attached(1), Vec::<String>::new(), "detached");
    let after = std::fs::metadata(&path).unwrap().len();
    assert!(after <= 2 * before + 4096, "{before} bytes became {after}");
    let back: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(back["x"], devices["x"], "everything else kept");
}

// Row 10: a device cap without --non-env-processes.

#[test]
fn row10_a_device_cap_that_leaves_jobs_outside_genv_says_so_and_can_count_them() {
    if !root() {
        return;
    }
    let mut h = Host::new(4);
    let job = h.spawn_as("evbob", Some("bobs"));
    let outside = h.spawn_as("evbob", None);
    h.write_envs(&[env("bobs", Some("evbob"), None, job)]);
    h.write_devices(4, &[(0, "bobs")]);
    h.set_apps(&[(job, 0, "100"), (outside, 1, "100"), (outside, 2, "100")]);
    let out = h.ours(&["enforce", "--interval", "0", "--max-devices-per-user", "2"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(lines(&out).is_empty());
    assert!(
        stderr(&out).contains("warning: a device cap counts attached devices only: GPU jobs run outside genv (env -u GENV_ENVIRONMENT_ID) escape it"),
        "{}",
        stderr(&out)
    );
    // Counted: bob holds 3 devices, one over; only his environment's can go.
    let out = h.ours(&[
        "enforce",
        "--interval",
        "0",
        "--max-devices-per-user",
        "2",
        "--count-non-env-devices",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(!stderr(&out).contains("escape it"), "{}", stderr(&out));
    assert_eq!(
        lines(&out)[0],
        "User evbob is using 3 devices which is 1 more than the maximum allowed"
    );
    assert_eq!(h.attached(0), Vec::<String>::new());
    assert_eq!(h.wait_signal(job, WAIT), Some(SIGTERM));
    assert!(h.running(outside));
}

#[test]
fn row11_a_stray_beside_each_job_never_shields_them_from_the_device_cap() {
    if !root() {
        return;
    }
    let mut h = Host::new(3);
    let shell = h.spawn_as("evbob", Some("bobs"));
    h.write_envs(&[env("bobs", Some("evbob"), None, shell)]);
    h.write_devices(3, &[(0, "bobs"), (1, "bobs"), (2, "bobs")]);
    // A job of his environment on each device, and beside each a process
    // of his with an id of no record (a stray, taken under his cap too).
    let jobs: Vec<u32> = (0..3).map(|_| h.spawn_as("evbob", Some("bobs"))).collect();
    let strays: Vec<u32> = (0..3).map(|_| h.spawn_as("evbob", Some("nope"))).collect();
    let apps: Vec<(u32, u32, &str)> = (0..3u32)
        .flat_map(|d| [(jobs[d as usize], d, "100"), (strays[d as usize], d, "100")])
        .collect();
    h.set_apps(&apps);
    let out = h.ours(&["enforce", "--interval", "0", "--max-devices-per-user", "1"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_eq!(
        lines(&out)[0],
        "User evbob is using 3 devices which is 2 more than the maximum allowed"
    );
    // Freed in genv's order: detached with the environment's jobs there,
    // and the strays beside them terminated (issue 42: a stray is brought
    // under its owner's cap like a member).
    assert_eq!(h.attached(0), Vec::<String>::new());
    assert_eq!(h.attached(1), Vec::<String>::new());
    assert_eq!(h.attached(2), ["bobs"]);
    for p in [jobs[0], jobs[1], strays[0], strays[1]] {
        assert_eq!(h.wait_signal(p, WAIT), Some(SIGTERM), "{p}: {err}");
    }
    std::thread::sleep(Duration::from_millis(300));
    assert!(h.running(jobs[2]) && h.running(shell) && h.running(strays[2]));
    assert!(!err.contains("over the device cap"), "{err}");
}

// The agent is the same on a remote host: rows 1 to 4 through real sshd.

#[test]
fn rows1_to_4_on_the_sshd_fleet() {
    let Some(mut f) = Fleet::up(2) else { return };
    let leader = util::job("exitlead");
    let fatenv = util::job("fatenv");
    // Host 1: an exited leader, a fat environ, bob's sub-uid jobs.
    let exited = f.host(0).start("evbob", None, &[leader.to_str().unwrap()]);
    let fat = f.host(0).start(
        "evbob",
        None,
        &[fatenv.to_str().unwrap(), "16", "last", "x"],
    );
    util::ensure_user("evsub");
    let start = sub_range("evsub", 2_000_000_000);
    let subs: Vec<u32> = (1..=2)
        .map(|k| sub_uid_job(f.host(0), "evsub", start, k))
        .collect();
    // Host 2: garbled state, a job outside genv.
    let stray = f.host(1).spawn_as("evbob", None);
    std::fs::write(f.host(1).state_dir().join("envs.json"), "x").unwrap();
    f.host(1).set_apps(&[(stray, 0, "100")]);
    std::thread::sleep(Duration::from_millis(700));
    f.host(0).set_apps(&[
        (exited, 0, "100"),
        (fat, 1, "100"),
        (subs[0], 2, "3000"),
        (subs[1], 3, "3000"),
    ]);
    let out = f.ours(&[
        "enforce",
        "--interval",
        "0",
        "--non-env-processes",
        "--max-memory-per-user",
        "4gi",
        "--output",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(1), "degraded: {}", stderr(&out));
    let r = report(&out);
    assert!(r["hosts"][1]["degraded"].as_str().is_some(), "{r}");
    let plan = &r["plan"]["hosts"];
    let pids = |i: usize| -> Vec<u64> {
        let mut v: Vec<u64> = plan
            .as_array()
            .unwrap()
            .iter()
            .filter(|h| h["host"] == f.names[i])
            .flat_map(|h| h["terminate"].as_array().cloned().unwrap_or_default())
            .map(|t| t["pid"].as_u64().unwrap())
            .collect();
        v.sort_unstable();
        v
    };
    // Outside genv: the exited leader, the fat environ, and the sub-uid
    // jobs (no environment).
    let mut want: Vec<u64> = [exited, fat, subs[0], subs[1]]
        .iter()
        .map(|p| u64::from(*p))
        .collect();
    want.sort_unstable();
    assert_eq!(pids(0), want, "{r}");
    assert_eq!(pids(1), [u64::from(stray)]);
    // The sub-uid jobs are evsub's, said with their sub-uids; the fat
    // environ is judged as carrying none, and said.
    let terminate = plan
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["host"] == f.names[0])
        .unwrap()["terminate"]
        .clone();
    for t in terminate.as_array().unwrap() {
        if [subs[0], subs[1]].contains(&(t["pid"].as_u64().unwrap() as u32)) {
            assert_eq!(t["user"], "evsub", "{t}");
            assert!(t["sub_uid"].as_u64().unwrap() > start, "{t}");
        }
    }
    assert!(
        r["notices"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["kind"] == "hidden_environ" && n["pid"] == fat),
        "{r}"
    );
    for p in [exited, fat, subs[0], subs[1]] {
        assert_eq!(f.host(0).wait_signal(p, WAIT), Some(SIGTERM), "{p}");
    }
    assert_eq!(f.host(1).wait_signal(stray, WAIT), Some(SIGTERM));
}

/// A FUSE file system that never answers a read (`tests/util/hangfs.py`),
/// mounted on `dir` serving `names`: what any user can mount on a
/// directory or file of theirs (fusermount). Unmounted when dropped.
struct HangFs {
    daemon: std::process::Child,
    dir: std::path::PathBuf,
}

impl HangFs {
    fn mount(dir: &Path, size: u64, names: &str) -> Option<HangFs> {
        if !util::prerequisite(
            Path::new("/dev/fuse").exists(),
            "/dev/fuse is missing (FUSE)",
        ) {
            return None;
        }
        let mut daemon = std::process::Command::new("python3")
            .arg(util::repo().join("tests/util/hangfs.py"))
            .args([dir.to_str().unwrap(), &size.to_string(), names])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(daemon.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        assert_eq!(line, "ready\n", "hangfs did not mount");
        Some(HangFs {
            daemon,
            dir: dir.to_path_buf(),
        })
    }
}

impl Drop for HangFs {
    fn drop(&mut self) {
        // Its end answers every waiting read (with an error).
        let _ = self.daemon.kill();
        let _ = self.daemon.wait();
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.dir)
            .status();
    }
}

// Row 3, a FUSE file: an environ, or genv's state, on a file system of a
// user's that never answers a read.

#[test]
fn row3_an_environ_or_state_on_a_fuse_mount_that_never_answers_blocks_nothing() {
    if !root() {
        return;
    }
    let exe = util::job("fatenv");
    let mut h = Host::new(2);
    let mnt = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        mnt.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let Some(fs) = HangFs::mount(mnt.path(), 1 << 20, "env") else {
        return;
    };
    // bob's job maps its environ from the file that never answers.
    let env_file = mnt.path().join("env");
    let job = h.start(
        "evbob",
        None,
        &[
            exe.to_str().unwrap(),
            "1",
            "none",
            "x",
            env_file.to_str().unwrap(),
        ],
    );
    assert!(wait_until(WAIT, || environ_size(job) == Some(1 << 20)));
    h.set_apps(&[(job, 0, "100")]);
    let started = Instant::now();
    let out = h.ours(&["enforce", "--interval", "0", "--non-env-processes"]);
    let took = started.elapsed();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    // Judged as outside genv (the kernel reads no environ from a file
    // mapping since 4.18; before, the read hangs and it is hidden).
    assert_eq!(
        lines(&out)[0],
        format!("Process {job} is not running in a GPU environment")
    );
    assert_eq!(h.wait_signal(job, WAIT), Some(SIGTERM));
    assert!(took < Duration::from_secs(8), "took {took:?}");
    drop(fs);
    // genv's state directory itself on such a mount (its owner mounted it
    // there): refused at once, the host degraded, the rest enforced.
    let stray = h.spawn_as("evbob", None);
    h.set_apps(&[(stray, 1, "100")]);
    let Some(_fs) = HangFs::mount(&h.state_dir(), 100, "envs.json,devices.json,genv.lock") else {
        return;
    };
    let started = Instant::now();
    let out = h.ours(&[
        "enforce",
        "--interval",
        "0",
        "--non-env-processes",
        "--command-timeout",
        "3s",
    ]);
    let took = started.elapsed();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("genv's state cannot be used (")
            && (err.contains("on a FUSE file system") || err.contains("did not answer")),
        "{err}"
    );
    assert_eq!(h.wait_signal(stray, WAIT), Some(SIGTERM));
    assert!(took < Duration::from_secs(8), "took {took:?}");
}
