//! End-to-end on this machine: our binary (or its library shell) against a
//! fake GPU host with real processes that really get signalled and a real
//! `devices.json` that really gets rewritten.

mod util;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use genv_enforce::host::LiveHost;
use genv_enforce::model::{EnvId, GpuIndex};
use genv_enforce::outcome::{self, TerminateResult as T};
use util::{env, lines, Host};

const SIGTERM: i32 = 15;

fn start_time(pid: u32) -> u64 {
    util::start_time(pid)
}

fn local(h: &Host) -> LiveHost {
    let mut host = genv_enforce::host::LiveHost::local(
        genv_enforce::model::HostId("local".into()),
        h.state_dir(),
        Duration::from_secs(10),
    );
    host.agent.nvidia_smi = vec![h.dir.path().join("bin/nvidia-smi").display().to_string()];
    host
}

#[test]
fn enforce_really_terminates_and_detaches() {
    let mut h = Host::new(4);
    let good = h.spawn_as("alice", Some("a"));
    let stray = h.spawn(None);
    let roamer = h.spawn_as("bob", Some("b"));
    let hog = h.spawn_as("carol", Some("c"));
    h.set_apps(&[
        (good, 0, "100"),
        (stray, 1, "100"),
        (roamer, 2, "100"),
        (roamer, 3, "100"),
        (hog, 3, "100"),
    ]);
    h.write_envs(&[
        env("a", Some("alice"), None, good),
        env("b", Some("bob"), None, roamer),
        env("c", Some("carol"), None, hog),
    ]);
    // carol holds two devices with a cap of 1: device 2 is detached and her process there... is on 3, so it lives.
    h.write_devices(4, &[(0, "a"), (2, "b"), (2, "c"), (3, "c")]);
    let out = h.ours(&[
        "enforce",
        "--interval",
        "0",
        "--non-env-processes",
        "--max-devices-per-user",
        "1",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let l = lines(&out);
    assert!(
        l.contains(&format!(
            "Process {stray} is not running in a GPU environment"
        )),
        "{l:?}"
    );
    assert!(
        l.contains(&"Detaching environment c of user carol from device 2".to_string()),
        "{l:?}"
    );
    assert_eq!(h.wait_signal(stray, Duration::from_secs(5)), Some(SIGTERM));
    assert_eq!(h.wait_signal(roamer, Duration::from_secs(5)), Some(SIGTERM));
    assert!(h.running(good));
    assert!(h.running(hog));
    assert_eq!(h.attached(2), vec!["b"]);
    assert_eq!(h.attached(3), vec!["c"]);
    assert_eq!(h.attached(0), vec!["a"]);
}

#[test]
fn dry_run_touches_nothing() {
    let mut h = Host::new(2);
    let stray = h.spawn(None);
    let p = h.spawn(Some("a"));
    h.set_apps(&[(stray, 0, "100"), (p, 1, "100")]);
    h.write_envs(&[env("a", Some("alice"), None, p)]);
    h.write_devices(2, &[(0, "a"), (1, "a")]);
    let before = std::fs::read(h.state_dir().join("devices.json")).unwrap();
    let out = h.ours(&[
        "enforce",
        "--interval",
        "0",
        "--dry-run",
        "--non-env-processes",
        "--max-devices-per-user",
        "0",
    ]);
    assert_eq!(
        out.status.code(),
        Some(3),
        "a dry run that found violations"
    );
    assert_eq!(lines(&out).len(), 6, "{:?}", lines(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("[DRY RUN]"));
    std::thread::sleep(Duration::from_millis(200));
    assert!(h.running(stray) && h.running(p));
    assert_eq!(
        std::fs::read(h.state_dir().join("devices.json")).unwrap(),
        before
    );
}

#[test]
fn reused_pid_is_skipped_and_the_same_process_is_signalled() {
    let mut h = Host::new(1);
    let p = h.spawn(None);
    let host = local(&h);
    let real = start_time(p);
    // The snapshot saw another process under this pid: leave it alone.
    assert_eq!(
        util::terminate(&host, p, Some(real + 1)),
        T::PidReused {
            expected: real + 1,
            found: real
        }
    );
    assert_eq!(util::terminate(&host, p, None), T::NoIdentity);
    std::thread::sleep(Duration::from_millis(100));
    assert!(h.running(p));
    assert_eq!(util::terminate(&host, p, Some(real)), T::Signalled);
    assert_eq!(h.wait_signal(p, Duration::from_secs(5)), Some(SIGTERM));
    // Reaped: the pid is gone now.
    assert_eq!(util::terminate(&host, p, Some(real)), T::AlreadyGone);
}

#[tokio::test]
async fn process_of_unknown_ownership_is_reported_never_terminated() {
    let mut h = Host::new(1);
    let p = h.spawn(None);
    h.set_apps(&[(p, 0, "100")]);
    // A procfs view where this pid's environ cannot be read (as for another
    // user's process when we are not root); everything else is the real one.
    let fake_proc = h.dir.path().join("proc");
    let pdir = fake_proc.join(p.to_string());
    std::fs::create_dir_all(pdir.join("environ")).unwrap();
    for f in ["stat", "status"] {
        std::os::unix::fs::symlink(format!("/proc/{p}/{f}"), pdir.join(f)).unwrap();
    }
    let mut host = local(&h);
    host.agent.proc_root = fake_proc.display().to_string();
    let options = genv_enforce::cycle::Options {
        mode: genv_enforce::model::Mode::Local,
        policy: genv_enforce::rules::Policy {
            non_env_processes: true,
            ..Default::default()
        },
        dry_run: false,
        follows: false,
        exit_on_error: false,
        kill_after: None,
        sample_usage: false,
        idle_gap: std::time::Duration::from_secs(3600),
        view: false,
    };
    let fleet =
        genv_enforce::fleet::Fleet::new(vec![genv_enforce::host::Host::Live(Box::new(host))], 1);
    let (report, _) =
        genv_enforce::cycle::cycle(&fleet, &options, 1, &mut Default::default()).await;
    assert!(report.violations.is_empty());
    assert!(report.plan.hosts.is_empty());
    assert!(
        matches!(&report.notices[..], [genv_enforce::rules::Notice::UnknownOwner { pid, .. }] if pid.0 == p)
    );
    let text = genv_enforce::report::render_text(&report);
    assert!(
        text.stderr[0].contains("has unknown ownership"),
        "{:?}",
        text.stderr
    );
    std::thread::sleep(Duration::from_millis(100));
    assert!(h.running(p));
}

#[test]
fn concurrent_genv_attach_loses_nothing_to_our_detach() {
    const N: u32 = 6;
    let mut h = Host::new(N);
    let victim = h.spawn(Some("victim"));
    let owners: Vec<u32> = (0..N).map(|i| h.spawn(Some(&format!("e{i}")))).collect();
    let mut envs = vec![env("victim", Some("vic"), None, victim)];
    envs.extend((0..N).map(|i| env(&format!("e{i}"), Some("u"), None, owners[i as usize])));
    h.write_envs(&envs);
    let victims: Vec<(u32, &str)> = (0..N).map(|i| (i, "victim")).collect();
    h.write_devices(N, &victims);
    // Real genv attaches, all at once, while we detach the victim device by device.
    let attaches: Vec<_> = (0..N)
        .map(|i| {
            Command::new(util::genv_bin())
                .args([
                    "devices",
                    "attach",
                    "--allow-over-subscription",
                    "--eid",
                    &format!("e{i}"),
                    "--index",
                    &i.to_string(),
                ])
                .env("GENV_TMPDIR", h.state_dir())
                .stdout(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut host = local(&h);
    if let genv_enforce::host::live::Transport::Local(pipes) = &mut host.via {
        pipes.timeout = Duration::from_secs(30);
    }
    for i in 0..N {
        let plan = genv_enforce::plan::HostPlan {
            terminate: Vec::new(),
            detach: vec![genv_enforce::plan::Detach {
                rules: Default::default(),
                groups: Vec::new(),
                device: GpuIndex(i),
                eid: EnvId("victim".into()),
                username: None,
                charged: None,
                owner: None,
                working: false,
            }],
        };
        let out = util::execute(&host, &plan);
        assert!(
            matches!(
                &out[..],
                [genv_enforce::outcome::Outcome::Detach {
                    outcome: outcome::DetachResult::Detached,
                    ..
                }]
            ),
            "{out:?}"
        );
        std::thread::sleep(Duration::from_millis(30));
    }
    for mut a in attaches {
        assert!(a.wait().unwrap().success());
    }
    for i in 0..N {
        assert_eq!(h.attached(i), vec![format!("e{i}")], "device {i}");
    }
}

#[test]
fn failing_or_hung_nvidia_smi_is_reported_and_nothing_is_done_but_garbled_state_stops_no_rule_that_needs_none(
) {
    let mut h = Host::new(1);
    let stray = h.spawn(None);
    h.set_apps(&[(stray, 0, "100")]);
    let args = [
        "enforce",
        "--interval",
        "0",
        "--non-env-processes",
        "--command-timeout",
        "1s",
    ];

    std::fs::write(h.gpu_dir().join("fail"), "").unwrap();
    let out = h.ours(&args);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("couldn't communicate with the NVIDIA driver"));
    std::fs::remove_file(h.gpu_dir().join("fail")).unwrap();

    std::fs::write(h.gpu_dir().join("hang"), "").unwrap();
    let out = h.ours(&args);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("did not finish within 1s"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::remove_file(h.gpu_dir().join("hang")).unwrap();

    std::fs::write(
        h.state_dir().join("envs.json"),
        r#"{"envs": [{"eid": "x", "uid": "root"}]}"#,
    )
    .unwrap();
    assert!(h.running(stray));
    // A garbled state file degrades the host (exit status 1, said), and
    // what needs no genv state is still enforced (issue 26).
    let out = h.ours(&args);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("genv's state cannot be used (envs.json: ") && err.contains("envs[0].uid"),
        "{err}"
    );
    assert_eq!(
        lines(&out),
        [
            format!("Process {stray} is not running in a GPU environment"),
            format!("Terminating process {stray} from environment N/A that is running on GPU(s) 0"),
        ]
    );
    assert_eq!(h.wait_signal(stray, Duration::from_secs(10)), Some(15));
}

/// `genv-enforce enforce --interval <interval> --output json` on `h`, stdout piped.
fn looping(h: &Host, interval: &str) -> std::process::Child {
    h.command(Path::new(env!("CARGO_BIN_EXE_genv-enforce")))
        .args(["enforce", "--interval", interval, "--output", "json"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn interval_loop_stops_cleanly_on_sigterm() {
    use std::io::{BufRead, Read};
    let h = Host::new(1);
    let mut child = looping(&h, "200ms");
    // Three cycles reported (however loaded this machine), then SIGTERM.
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut text = String::new();
    for _ in 0..3 {
        assert!(stdout.read_line(&mut text).unwrap() > 0, "{text}");
    }
    rustix::process::kill_process(
        rustix::process::Pid::from_child(&child),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    stdout.read_to_string(&mut text).unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    let cycles: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(cycles.len() >= 3, "{} cycles", cycles.len());
    assert_eq!(cycles[1]["cycle"], 2);
    assert_eq!(cycles[0]["hosts"][0]["devices"], 1);
}

#[test]
fn closed_stdout_ends_the_loop_like_head_expects() {
    let h = Host::new(1);
    let mut child = looping(&h, "50ms");
    let mut first = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut first,
    )
    .unwrap();
    assert!(first.starts_with('{'));
    // The reader is gone now (as `| head -1` exits): the run must end.
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "{status:?}");
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("still running 10s after its stdout closed");
}

#[test]
fn closed_stdout_ends_every_subcommand_with_0() {
    // Regression, issue 7: `snapshot | true` and `enforce --snapshot a b | head -1` panicked (exit 101).
    let h = Host::new(2);
    let fixtures = util::repo().join("fixtures/snapshots");
    let (a, b) = (fixtures.join("gpu1.json"), fixtures.join("gpu2.json"));
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    let dir = fixtures.display().to_string();
    for args in [
        vec!["snapshot"],
        vec!["enforce", "--snapshot", a, b, "--non-env-processes"],
        vec!["enforce", "--snapshot", a, b, "--output", "json"],
        vec![
            "remote",
            "enforce",
            "--snapshot-dir",
            &dir,
            "--non-env-processes",
        ],
    ] {
        let mut child = h
            .command(Path::new(env!("CARGO_BIN_EXE_genv-enforce")))
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // The reader is gone before anything is written: every write fails with EPIPE.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(0),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[tokio::test]
async fn an_answer_given_up_on_is_never_read_as_the_next_requests() {
    let mut h = Host::new(1);
    let first = h.spawn(None);
    h.set_apps(&[(first, 0, "100")]);
    // nvidia-smi answers its first query (as things are then) 1.5 s late,
    // the others at once.
    let slow = h.dir.path().join("bin/slow-nvidia-smi");
    util::write_executable(
        &slow,
        &format!(
            "#!/bin/sh\nout=$('{1}' \"$@\")\nif mkdir '{0}' 2>/dev/null; then sleep 1.5; fi\nprintf '%s\\n' \"$out\"\n",
            h.dir.path().join("slow-once").display(),
            h.dir.path().join("bin/nvidia-smi").display(),
        ),
    );
    let mut host = local(&h);
    host.agent.nvidia_smi = vec![slow.display().to_string()];
    let host = genv_enforce::host::Host::Live(Box::new(host));
    // The agent up and answering (nvidia-smi quick while slow-once exists).
    let once = h.dir.path().join("slow-once");
    std::fs::create_dir(&once).unwrap();
    assert_eq!(host.snapshot().await.unwrap().processes.len(), 1);
    std::fs::remove_dir(&once).unwrap();
    // Given up on (a caller's timeout, a signal) while the agent answers.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), host.snapshot())
            .await
            .is_err()
    );
    let second = h.spawn(None);
    h.set_apps(&[(second, 0, "100")]);
    // By now the abandoned answer (the first job's) would be waiting.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let snap = host.snapshot().await.unwrap();
    let pids: Vec<u32> = snap.processes.iter().map(|p| p.pid.0).collect();
    assert_eq!(pids, [second], "the answer read is this request's");
    host.close().await.unwrap();
}
