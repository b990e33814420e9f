//! Remote enforcement end to end, through real sshd (`scripts/fleet`): real
//! processes really signalled, real `devices.json` really changed, and
//! every failure path of a fleet. Needs root (CI runs as root).

mod util;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use util::fleet::Fleet;
use util::{env, lines};

const SIGTERM: i32 = 15;
const WAIT: Duration = Duration::from_secs(10);

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn each_rule_across_hosts_with_cluster_wide_device_caps() {
    let Some(mut f) = Fleet::up(3) else { return };
    let (n1, n2, n3) = (f.names[0].clone(), f.names[1].clone(), f.names[2].clone());
    // h1: a process outside any environment; alice holds devices 0 and 1.
    let stray = f.host(0).spawn(None);
    let a1 = f.host(0).spawn_as("alice", Some("a1"));
    f.host(0).set_apps(&[(stray, 2, "100"), (a1, 0, "100")]);
    f.host(0).write_envs(&[env("a1", Some("alice"), None, a1)]);
    f.host(0).write_devices(4, &[(0, "a1"), (1, "a1")]);
    // h2: a process on a GPU its environment is not attached to; alice again.
    let roamer = f.host(1).spawn_as("bob", Some("b"));
    let a2 = f.host(1).spawn_as("alice", Some("a2"));
    f.host(1)
        .set_apps(&[(roamer, 1, "100"), (roamer, 2, "100"), (a2, 3, "100")]);
    f.host(1).write_envs(&[
        env("b", Some("bob"), None, roamer),
        env("a2", Some("alice"), None, a2),
    ]);
    f.host(1).write_devices(4, &[(1, "b"), (3, "a2")]);
    // h3: an environment over its memory capacity.
    // genv walks the pids in CPython set order: the hog comes first there,
    // so killing it is enough.
    let (hog, fine) = f.host(2).spawn_pair_in_set_order("carol", "c");
    f.host(2).set_apps(&[(hog, 0, "3000"), (fine, 0, "10")]);
    f.host(2)
        .write_envs(&[env("c", Some("carol"), Some("2gi"), hog)]);
    f.host(2).write_devices(4, &[(0, "c")]);

    let out = f.ours(&[
        "enforce",
        "--interval",
        "0",
        "--non-env-processes",
        "--max-devices-per-user",
        "2",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let l = lines(&out);
    for expected in [
        format!("[{n1}] Process {stray} is not running in a GPU environment"),
        format!("[{n2}] Process {roamer} from environment b is using non-attached GPU(s) 2"),
        format!("[{n3}] Environment c is using 3156m on device 0 which is 1008m over its capacity of 2gi"),
        "User alice is using 3 devices on 2 hosts which is 1 more than the maximum allowed".to_string(),
        // The device none of her jobs runs on (genv: device 0, and her job).
        format!("[{n1}] Detaching environment a1 of user alice from device 1"),
    ] {
        assert!(l.contains(&expected), "missing {expected:?} in {l:#?}");
    }
    assert_eq!(l.len(), 8, "{l:#?}");
    for (h, pid) in [(0, stray), (1, roamer), (2, hog)] {
        assert_eq!(
            f.host(h).wait_signal(pid, WAIT),
            Some(SIGTERM),
            "pid {pid} on host {h}"
        );
    }
    assert!(f.host(2).running(fine));
    assert!(f.host(1).running(a2));
    assert!(f.host(0).running(a1));
    assert_eq!(f.host(0).attached(0), vec!["a1"]);
    assert_eq!(f.host(0).attached(1), Vec::<String>::new());
    assert_eq!(f.host(1).attached(3), vec!["a2"]);
}

#[test]
fn dry_run_through_ssh_touches_nothing() {
    let Some(mut f) = Fleet::up(2) else { return };
    let stray = f.host(1).spawn(None);
    f.host(1).set_apps(&[(stray, 0, "100")]);
    let p = f.host(0).spawn_as("xu", Some("x"));
    f.host(0).write_envs(&[env("x", Some("xu"), None, p)]);
    f.host(0).write_devices(4, &[(0, "x"), (1, "x")]);
    let before = std::fs::read(f.host(0).state_dir().join("devices.json")).unwrap();
    let out = f.ours(&[
        "enforce",
        "--interval",
        "0",
        "--dry-run",
        "--non-env-processes",
        "--max-devices-per-user",
        "1",
    ]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert_eq!(lines(&out).len(), 4, "{:?}", lines(&out));
    std::thread::sleep(Duration::from_millis(300));
    assert!(f.host(1).running(stray));
    assert_eq!(
        std::fs::read(f.host(0).state_dir().join("devices.json")).unwrap(),
        before
    );
}

#[test]
fn broken_hosts_are_reported_and_the_rest_enforced() {
    // h1 down, h2 sudo wants a password, h3 nvidia-smi hangs, h4 malformed state, h5 fine.
    let Some(mut f) = Fleet::up_with_password_sudo(5, 2) else {
        return;
    };
    f.stop(0);
    std::fs::write(f.host(2).gpu_dir().join("hang"), "").unwrap();
    std::fs::write(
        f.host(3).state_dir().join("envs.json"),
        "{\"envs\": [{\"eid\": 7}]}",
    )
    .unwrap();
    let mut strays = Vec::new();
    for h in 1..5 {
        let p = f.host(h).spawn(None);
        f.host(h).set_apps(&[(p, 0, "100")]);
        strays.push(p);
    }
    let audit = tempfile::tempdir().unwrap();
    let audit_log = audit.path().join("audit.log");
    let started = Instant::now();
    let out = f.ours(&[
        "-t",
        "5",
        "--command-timeout",
        "4s",
        "enforce",
        "--interval",
        "0",
        "--non-env-processes",
        "--audit-log",
        audit_log.to_str().unwrap(),
    ]);
    let elapsed = started.elapsed();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    let line = |i: usize| {
        err.lines()
            .find(|l| l.starts_with(&format!("Failed running SSH command on {} (", f.names[i])))
            .map(String::from)
    };
    assert!(
        line(0).is_some_and(|l| l.contains("onnect")),
        "down host: {err}"
    );
    assert!(
        line(1).is_some_and(|l| l.contains("a password is required")),
        "sudo: {err}"
    );
    assert!(
        line(2).is_some_and(|l| l.contains("nvidia-smi")),
        "hung nvidia-smi: {err}"
    );
    // Malformed state degrades its host: what needs none is enforced.
    assert!(line(3).is_none(), "{err}");
    assert!(
        err.contains(&format!(
            "[{}] [ERROR] genv's state cannot be used (envs.json: ",
            f.names[3]
        )) && err.contains("envs[0].eid"),
        "malformed: {err}"
    );
    assert!(line(4).is_none(), "{err}");
    // Each failure has its kind, in the audit log (and metrics).
    let failed: Vec<(String, String)> = std::fs::read_to_string(&audit_log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|e| e["phase"] == "failed")
        .map(|e| {
            let s = |k: &str| e[k].as_str().unwrap().to_string();
            (s("host"), s("failure"))
        })
        .collect();
    let kind = |i: usize| {
        failed
            .iter()
            .find(|(h, _)| *h == f.names[i])
            .map(|(_, k)| k.as_str())
    };
    assert_eq!(
        [kind(0), kind(1), kind(2), kind(3), kind(4)],
        [
            Some("connect-refused"),
            Some("sudo"),
            Some("nvidia-smi"),
            Some("degraded"),
            None
        ],
        "{failed:?}"
    );
    // The healthy and the degraded host were enforced; the broken ones
    // were left alone.
    assert_eq!(f.host(4).wait_signal(strays[3], WAIT), Some(SIGTERM));
    assert_eq!(f.host(3).wait_signal(strays[2], WAIT), Some(SIGTERM));
    for (h, p) in [(1, strays[0]), (2, strays[1])] {
        assert!(f.host(h).running(p), "host {h}");
    }
    assert_eq!(
        lines(&out),
        vec![
            format!(
                "[{}] Process {} is not running in a GPU environment",
                f.names[3], strays[2]
            ),
            format!(
                "[{}] Process {} is not running in a GPU environment",
                f.names[4], strays[3]
            ),
            format!(
                "[{}] Terminating process {} from environment N/A that is running on GPU(s) 0",
                f.names[3], strays[2]
            ),
            format!(
                "[{}] Terminating process {} from environment N/A that is running on GPU(s) 0",
                f.names[4], strays[3]
            ),
        ]
    );
    // -q hides the failures; -e aborts before enforcing anything.
    let stray = f.host(4).spawn(None);
    f.host(4).set_apps(&[(stray, 1, "100")]);
    let out = f.ours(&[
        "-q",
        "-t",
        "5",
        "--command-timeout",
        "4s",
        "enforce",
        "--interval",
        "0",
        "--dry-run",
    ]);
    assert!(
        !stderr(&out).contains("Failed running SSH command"),
        "{}",
        stderr(&out)
    );
    let out = f.ours(&[
        "-e",
        "-t",
        "5",
        "--command-timeout",
        "4s",
        "enforce",
        "--interval",
        "0",
        "--non-env-processes",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(lines(&out).is_empty());
    assert!(f.host(4).running(stray));
    eprintln!("a cycle with 4 broken hosts of 5 took {elapsed:?}");
}

#[test]
fn unreachable_host_never_causes_a_detach_elsewhere() {
    let Some(mut f) = Fleet::up(2) else { return };
    // dave: 2 devices on h1 (about to go down) and 2 on h2, cap 3.
    for h in 0..2 {
        let p = f.host(h).spawn_as("dave", Some("d"));
        f.host(h).write_envs(&[env("d", Some("dave"), None, p)]);
        f.host(h).write_devices(4, &[(0, "d"), (1, "d")]);
    }
    let out = f.ours(&[
        "enforce",
        "--interval",
        "0",
        "--dry-run",
        "--max-devices-per-user",
        "3",
    ]);
    assert!(
        lines(&out)[0].starts_with("User dave is using 4 devices on 2 hosts which is 1 more"),
        "{:?}",
        lines(&out)
    );
    f.stop(0);
    // With h1 unseen, dave has 2 visible devices: nothing is detached on h2.
    let out = f.ours(&[
        "-t",
        "5",
        "enforce",
        "--interval",
        "0",
        "--max-devices-per-user",
        "3",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(lines(&out).is_empty(), "{:?}", lines(&out));
    assert_eq!(f.host(1).attached(0), vec!["d"]);
    // What is visible alone breaks a cap of 1: that much is enforced.
    let out = f.ours(&[
        "-t",
        "5",
        "enforce",
        "--interval",
        "0",
        "--max-devices-per-user",
        "1",
    ]);
    assert!(
        lines(&out).contains(
            &"User dave is using 2 devices on 1 hosts which is 1 more than the maximum allowed"
                .to_string()
        ),
        "{:?} {}",
        lines(&out),
        stderr(&out)
    );
    assert!(f.host(1).attached(0).is_empty());
    assert_eq!(f.host(1).attached(1), vec!["d"]);
}

/// Starts a looping run with JSON output; returns the child and a reader of its cycles.
fn looping(
    f: &Fleet,
    control: &std::path::Path,
    interval: &str,
    extra: &[&str],
) -> (std::process::Child, BufReader<std::process::ChildStdout>) {
    let hosts = f.names.join(",");
    let control = control.display().to_string();
    let mut args = vec!["-H", hosts.as_str(), "--control-dir", control.as_str()];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["enforce", "--interval", interval, "--output", "json"]);
    let mut child = f
        .command(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    (child, out)
}

fn next_cycle(out: &mut BufReader<std::process::ChildStdout>) -> serde_json::Value {
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"))
}

/// SIGHUP: a reload.
fn hup(child: &std::process::Child) {
    rustix::process::kill_process(
        rustix::process::Pid::from_child(child),
        rustix::process::Signal::HUP,
    )
    .unwrap();
}

fn terminate(child: &std::process::Child) {
    rustix::process::kill_process(
        rustix::process::Pid::from_child(child),
        rustix::process::Signal::TERM,
    )
    .unwrap();
}

fn sockets_in(dir: &std::path::Path) -> Vec<String> {
    walk(dir)
        .into_iter()
        .filter(|p| {
            std::fs::metadata(p)
                .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
        })
        .map(|p| p.display().to_string())
        .collect()
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        }
        out.push(p);
    }
    out
}

#[test]
fn interval_loop_keeps_one_master_per_host_and_reconnects_after_a_reboot() {
    let Some(mut f) = Fleet::up(2) else { return };
    let control = tempfile::tempdir().unwrap();
    let (child, mut out) = looping(&f, control.path(), "300ms", &["-t", "5"]);
    for cycle in 1..=3 {
        let c = next_cycle(&mut out);
        assert_eq!(c["cycle"], cycle);
        // Per-phase timing: masters opened in cycle 1 only.
        let t = &c["timing"];
        assert_eq!(t["connects"], if cycle == 1 { 2 } else { 0 }, "{c}");
        assert!(
            f.names.iter().any(|n| t["slowest_host"] == n.as_str()),
            "{c}"
        );
        let ms = |k: &str| t[k].as_u64().unwrap();
        assert!(
            ms("total_ms") >= ms("snapshot_ms") && ms("snapshot_ms") >= ms("slowest_ms"),
            "{c}"
        );
        assert!(ms("snapshot_ms") >= ms("connect_ms"), "{c}");
        assert!(
            c["hosts"]
                .as_array()
                .unwrap()
                .iter()
                .all(|h| h["error"].is_null()),
            "{c}"
        );
    }
    assert_eq!(
        (f.connections(0), f.connections(1)),
        (1, 1),
        "3 cycles over one connection per host"
    );
    // h1 reboots: its master dies with it; it fails while down, then comes back.
    f.stop(0);
    let mut saw_failure = false;
    let mut back = false;
    for _ in 0..40 {
        let c = next_cycle(&mut out);
        if !c["hosts"][0]["error"].is_null() {
            if !saw_failure {
                f.start(0);
            }
            saw_failure = true;
        } else if saw_failure {
            back = true;
            break;
        }
        assert!(
            c["hosts"][1]["error"].is_null(),
            "the other host is unaffected: {c}"
        );
    }
    assert!(
        saw_failure && back,
        "failure seen {saw_failure}, back {back}"
    );
    assert_eq!(f.connections(0), 2, "one new master after the reboot");
    assert_eq!(f.connections(1), 1);
    terminate(&child);
    let status = child.wait_with_output().unwrap().status;
    assert!(status.code().is_some(), "exited, not killed: {status:?}");
    assert_eq!(sockets_in(control.path()), Vec::<String>::new());
}

#[test]
fn sigterm_during_a_cycle_stops_cleanly_and_leaves_no_master_socket() {
    let Some(f) = Fleet::up(2) else { return };
    let control = tempfile::tempdir().unwrap();
    let (child, mut out) = looping(&f, control.path(), "200ms", &["--command-timeout", "60s"]);
    next_cycle(&mut out);
    // The next cycle hangs on h2's nvidia-smi (60s deadline): stop it then.
    std::fs::write(f.hosts[1].gpu_dir().join("hang"), "").unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        !sockets_in(control.path()).is_empty(),
        "masters are up mid-cycle"
    );
    let stopped = Instant::now();
    terminate(&child);
    let output = child.wait_with_output().unwrap();
    assert!(
        stopped.elapsed() < Duration::from_secs(15),
        "took {:?}",
        stopped.elapsed()
    );
    assert!(output.status.code().is_some(), "{:?}", output.status);
    assert_eq!(sockets_in(control.path()), Vec::<String>::new());
    let masters = std::process::Command::new("pgrep")
        .args(["-f", &control.path().display().to_string()])
        .output()
        .unwrap();
    assert!(
        masters.stdout.is_empty(),
        "ssh masters left: {}",
        String::from_utf8_lossy(&masters.stdout)
    );
}

#[test]
fn a_refused_session_is_an_error_not_a_silent_new_connection() {
    let Some(f) = Fleet::up_with(1, |dir, _| {
        std::fs::write(dir.join("sshd_extra"), "MaxSessions 0\n").unwrap()
    }) else {
        return;
    };
    let out = f.ours(&["-t", "5", "enforce", "--interval", "0"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).starts_with(&format!("Failed running SSH command on {} (", f.names[0])),
        "{}",
        stderr(&out)
    );
    assert_eq!(f.connections(0), 1, "no fallback connection was opened");
}

#[test]
fn hostile_eid_and_username_reach_no_shell() {
    let Some(mut f) = Fleet::up(1) else { return };
    let mark = f.dir.path().join("pwned");
    let m = mark.display().to_string();
    let eid = format!("e$(touch {m});touch {m}\n`touch {m}`");
    let user = format!("u$(touch {m}); touch {m}");
    let p = f.host(0).spawn_as("mallory", Some(&eid));
    let q = f.host(0).spawn_as("mallory", Some(&eid));
    f.host(0)
        .set_apps(&[(p, 0, "100"), (p, 1, "100"), (q, 3, "100")]);
    f.host(0).write_envs(&[env(&eid, Some(&user), None, p)]);
    f.host(0).write_devices(4, &[(0, &eid), (1, &eid)]);
    let out = f.ours(&["enforce", "--interval", "0", "--max-devices-per-user", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!mark.exists(), "a host value reached a shell");
    // It was enforced all the same: detached from device 0 (and its process
    // there terminated), and its process on an unattached GPU terminated.
    assert_eq!(f.host(0).wait_signal(p, WAIT), Some(SIGTERM));
    assert_eq!(f.host(0).wait_signal(q, WAIT), Some(SIGTERM));
    assert_eq!(f.host(0).attached(0), Vec::<String>::new());
    assert_eq!(f.host(0).attached(1), vec![eid.clone()]);
    // No forged output line: the newline is escaped.
    assert!(
        lines(&out)
            .iter()
            .all(|l| l.starts_with(&format!("[{}] ", f.names[0])) || l.starts_with("User ")),
        "{:?}",
        lines(&out)
    );
}

#[test]
fn remote_snapshot_matches_genv_usage_snapshot_on_the_host() {
    let Some(mut f) = Fleet::up(1) else { return };
    let a = f.host(0).spawn(Some("a"));
    let stray = f.host(0).spawn(None);
    let dead_env_pid = 999_999;
    f.host(0)
        .set_apps(&[(a, 0, "1200"), (a, 1, "300"), (stray, 2, "50")]);
    f.host(0).write_envs(&[
        env("a", Some("alice"), Some("4gi"), a),
        env("gone", Some("bob"), None, dead_env_pid),
    ]);
    f.host(0).write_devices(4, &[(0, "a"), (2, "gone")]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (ours, genv) = rt.block_on(async {
        let spec = genv_enforce::inventory::parse_host(&f.names[0], &Default::default()).unwrap();
        let spec = genv_enforce::inventory::HostSpec {
            identity_file: Some(f.dir.path().join("id_ed25519")),
            ..spec
        };
        let ssh = std::sync::Arc::new(genv_enforce::host::ssh::SshOptions {
            connect_timeout: Some(Duration::from_secs(5)),
            control_dir: f.dir.path().to_path_buf(),
            persist: Duration::from_secs(60),
            known_hosts: openssh::KnownHosts::Add,
            known_hosts_file: Some(f.dir.path().join("known_hosts")),
            at_end: genv_enforce::host::ssh::AtEnd::Close,
        });
        let host = genv_enforce::host::LiveHost::ssh(
            spec,
            ssh,
            Duration::from_secs(20),
            genv_enforce::host::remote::AgentLifetime::OneCycle,
        );
        let ours = match host.fetch().await {
            Ok(fetched) => host.parser().parse(fetched),
            Err(e) => Err(e),
        };
        let argv: Vec<String> = ["sudo", "-n", "genv", "usage", "snapshot"]
            .map(String::from)
            .to_vec();
        let genv_enforce::host::live::Transport::Ssh(ssh) = &host.via else {
            unreachable!("an SSH host")
        };
        let genv = ssh
            .conn
            .run(&argv, None, Duration::from_secs(20), &ssh.ssh)
            .await
            .unwrap();
        host.close().await.unwrap();
        (ours.unwrap(), genv)
    });
    assert!(
        genv.status.success(),
        "{}",
        String::from_utf8_lossy(&genv.stderr)
    );
    let ours_json = serde_json::to_vec(&genv_enforce::snapshot::genv::to_json(&ours)).unwrap();
    util::assert_same_snapshot(&genv.stdout, &ours_json);
    assert!(ours
        .processes
        .iter()
        .all(|p| p.start_time.is_some() && p.uid == Some(0)));
}

#[test]
fn inventory_fleet_with_a_host_failing_during_dispatch() {
    let Some(mut f) = Fleet::up(2) else { return };
    let inventory = f.inventory(false, &[], "\n[limits]\nmax_devices_per_user = 1\n");
    let mut pids = Vec::new();
    for h in 0..2 {
        let p = f.host(h).spawn_as(&format!("user{h}"), Some("e"));
        // Working on both devices: the cap takes device 0, as genv.
        f.host(h).set_apps(&[(p, 0, "100"), (p, 1, "100")]);
        f.host(h)
            .write_envs(&[env("e", Some(&format!("user{h}")), None, p)]);
        f.host(h).write_devices(4, &[(0, "e"), (1, "e")]);
        pids.push(p);
    }
    // Once host 1 is decided on, its devices.json becomes a link: the
    // detach there must fail (and be reported), nothing else.
    let state = f.host(0).state_dir();
    f.host(0).answer_late();
    let watcher = util::after_read(&state.join("devices.json"), move || {
        let text = std::fs::read(state.join("devices.json")).unwrap();
        std::fs::write(state.join("elsewhere.json"), text).unwrap();
        std::fs::remove_file(state.join("devices.json")).unwrap();
        std::os::unix::fs::symlink(state.join("elsewhere.json"), state.join("devices.json"))
            .unwrap();
    });
    let out = f
        .command(&[
            "--inventory",
            &inventory.display().to_string(),
            "enforce",
            "--interval",
            "0",
        ])
        .output()
        .unwrap();
    assert!(watcher.join().unwrap());
    assert_eq!(
        out.status.code(),
        Some(1),
        "a failed action makes the run fail"
    );
    let err = stderr(&out);
    assert!(
        err.contains(
            "[h1] [ERROR] Failed detaching environment e from device 0: /var/tmp/genv/devices.json is a symbolic link: refused"
        ),
        "{err}"
    );
    // The caps came from the file; both hosts had their process terminated.
    assert!(lines(&out).contains(
        &"User user1 is using 2 devices on 1 hosts which is 1 more than the maximum allowed"
            .to_string()
    ));
    assert_eq!(f.host(0).wait_signal(pids[0], WAIT), Some(SIGTERM));
    assert_eq!(f.host(1).wait_signal(pids[1], WAIT), Some(SIGTERM));
    assert_eq!(
        f.host(0).attached(0),
        vec!["e"],
        "nothing detached where the host refused"
    );
    assert_eq!(f.host(1).attached(0), Vec::<String>::new());
    assert_eq!(f.host(1).attached(1), vec!["e"]);
}

#[test]
fn a_hung_command_fails_its_host_at_the_deadline_and_the_master_survives() {
    let Some(mut f) = Fleet::up(2) else { return };
    // On host 1, everything run through "sudo" hangs first (its /usr/local/sbin is this dir).
    let hang = f.dir.path().join("h1/sbin/hang-sudo");
    util::write_executable(&hang, "#!/bin/sh\nsleep 37\nexec sudo \"$@\"\n");
    let inventory = f.inventory(false, &["sudo = \"/usr/local/sbin/hang-sudo -n\""], "");
    let stray = f.host(1).spawn(None);
    f.host(1).set_apps(&[(stray, 0, "100")]);
    let control = tempfile::tempdir().unwrap();
    let mut child = f
        .command(&[
            "--inventory",
            &inventory.display().to_string(),
            "--command-timeout",
            "3s",
            "--control-dir",
            &control.path().display().to_string(),
            "enforce",
            "--interval",
            "100ms",
            "--output",
            "json",
            "--non-env-processes",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    for _ in 0..2 {
        let c = next_cycle(&mut out);
        let error = c["hosts"][0]["error"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        // Killed on the host (limit 1 s, then 1 s grace) before our 3 s deadline.
        assert!(
            error.contains("snapshot (killed on the host) did not finish within 1s"),
            "{c}"
        );
        assert!(c["hosts"][1]["error"].is_null(), "{c}");
    }
    terminate(&child);
    child.wait().unwrap();
    assert_eq!(f.host(1).wait_signal(stray, WAIT), Some(SIGTERM));
    // Nothing hung is left on the host to hold a session open on its master.
    let leftovers = || {
        let out = std::process::Command::new("pgrep")
            .args(["-f", "^sleep 37$"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).lines().count()
    };
    let t = Instant::now();
    while leftovers() > 0 && t.elapsed() < WAIT {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(leftovers(), 0, "hung commands outlived their deadline");
    assert_eq!(
        f.connections(0),
        1,
        "the master outlived the timed-out commands"
    );
}

#[test]
fn remote_output_matches_genv_remote_enforce() {
    let Some(mut f) = Fleet::up(2) else { return };
    let key = f.dir.path().join("id_ed25519").display().to_string();
    let addresses = f.addresses();
    // Hosts named by address, as genv names them.
    let inventory = f.inventory(true, &[], "");
    // genv runs plain `ssh HOST sudo genv ...`: give it the fleet's settings.
    let bin = f.dir.path().join("genv-bin");
    std::fs::create_dir_all(&bin).unwrap();
    let config = f.dir.path().join("ssh_config");
    std::fs::write(&config, format!("Host *\n  User genv-fleet\n  Port 2222\n  IdentityFile {key}\n  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n")).unwrap();
    util::write_executable(
        &bin.join("ssh"),
        &format!(
            "#!/bin/sh\nexec /usr/bin/ssh -F {} \"$@\"\n",
            config.display()
        ),
    );

    let stray = f.host(0).spawn(None);
    let a1 = f.host(0).spawn_as("alice", Some("a1"));
    // a1 works on both its devices: the cap then takes device 0, as genv.
    f.host(0)
        .set_apps(&[(stray, 3, "100"), (a1, 0, "100"), (a1, 1, "100")]);
    f.host(0).write_envs(&[env("a1", Some("alice"), None, a1)]);
    f.host(0).write_devices(4, &[(0, "a1"), (1, "a1")]);
    let b = f.host(1).spawn_as("bob", Some("b"));
    let a2 = f.host(1).spawn_as("alice", Some("a2"));
    let hog = f.host(1).spawn_as("alice", Some("a2"));
    f.host(1).set_apps(&[
        (b, 1, "100"),
        (b, 2, "100"),
        (a2, 3, "100"),
        (hog, 3, "5000"),
    ]);
    f.host(1).write_envs(&[
        env("b", Some("bob"), None, b),
        env("a2", Some("alice"), Some("3gi"), a2),
    ]);
    f.host(1).write_devices(4, &[(1, "b"), (3, "a2")]);
    let flags = [
        "enforce",
        "--interval",
        "0",
        "--non-env-processes",
        "--max-devices-per-user",
        "2",
    ];

    let mut args = vec!["--inventory", inventory.to_str().unwrap()];
    args.extend_from_slice(&flags);
    args.push("--dry-run");
    let ours = f.command(&args).output().unwrap();
    assert_eq!(
        ours.status.code(),
        Some(if ours.stdout.is_empty() { 0 } else { 3 }),
        "{}",
        stderr(&ours)
    );

    let genv = std::process::Command::new(util::genv_bin())
        .args(["remote", "-H", &addresses.join(",")])
        .args(flags)
        .env(
            "PATH",
            format!("{}:{}", bin.display(), std::env::var("PATH").unwrap()),
        )
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(genv.status.success(), "genv: {}", stderr(&genv));
    let (ours, theirs) = (util::lines(&ours), util::lines(&genv));
    assert_eq!(ours, theirs);
    // env-memory stops at the hog when genv's process order puts it first.
    let order = genv_enforce::snapshot::pyset::set_order(&[b, a2, hog]);
    let hog_first = order.iter().position(|p| *p == hog) < order.iter().position(|p| *p == a2);
    assert_eq!(ours.len(), if hog_first { 9 } else { 10 }, "{ours:#?}");
}

#[test]
fn detach_uses_the_hosts_genv_dir_and_a_held_lock_holds_nothing_up() {
    let Some(mut f) = Fleet::up(2) else { return };
    let mut pids = Vec::new();
    for h in 0..2 {
        let p = f.host(h).spawn_as(&format!("user{h}"), Some("e"));
        // Working on both devices: the cap takes device 0, as genv.
        f.host(h).set_apps(&[(p, 0, "100"), (p, 1, "100")]);
        f.host(h)
            .write_envs(&[env("e", Some(&format!("user{h}")), None, p)]);
        f.host(h).write_devices(4, &[(0, "e"), (1, "e")]);
        pids.push(p);
    }
    // Host 0 keeps genv's state in a non-default dir (genv's own default
    // there holds nothing).
    let state = f.host(0).state_dir();
    let alt = state.join("alt");
    std::fs::create_dir(&alt).unwrap();
    for file in ["envs.json", "devices.json"] {
        std::fs::rename(state.join(file), alt.join(file)).unwrap();
    }
    // Host 1: someone holds genv's lock (shared, so a snapshot still reads).
    let lock = f.host(1).state_dir().join("genv.lock");
    std::fs::write(&lock, "").unwrap();
    let mut holder = std::process::Command::new("flock")
        .args(["-s", &lock.display().to_string(), "sleep", "60"])
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));

    let inventory = f.inventory(
        false,
        &["genv_dir = \"/var/tmp/genv/alt\""],
        "\n[limits]\nmax_devices_per_user = 1\n",
    );
    let started = Instant::now();
    let out = f
        .command(&[
            "--inventory",
            &inventory.display().to_string(),
            "--command-timeout",
            "6s",
            "enforce",
            "--interval",
            "0",
        ])
        .output()
        .unwrap();
    let took = started.elapsed();
    holder.kill().unwrap();
    holder.wait().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let err = stderr(&out);
    // A lock a user holds blocks nobody (issue 26): after a second, the
    // detach goes on without it and says so.
    assert!(
        err.contains("h2: genv.lock held for over 1s by ")
            && err.contains("devices.json was written without it"),
        "{err}"
    );
    assert!(took < Duration::from_secs(6), "waited {took:?} on the lock");
    assert_eq!(f.host(0).wait_signal(pids[0], WAIT), Some(SIGTERM));
    assert_eq!(f.host(1).wait_signal(pids[1], WAIT), Some(SIGTERM));
    assert_eq!(
        f.host(1).attached(0),
        Vec::<String>::new(),
        "detached beside a held lock"
    );
    let devices: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(alt.join("devices.json")).unwrap()).unwrap();
    assert_eq!(
        devices["devices"][0]["attachments"],
        serde_json::json!([]),
        "detached in genv_dir"
    );
    assert_eq!(devices["devices"][1]["attachments"][0]["eid"], "e");
}

#[test]
fn concurrency_bounds_how_many_hosts_are_worked_on_at_once() {
    let Some(mut f) = Fleet::up(3) else { return };
    // Each host's sudo logs when it runs, taking 1.5 s.
    for i in 1..=3 {
        let slow = f.dir.path().join(format!("h{i}/sbin/slow-sudo"));
        util::write_executable(
            &slow,
            "#!/bin/sh\nlog=/var/tmp/genv/slow.log\necho \"$(date +%s%N)\" >> $log\nsleep 1.5\necho \"$(date +%s%N)\" >> $log\nexec sudo \"$@\"\n",
        );
    }
    let sudo = "sudo = \"/usr/local/sbin/slow-sudo -n\"";
    let inventory = f.inventory(false, &[sudo, sudo, sudo], "");
    let mut spans = |concurrency: &str| -> Vec<(u128, u128)> {
        for h in 0..3 {
            let _ = std::fs::remove_file(f.host(h).state_dir().join("slow.log"));
        }
        let out = f
            .command(&[
                "--inventory",
                &inventory.display().to_string(),
                "--concurrency",
                concurrency,
                "enforce",
                "--interval",
                "0",
                "--dry-run",
            ])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
        (0..3)
            .map(|h| {
                let log = std::fs::read_to_string(f.host(h).state_dir().join("slow.log")).unwrap();
                let t: Vec<u128> = log.lines().map(|l| l.parse().unwrap()).collect();
                // One sudo per host in a run of one cycle: our agent's.
                assert_eq!(t.len(), 2, "one agent per host: {log}");
                (t[0], t[1])
            })
            .collect()
    };
    let mut one = spans("1");
    one.sort();
    for w in one.windows(2) {
        assert!(w[0].1 <= w[1].0, "--concurrency 1 overlapped: {one:?}");
    }
    let all = spans("3");
    let last_start = all.iter().map(|s| s.0).max().unwrap();
    let first_end = all.iter().map(|s| s.1).min().unwrap();
    assert!(
        last_start < first_end,
        "--concurrency 3 ran hosts one by one: {all:?}"
    );
}

#[test]
fn cron_runs_reuse_the_masters_they_left_and_replace_stale_or_foreign_ones() {
    let Some(mut f) = Fleet::up(2) else { return };
    let stray = f.host(1).spawn(None);
    f.host(1).set_apps(&[(stray, 0, "100")]);
    let control = tempfile::tempdir().unwrap();
    let ctl = control.path().display().to_string();
    let cron = |f: &Fleet, extra: &[&str]| {
        let mut args = vec!["--control-dir", ctl.as_str(), "--control-persist", "60s"];
        args.extend_from_slice(&["enforce", "--interval", "0", "--output", "json"]);
        args.extend_from_slice(extra);
        let out = f.ours(&args);
        assert!(out.status.success(), "{}", stderr(&out));
        let c: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        c["timing"]["connects"].as_u64().unwrap()
    };
    assert_eq!(cron(&f, &[]), 2, "the first run opens the masters");
    assert_eq!(
        cron(&f, &["--non-env-processes"]),
        0,
        "the second finds them"
    );
    assert_eq!(
        f.host(1).wait_signal(stray, WAIT),
        Some(SIGTERM),
        "and enforces through them"
    );
    assert_eq!(
        (f.connections(0), f.connections(1)),
        (1, 1),
        "one handshake per host in all"
    );
    let sockets = sockets_in(control.path());
    assert_eq!(
        sockets.len(),
        2,
        "the masters outlive the runs: {sockets:?}"
    );
    // Host 1's master dies (its socket stays, stale); host 2's socket is
    // replaced by one another user could reach.
    let pids = std::process::Command::new("pgrep")
        .args(["-f", &format!("{ctl}/.*{}", "")])
        .output()
        .unwrap();
    assert!(!pids.stdout.is_empty());
    let first = sockets
        .iter()
        .find(|s| s.contains("genvfleet127"))
        .unwrap()
        .clone();
    let masters = String::from_utf8_lossy(&pids.stdout).into_owned();
    for pid in masters.split_whitespace() {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(&first) {
            rustix::process::kill_process(
                rustix::process::Pid::from_raw(pid.parse().unwrap()).unwrap(),
                rustix::process::Signal::KILL,
            )
            .unwrap();
        }
    }
    let other = sockets.iter().find(|s| **s != first).unwrap().clone();
    std::fs::set_permissions(&other, std::os::unix::fs::PermissionsExt::from_mode(0o666)).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        cron(&f, &[]),
        2,
        "a stale and a foreign socket are both replaced"
    );
    assert_eq!((f.connections(0), f.connections(1)), (2, 2));
    assert_eq!(cron(&f, &[]), 0);
    // A run without --control-persist uses what it finds, and closes it.
    let out = f.ours(&["--control-dir", &ctl, "enforce", "--interval", "0"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!((f.connections(0), f.connections(1)), (2, 2));
    assert_eq!(sockets_in(control.path()), Vec::<String>::new());
    // A control dir others can write to is refused.
    std::fs::set_permissions(
        control.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let out = f.ours(&[
        "--control-dir",
        &ctl,
        "--control-persist",
        "60s",
        "enforce",
        "--interval",
        "0",
    ]);
    // A usage error (exit 2), before anything runs.
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("writable by others"),
        "{}",
        stderr(&out)
    );
    std::fs::set_permissions(
        control.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    for s in sockets_in(control.path()) {
        let _ = std::process::Command::new("ssh")
            .args(["-S", &s, "-O", "exit", "x"])
            .output();
    }
}

#[test]
fn a_looping_runs_agent_holds_nothing_between_cycles() {
    // The agent stays between cycles: a detach in one cycle must leave
    // genv's lock free for the next, and for genv itself.
    let Some(mut f) = Fleet::up(1) else { return };
    let p = f.host(0).spawn_as("alice", Some("a"));
    f.host(0).set_apps(&[(p, 0, "100"), (p, 1, "100")]);
    f.host(0).write_envs(&[env("a", Some("alice"), None, p)]);
    f.host(0).write_devices(4, &[(0, "a"), (1, "a")]);
    let hosts = f.names.join(",");
    let mut child = f
        .command(&[
            "-H",
            &hosts,
            "--command-timeout",
            "5s",
            "enforce",
            "--interval",
            "300ms",
            "--output",
            "json",
            "--max-devices-per-user",
            "1",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let first = next_cycle(&mut out);
    assert_eq!(
        first["outcomes"][1]["outcome"]["result"], "detached",
        "{first}"
    );
    for _ in 0..3 {
        let c = next_cycle(&mut out);
        assert!(c["hosts"][0]["error"].is_null(), "{c}");
    }
    let lock = f.host(0).state_dir().join("genv.lock");
    let free = std::process::Command::new("flock")
        .args(["-n", "-x", &lock.display().to_string(), "true"])
        .status()
        .unwrap();
    assert!(free.success(), "genv.lock is held between cycles");
    terminate(&child);
    child.wait().unwrap();
}

#[test]
fn sighup_reloads_the_hostfile_keeps_unchanged_connections_and_survives_a_broken_one() {
    let Some(f) = Fleet::up(2) else { return };
    let control = tempfile::tempdir().unwrap();
    let hostfile = f.dir.path().join("hosts.txt");
    std::fs::write(&hostfile, format!("{}\n", f.names[0])).unwrap();
    let mut child = f
        .command(&[
            "--hostfile",
            &hostfile.display().to_string(),
            "--control-dir",
            &control.path().display().to_string(),
            "enforce",
            "--interval",
            "300ms",
            "--output",
            "json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let hosts = |c: &serde_json::Value| {
        c["hosts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h["host"].as_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(hosts(&next_cycle(&mut out)), vec![f.names[0].clone()]);
    std::fs::write(&hostfile, format!("{}\n{}\n", f.names[0], f.names[1])).unwrap();
    hup(&child);
    let mut grown = None;
    for _ in 0..20 {
        let c = next_cycle(&mut out);
        if hosts(&c).len() == 2 {
            grown = Some(c);
            break;
        }
    }
    let grown = grown.expect("the reloaded hostfile's hosts are enforced");
    assert_eq!(hosts(&grown), f.names);
    assert_eq!(
        grown["timing"]["connects"], 1,
        "only the new host connects: {grown}"
    );
    assert_eq!(
        f.connections(0),
        1,
        "the unchanged host kept its connection"
    );
    // A broken hostfile: reported, the old configuration goes on.
    std::fs::write(&hostfile, "genv-fleet@:0\n").unwrap();
    hup(&child);
    for _ in 0..5 {
        let c = next_cycle(&mut out);
        assert_eq!(hosts(&c), f.names, "{c}");
        assert!(c["hosts"]
            .as_array()
            .unwrap()
            .iter()
            .all(|h| h["error"].is_null()));
    }
    terminate(&child);
    let rest = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&rest.stderr);
    assert!(err.contains("configuration reloaded"), "{err}");
    assert!(
        err.contains("configuration not reloaded, the old one is kept")
            && err.contains("hosts.txt"),
        "{err}"
    );
    assert_eq!((f.connections(0), f.connections(1)), (1, 1));
    assert_eq!(sockets_in(control.path()), Vec::<String>::new());
}

#[test]
fn sighup_reloads_the_configuration_file_whole_or_not_at_all() {
    let Some(mut f) = Fleet::up(1) else { return };
    let p = f.host(0).spawn_as("xu", Some("x"));
    f.host(0).set_apps(&[(p, 0, "100")]);
    f.host(0).write_envs(&[env("x", Some("xu"), None, p)]);
    f.host(0).write_devices(4, &[(0, "x"), (1, "x")]);
    let config = f.dir.path().join("genv-enforce.toml");
    let audit = f.dir.path().join("audit.log");
    let state = f.dir.path().join("state");
    std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), 0o700)
        .create(&state)
        .unwrap();
    let db = state.join("state.db");
    let file = |cap: u32, rest: &str| {
        format!(
            "[rules]\nmax-devices-per-user = {cap}\n{rest}\n[policy]\ndry-run = true\n\
             interval = \"300ms\"\noutput = \"json\"\n[state]\naudit-log = {:?}\n\
             state-db = {:?}\n",
            audit.display().to_string(),
            db.display().to_string()
        )
    };
    std::fs::write(&config, file(1, "")).unwrap();
    let mut child = f
        .command(&[
            "-H",
            &f.names[0],
            "--config",
            &config.display().to_string(),
            "enforce",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let capped = |c: &serde_json::Value| {
        c["violations"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["rule"] == "max-devices-per-user")
    };
    assert!(capped(&next_cycle(&mut out)), "the file's cap of 1");
    // A broken file (a key in the wrong section, a cap that is no number):
    // refused whole, the cap of 1 goes on.
    std::fs::write(&config, file(3, "interval = \"1s\"\nidle-below = \"x\"")).unwrap();
    hup(&child);
    for _ in 0..5 {
        assert!(
            capped(&next_cycle(&mut out)),
            "the old configuration goes on"
        );
    }
    // One that moves the metrics endpoint: only a restart can, so it is
    // refused whole (its cap of 2 too).
    std::fs::write(
        &config,
        file(2, "") + "[metrics]\nmetrics-listen = \"127.0.0.1:1\"\n",
    )
    .unwrap();
    hup(&child);
    for _ in 0..5 {
        assert!(
            capped(&next_cycle(&mut out)),
            "the old configuration goes on"
        );
    }
    // A good one: the cap of 2 holds from the next cycle on.
    std::fs::write(&config, file(2, "")).unwrap();
    hup(&child);
    let mut lifted = false;
    for _ in 0..20 {
        if !capped(&next_cycle(&mut out)) {
            lifted = true;
            break;
        }
    }
    assert!(lifted, "the reloaded file's cap of 2 is enforced");
    for _ in 0..3 {
        assert!(!capped(&next_cycle(&mut out)));
    }
    terminate(&child);
    let rest = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&rest.stderr);
    let name = config.display().to_string();
    assert!(
        err.contains("configuration not reloaded, the old one is kept")
            && err.contains(&format!(
                "{name}:3:1: \"interval\" belongs in [policy], not [rules]"
            ))
            && err.contains(&format!("{name}:4:14: idle-below:")),
        "{err}"
    );
    assert!(
        err.contains("metrics-listen cannot change without a restart"),
        "{err}"
    );
    assert!(err.contains("configuration reloaded"), "{err}");
    // Each reload in the audit log: two refused, with why, one applied.
    let phases: Vec<(String, String)> = std::fs::read_to_string(&audit)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|e| e["phase"] == "refused" || e["phase"] == "reloaded")
        .map(|e| {
            (
                e["phase"].as_str().unwrap().to_string(),
                e["message"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(phases.len(), 3, "{phases:?}");
    assert_eq!(phases[0].0, "refused");
    assert!(phases[0].1.contains("belongs in [policy]"), "{phases:?}");
    assert_eq!(phases[1].0, "refused");
    assert!(phases[1].1.contains("metrics-listen"), "{phases:?}");
    assert_eq!(phases[2].0, "reloaded");
}

#[test]
fn a_reload_that_would_change_the_command_run_is_refused() {
    let Some(f) = Fleet::up(1) else { return };
    let config = f.dir.path().join("genv-enforce.toml");
    let policy = "[policy]\ndry-run = true\ninterval = \"300ms\"\noutput = \"json\"\n";
    std::fs::write(
        &config,
        format!(
            "[hosts]\nhost = {:?}\nidentity-file = {:?}\nknown-hosts-file = {:?}\n{policy}",
            f.names[0],
            f.dir.path().join("id_ed25519").display().to_string(),
            f.dir.path().join("known_hosts").display().to_string(),
        ),
    )
    .unwrap();
    // The file alone: it names a host, so it runs `remote enforce`.
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_genv-enforce"))
        .args(["--config", &config.display().to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let hosts = |c: &serde_json::Value| {
        c["hosts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h["host"].as_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(hosts(&next_cycle(&mut out)), [f.names[0].clone()]);
    // Without [hosts] it would run `enforce` on this machine instead.
    std::fs::write(&config, policy).unwrap();
    hup(&child);
    for _ in 0..5 {
        assert_eq!(hosts(&next_cycle(&mut out)), [f.names[0].clone()]);
    }
    terminate(&child);
    let rest = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&rest.stderr);
    assert!(
        err.contains(
            "configuration not reloaded, the old one is kept: it runs `enforce`, not `remote enforce`"
        ),
        "{err}"
    );
}

#[test]
fn a_remote_process_that_ignores_sigterm_is_killed_after_the_grace_period() {
    let Some(mut f) = Fleet::up(1) else { return };
    let stubborn = f
        .host(0)
        .start("root", None, &["sh", "-c", "trap '' TERM; exec sleep 1000"]);
    let meek = f.host(0).spawn(None);
    f.host(0)
        .set_apps(&[(stubborn, 0, "100"), (meek, 1, "100")]);
    let out = f.ours(&[
        "enforce",
        "--interval",
        "0",
        "--non-env-processes",
        "--kill-after",
        "1s",
        "--output",
        "json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(f.host(0).wait_signal(meek, WAIT), Some(SIGTERM));
    assert_eq!(f.host(0).wait_signal(stubborn, WAIT), Some(9));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let killed: Vec<_> = report["outcomes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o["action"] == "kill" && o["outcome"]["result"] == "signalled")
        .map(|o| o["pid"].as_u64().unwrap())
        .collect();
    assert_eq!(killed, vec![u64::from(stubborn)], "{report:#}");
}

#[test]
fn doctor_finds_what_is_wrong_with_each_host_and_how_to_fix_it() {
    // h1 refuses our key, h2's sudo wants a password, h3 has no working
    // nvidia-smi, h4's envs.json is a symlink, h5 is fine; nowhere refuses.
    let Some(mut f) = Fleet::up_with_password_sudo(5, 2) else {
        return;
    };
    std::fs::write(f.host(2).gpu_dir().join("fail"), "").unwrap();
    std::os::unix::fs::symlink("/etc/shadow", f.host(3).state_dir().join("envs.json")).unwrap();
    let inventory = f.inventory(
        false,
        &["identity_file = \"/nonexistent/key\""],
        "\n[[host]]\nname = \"nowhere\"\naddress = \"127.0.0.1\"\nport = 1\n",
    );
    let inventory = inventory.display().to_string();
    let out = f
        .command(&["--inventory", &inventory, "doctor", "--output", "json"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let host = |name: &str| {
        report["hosts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|h| h["host"] == name)
            .unwrap_or_else(|| panic!("{name}: {report:#}"))
            .clone()
    };
    let check = |name: &str, check: &str| {
        host(name)["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["check"] == check)
            .unwrap_or_else(|| panic!("{name} {check}: {report:#}"))
            .clone()
    };
    let ok: Vec<bool> = ["h1", "h2", "h3", "h4", "h5", "nowhere"]
        .iter()
        .map(|h| host(h)["ok"].as_bool().unwrap())
        .collect();
    assert_eq!(ok, [false, false, false, false, true, false], "{report:#}");
    let fails = |name: &str, c: &str, fix: &str| {
        let c = check(name, c);
        assert_eq!(c["status"], "fail", "{c}");
        assert!(c["fix"].as_str().unwrap().contains(fix), "{c}");
    };
    fails("h1", "ssh", "authorized_keys");
    assert_eq!(check("h1", "sudo")["status"], "skip");
    fails(
        "h2",
        "sudo",
        "'genv-fleet ALL=(root) NOPASSWD: /usr/bin/python3' > /etc/sudoers.d/genv-enforce",
    );
    assert!(check("h2", "sudo")["detail"]
        .as_str()
        .unwrap()
        .contains("password"));
    fails("h3", "nvidia-smi", "NVIDIA driver");
    assert_eq!(check("h3", "snapshot")["status"], "skip");
    fails("h4", "genv state", "remove them");
    assert!(check("h4", "genv state")["detail"]
        .as_str()
        .unwrap()
        .contains("envs.json is a symbolic link"));
    fails("nowhere", "ssh", "nothing listens on port 1");
    for c in [
        "ssh",
        "host key",
        "sudo",
        "python",
        "nvidia-smi",
        "genv state",
        "snapshot",
        "clock",
    ] {
        assert_eq!(check("h5", c)["status"], "ok", "{c}: {report:#}");
    }
    assert!(check("h5", "nvidia-smi")["detail"]
        .as_str()
        .unwrap()
        .contains("driver 535.104.05"));
    // The table says the same, a fix under each failure.
    let out = f
        .command(&["--inventory", &inventory, "doctor"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let text = lines(&out);
    assert_eq!(text.last().unwrap(), "1 of 6 hosts ready", "{text:#?}");
    let fail = text.iter().position(|l| l.contains(" FAIL ")).unwrap();
    assert!(
        text[fail + 1].trim_start().starts_with("fix: "),
        "{text:#?}"
    );
    // Nothing was left behind, and the symlink's target was not read.
    assert!(f.host(3).state_dir().join("envs.json").is_symlink());
}

/// One cycle over host `i` (`--interval 0`, cron's way).
fn cron_run(f: &Fleet, i: usize) -> std::process::Output {
    let host = f.names[i].clone();
    f.command(&[
        "-H",
        &host,
        "enforce",
        "--non-env-processes",
        "--interval",
        "0",
    ])
    .output()
    .unwrap()
}

/// A looping run (the service's way: its agent kept across cycles) over
/// `host` until `stray` is signalled or `WAIT` passes; the signal.
fn looping_run_until_signalled(f: &mut Fleet, i: usize, stray: u32, flags: &[&str]) -> Option<i32> {
    let host = f.names[i].clone();
    let mut args = vec![
        "-H",
        host.as_str(),
        "enforce",
        "--non-env-processes",
        "--interval",
        "1s",
    ];
    args.extend_from_slice(flags);
    let run = f
        .command(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let signal = f.host(i).wait_signal(stray, WAIT);
    let _ = Command::new("kill")
        .args(["-TERM", &run.id().to_string()])
        .status();
    let out = run.wait_with_output().unwrap();
    if signal.is_none() {
        eprintln!("the looping run said: {}", stderr(&out));
    }
    signal
}

#[test]
fn the_documented_sudoers_rule_covers_doctor_cron_and_the_service_and_doctor_names_a_narrower_ones_gap(
) {
    // h1's login user has exactly the rule docs/first-fleet.md gives; h2's
    // may run only `true` as root.
    let Some(mut f) = Fleet::up_with(2, |dir, i| {
        let d = dir.join("sudoers.d");
        std::fs::create_dir_all(&d).unwrap();
        let rule = if i == 1 {
            "/usr/bin/python3"
        } else {
            "/usr/bin/true"
        };
        std::fs::write(
            d.join("genv-enforce"),
            format!("genv-fleet ALL=(root) NOPASSWD: {rule}\n"),
        )
        .unwrap();
    }) else {
        return;
    };
    let out = f.ours(&["doctor", "--output", "json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let hosts = report["hosts"].as_array().unwrap();
    assert_eq!(hosts[0]["ok"], true, "{report:#}");
    assert_eq!(hosts[1]["ok"], false, "{report:#}");
    let sudo = hosts[1]["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["check"] == "sudo")
        .unwrap();
    assert_eq!(sudo["status"], "fail", "{sudo}");
    assert!(
        sudo["fix"].as_str().unwrap().contains(
            "'genv-fleet ALL=(root) NOPASSWD: /usr/bin/python3' > /etc/sudoers.d/genv-enforce"
        ),
        "{sudo}"
    );
    // Where doctor says ready, a cron run and the service both enforce.
    let stray = f.host(0).spawn_as("bob", None);
    f.host(0).set_apps(&[(stray, 0, "100")]);
    let out = cron_run(&f, 0);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(f.host(0).wait_signal(stray, WAIT), Some(SIGTERM));
    let stray = f.host(0).spawn_as("bob", None);
    f.host(0).set_apps(&[(stray, 0, "100")]);
    assert_eq!(
        looping_run_until_signalled(&mut f, 0, stray, &[]),
        Some(SIGTERM)
    );
    // Where it says not, the service fails the host, naming sudo.
    let stray = f.host(1).spawn_as("bob", None);
    f.host(1).set_apps(&[(stray, 0, "100")]);
    let out = cron_run(&f, 1);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(f.host(1).running(stray));
}

#[test]
fn doctor_with_the_services_configuration_reaches_the_hosts_as_the_service_does() {
    let Some(mut f) = Fleet::up(1) else { return };
    let inventory = f.inventory(false, &[], "");
    // The service's own known_hosts, empty on a fresh box, and its
    // host-key policy, as the shipped configuration sets them.
    let known = f.dir.path().join("service_known_hosts");
    std::fs::write(&known, "").unwrap();
    let config = f.dir.path().join("genv-enforce.toml");
    std::fs::write(
        &config,
        format!(
            "[hosts]\ninventory = \"{}\"\nknown-hosts-file = \"{}\"\nhost-key-check = \"strict\"\n\n\
             [rules]\nnon-env-processes = true\n\n[policy]\ninterval = \"0\"\n",
            inventory.display(),
            known.display()
        ),
    )
    .unwrap();
    let ours = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_genv-enforce"))
            .arg("--config")
            .arg(&config)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let stray = f.host(0).spawn_as("bob", None);
    f.host(0).set_apps(&[(stray, 0, "100")]);
    // The host's key is not pinned yet: doctor fails it as the service does.
    let doctor = ours(&["doctor", "--output", "json"]);
    assert_eq!(doctor.status.code(), Some(1), "{}", stderr(&doctor));
    let report: serde_json::Value = serde_json::from_slice(&doctor.stdout).unwrap();
    let h1 = &report["hosts"][0];
    assert_eq!(h1["host"], "h1", "{report:#}");
    let failed: Vec<&serde_json::Value> = h1["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["status"] == "fail")
        .collect();
    let pin = format!("ssh-keyscan -p 2222 HOST >> {}", known.display());
    assert!(
        failed
            .iter()
            .any(|c| c["fix"].as_str().unwrap().contains(&pin)),
        "{report:#}"
    );
    let service = ours(&[]);
    assert_eq!(service.status.code(), Some(1), "{}", stderr(&service));
    assert!(f.host(0).running(stray));
    // Pinned as docs/first-fleet.md does: both pass, and the service acts.
    let address = f.addresses()[0].clone();
    let scan = Command::new("ssh-keyscan")
        .args(["-p", "2222", "-t", "ed25519", &address])
        .output()
        .unwrap();
    assert!(!scan.stdout.is_empty(), "{}", stderr(&scan));
    std::fs::write(&known, &scan.stdout).unwrap();
    let doctor = ours(&["doctor"]);
    assert!(
        doctor.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&doctor.stdout),
        stderr(&doctor)
    );
    let service = ours(&[]);
    assert!(service.status.success(), "{}", stderr(&service));
    assert_eq!(f.host(0).wait_signal(stray, WAIT), Some(SIGTERM));
}

#[test]
fn exemptions_by_user_host_and_window_and_warn_only_rules_on_the_fleet() {
    let Some(mut f) = Fleet::up(2) else { return };
    // alice is exempt on h1 now; carol's exemption ended yesterday; bob's
    // starts tomorrow. Every one of them runs a non-env GPU job on h1,
    // alice one on h2 as well.
    let day = 86_400;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let at =
        |s: u64| humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + Duration::from_secs(s));
    let tail = format!(
        "\n[[exempt]]\nuser = \"alice\"\nhost = \"h1\"\nreason = \"paper\\u001b[2J deadline\"\n\
         \n[[exempt]]\nuser = \"carol\"\nfrom = \"{}\"\nuntil = \"{}\"\n\
         \n[[exempt]]\nuser = \"bob\"\nfrom = \"{}\"\n",
        at(now - 2 * day),
        at(now - day),
        at(now + day)
    );
    let inventory = f.inventory(false, &[], &tail);
    let alice1 = f.host(0).spawn_as("alice", None);
    let carol = f.host(0).spawn_as("carol", None);
    let bob = f.host(0).spawn_as("bob", None);
    f.host(0)
        .set_apps(&[(alice1, 0, "100"), (carol, 1, "100"), (bob, 2, "100")]);
    let alice2 = f.host(1).spawn_as("alice", None);
    f.host(1).set_apps(&[(alice2, 0, "100")]);
    let run = |f: &Fleet, inventory: &std::path::Path| {
        f.command(&[
            "--inventory",
            &inventory.display().to_string(),
            "enforce",
            "--interval",
            "0",
            "--non-env-processes",
        ])
        .output()
        .unwrap()
    };
    let out = run(&f, &inventory);
    let err = stderr(&out);
    assert!(
        err.contains(&format!(
            "[h1] [INFO] Process {alice1} is exempt (paper\\u{{1b}}[2J deadline): it is not terminated"
        )),
        "{err}"
    );
    assert!(!err.contains('\x1b'), "{err}");
    assert_eq!(f.host(0).wait_signal(carol, WAIT), Some(SIGTERM));
    assert_eq!(f.host(0).wait_signal(bob, WAIT), Some(SIGTERM));
    assert_eq!(f.host(1).wait_signal(alice2, WAIT), Some(SIGTERM));
    assert!(f.host(0).running(alice1), "exempt on h1");
    // A warn-only rule: nothing is terminated, the warning is said once.
    let stray = f.host(1).spawn_as("dave", None);
    f.host(1).set_apps(&[(stray, 1, "100")]);
    let warn_only = f.inventory(
        false,
        &[],
        "\n[policy.non-env-processes]\naction = \"warn\"\n",
    );
    let out = run(&f, &warn_only);
    let err = stderr(&out);
    assert!(
        err.contains(&format!(
            "[h2] [WARNING] Process {stray} of user dave from environment N/A on GPU(s) 1 violates non-env-processes: warned only, nothing will be done"
        )),
        "{err}"
    );
    std::thread::sleep(Duration::from_millis(500));
    assert!(f.host(1).running(stray));
    assert!(f.host(0).running(alice1));
}
