//! Differential tests against the real genv 1.4.3 on the same host state.
//!
//! Each case builds a fake GPU host (fake nvidia-smi, `GENV_TMPDIR` in a
//! temp dir, real `sleep` processes carrying `GENV_ENVIRONMENT_ID`) and
//! compares:
//! - `genv-enforce enforce --interval 0 --dry-run` with
//!   `genv enforce --interval 0` under `GENV_TERMINATE_PROCESSES=0`, line
//!   for line (we order a host's processes as genv's Python set does);
//! - `genv-enforce enforce --snapshot <genv's own snapshot>` with the same,
//!   line for line (same process order, so genv's greedy choices too);
//! - `genv-enforce snapshot` with `genv usage snapshot`.
//!
//! Differences are asserted only where docs/differences.md lists them.

mod util;

use util::{assert_same_snapshot, env, lines, Host};

struct Runs {
    ours: Vec<String>,
    replay: Vec<String>,
    genv: std::process::Output,
}

/// Runs everything on `host` with `flags`. genv runs last: its execute
/// really detaches (only kills are disabled).
fn run(host: &Host, flags: &[&str]) -> Runs {
    let before = std::fs::read(host.state_dir().join("devices.json")).ok();
    let mut args = vec!["enforce", "--interval", "0", "--dry-run"];
    args.extend_from_slice(flags);
    let ours = host.ours(&args);
    // A dry run exits 3 when it found violations (it prints them).
    assert_eq!(
        ours.status.code(),
        Some(if ours.stdout.is_empty() { 0 } else { 3 }),
        "genv-enforce failed: {}",
        String::from_utf8_lossy(&ours.stderr)
    );
    assert_eq!(
        std::fs::read(host.state_dir().join("devices.json")).ok(),
        before,
        "--dry-run touched devices.json"
    );

    let genv_snapshot = host.genv(&["usage", "snapshot"]);
    assert!(
        genv_snapshot.status.success(),
        "genv usage snapshot: {}",
        String::from_utf8_lossy(&genv_snapshot.stderr)
    );
    let our_snapshot = host.ours(&["snapshot"]);
    assert!(
        our_snapshot.status.success(),
        "{}",
        String::from_utf8_lossy(&our_snapshot.stderr)
    );
    assert_same_snapshot(&genv_snapshot.stdout, &our_snapshot.stdout);

    let file = host.dir.path().join("genv-snapshot.json");
    std::fs::write(&file, &genv_snapshot.stdout).unwrap();
    let file = file.display().to_string();
    let mut args = vec!["enforce", "--snapshot", file.as_str()];
    args.extend_from_slice(flags);
    let replay = host.ours(&args);
    // A replay is a dry run: 3 when it found violations (it prints them).
    assert_eq!(
        replay.status.code(),
        Some(if replay.stdout.is_empty() { 0 } else { 3 }),
        "{}",
        String::from_utf8_lossy(&replay.stderr)
    );

    let mut args = vec!["enforce", "--interval", "0"];
    args.extend_from_slice(flags);
    let genv = host.genv(&args);
    Runs {
        ours: lines(&ours),
        replay: lines(&replay),
        genv,
    }
}

/// Asserts genv and we agree on `flags` over `host`.
fn assert_agree(host: &Host, flags: &[&str]) -> Vec<String> {
    let r = run(host, flags);
    assert!(
        r.genv.status.success(),
        "genv failed: {}",
        String::from_utf8_lossy(&r.genv.stderr)
    );
    assert_eq!(
        r.ours,
        lines(&r.genv),
        "live dry run vs genv, line for line"
    );
    assert_eq!(
        r.replay,
        lines(&r.genv),
        "replay of genv's snapshot vs genv, line for line"
    );
    lines(&r.genv)
}

#[test]
fn non_env_processes_and_state_clean_up() {
    let mut h = Host::new(4);
    let a = h.spawn(Some("a"));
    let stray1 = h.spawn(None);
    let stray2 = h.spawn(None);
    let dead = h.spawn(Some("gone"));
    h.set_apps(&[
        (a, 0, "1000"),
        (stray1, 1, "200"),
        (stray2, 2, "300"),
        (stray2, 3, "300"),
    ]);
    // "gone" has no live pid: genv drops it on load, and its attachment too.
    h.write_envs(&[
        env("a", Some("alice"), None, a),
        env("gone", Some("bob"), None, 999_999),
    ]);
    h.write_devices(4, &[(0, "a"), (1, "gone")]);
    let _ = dead;
    let out = assert_agree(&h, &["--non-env-processes"]);
    assert_eq!(out.len(), 4, "{out:?}");
    assert!(out.contains(&format!(
        "Process {stray1} is not running in a GPU environment"
    )));
    assert!(out.contains(&format!(
        "Terminating process {stray2} from environment N/A that is running on GPU(s) 2,3"
    )));
    // Off by default, as in genv.
    assert!(assert_agree(&h, &[]).is_empty());
}

#[test]
fn env_devices_multi_gpu_process() {
    let mut h = Host::new(4);
    let p1 = h.spawn(Some("a"));
    let p2 = h.spawn(Some("a"));
    let p3 = h.spawn(Some("b"));
    h.set_apps(&[
        (p1, 0, "100"),
        (p1, 1, "100"),
        (p1, 2, "100"),
        (p2, 0, "100"),
        (p3, 3, "100"),
    ]);
    h.write_envs(&[env("a", Some("alice"), None, p1), env("b", None, None, p3)]);
    h.write_devices(4, &[(0, "a"), (3, "b")]);
    let out = assert_agree(&h, &[]);
    assert_eq!(
        out,
        vec![
            format!("Process {p1} from environment a is using non-attached GPU(s) 1,2"),
            format!("Terminating process {p1} from environment a that is running on GPU(s) 0,1,2"),
        ]
    );
    assert!(assert_agree(&h, &["--no-env-devices"]).is_empty());
}

#[test]
fn env_memory_over_by_several_processes() {
    let mut h = Host::new(2);
    let ps: Vec<u32> = (0..3).map(|_| h.spawn(Some("m"))).collect();
    let free = h.spawn(Some("u"));
    // 3 x 500mi with a 100mi cap: all three must go, whatever the order.
    h.set_apps(&[
        (ps[0], 0, "500"),
        (ps[1], 0, "500"),
        (ps[2], 0, "500"),
        (free, 1, "70000"),
    ]);
    h.write_envs(&[
        env("m", Some("alice"), Some("100mi"), ps[0]),
        env("u", Some("bob"), None, free),
    ]);
    h.write_devices(2, &[(0, "m"), (1, "u")]);
    let out = assert_agree(&h, &[]);
    assert_eq!(
        out[0],
        "Environment m is using 1572m on device 0 which is 1468m over its capacity of 100mi"
    );
    assert_eq!(out.len(), 4);
}

#[test]
fn env_memory_greedy_choice_follows_snapshot_order() {
    let mut h = Host::new(1);
    let ps: Vec<u32> = (0..4).map(|_| h.spawn(Some("g"))).collect();
    // 4 x 800mi with a 2gi cap: 1152mi over, so two of the four go; which
    // two depends on the process order, compared exactly through the replay.
    h.set_apps(&[
        (ps[0], 0, "800"),
        (ps[1], 0, "800"),
        (ps[2], 0, "800"),
        (ps[3], 0, "800"),
    ]);
    h.write_envs(&[env("g", Some("carol"), Some("2gi"), ps[0])]);
    h.write_devices(1, &[(0, "g")]);
    let r = run(&h, &[]);
    assert!(r.genv.status.success());
    assert_eq!(r.replay, lines(&r.genv));
    assert_eq!(r.replay.len(), 3);
    assert_eq!(
        r.ours[0],
        "Environment g is using 3355m on device 0 which is 1207m over its capacity of 2gi"
    );
}

#[test]
fn env_memory_kills_in_genvs_process_order_not_nvidia_smis() {
    let mut h = Host::new(1);
    let (hog, small) = h.spawn_pair_in_set_order("mia", "m");
    // nvidia-smi lists the small one first: in line order both would go.
    h.set_apps(&[(small, 0, "100"), (hog, 0, "5000")]);
    h.write_envs(&[env("m", Some("mia"), Some("3gi"), small)]);
    h.write_devices(1, &[(0, "m")]);
    let r = run(&h, &[]);
    assert!(r.genv.status.success());
    assert_eq!(
        r.ours,
        [
            "Environment m is using 5347m on device 0 which is 2126m over its capacity of 3gi"
                .to_string(),
            format!("Terminating process {hog} from environment m that is running on GPU(s) 0"),
        ]
    );
}

#[test]
fn max_devices_per_user_with_override() {
    let mut h = Host::new(6);
    let a1 = h.spawn_as("alice", Some("a1"));
    let a2 = h.spawn_as("alice", Some("a2"));
    let b = h.spawn_as("bob", Some("b"));
    h.set_apps(&[
        (a1, 0, "100"),
        (a2, 1, "100"),
        (a2, 2, "100"),
        (b, 4, "100"),
    ]);
    h.write_envs(&[
        env("a1", Some("alice"), None, a1),
        env("a2", Some("alice"), None, a2),
        env("b", Some("bob"), None, b),
    ]);
    h.write_devices(
        6,
        &[
            (0, "a1"),
            (1, "a1"),
            (1, "a2"),
            (2, "a2"),
            (4, "b"),
            (5, "b"),
        ],
    );
    let out = assert_agree(
        &h,
        &[
            "--max-devices-per-user",
            "1",
            "--max-devices-for-user",
            "bob=2",
        ],
    );
    assert_eq!(
        out[0],
        "User alice is using 3 devices which is 2 more than the maximum allowed"
    );
    assert!(out.contains(&"Detaching environment a1 of user alice from device 0".to_string()));
    assert!(out.contains(&"Detaching environment a2 of user alice from device 1".to_string()));
    assert!(out.contains(&format!(
        "Terminating process {a2} from environment a2 that is running on GPU(s) 1,2"
    )));
    assert_eq!(out.len(), 6, "{out:?}");
}

#[test]
fn all_rules_on_a_compliant_host_do_nothing() {
    let mut h = Host::new(2);
    let p = h.spawn_as("alice", Some("ok"));
    h.set_apps(&[(p, 1, "1000")]);
    h.write_envs(&[env("ok", Some("alice"), Some("2gi"), p)]);
    h.write_devices(2, &[(1, "ok")]);
    assert!(assert_agree(&h, &["--non-env-processes", "--max-devices-per-user", "1"]).is_empty());
}

// Documented differences (docs/differences.md).

#[test]
fn an_orphaned_job_is_left_alone_as_genv_does() {
    // A job whose environment's record is gone (a nohup job that outlived
    // its shell, or an emptied envs.json): genv lets it through, and so do
    // we, whatever the flags; we say so on stderr.
    let mut h = Host::new(2);
    let ghost = h.spawn_as("alice", Some("no-such-env"));
    h.set_apps(&[(ghost, 1, "100")]);
    h.write_envs(&[]);
    h.write_devices(2, &[]);
    assert!(assert_agree(&h, &["--non-env-processes"]).is_empty());
    let out = h.ours(&[
        "enforce",
        "--interval",
        "0",
        "--dry-run",
        "--non-env-processes",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(
            "[WARNING] Process {ghost} (user alice) on GPU(s) 1 carries environment no-such-env, which does not exist (its record is gone): it is left alone"
        )),
        "{err}"
    );
}

#[test]
fn difference_per_user_caps_apply_on_their_own() {
    let mut h = Host::new(2);
    let p = h.spawn_as("dave", Some("d"));
    h.set_apps(&[(p, 0, "100")]);
    h.write_envs(&[env("d", Some("dave"), None, p)]);
    h.write_devices(2, &[(0, "d"), (1, "d")]);
    let r = run(&h, &["--max-devices-for-user", "dave=1"]);
    assert!(r.genv.status.success());
    assert!(
        lines(&r.genv).is_empty(),
        "genv ignores it without --max-devices-per-user"
    );
    let expected = vec![
        "User dave is using 2 devices which is 1 more than the maximum allowed".to_string(),
        // The device his job does not run on (genv: device 0, and his job).
        "Detaching environment d of user dave from device 1".to_string(),
    ];
    assert_eq!(r.replay, expected);
    assert_eq!(r.ours, expected);
}

#[test]
fn difference_the_cap_takes_idle_devices_first() {
    // bob attached alice's env to two spare devices: genv detaches in index
    // order, her working device 0 first, and kills her job; we take the
    // spare ones.
    let mut h = Host::new(3);
    let p = h.spawn_as("alice", Some("a"));
    h.set_apps(&[(p, 0, "100")]);
    h.write_envs(&[env("a", Some("alice"), None, p)]);
    h.write_devices(3, &[(0, "a"), (1, "a"), (2, "a")]);
    let r = run(&h, &["--max-devices-per-user", "1"]);
    assert!(r.genv.status.success());
    assert_eq!(
        lines(&r.genv),
        vec![
            "User alice is using 3 devices which is 2 more than the maximum allowed".to_string(),
            format!("Terminating process {p} from environment a that is running on GPU(s) 0"),
            "Detaching environment a of user alice from device 0".to_string(),
            "Detaching environment a of user alice from device 1".to_string(),
        ]
    );
    let expected = vec![
        "User alice is using 3 devices which is 2 more than the maximum allowed".to_string(),
        "Detaching environment a of user alice from device 1".to_string(),
        "Detaching environment a of user alice from device 2".to_string(),
    ];
    assert_eq!(r.replay, expected);
    assert_eq!(r.ours, expected);
}

#[test]
fn difference_unmeasured_usage_does_not_crash() {
    let mut h = Host::new(1);
    let na = h.spawn(Some("n"));
    let big = h.spawn(Some("n"));
    h.set_apps(&[(na, 0, "[N/A]"), (big, 0, "3000")]);
    h.write_envs(&[env("n", Some("erin"), Some("1gi"), na)]);
    h.write_devices(1, &[(0, "n")]);
    let r = run(&h, &[]);
    assert!(!r.genv.status.success(), "genv 1.4.3 dies on [N/A]");
    assert!(String::from_utf8_lossy(&r.genv.stderr).contains("ValueError"));
    let expected = vec![
        "Environment n is using 3145m on device 0 which is 2071m over its capacity of 1gi"
            .to_string(),
        format!("Terminating process {big} from environment n that is running on GPU(s) 0"),
    ];
    assert_eq!(r.replay, expected);
    assert_eq!(r.ours, expected);
}

/// genv 1.4.3 terminates the machine's CUDA MPS server (a process outside
/// any environment), and with it every client: here alice's job in her own
/// environment. We never judge it: the kernel says root's control daemon
/// started it from the driver's root-owned file (see docs/rules.md, "CUDA
/// MPS"). A snapshot genv recorded says none of that: its replay judges
/// the server as genv does.
#[test]
fn difference_the_shared_mps_server_is_never_terminated() {
    use std::os::unix::fs::PermissionsExt;
    let mut h = Host::new(1);
    let (alice, _) = util::ensure_user("alice");
    // Root's programs (copies of sh and sleep) in root's directories,
    // which alice may run.
    let open = std::fs::Permissions::from_mode(0o755);
    let driver_dir = util::driver_dir();
    let driver = driver_dir.path();
    let (control, server) = (
        driver.join("nvidia-cuda-mps-control"),
        driver.join("nvidia-cuda-mps-server"),
    );
    for (from, to) in [("/bin/sh", &control), ("/bin/sleep", &server)] {
        std::fs::copy(from, to).unwrap();
        std::fs::set_permissions(to, open.clone()).unwrap();
    }
    let pid_file = h.dir.path().join("server.pid");
    let script = format!(
        "setpriv --reuid={alice} --regid={alice} --clear-groups {} 1000 & echo $! > {}; wait",
        server.display(),
        pid_file.display()
    );
    let daemon = h.start("root", None, &[control.to_str().unwrap(), "-c", &script]);
    let start = std::time::Instant::now();
    let server: u32 = loop {
        if let Some(pid) = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|t| t.trim().parse().ok())
        {
            break pid;
        }
        assert!(start.elapsed().as_secs() < 10, "the server did not start");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    // The daemon's end (the test's, or a panic's) leaves the server: it
    // goes with the test, or it would hold the test's output open.
    struct Ends(u32);
    impl Drop for Ends {
        fn drop(&mut self) {
            let _ = std::process::Command::new("kill")
                .arg(self.0.to_string())
                .status();
        }
    }
    let _server = Ends(server);
    let client = h.spawn_as("alice", Some("ea"));
    h.set_apps(&[(client, 0, "1540"), (server, 0, "66")]);
    h.write_envs(&[env("ea", Some("alice"), None, client)]);
    h.write_devices(1, &[(0, "ea")]);

    let genv = h.genv(&["enforce", "--interval", "0", "--non-env-processes"]);
    assert!(genv.status.success());
    assert_eq!(
        lines(&genv),
        [
            format!("Process {server} is not running in a GPU environment"),
            format!(
                "Terminating process {server} from environment N/A that is running on GPU(s) 0"
            ),
        ]
    );
    // Ours, acting: nothing to do; the server is said, and lives.
    let ours = h.ours(&["enforce", "--interval", "0", "--non-env-processes"]);
    let stderr = String::from_utf8_lossy(&ours.stderr);
    assert!(ours.status.success(), "{stderr}");
    assert!(lines(&ours).is_empty(), "{:?}", lines(&ours));
    assert!(
        stderr.contains(&format!(
            "[INFO] Process {server} (user alice) on device 0 is the machine's CUDA MPS server"
        )),
        "{stderr}"
    );
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(h.running(daemon) && h.running(client));
}
