//! Regressions of issue 7: what a user can write never gains them root,
//! never hangs or blinds the enforcer, never gets another user's job
//! killed. One test per row of the table, on this machine and
//! through real sshd, each of which failed before the fix.

mod util;

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use util::fleet::Fleet;
use util::{env, lines, Host};

const SIGTERM: i32 = 15;
const WAIT: Duration = Duration::from_secs(10);

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Waits for `child` at most `limit`; a child still running then is
/// killed and the test fails: the enforcer hung.
fn finish_within(mut child: Child, limit: Duration) -> (Output, Duration) {
    let start = Instant::now();
    while start.elapsed() < limit {
        if child.try_wait().unwrap().is_some() {
            return (child.wait_with_output().unwrap(), start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    panic!(
        "still running after {limit:?}: the enforcer hung; stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn ours(h: &Host, args: &[&str]) -> Child {
    h.command(Path::new(env!("CARGO_BIN_EXE_genv-enforce")))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// A root-only file outside genv's directory, as `/etc/shadow` would be.
fn secret(dir: &Path) -> PathBuf {
    let p = dir.join("shadow");
    std::fs::write(&p, "root:$6$secret:19000:0:99999:7:::\n").unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p
}

fn assert_untouched(secret: &Path) {
    let meta = std::fs::metadata(secret).unwrap();
    assert_eq!(
        meta.permissions().mode() & 0o777,
        0o600,
        "{} chmodded",
        secret.display()
    );
    assert_eq!(
        std::fs::read_to_string(secret).unwrap(),
        "root:$6$secret:19000:0:99999:7:::\n",
        "{} written",
        secret.display()
    );
}

// Local.

#[test]
fn symlinked_genv_lock_is_never_followed_nor_chmodded() {
    let h = Host::new(2);
    let outside = tempfile::tempdir().unwrap();
    let shadow = secret(outside.path());
    std::os::unix::fs::symlink(&shadow, h.state_dir().join("genv.lock")).unwrap();
    for args in [
        &["enforce", "--interval", "0"][..],
        &["enforce", "--interval", "0", "--dry-run"],
        &["snapshot"],
    ] {
        let (out, _) = finish_within(ours(&h, args), WAIT);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert!(
            stderr(&out).contains("genv.lock is a symbolic link: refused"),
            "{args:?}: {}",
            stderr(&out)
        );
        assert_untouched(&shadow);
    }
    // The user made genv's directory itself, as a link to elsewhere.
    let real = tempfile::tempdir().unwrap();
    std::fs::remove_file(h.state_dir().join("genv.lock")).unwrap();
    std::fs::remove_dir(h.state_dir()).unwrap();
    std::os::unix::fs::symlink(real.path(), h.state_dir()).unwrap();
    let (out, _) = finish_within(ours(&h, &["enforce", "--interval", "0"]), WAIT);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("genv is a symbolic link: refused"),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        std::fs::read_dir(real.path()).unwrap().count(),
        0,
        "nothing created through it"
    );
}

#[test]
fn a_fifo_or_a_device_as_state_file_fails_fast_naming_it() {
    let h = Host::new(2);
    let envs = h.state_dir().join("envs.json");
    let mkfifo = Command::new("mkfifo").arg(&envs).status().unwrap();
    assert!(mkfifo.success());
    let (out, took) = finish_within(ours(&h, &["enforce", "--interval", "0"]), WAIT);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("envs.json is a FIFO: refused"),
        "{}",
        stderr(&out)
    );
    assert!(took < Duration::from_secs(5), "took {took:?}");
    std::fs::remove_file(&envs).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &envs).unwrap();
    let (out, _) = finish_within(ours(&h, &["snapshot"]), WAIT);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("envs.json is a symbolic link: refused"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn sigterm_ends_a_run_whatever_it_waits_on() {
    // genv's lock held by someone else, with a long deadline: the run waits
    // on it, and a SIGTERM must still end the run at once.
    let h = Host::new(1);
    let lock = h.state_dir().join("genv.lock");
    std::fs::write(&lock, "").unwrap();
    let mut holder = Command::new("flock")
        .arg(&lock)
        .args(["sleep", "60"])
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let child = ours(
        &h,
        &["enforce", "--interval", "1", "--command-timeout", "60s"],
    );
    std::thread::sleep(Duration::from_millis(800));
    let pid = rustix::process::Pid::from_child(&child);
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let (out, took) = finish_within(child, Duration::from_secs(20));
    holder.kill().unwrap();
    holder.wait().unwrap();
    assert!(took < Duration::from_secs(3), "SIGTERM took {took:?}");
    assert!(out.status.code().is_some(), "{:?}", out.status);
}

/// Inside a fresh pid namespace (see the test below): a process is
/// identified, dies, and its pid is given to a new process on purpose;
/// terminating the old identity must leave the new process alone.
fn reuse_a_pid_inside_this_namespace() {
    use genv_enforce::outcome::TerminateResult as T;
    let mut first = Command::new("sleep").arg("1000").spawn().unwrap();
    let pid = first.id();
    let start = util::start_time(pid);
    first.kill().unwrap();
    first.wait().unwrap();
    // Start times count clock ticks (10 ms): a pid cannot come round again
    // within one on a real machine, only here, where we force it.
    std::thread::sleep(Duration::from_millis(50));
    std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).unwrap();
    let mut second = Command::new("sleep").arg("1000").spawn().unwrap();
    assert_eq!(second.id(), pid, "the pid was not reused: cannot test");
    let host = genv_enforce::host::LiveHost::this_machine(Duration::from_secs(5));
    let outcome = util::terminate(&host, pid, Some(start));
    assert!(
        matches!(outcome, T::PidReused { expected, .. } if expected == start),
        "{outcome:?}"
    );
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        second.try_wait().unwrap().is_none(),
        "the new process was signalled"
    );
    second.kill().unwrap();
    second.wait().unwrap();
}

#[test]
fn a_pid_reused_in_a_pid_namespace_is_never_signalled() {
    if std::env::var_os("GENV_ENFORCE_IN_PID_NS").is_some() {
        return reuse_a_pid_inside_this_namespace();
    }
    // Run this very test again, alone, as pid 1's child of a new namespace
    // where ns_last_pid is ours to set.
    let out = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "--"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_pid_reused_in_a_pid_namespace_is_never_signalled",
            "--test-threads",
            "1",
        ])
        .env("GENV_ENFORCE_IN_PID_NS", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("1 passed"),
        "in the namespace: {}{}",
        String::from_utf8_lossy(&out.stdout),
        stderr(&out)
    );
}

#[test]
fn absurd_durations_and_hosts_named_twice_are_usage_errors() {
    let bin = env!("CARGO_BIN_EXE_genv-enforce");
    for args in [
        &["remote", "-H", "a", "-t", "18446744073709551615", "enforce"][..],
        &["enforce", "--interval", "18446744073709551615"],
        &["enforce", "--command-timeout", "100000000000d"],
    ] {
        let out = Command::new(bin).args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
    }
    let out = Command::new(bin)
        .args(["remote", "-H", "gpu1,gpu1", "enforce", "--interval", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("host `gpu1` is listed twice"),
        "{}",
        stderr(&out)
    );
}

// Remote.

fn run_inventory(f: &Fleet, inventory: &Path, extra: &[&str]) -> Output {
    let inv = inventory.display().to_string();
    let mut args = vec!["--inventory", inv.as_str()];
    args.extend_from_slice(extra);
    f.command(&args).output().unwrap()
}

/// Processes left in host `i`'s namespaces besides its sshd and the
/// test's jobs, once our agent there has had a few seconds to see the end
/// of its input.
fn leftovers(f: &Fleet, i: usize) -> Vec<String> {
    let ns = f.hosts[i].ns.unwrap().to_string();
    let list = || {
        let out = Command::new("nsenter")
            .args([
                "--target",
                &ns,
                "--mount",
                "--pid",
                "--",
                "ps",
                "-eo",
                "pid=,user=,args=",
            ])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::trim)
            .filter(|l| !l.contains("sshd") && !l.contains("ps -eo") && !l.contains("sleep 1000"))
            .map(String::from)
            .collect::<Vec<_>>()
    };
    let start = Instant::now();
    let mut left = list();
    while !left.is_empty() && start.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(100));
        left = list();
    }
    left
}

/// Replaces `name` in `dir` by a symlink to `target`, as a user may.
fn link(dir: &Path, name: &str, target: &Path) {
    let tmp = dir.join(format!(".{name}.link"));
    std::os::unix::fs::symlink(target, &tmp).unwrap();
    std::fs::rename(&tmp, dir.join(name)).unwrap();
}

#[test]
fn a_remote_hosts_symlinked_lock_and_state_are_never_followed() {
    let Some(mut f) = Fleet::up(2) else { return };
    let shadow = secret(f.dir.path());
    // Host 1: genv.lock is a link to a root-only file.
    std::os::unix::fs::symlink(&shadow, f.host(0).state_dir().join("genv.lock")).unwrap();
    // Host 2: sound until decided on; then, before the detach, the user
    // links genv.lock and devices.json to root-only files.
    let shadow2 = f.dir.path().join("devices-target");
    let p = f.host(1).spawn_as("alice", Some("a"));
    f.host(1).set_apps(&[(p, 0, "100")]);
    f.host(1).write_envs(&[env("a", Some("alice"), None, p)]);
    f.host(1).write_devices(4, &[(0, "a"), (1, "a")]);
    let devices = std::fs::read_to_string(f.host(1).state_dir().join("devices.json")).unwrap();
    std::fs::write(&shadow2, &devices).unwrap();
    std::fs::set_permissions(&shadow2, std::fs::Permissions::from_mode(0o600)).unwrap();
    let state = f.host(1).state_dir();
    let (s1, s2) = (shadow.clone(), shadow2.clone());
    f.host(1).answer_late();
    let user = util::after_read(&state.join("devices.json"), move || {
        link(&state, "genv.lock", &s1);
        link(&state, "devices.json", &s2);
    });
    let inventory = f.inventory(false, &[], "\n[limits]\nmax_devices_per_user = 0\n");
    let out = run_inventory(&f, &inventory, &["enforce", "--interval", "0"]);
    assert!(user.join().unwrap());
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    // Degraded, not failed: what needs no genv state is still judged.
    assert!(
        err.contains("[h1] [ERROR] genv's state cannot be used (/var/tmp/genv/genv.lock is a symbolic link: refused"),
        "{err}"
    );
    assert!(
        err.contains("[h2] [ERROR] Failed detaching environment a from device 1: /var/tmp/genv/genv.lock is a symbolic link: refused"),
        "{err}"
    );
    assert_untouched(&shadow);
    assert_eq!(
        std::fs::read_to_string(&shadow2).unwrap(),
        devices,
        "the link's target was rewritten"
    );
    assert_eq!(
        std::fs::metadata(&shadow2).unwrap().permissions().mode() & 0o777,
        0o600
    );
    // The kill needed no state: it happened.
    assert_eq!(f.host(1).wait_signal(p, WAIT), Some(SIGTERM));
    // A link in place of devices.json alone is refused too.
    let state = f.host(1).state_dir();
    std::fs::remove_file(state.join("genv.lock")).unwrap();
    std::fs::remove_file(state.join("devices.json")).unwrap();
    f.host(1).write_devices(4, &[(0, "a"), (1, "a")]);
    let q = f.host(1).spawn_as("alice", Some("a"));
    f.host(1).set_apps(&[(q, 0, "100")]);
    f.host(1).write_envs(&[env("a", Some("alice"), None, q)]);
    let s2 = shadow2.clone();
    let user = util::after_read(&state.join("devices.json"), move || {
        link(&state, "devices.json", &s2)
    });
    let out = run_inventory(&f, &inventory, &["-q", "enforce", "--interval", "0"]);
    assert!(user.join().unwrap());
    assert!(
        stderr(&out).contains("[h2] [ERROR] Failed detaching environment a from device 1: /var/tmp/genv/devices.json is a symbolic link: refused"),
        "{}",
        stderr(&out)
    );
    assert_eq!(std::fs::read_to_string(&shadow2).unwrap(), devices);
    assert!(leftovers(&f, 1).is_empty(), "{:?}", leftovers(&f, 1));
}

/// A lock a user takes blocks nobody's enforcement (issue 26): the detach
/// waits a second at most, then goes on without it and says who held it.
#[test]
fn a_lock_taken_between_decision_and_detach_holds_nothing_up() {
    let Some(mut f) = Fleet::up(1) else { return };
    let p = f.host(0).spawn_as("alice", Some("a"));
    f.host(0).set_apps(&[(p, 0, "100")]);
    f.host(0).write_envs(&[env("a", Some("alice"), None, p)]);
    f.host(0).write_devices(4, &[(0, "a"), (1, "a")]);
    let state = f.host(0).state_dir();
    let before = std::fs::read(state.join("devices.json")).unwrap();
    f.host(0).answer_late();
    // Once the snapshot has read the state, someone takes genv's lock for 8 s.
    let lock = state.join("genv.lock");
    let holder = std::sync::Arc::new(std::sync::Mutex::new(None));
    let held = std::sync::Arc::clone(&holder);
    let user = util::after_read(&state.join("devices.json"), move || {
        let child = Command::new("flock")
            .arg(&lock)
            .args(["sleep", "8"])
            .spawn()
            .unwrap();
        *held.lock().unwrap() = Some(child);
        std::thread::sleep(Duration::from_millis(100));
    });
    let inventory = f.inventory(false, &[], "\n[limits]\nmax_devices_per_user = 1\n");
    let started = Instant::now();
    let out = run_inventory(
        &f,
        &inventory,
        &["--command-timeout", "5s", "enforce", "--interval", "0"],
    );
    let took = started.elapsed();
    assert!(user.join().unwrap());
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("h1: genv.lock held for over 1s by "), "{err}");
    assert!(err.contains("devices.json was written without it"), "{err}");
    assert!(took < Duration::from_secs(6), "waited {took:?}");
    assert_eq!(f.host(0).attached(1), Vec::<String>::new(), "detached");
    assert_eq!(f.host(0).attached(0), ["a"]);
    // Once the holder has let go, nothing else lands late.
    let mut holder = holder.lock().unwrap().take().unwrap();
    holder.wait().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_ne!(
        std::fs::read(f.host(0).state_dir().join("devices.json")).unwrap(),
        before
    );
    assert_eq!(f.host(0).attached(1), Vec::<String>::new());
    assert!(leftovers(&f, 0).is_empty(), "{:?}", leftovers(&f, 0));
}

#[test]
fn a_fifo_or_dev_zero_on_a_remote_host_fails_it_and_leaves_nothing() {
    let Some(mut f) = Fleet::up(3) else { return };
    let mkfifo = Command::new("mkfifo")
        .arg(f.host(0).state_dir().join("envs.json"))
        .status()
        .unwrap();
    assert!(mkfifo.success());
    std::os::unix::fs::symlink("/dev/zero", f.host(1).state_dir().join("devices.json")).unwrap();
    let stray = f.host(2).spawn(None);
    f.host(2).set_apps(&[(stray, 0, "100")]);
    let started = Instant::now();
    let out = f.ours(&[
        "-t",
        "5",
        "--command-timeout",
        "6s",
        "enforce",
        "--interval",
        "0",
        "--non-env-processes",
    ]);
    let took = started.elapsed();
    let err = stderr(&out);
    assert!(
        err.contains(&format!(
            "[{}] [ERROR] genv's state cannot be used (/var/tmp/genv/envs.json is a FIFO: refused",
            f.names[0]
        )),
        "{err}"
    );
    assert!(
        err.contains(&format!("[{}] [ERROR] genv's state cannot be used (/var/tmp/genv/devices.json is a symbolic link: refused", f.names[1])),
        "{err}"
    );
    assert_eq!(out.status.code(), Some(1), "degraded hosts: {err}");
    assert_eq!(
        f.host(2).wait_signal(stray, WAIT),
        Some(SIGTERM),
        "the sound host is enforced"
    );
    assert!(took < Duration::from_secs(6), "took {took:?}");
    for i in 0..2 {
        assert!(
            leftovers(&f, i).is_empty(),
            "host {i}: {:?}",
            leftovers(&f, i)
        );
    }
}

#[test]
fn a_process_named_with_odd_bytes_is_terminated() {
    let Some(mut f) = Fleet::up(1) else { return };
    // Its executable's name (so its comm in /proc/<pid>/stat) holds \xff,
    // a parenthesis and spaces.
    let dir = f.dir.path().join("odd");
    std::fs::create_dir(&dir).unwrap();
    let made = Command::new("sh")
        .args([
            "-c",
            "ln -s \"$(command -v sleep)\" \"$(printf '%s/\\377) x (y' \"$1\")\"",
            "sh",
        ])
        .arg(&dir)
        .status()
        .unwrap();
    assert!(made.success());
    let script = "exec \"$(printf '%s/\\377) x (y' \"$0\")\" 1000";
    let pid = f
        .host(0)
        .start("root", None, &["sh", "-c", script, dir.to_str().unwrap()]);
    f.host(0).set_apps(&[(pid, 0, "100")]);
    let out = f.ours(&[
        "enforce",
        "--interval",
        "0",
        "--non-env-processes",
        "--output",
        "json",
    ]);
    assert!(
        out.status.success(),
        "{:?}\nstderr: {}\nstdout: {}",
        out.status,
        stderr(&out),
        String::from_utf8_lossy(&out.stdout)
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        report["outcomes"][0]["outcome"]["result"], "signalled",
        "{report}"
    );
    assert_eq!(f.host(0).wait_signal(pid, WAIT), Some(SIGTERM));
}

#[test]
fn an_eid_with_a_newline_is_its_real_environment_and_its_detach_is_carried_out() {
    let Some(mut f) = Fleet::up(1) else { return };
    let eid = "job\nx; $(touch /tmp/pwned)";
    let p = f.host(0).spawn_as("alice", Some(eid));
    f.host(0).set_apps(&[(p, 0, "100")]);
    f.host(0).write_envs(&[env(eid, Some("alice"), None, p)]);
    f.host(0).write_devices(4, &[(0, eid), (1, eid)]);
    let out = f.ours(&[
        "enforce",
        "--interval",
        "0",
        "--max-devices-per-user",
        "0",
        "--non-env-processes",
        "--output",
        "json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    // Only the cap was broken: the process is in its (existing) environment.
    let violations = report["violations"].as_array().unwrap();
    assert_eq!(violations.len(), 1, "{report}");
    assert_eq!(violations[0]["rule"], "max-devices-per-user");
    let plan = &report["plan"]["hosts"][0];
    assert_eq!(
        plan["terminate"][0]["rules"],
        serde_json::json!(["max-devices-per-user"])
    );
    assert_eq!(plan["terminate"][0]["eid"], eid);
    // The idle device first, then the one its job runs on.
    assert_eq!(plan["detach"][0]["eid"], eid);
    assert_eq!(plan["detach"][0]["device"], 1);
    assert_eq!(plan["detach"][1]["device"], 0);
    for i in [1, 2] {
        assert_eq!(
            report["outcomes"][i]["outcome"]["result"], "detached",
            "{report}"
        );
    }
    assert_eq!(f.host(0).wait_signal(p, WAIT), Some(SIGTERM));
    assert_eq!(f.host(0).attached(0), Vec::<String>::new());
    assert_eq!(f.host(0).attached(1), Vec::<String>::new());
}

#[test]
fn a_forged_or_relabelled_env_never_gets_another_users_job_killed() {
    let Some(mut f) = Fleet::up(2) else { return };
    // Host A: alice's shell and her job, her env attached to two devices.
    let shell = f.host(0).spawn_as("alice", None);
    let job = f.host(0).spawn_as("alice", Some("a"));
    f.host(0).set_apps(&[(job, 0, "100")]);
    f.host(0)
        .write_envs(&[env("a", Some("alice"), None, shell)]);
    f.host(0).write_devices(4, &[(0, "a"), (1, "a")]);
    // Host B: bob forges envs in alice's name (with alice's real shell pid,
    // and with his own shell beside it) on three devices, and labels his
    // own env, with his own job, as alice's.
    let bob_shell = f.host(1).spawn_as("bob", None);
    let bob_job = f.host(1).spawn_as("bob", Some("b"));
    f.host(1).set_apps(&[(bob_job, 3, "100")]);
    let mut forged = env("f1", Some("alice"), None, shell);
    forged["uid"] = env("x", Some("alice"), None, 0)["uid"].clone();
    let mut forged2 = forged.clone();
    forged2["eid"] = "f2".into();
    forged2["pids"] = serde_json::json!([shell, bob_shell]);
    f.host(1)
        .write_envs(&[forged, forged2, env("b", Some("alice"), None, bob_shell)]);
    f.host(1)
        .write_devices(4, &[(0, "f1"), (1, "f1"), (2, "f2"), (3, "b")]);
    let out = f.ours(&[
        "enforce",
        "--interval",
        "0",
        "--max-devices-per-user",
        "2",
        "--max-devices-for-user",
        "bob=0",
    ]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    // Alice: untouched on every host.
    assert!(
        f.host(0).running(job),
        "alice's job was killed: {:?}",
        lines(&out)
    );
    assert_eq!(f.host(0).attached(0), vec!["a"]);
    assert_eq!(f.host(0).attached(1), vec!["a"]);
    // The forged records count toward her cap (an idle record is its
    // recorded user's, as in genv), and are what goes: they list none of
    // her processes on host B (her host-A shell's pid is another process
    // there, or none).
    assert!(
        lines(&out)
            .iter()
            .any(|l| l.starts_with("User alice is using ")),
        "{:?}",
        lines(&out)
    );
    for d in 0..3 {
        assert_eq!(f.host(1).attached(d), Vec::<String>::new());
    }
    // Bob: his relabelled env is still his, and over his cap of 0.
    assert!(
        lines(&out).contains(
            &"User bob is using 1 devices on 1 hosts which is 1 more than the maximum allowed"
                .to_string()
        ),
        "{:?}",
        lines(&out)
    );
    assert_eq!(f.host(1).wait_signal(bob_job, WAIT), Some(SIGTERM));
    assert_eq!(f.host(1).attached(3), Vec::<String>::new());
    assert!(
        err.contains("[WARNING] Environment b is recorded as alice's but its processes are bob's"),
        "{err}"
    );
}

#[test]
fn a_pid_reused_between_decision_and_kill_on_a_remote_host_is_never_signalled() {
    let Some(mut f) = Fleet::up(2) else { return };
    let victim = f.host(0).spawn(None);
    f.host(0).set_apps(&[(victim, 0, "100")]);
    f.host(0).write_devices(4, &[]);
    // With -e nothing is done before every host has answered, and host 2's
    // sudo takes 2 s: the kill on host 1 comes 2 s after its snapshot. In
    // between the process dies and its pid goes to a new one.
    let slow = f.dir.path().join("h2/sbin/slow-sudo");
    util::write_executable(&slow, "#!/bin/sh\nsleep 2\nexec sudo \"$@\"\n");
    let inventory = f.inventory(false, &["", "sudo = \"/usr/local/sbin/slow-sudo -n\""], "");
    let ns = f.hosts[0].ns.unwrap().to_string();
    let reborn = f.host(0).state_dir().join(".reborn");
    let script = format!(
        "kill -KILL {victim}; while kill -0 {victim} 2>/dev/null; do sleep 0.01; done; sleep 0.05; echo {} > /proc/sys/kernel/ns_last_pid; setsid sleep 999 >/dev/null 2>&1 < /dev/null & echo $! > /var/tmp/genv/.reborn",
        victim - 1
    );
    let user = util::after_read(&f.host(0).state_dir().join("devices.json"), move || {
        std::thread::sleep(Duration::from_millis(500));
        let done = Command::new("nsenter")
            .args([
                "--target", &ns, "--mount", "--pid", "--", "sh", "-c", &script,
            ])
            .status()
            .unwrap();
        assert!(done.success());
    });
    f.host(0).write_devices(4, &[]);
    let out = run_inventory(
        &f,
        &inventory,
        &[
            "-e",
            "enforce",
            "--interval",
            "0",
            "--non-env-processes",
            "--output",
            "json",
        ],
    );
    assert!(user.join().unwrap());
    let report: Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", stderr(&out)));
    let reborn: u32 = std::fs::read_to_string(&reborn)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(reborn, victim, "the pid was not reused: cannot test");
    assert_eq!(
        report["outcomes"][0]["outcome"]["result"], "pid_reused",
        "{report}"
    );
    assert_eq!(
        f.host(0).wait_signal(victim, WAIT),
        Some(9),
        "the old process died of the user's SIGKILL"
    );
    let alive = Command::new("nsenter")
        .args([
            "--target",
            &f.hosts[0].ns.unwrap().to_string(),
            "--pid",
            "--mount",
            "--",
            "kill",
            "-0",
            &reborn.to_string(),
        ])
        .status()
        .unwrap();
    assert!(
        alive.success(),
        "the new process with the reused pid was signalled"
    );
}

#[test]
fn a_hung_host_does_not_hold_up_the_others() {
    let Some(mut f) = Fleet::up(4) else { return };
    let hang = f.dir.path().join("h1/sbin/hang-sudo");
    util::write_executable(&hang, "#!/bin/sh\nsleep 60\nexec sudo \"$@\"\n");
    let inventory = f.inventory(false, &["sudo = \"/usr/local/sbin/hang-sudo -n\""], "");
    let mut strays = Vec::new();
    for h in 1..4 {
        let p = f.host(h).spawn(None);
        f.host(h).set_apps(&[(p, 0, "100")]);
        strays.push(p);
    }
    let started = Instant::now();
    let inv = inventory.display().to_string();
    let child = f
        .command(&[
            "--inventory",
            &inv,
            "--concurrency",
            "2",
            "--command-timeout",
            "15s",
            "enforce",
            "--interval",
            "0",
            "--non-env-processes",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Two at a time and the first hung for 15 s: the three others still
    // go through the free slot, and are enforced right after their snapshot.
    for (h, p) in (1..4).zip(&strays) {
        assert_eq!(
            f.host(h).wait_signal(*p, Duration::from_secs(20)),
            Some(SIGTERM)
        );
        let at = started.elapsed();
        assert!(
            at < Duration::from_secs(7),
            "host {h} enforced only after {at:?}"
        );
    }
    let (out, _) = finish_within(child, Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("Failed running SSH command on h1 ("),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_silent_host_leaves_no_ssh_behind() {
    // A peer that accepts and then says nothing after its banner.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming().flatten() {
            let mut c = conn;
            let _ = std::io::Write::write_all(&mut c, b"SSH-2.0-OpenSSH_9.2\r\n");
            held.push(c);
        }
    });
    let control = tempfile::tempdir().unwrap();
    let ctl = control.path().display().to_string();
    let host = format!("127.0.0.1:{port}");
    let mut child = Command::new(env!("CARGO_BIN_EXE_genv-enforce"))
        .args([
            "remote",
            "-H",
            &host,
            "-t",
            "1",
            "--control-dir",
            &ctl,
            "enforce",
            "--interval",
            "100ms",
            "--output",
            "json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let ssh_left = || {
        let out = Command::new("pgrep")
            .args(["-f", &format!("ssh .*{ctl}")])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).lines().count()
    };
    let mut cycles = BufReader::new(child.stdout.take().unwrap());
    for _ in 0..3 {
        let mut line = String::new();
        cycles.read_line(&mut line).unwrap();
        let c: Value = serde_json::from_str(&line).unwrap();
        assert!(
            c["hosts"][0]["error"]
                .as_str()
                .is_some_and(|e| !e.is_empty()),
            "{c}"
        );
        assert!(ssh_left() <= 1, "ssh processes pile up: {}", ssh_left());
    }
    rustix::process::kill_process(
        rustix::process::Pid::from_child(&child),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    child.wait().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(ssh_left(), 0, "ssh left behind");
}
