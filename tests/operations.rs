//! Operator features end to end on this machine (real processes really
//! signalled, real files): the audit log, `--kill-after` escalation,
//! `--confirm-cycles`.

mod util;

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use util::{env, lines, Host};

const SIGTERM: i32 = 15;
const SIGKILL: i32 = 9;

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn audit_lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn the_audit_log_records_each_action_before_and_its_outcome_after() {
    let mut h = Host::new(4);
    let stray = h.spawn(None);
    let roamer = h.spawn_as("bob", Some("b"));
    let hog = h.spawn_as("carol", Some("c"));
    h.set_apps(&[
        (stray, 1, "100"),
        (roamer, 2, "100"),
        (roamer, 3, "100"),
        (hog, 3, "100"),
    ]);
    h.write_envs(&[
        env("b", Some("bob"), None, roamer),
        env("c", Some("carol"), None, hog),
    ]);
    h.write_devices(4, &[(2, "b"), (2, "c"), (3, "c")]);
    let log = h.dir.path().join("audit.log");
    let l = log.to_str().unwrap();
    let run = |h: &Host| {
        h.ours(&[
            "enforce",
            "--interval",
            "0",
            "--non-env-processes",
            "--max-devices-per-user",
            "1",
            "--audit-log",
            l,
        ])
    };
    let out = run(&h);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(h.wait_signal(stray, Duration::from_secs(5)), Some(SIGTERM));
    assert_eq!(h.wait_signal(roamer, Duration::from_secs(5)), Some(SIGTERM));
    let entries = audit_lines(&log);
    // Two terminations and one detach, each decided then done.
    assert_eq!(entries.len(), 6, "{entries:#?}");
    assert_eq!(
        std::fs::metadata(&log).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let find = |phase: &str, action: &str, key: &str, value: &Value| {
        entries
            .iter()
            .position(|e| e["phase"] == phase && e["action"] == action && &e[key] == value)
            .unwrap_or_else(|| panic!("no {phase} {action} {key}={value}: {entries:#?}"))
    };
    for pid in [stray, roamer] {
        let d = find("decided", "terminate", "pid", &Value::from(pid));
        let done = find("done", "terminate", "pid", &Value::from(pid));
        assert!(d < done, "decided before done");
        assert_eq!(entries[done]["outcome"]["result"], "signalled");
        assert!(entries[d]["start_time"].is_u64());
        assert!(entries[d]["cycle"] == 1 && entries[d]["time"].is_string());
        assert!(entries[d]["message"]
            .as_str()
            .unwrap()
            .starts_with(&format!("Terminating process {pid}")));
    }
    let d = find("decided", "detach", "eid", &Value::from("c"));
    assert_eq!(entries[d]["device"], 2);
    assert_eq!(entries[d]["user"], "carol");
    assert_eq!(
        entries[d]["rules"],
        serde_json::json!(["max-devices-per-user"])
    );
    let done = find("done", "detach", "eid", &Value::from("c"));
    assert_eq!(entries[done]["outcome"]["result"], "detached");
    let roamer_entry = &entries[find("decided", "terminate", "pid", &Value::from(roamer))];
    assert_eq!(roamer_entry["user"], "bob");
    assert_eq!(roamer_entry["eid"], "b");
    assert_eq!(roamer_entry["rules"], serde_json::json!(["env-devices"]));

    // Appended, never truncated: a second run with nothing to do adds nothing.
    let out = run(&h);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(audit_lines(&log).len(), 6);
}

#[test]
fn an_unsafe_audit_log_path_is_refused_and_left_alone() {
    let h = Host::new(1);
    let secret = h.dir.path().join("secret");
    std::fs::write(&secret, "root only\n").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let link = h.dir.path().join("link.log");
    std::os::unix::fs::symlink(&secret, &link).unwrap();
    let protected = h.dir.path().join("protected.log");
    std::fs::write(&protected, "").unwrap();
    std::fs::set_permissions(&protected, std::fs::Permissions::from_mode(0o400)).unwrap();
    let shared = h.dir.path().join("shared.log");
    std::fs::write(&shared, "").unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o666)).unwrap();
    let fifo = h.dir.path().join("fifo.log");
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &fifo,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    for (path, why) in [
        (&link, "a symbolic link: refused"),
        (&protected, "write-protected: refused"),
        (&shared, "writable by others: refused"),
        (&fifo, "a socket or FIFO: refused"),
    ] {
        let out = h.ours(&[
            "enforce",
            "--interval",
            "0",
            "--audit-log",
            path.to_str().unwrap(),
        ]);
        assert_eq!(out.status.code(), Some(2), "{path:?}");
        assert!(stderr(&out).contains(why), "{path:?}: {}", stderr(&out));
    }
    assert_eq!(std::fs::read_to_string(&secret).unwrap(), "root only\n");
    assert_eq!(
        std::fs::metadata(&secret).unwrap().permissions().mode() & 0o777,
        0o600
    );
}

#[test]
fn a_process_that_ignores_sigterm_is_killed_after_the_grace_period() {
    let mut h = Host::new(2);
    let stubborn = h.start("root", None, &["sh", "-c", "trap '' TERM; exec sleep 1000"]);
    let meek = h.spawn(None);
    h.set_apps(&[(stubborn, 0, "100"), (meek, 1, "100")]);
    let log = h.dir.path().join("audit.log");
    let out = h.ours(&[
        "enforce",
        "--interval",
        "0",
        "--non-env-processes",
        "--kill-after",
        "1s",
        "--output",
        "json",
        "--audit-log",
        log.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(h.wait_signal(meek, Duration::from_secs(5)), Some(SIGTERM));
    assert_eq!(
        h.wait_signal(stubborn, Duration::from_secs(5)),
        Some(SIGKILL)
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let kills: Vec<&Value> = report["outcomes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o["action"] == "kill" && o["outcome"]["result"] == "signalled")
        .collect();
    // Only the one still running after its SIGTERM (the other is gone).
    assert_eq!(kills.len(), 1, "{report:#}");
    assert_eq!(kills[0]["pid"], stubborn);
    assert_eq!(kills[0]["outcome"]["result"], "signalled");
    let entries = audit_lines(&log);
    assert!(entries
        .iter()
        .any(|e| e["action"] == "kill" && e["phase"] == "decided" && e["pid"] == stubborn));

    // Without --kill-after (genv's behaviour) it is left running.
    let stubborn = h.start("root", None, &["sh", "-c", "trap '' TERM; exec sleep 1000"]);
    h.set_apps(&[(stubborn, 0, "100")]);
    let out = h.ours(&["enforce", "--interval", "0", "--non-env-processes"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stderr(&out).contains("SIGKILL"));
    std::thread::sleep(Duration::from_millis(1500));
    assert!(h.running(stubborn));
}

#[test]
fn a_violation_waits_for_confirmation_over_two_cycles() {
    let mut h = Host::new(2);
    let stray = h.spawn(None);
    let passing = h.spawn(None);
    h.set_apps(&[(stray, 0, "100"), (passing, 1, "100")]);
    let mut child = h
        .command(Path::new(env!("CARGO_BIN_EXE_genv-enforce")))
        .args([
            "enforce",
            "--interval",
            "1s",
            "--non-env-processes",
            "--confirm-cycles",
            "2",
            "--output",
            "json",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut reports = BufReader::new(child.stdout.take().unwrap()).lines();
    let first: Value = serde_json::from_str(&reports.next().unwrap().unwrap()).unwrap();
    // Seen once: both wait, nothing is done.
    assert!(
        first["outcomes"].as_array().unwrap().is_empty(),
        "{first:#}"
    );
    let waiting = first["awaiting_confirmation"].as_array().unwrap();
    assert_eq!(waiting.len(), 2, "{first:#}");
    assert!(waiting.iter().all(|w| w["seen"] == 1 && w["needed"] == 2));
    assert!(h.running(stray) && h.running(passing));
    // The passing one is gone from the GPU before the next cycle: a
    // transient state, never punished.
    h.set_apps(&[(stray, 0, "100")]);
    let second: Value = serde_json::from_str(&reports.next().unwrap().unwrap()).unwrap();
    let _ = stop(&mut child);
    let outcomes = second["outcomes"].as_array().unwrap();
    assert_eq!(outcomes.len(), 1, "{second:#}");
    assert_eq!(outcomes[0]["pid"], stray);
    assert_eq!(h.wait_signal(stray, Duration::from_secs(5)), Some(SIGTERM));
    assert!(h.running(passing));

    // In text, what waits is said on stderr.
    let other = h.spawn(None);
    h.set_apps(&[(other, 0, "100")]);
    let out = h.ours(&[
        "enforce",
        "--interval",
        "0",
        "--non-env-processes",
        "--confirm-cycles",
        "2",
    ]);
    assert!(lines(&out).contains(&format!(
        "Process {other} is not running in a GPU environment"
    )));
    assert!(
        stderr(&out).contains(&format!("[INFO] Process {other} is not terminated yet")),
        "{}",
        stderr(&out)
    );
    assert!(h.running(other));
}

/// `GET path` over plain HTTP: the status line and the body.
fn http_get(port: u16, path: &str) -> (String, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_string(), body.to_string())
}

/// SIGTERM to a run of ours, then its exit status.
fn stop(child: &mut std::process::Child) -> std::process::ExitStatus {
    rustix::process::kill_process(
        rustix::process::Pid::from_child(child),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    child.wait().unwrap()
}

/// The value of the sample `name` (labels included, as printed).
fn sample(metrics: &str, name: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// A host of 2 GPUs: a stray on GPU 0, alice's job of environment `a` on
/// GPU 1 (attached there); the host, the stray's pid and hers.
fn a_stray_beside_alices_job() -> (Host, u32, u32) {
    let mut h = Host::new(2);
    let stray = h.spawn(None);
    let good = h.spawn(Some("a"));
    h.set_apps(&[(stray, 0, "100"), (good, 1, "100")]);
    h.write_envs(&[env("a", Some("alice"), None, good)]);
    h.write_devices(2, &[(1, "a")]);
    (h, stray, good)
}

#[test]
fn metrics_are_scraped_over_http_after_a_cycle() {
    let (mut h, stray, _) = a_stray_beside_alices_job();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = h
        .command(Path::new(env!("CARGO_BIN_EXE_genv-enforce")))
        .args([
            "enforce",
            "--interval",
            "1m",
            "--non-env-processes",
            "--output",
            "json",
            "--metrics-listen",
            &format!("127.0.0.1:{port}"),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut reports = BufReader::new(child.stdout.take().unwrap()).lines();
    let first: Value = serde_json::from_str(&reports.next().unwrap().unwrap()).unwrap();
    let host = first["hosts"][0]["host"].as_str().unwrap().to_string();
    let (status, metrics) = http_get(port, "/metrics");
    let (missing, _) = http_get(port, "/");
    let (view, why) = http_get(port, "/view");
    let _ = stop(&mut child);
    assert!(status.contains("200"), "{status}");
    assert!(missing.contains("404"), "{missing}");
    // The view only behind basic authentication: any local user can
    // reach this port.
    assert!(
        view.contains("404") && why.contains("basic authentication"),
        "{view} {why}"
    );
    let value = |name: &str| sample(&metrics, name).unwrap_or_else(|| panic!("{name}: {metrics}"));
    assert_eq!(value("genv_enforce_cycles_total"), 1.0);
    assert_eq!(value("genv_enforce_cycle_duration_seconds_count"), 1.0);
    assert_eq!(
        value(&format!("genv_enforce_host_up{{host=\"{host}\"}}")),
        1.0
    );
    assert!(
        value(&format!(
            "genv_enforce_host_snapshot_seconds{{host=\"{host}\"}}"
        )) > 0.0
    );
    assert_eq!(
        value(&format!(
            "genv_enforce_violations_total{{rule=\"non-env-processes\",host=\"{host}\"}}"
        )),
        1.0
    );
    assert_eq!(
        value(&format!(
            "genv_enforce_actions_total{{action=\"terminate\",host=\"{host}\",result=\"signalled\"}}"
        )),
        1.0
    );
    assert!(value("genv_enforce_last_success_timestamp_seconds") > 1.7e9);
    assert!(sample(&metrics, "genv_enforce_errors_total{kind=\"snapshot\"}").is_none());
    assert_eq!(h.wait_signal(stray, Duration::from_secs(5)), Some(SIGTERM));
}

#[test]
fn a_metrics_address_another_process_holds_never_stops_enforcement() {
    let mut h = Host::new(2);
    let stray = h.spawn(None);
    h.set_apps(&[(stray, 0, "100")]);
    // Any local user can take the port first.
    let squatter = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = squatter.local_addr().unwrap().port();
    let mut child = h
        .command(Path::new(env!("CARGO_BIN_EXE_genv-enforce")))
        .args([
            "enforce",
            "--interval",
            "1s",
            "--non-env-processes",
            "--output",
            "json",
            "--metrics-listen",
            &format!("127.0.0.1:{port}"),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let said = std::thread::spawn(move || {
        BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .find(|l| l.contains("--metrics-listen"))
    });
    let mut reports = BufReader::new(child.stdout.take().unwrap()).lines();
    let first: Value = serde_json::from_str(&reports.next().unwrap().unwrap()).unwrap();
    assert!(first["hosts"][0]["error"].is_null(), "{first:#}");
    assert_eq!(h.wait_signal(stray, Duration::from_secs(5)), Some(SIGTERM));
    // Freed, it is served within the retry's period, cycles counted since
    // the start.
    drop(squatter);
    let served = util::wait_until(Duration::from_secs(15), || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    let metrics = served.then(|| http_get(port, "/metrics").1);
    let _ = stop(&mut child);
    // Said on stderr (read to its end: the run is over).
    let line = said.join().unwrap().unwrap_or_default();
    assert!(
        line.contains("enforcing without the metrics endpoint meanwhile"),
        "{line}"
    );
    let metrics = metrics.expect("the endpoint was never served once its port was free");
    assert!(
        sample(&metrics, "genv_enforce_cycles_total").unwrap() >= 2.0,
        "{metrics}"
    );
}

/// The resident memory of process `pid`, in KiB.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| {
            l.strip_prefix("VmRSS:")?
                .trim()
                .strip_suffix(" kB")?
                .trim()
                .parse()
                .ok()
        })
        .unwrap()
}

/// A local user's flood: `n` connections to `port`, half of them sending
/// a 300 KB header that never ends, half a few bytes of one and then
/// nothing; held open until stdin closes. Prints `ready` once all is sent.
const FLOOD: &str = r#"
import os, resource, socket, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
port, n = int(sys.argv[1]), int(sys.argv[2])
socks = []
for i in range(n):
    s = socket.create_connection(("127.0.0.1", port))
    s.setblocking(False)
    head = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Flood: "
    body = b"a" * (300 * 1024 if i % 2 == 0 else 16)
    try:
        s.send(head + body)
    except OSError:
        pass
    socks.append(s)
print("ready", flush=True)
sys.stdin.read()
"#;

/// A local user's flood of stalled heads: N connections, each sending a
/// head that never ends; then "ready" and how many the endpoint still
/// holds open (those it closed read as ended).
const STALL: &str = r#"
import resource, select, socket, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
port, n = int(sys.argv[1]), int(sys.argv[2])
socks = []
for _ in range(n):
    s = socket.create_connection(("127.0.0.1", port), timeout=2)
    s.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Flood: aaaa")
    socks.append(s)
time.sleep(0.5)
ended = 0
for s in socks:
    if select.select([s], [], [], 0)[0]:
        try:
            ended += s.recv(1) == b""
        except OSError:
            ended += 1
print("ready", n - ended, flush=True)
sys.stdin.read()
"#;

/// A run of ours on `h` (one GPU, no environment) serving metrics on a
/// free port of 127.0.0.1, past its first cycle: the run and the port.
fn serving_metrics(h: &Host) -> (std::process::Child, u16) {
    h.write_devices(1, &[]);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = h
        .command(Path::new(env!("CARGO_BIN_EXE_genv-enforce")))
        .args([
            "enforce",
            "--interval",
            "1m",
            "--output",
            "json",
            "--metrics-listen",
            &format!("127.0.0.1:{port}"),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut reports = BufReader::new(child.stdout.take().unwrap()).lines();
    reports.next().unwrap().unwrap();
    (child, port)
}

/// Python `script` with `args`, run as mallory (a user of the machine, not
/// root, with the system's Python as any user has it), once it says its
/// first line: the process (stdin open) and the line.
fn as_mallory(script: &str, args: &[&str]) -> (std::process::Child, String) {
    let (uid, gid) = util::ensure_user("mallory");
    let mut flood = std::process::Command::new("/usr/bin/python3");
    flood.args(["-c", script]).args(args);
    std::os::unix::process::CommandExt::uid(&mut flood, uid);
    std::os::unix::process::CommandExt::gid(&mut flood, gid);
    let mut flood = flood
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut said = String::new();
    BufReader::new(flood.stdout.take().unwrap())
        .read_line(&mut said)
        .unwrap();
    (flood, said)
}

#[test]
fn the_metrics_endpoint_holds_under_a_local_users_flood() {
    let h = Host::new(1);
    let (mut child, port) = serving_metrics(&h);
    let (status, _) = http_get(port, "/metrics");
    assert!(status.contains("200"), "{status}");
    let before = rss_kib(child.id());
    let (mut flood, said) = as_mallory(FLOOD, &[&port.to_string(), "1500"]);
    assert_eq!(said.trim(), "ready", "the flood did not start");
    std::thread::sleep(Duration::from_millis(500));
    let during = rss_kib(child.id());
    // A scrape while the stalled connections are held.
    let (status, metrics) = http_get(port, "/metrics");
    let (post, _) = {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        write!(
            s,
            "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        (text.lines().next().unwrap_or("").to_string(), ())
    };
    drop(flood.stdin.take());
    let _ = flood.kill();
    let _ = flood.wait();
    let _ = stop(&mut child);
    assert!(status.contains("200"), "{status}");
    assert!(metrics.contains("genv_enforce_cycles_total 1"), "{metrics}");
    assert!(post.contains("405"), "{post}");
    let grown = during.saturating_sub(before);
    eprintln!("RSS {before} KiB before the flood, {during} KiB during (+{grown} KiB)");
    assert!(grown < 64 << 10, "RSS grew by {grown} KiB under the flood");
}

/// Issue 42, point 6: one local user opening many connections holds only
/// their own share of the endpoint's (64 of its 2,048, the rest closed at
/// once), so the scraper is served however many they open.
#[test]
fn one_local_user_cannot_crowd_the_scraper_out() {
    let h = Host::new(1);
    let (mut child, port) = serving_metrics(&h);
    let (mut flood, said) = as_mallory(STALL, &[&port.to_string(), "400"]);
    let held: usize = (said.trim().strip_prefix("ready "))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the flood did not start: {said}"));
    // Her stalled heads held meanwhile (5 s each): scrape among them.
    let (status, metrics) = http_get(port, "/metrics");
    drop(flood.stdin.take());
    let _ = flood.kill();
    let _ = flood.wait();
    let _ = stop(&mut child);
    assert_eq!(held, genv_enforce::metrics::PER_PEER, "of her 400");
    assert!(status.contains("200"), "{status}");
    assert!(metrics.contains("genv_enforce_cycles_total 1"), "{metrics}");
}

#[test]
fn local_doctor_passes_a_healthy_machine_and_fails_a_broken_one() {
    let mut h = Host::new(2);
    let p = h.start("root", Some("a"), &["sleep", "1000"]);
    h.set_apps(&[(p, 0, "100")]);
    h.write_envs(&[env("a", Some("alice"), None, p)]);
    h.write_devices(2, &[(0, "a")]);
    let out = h.ours(&["doctor", "--output", "json"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let checks = report["hosts"][0]["checks"].as_array().unwrap().clone();
    let detail = |name: &str| {
        let c = checks.iter().find(|c| c["check"] == name).unwrap();
        assert_eq!(c["status"], "ok", "{c}");
        c["detail"].as_str().unwrap().to_string()
    };
    assert_eq!(detail("privileges"), "running as root");
    assert_eq!(detail("nvidia-smi"), "2 GPUs, driver 535.104.05");
    assert!(detail("genv state").ends_with(": 1 environments, 1 attachments"));
    assert!(detail("snapshot").contains("1 GPU processes"));
    std::fs::write(h.gpu_dir().join("fail"), "").unwrap();
    let out = h.ours(&["doctor"]);
    assert_eq!(out.status.code(), Some(1));
    let text = lines(&out);
    assert!(
        text.iter()
            .any(|l| l.contains("nvidia-smi") && l.contains("FAIL")),
        "{text:#?}"
    );
    assert_eq!(text.last().unwrap(), "0 of 1 hosts ready");
    // On a terminal, a progress line (on a pty made by util-linux's script).
    let out = h
        .command(Path::new("script"))
        .args([
            "-qec",
            &format!("{} doctor", env!("CARGO_BIN_EXE_genv-enforce")),
            "/dev/null",
        ])
        .output()
        .unwrap();
    let tty = String::from_utf8_lossy(&out.stdout);
    assert!(tty.contains("doctor: 1/1 hosts checked"), "{tty}");
    assert!(tty.contains("0 of 1 hosts ready"), "{tty}");
}

#[test]
fn a_grace_warns_first_acts_on_what_still_holds_at_its_deadline_and_clears_the_rest() {
    let mut h = Host::new(2);
    let stray = h.spawn(None);
    let fixed = h.spawn(None);
    h.set_apps(&[(stray, 0, "100"), (fixed, 1, "100")]);
    let dir = tempfile::tempdir().unwrap();
    let audit = dir.path().join("audit.log");
    let mut child = h
        .command(Path::new(env!("CARGO_BIN_EXE_genv-enforce")))
        .args([
            "enforce",
            "--interval",
            "1s",
            "--non-env-processes",
            "--grace",
            "4s",
            "--output",
            "json",
            "--audit-log",
            audit.to_str().unwrap(),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    let mut reports = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut next = || -> Value { serde_json::from_str(&reports.next().unwrap().unwrap()).unwrap() };
    let first = next();
    // Seen: both warned once, with their deadline; nothing done.
    let events = first["events"].as_array().unwrap();
    assert_eq!(events.len(), 2, "{first:#}");
    assert!(events
        .iter()
        .all(|e| e["stage"] == "warned" && e["deadline_ms"].is_u64()));
    assert!(
        first["outcomes"].as_array().unwrap().is_empty(),
        "{first:#}"
    );
    let waiting = first["awaiting_confirmation"].as_array().unwrap();
    assert!(waiting
        .iter()
        .all(|w| w["deadline_ms"] == events[0]["deadline_ms"]));
    // One is fixed within the grace (off the GPU): cleared, once.
    h.set_apps(&[(stray, 0, "100")]);
    let second = next();
    let events = second["events"].as_array().unwrap();
    assert_eq!(events.len(), 1, "{second:#}");
    assert_eq!(
        (events[0]["stage"].as_str(), events[0]["pid"].as_u64()),
        (Some("cleared"), Some(u64::from(fixed)))
    );
    assert!(h.running(stray) && h.running(fixed));
    // The other still holds at its deadline: terminated then, not before.
    let acted = loop {
        let r = next();
        if !r["outcomes"].as_array().unwrap().is_empty() {
            break r;
        }
        assert!(r["events"].as_array().is_none_or(Vec::is_empty), "{r:#}");
        assert!(started.elapsed() < Duration::from_secs(20), "never acted");
    };
    assert!(started.elapsed() >= Duration::from_secs(4));
    assert_eq!(acted["outcomes"][0]["pid"], stray);
    assert_eq!(acted["events"][0]["stage"], "acted");
    assert_eq!(h.wait_signal(stray, Duration::from_secs(5)), Some(SIGTERM));
    let _ = stop(&mut child);
    assert!(h.running(fixed));
    // The audit log tells the story in order.
    let phases: Vec<(String, u64)> = std::fs::read_to_string(&audit)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .map(|e| {
            (
                e["phase"].as_str().unwrap().to_string(),
                e["pid"].as_u64().unwrap(),
            )
        })
        .collect();
    let (s, f) = (u64::from(stray), u64::from(fixed));
    assert_eq!(
        phases,
        [
            ("warned".to_string(), s),
            ("warned".to_string(), f),
            ("cleared".to_string(), f),
            ("decided".to_string(), s),
            ("done".to_string(), s)
        ],
        "{phases:?}"
    );
}

#[test]
fn a_restart_mid_grace_keeps_the_deadline_and_warns_nobody_twice() {
    let mut h = Host::new(1);
    let stray = h.spawn(None);
    h.set_apps(&[(stray, 0, "100")]);
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let db = dir.path().join("state.db");
    let start = || {
        h.command(Path::new(env!("CARGO_BIN_EXE_genv-enforce")))
            .args([
                "enforce",
                "--interval",
                "1s",
                "--non-env-processes",
                "--grace",
                "6s",
                "--output",
                "json",
                "--state-db",
                db.to_str().unwrap(),
            ])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let stop_ok = |child: &mut std::process::Child| {
        assert!(stop(child).success());
    };
    let started = std::time::Instant::now();
    let mut first = start();
    let mut reports = BufReader::new(first.stdout.take().unwrap()).lines();
    let report: Value = serde_json::from_str(&reports.next().unwrap().unwrap()).unwrap();
    assert_eq!(report["events"][0]["stage"], "warned", "{report:#}");
    let deadline = report["events"][0]["deadline_ms"].as_u64().unwrap();
    stop_ok(&mut first);
    // A new run, mid-grace: no second warning; the same deadline.
    let mut second = start();
    let mut reports = BufReader::new(second.stdout.take().unwrap()).lines();
    let acted = loop {
        let r: Value = serde_json::from_str(&reports.next().unwrap().unwrap()).unwrap();
        let events = r["events"].as_array().cloned().unwrap_or_default();
        assert!(events.iter().all(|e| e["stage"] != "warned"), "{r:#}");
        if !r["outcomes"].as_array().unwrap().is_empty() {
            break r;
        }
        assert_eq!(r["awaiting_confirmation"][0]["deadline_ms"], deadline);
        assert!(started.elapsed() < Duration::from_secs(20), "never acted");
    };
    stop_ok(&mut second);
    assert_eq!(acted["events"][0]["stage"], "acted");
    assert_eq!(acted["events"][0]["deadline_ms"], deadline);
    assert_eq!(h.wait_signal(stray, Duration::from_secs(5)), Some(SIGTERM));
    // A database open to others is refused before anything runs.
    std::fs::set_permissions(&db, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = h.ours(&[
        "enforce",
        "--interval",
        "0",
        "--state-db",
        db.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("open to others (must be 0600): refused"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn report_gives_the_gpu_hours_a_multi_cycle_run_recorded() {
    let mut h = Host::new(4);
    let alice = h.spawn_as("alice", None);
    let bob = h.spawn_as("bob", None);
    h.set_apps(&[(alice, 0, "1024"), (alice, 1, "1024"), (bob, 2, "512")]);
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let db = dir.path().join("state.db");
    let db_arg = db.to_str().unwrap();
    let mut child = h
        .command(Path::new(env!("CARGO_BIN_EXE_genv-enforce")))
        .args([
            "enforce",
            "--interval",
            "1s",
            "--output",
            "json",
            "--state-db",
            db_arg,
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    let mut reports = BufReader::new(child.stdout.take().unwrap()).lines();
    for _ in 0..4 {
        reports.next().unwrap().unwrap();
    }
    assert!(stop(&mut child).success());
    let elapsed = started.elapsed().as_secs_f64();
    // What the run recorded: its first and last sample.
    let (first, last): (i64, i64) = rusqlite::Connection::open(&db)
        .unwrap()
        .query_row("SELECT min(time_ms), max(time_ms) FROM usage", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .unwrap();
    let span = (last - first) as f64 / 1000.0;
    assert!(span >= 2.5 && span <= elapsed, "{span} s of {elapsed} s");
    let out = h.ours(&["report", "--state-db", db_arg, "--output", "json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let lines: Value = serde_json::from_slice(&out.stdout).unwrap();
    let line = |user: &str| {
        lines
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["name"] == user)
            .unwrap_or_else(|| panic!("{user}: {lines:#}"))
            .clone()
    };
    let (a, b) = (line("alice"), line("bob"));
    let hours = |l: &Value| l["gpu_hours"].as_f64().unwrap();
    assert!(
        (hours(&a) - 2.0 * span / 3600.0).abs() < 1e-6,
        "{a:#} over {span} s"
    );
    assert!(
        (hours(&b) - span / 3600.0).abs() < 1e-6,
        "{b:#} over {span} s"
    );
    assert_eq!(
        (a["peak_gpus"].as_u64(), b["peak_gpus"].as_u64()),
        (Some(2), Some(1))
    );
    assert_eq!(a["mean_gpu_memory_bytes"].as_u64(), Some(2048 << 20));
    // Text: an aligned table; CSV: a header and one line per user.
    let text = String::from_utf8(h.ours(&["report", "--state-db", db_arg]).stdout).unwrap();
    let rows: Vec<&str> = text.lines().collect();
    assert!(
        rows[0].starts_with("user ") && rows[0].contains("gpu_hours"),
        "{text}"
    );
    assert_eq!(rows.len(), 3, "{text}");
    let csv = String::from_utf8(
        h.ours(&[
            "report",
            "--state-db",
            db_arg,
            "--output",
            "csv",
            "--by",
            "host",
        ])
        .stdout,
    )
    .unwrap();
    assert_eq!(csv.lines().count(), 2, "{csv}");
    assert!(csv.starts_with("host,gpu_hours,"), "{csv}");
    // A missing database is an error, not an empty report.
    let out = h.ours(&[
        "report",
        "--state-db",
        dir.path().join("none.db").to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
}

/// The metrics endpoint behind TLS and basic authentication, from a web
/// configuration file as Prometheus exporters read it (issue 26): plain
/// HTTP, no credentials or a wrong password get nothing.
#[test]
fn metrics_may_be_served_over_tls_to_the_users_of_a_web_config_only() {
    let h = Host::new(1);
    let dir = tempfile::tempdir().unwrap();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let key = dir.path().join("metrics.key");
    std::fs::write(&key, cert.key_pair.serialize_pem()).unwrap();
    std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    std::fs::write(dir.path().join("metrics.crt"), cert.cert.pem()).unwrap();
    let hash = bcrypt::hash("s3cret", 4).unwrap();
    let web = dir.path().join("web.yml");
    std::fs::write(
        &web,
        format!("tls_server_config:\n  cert_file: metrics.crt\n  key_file: metrics.key\nbasic_auth_users:\n  prometheus: '{hash}'\n"),
    )
    .unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = h
        .command(Path::new(env!("CARGO_BIN_EXE_genv-enforce")))
        .args([
            "enforce",
            "--interval",
            "1m",
            "--output",
            "json",
            "--metrics-listen",
            &format!("127.0.0.1:{port}"),
            "--web.config.file",
            web.to_str().unwrap(),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut reports = BufReader::new(child.stdout.take().unwrap()).lines();
    let _first = reports.next().unwrap().unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let url = format!("https://localhost:{port}/metrics");
    let (good, wrong, none, view, view_none) = runtime.block_on(async {
        let client = reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .add_root_certificate(
                reqwest::Certificate::from_pem(cert.cert.pem().as_bytes()).unwrap(),
            )
            .resolve(
                "localhost",
                std::net::SocketAddr::from(([127, 0, 0, 1], port)),
            )
            .build()
            .unwrap();
        let get = |user: Option<(&str, &str)>| {
            let mut r = client.get(&url);
            if let Some((u, p)) = user {
                r = r.basic_auth(u, Some(p));
            }
            r.send()
        };
        let good = get(Some(("prometheus", "s3cret"))).await.unwrap();
        let good = (good.status().as_u16(), good.text().await.unwrap());
        let wrong = get(Some(("prometheus", "guess")))
            .await
            .unwrap()
            .status()
            .as_u16();
        let none = get(None).await.unwrap().status().as_u16();
        // The view (`status --connect URL`) under the same configuration.
        let view = client
            .get(url.replace("/metrics", "/view"))
            .basic_auth("prometheus", Some("s3cret"))
            .send()
            .await
            .unwrap();
        let view = (view.status().as_u16(), view.text().await.unwrap());
        let view_none = client
            .get(url.replace("/metrics", "/view"))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16();
        (good, wrong, none, view, view_none)
    });
    // Plain HTTP gets no metrics.
    let plain = {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let _ = write!(
            s,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        );
        let mut text = Vec::new();
        let _ = s.read_to_end(&mut text);
        String::from_utf8_lossy(&text).into_owned()
    };
    let _ = stop(&mut child);
    assert_eq!(good.0, 200);
    assert!(good.1.contains("genv_enforce_cycles_total"), "{}", good.1);
    assert_eq!((wrong, none), (401, 401));
    assert_eq!(view.0, 200, "{}", view.1);
    let schema = format!("{{\"schema\":{},\"cycle\":1,", genv_enforce::view::SCHEMA);
    assert!(view.1.starts_with(&schema), "{}", view.1);
    assert_eq!(view_none, 401);
    assert!(!plain.contains("genv_enforce"), "{plain}");
    // A web configuration that cannot be used stops the run before it starts.
    std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let out = h.ours(&[
        "enforce",
        "--interval",
        "0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--web.config.file",
        web.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("others may read or write it"),
        "{}",
        stderr(&out)
    );
}

/// `status` attached to a running service (issue 43): its socket is
/// root's alone (0600, the run's own user here), the view shows the stray
/// and its termination, `--output json` meets the shipped schema, and the
/// schema is what the binary prints. With no service, a clear error.
#[test]
fn status_prints_the_running_services_view_from_its_socket() {
    let (h, stray, good) = a_stray_beside_alices_job();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("run/view.sock");
    let mut child = h
        .command(Path::new(env!("CARGO_BIN_EXE_genv-enforce")))
        .args([
            "enforce",
            "--interval",
            "1m",
            "--non-env-processes",
            "--grace",
            "10m",
            "--output",
            "json",
            "--view-socket",
            socket.to_str().unwrap(),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut reports = BufReader::new(child.stdout.take().unwrap()).lines();
    let _first = reports.next().unwrap().unwrap();
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode();
    let status = |args: &[&str]| {
        let mut all = vec!["status", "--connect", socket.to_str().unwrap()];
        all.extend(args);
        h.ours(&all)
    };
    let text = status(&[]);
    let json = status(&["--output", "json"]);
    let _ = stop(&mut child);
    assert_eq!(mode & 0o777, 0o600, "{mode:o}");
    let words = String::from_utf8_lossy(&text.stdout);
    assert!(text.status.success(), "{}", stderr(&text));
    assert!(words.starts_with("cycle 1, "), "{words}");
    assert!(words.contains("gpu 0 an action waits"), "{words}");
    // Its owner as the kernel says (this test's own user).
    let me = nix::unistd::User::from_uid(nix::unistd::getuid())
        .unwrap()
        .unwrap()
        .name;
    assert!(
        words.contains(&format!(
            "terminate pid {stray} of {me} (non-env-processes), due in 9m"
        )),
        "{words}"
    );
    assert!(words.contains(&format!("pid {good} ")), "{words}");
    assert!(json.status.success(), "{}", stderr(&json));
    let view: Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(view["waiting"][0]["pid"], stray);
    assert_eq!(view["waiting"][0]["action"], "terminate");
    assert_eq!(view["waiting"][0]["owner"], me.as_str());
    let found = std::process::Command::new("python3")
        .args(["-c", "import jsonschema"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found,
        "python3 with jsonschema is needed: pip install jsonschema (scripts/test does)"
    );
    let schema = util::repo().join("contrib/genv-enforce-view.schema.json");
    let checked = std::process::Command::new("python3")
        .arg("-c")
        .arg(
            "import json, sys, jsonschema\n\
             s = json.load(open(sys.argv[1]))\n\
             jsonschema.Draft202012Validator.check_schema(s)\n\
             jsonschema.Draft202012Validator(s).validate(json.loads(sys.stdin.read()))",
        )
        .arg(&schema)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut p| {
            use std::io::Write;
            p.stdin.take().unwrap().write_all(&json.stdout)?;
            p.wait_with_output()
        })
        .unwrap();
    assert!(
        checked.status.success(),
        "{}",
        String::from_utf8_lossy(&checked.stderr)
    );
    let printed = h.ours(&["status", "--schema"]);
    assert_eq!(
        String::from_utf8_lossy(&printed.stdout),
        std::fs::read_to_string(&schema).unwrap(),
        "contrib/genv-enforce-view.schema.json is stale: genv-enforce status --schema > contrib/genv-enforce-view.schema.json"
    );
    // The service gone: its socket with it, and a clear error.
    assert!(!socket.exists());
    let none = status(&[]);
    assert_eq!(none.status.code(), Some(1));
    assert!(
        stderr(&none).contains("no service answers there"),
        "{}",
        stderr(&none)
    );
}

/// A program run in a pseudo-terminal of `cols` x `rows`, its screen kept
/// by a terminal emulator (vt100) as it draws.
struct Pty {
    child: std::process::Child,
    master: std::fs::File,
    screen: std::sync::Arc<std::sync::Mutex<(vt100::Parser, Vec<u8>)>>,
}

impl Pty {
    fn spawn(mut cmd: std::process::Command, cols: u16, rows: u16) -> Pty {
        use std::os::fd::OwnedFd;
        use std::os::unix::process::CommandExt;
        let size = nix::pty::Winsize {
            ws_row: rows,
            ws_col: cols,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        let pty = nix::pty::openpty(Some(&size), None).unwrap();
        let slave: OwnedFd = pty.slave;
        cmd.stdin(Stdio::from(slave.try_clone().unwrap()))
            .stdout(Stdio::from(slave.try_clone().unwrap()))
            .stderr(Stdio::from(slave))
            .env("TERM", "xterm-256color");
        // Its own session, the pty its controlling terminal.
        unsafe {
            cmd.pre_exec(|| {
                rustix::process::setsid().map_err(std::io::Error::from)?;
                if nix::libc::ioctl(0, nix::libc::TIOCSCTTY as _, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().unwrap();
        let master = std::fs::File::from(pty.master);
        let screen = std::sync::Arc::new(std::sync::Mutex::new((
            vt100::Parser::new(rows, cols, 0),
            Vec::new(),
        )));
        let mut reader = master.try_clone().unwrap();
        let fed = std::sync::Arc::clone(&screen);
        std::thread::spawn(move || {
            use std::io::Read;
            let mut buf = [0u8; 8192];
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let mut s = fed.lock().unwrap();
                s.0.process(&buf[..n]);
                s.1.extend_from_slice(&buf[..n]);
            }
        });
        Pty {
            child,
            master,
            screen,
        }
    }

    fn contents(&self) -> String {
        self.screen.lock().unwrap().0.screen().contents()
    }

    fn bytes(&self) -> Vec<u8> {
        self.screen.lock().unwrap().1.clone()
    }

    fn keys(&mut self, keys: &str) {
        use std::io::Write;
        self.master.write_all(keys.as_bytes()).unwrap();
    }

    /// Whether the line that shows `line` counts down: two different
    /// times left, seconds apart; the screen if not.
    fn counts_down(&self, line: &str) -> Result<(), String> {
        let left = |s: &str| {
            s.lines()
                .find(|l| l.contains(line))
                .and_then(|l| l.split(" in ").nth(1))
                .map(|t| t.split_whitespace().next().unwrap_or("").to_string())
        };
        let first = left(&self.contents()).ok_or_else(|| self.contents())?;
        std::thread::sleep(Duration::from_millis(2100));
        let then = left(&self.contents()).unwrap_or_default();
        if first == then {
            return Err(format!(
                "no countdown: {first} then {then}\n{}",
                self.contents()
            ));
        }
        Ok(())
    }

    /// Whether `top` quits within 10 s (killed if not), the service
    /// stopped either way.
    fn quit_then_stop(&mut self, service: &mut std::process::Child) -> bool {
        let quit = util::wait_until(Duration::from_secs(10), || {
            self.child.try_wait().ok().flatten().is_some()
        });
        let _ = stop(service);
        if !quit {
            let _ = self.child.kill();
        }
        quit
    }

    /// Waits until the screen shows `text`; the screen if it never does.
    fn shows(&self, text: &str, limit: Duration) -> Result<(), String> {
        if util::wait_until(limit, || self.contents().contains(text)) {
            Ok(())
        } else {
            Err(self.contents())
        }
    }
}

/// `top` in a real pseudo-terminal attached to a running service
/// (issue 43): a stray appears with its termination waiting and a live
/// countdown, is terminated at its deadline (a real process, really
/// signalled), and is gone from what waits, in the recent actions; `q`
/// quits and the terminal is put back (the alternate screen left).
#[test]
fn top_shows_a_stray_waiting_with_its_countdown_then_gone_after_the_action() {
    let (mut h, stray, _) = a_stray_beside_alices_job();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("view.sock");
    let mut service = h
        .command(Path::new(env!("CARGO_BIN_EXE_genv-enforce")))
        .args([
            "enforce",
            "--interval",
            "1s",
            "--non-env-processes",
            "--grace",
            "8s",
            "--view-socket",
            socket.to_str().unwrap(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut top = h.command(Path::new(env!("CARGO_BIN_EXE_genv-enforce")));
    top.args(["top", "--connect", socket.to_str().unwrap()])
        .env_remove("NO_COLOR");
    let mut top = Pty::spawn(top, 120, 30);
    let waited = (|| {
        top.shows("1 fleet", Duration::from_secs(20))?;
        // The stray's GPU waits on its action, alice's is in her environment.
        top.shows(" We ", Duration::from_secs(20))?;
        top.keys("3");
        let line = format!("terminate pid {stray}");
        top.shows(&line, Duration::from_secs(10))?;
        top.counts_down(&line)?;
        Ok::<(), String>(())
    })();
    let signalled = h.wait_signal(stray, Duration::from_secs(20));
    let after = (|| {
        top.shows("0 rows", Duration::from_secs(10))?;
        top.keys("4");
        top.shows(&format!("terminate pid {stray}"), Duration::from_secs(10))?;
        top.keys("q");
        Ok::<(), String>(())
    })();
    let quit = top.quit_then_stop(&mut service);
    waited.unwrap_or_else(|s| panic!("before the action:\n{s}"));
    assert_eq!(signalled, Some(SIGTERM));
    after.unwrap_or_else(|s| panic!("after the action:\n{s}"));
    assert!(quit, "q did not quit:\n{}", top.contents());
    let status = top.child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    let bytes = top.bytes();
    let text = String::from_utf8_lossy(&bytes);
    assert!(
        text.contains("\u{1b}[?1049h"),
        "the alternate screen was entered"
    );
    assert!(text.contains("\u{1b}[?1049l"), "and left");
}

/// `top` in a real pseudo-terminal attached to a service that enforces
/// on the sshd fleet (issue 43): each GPU at a glance (alice's working
/// one, carol's working one and the one she holds idle), then a stray of
/// bob's appears, waits with a live countdown, is terminated at its
/// deadline (really signalled on its host) and is gone from what waits,
/// in the service's recent actions; each user against the cap, carol's
/// idle GPU counted; `q` quits.
#[test]
fn top_on_the_sshd_fleet_sees_a_stray_appear_wait_with_its_countdown_and_go() {
    let Some(mut f) = util::fleet::Fleet::up(2) else {
        return;
    };
    let alice = f.host(0).spawn_as("alice", Some("a"));
    f.host(0)
        .write_envs(&[env("a", Some("alice"), None, alice)]);
    f.host(0).write_devices(4, &[(1, "a")]);
    f.host(0).set_apps(&[(alice, 1, "100")]);
    let carol = f.host(1).spawn_as("carol", Some("c"));
    f.host(1)
        .write_envs(&[env("c", Some("carol"), None, carol)]);
    f.host(1).write_devices(4, &[(0, "c"), (2, "c")]);
    f.host(1).set_apps(&[(carol, 0, "100")]);
    let inventory = f.inventory(false, &[], "");
    let dir = util::private_dir();
    let socket = dir.path().join("view.sock");
    let mut service = f
        .command(&[
            "--inventory",
            inventory.to_str().unwrap(),
            "enforce",
            "--interval",
            "1s",
            "--non-env-processes",
            "--max-devices-per-user",
            "3",
            "--grace",
            "8s",
            "--view-socket",
            socket.to_str().unwrap(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut top = std::process::Command::new(env!("CARGO_BIN_EXE_genv-enforce"));
    top.args(["top", "--connect", socket.to_str().unwrap()])
        .env_remove("NO_COLOR");
    let mut top = Pty::spawn(top, 120, 30);
    let mut stray = 0;
    let waited = (|| {
        // h1: alice works on GPU 1; h2: carol works on GPU 0 and holds 2 idle.
        top.shows(".e..", Duration::from_secs(30))?;
        top.shows("e.i.", Duration::from_secs(10))?;
        top.shows("attached to", Duration::from_secs(5))?;
        // A stray of bob's appears on h2's GPU 3.
        stray = f.host(1).spawn_as("bob", None);
        f.host(1).set_apps(&[(carol, 0, "100"), (stray, 3, "100")]);
        top.shows("e.iW", Duration::from_secs(10))?;
        // GENV_ENFORCE_CAPTURE=FILE keeps the fleet tab's screen, h2's
        // detail open (the README's picture).
        if let Some(to) = std::env::var_os("GENV_ENFORCE_CAPTURE") {
            top.keys("j\r");
            top.shows("gpu 3: an action waits on it", Duration::from_secs(5))?;
            std::fs::write(to, top.contents()).unwrap();
            top.keys("\u{1b}");
        }
        top.keys("3");
        let line = format!("terminate pid {stray}");
        top.shows(&line, Duration::from_secs(10))?;
        top.counts_down(&line)?;
        // carol against the cap: 2 of 3, one of them held idle.
        top.keys("2");
        top.shows("2/3 (1i)", Duration::from_secs(5))?;
        top.keys("3");
        Ok::<(), String>(())
    })();
    let signalled = (stray != 0).then(|| f.host(1).wait_signal(stray, Duration::from_secs(30)));
    // Ended, nvidia-smi lists it no more.
    f.host(1).set_apps(&[(carol, 0, "100")]);
    let after = (|| {
        top.shows("0 rows", Duration::from_secs(10))?;
        top.keys("4");
        top.shows(&format!("terminate pid {stray}"), Duration::from_secs(10))?;
        top.shows("signalled", Duration::from_secs(5))?;
        top.keys("1");
        top.shows("e.i.", Duration::from_secs(10))?;
        top.keys("q");
        Ok::<(), String>(())
    })();
    let quit = top.quit_then_stop(&mut service);
    waited.unwrap_or_else(|s| panic!("before the action:\n{s}"));
    assert_eq!(signalled, Some(Some(SIGTERM)));
    assert!(f.host(0).running(alice) && f.host(1).running(carol));
    after.unwrap_or_else(|s| panic!("after the action:\n{s}"));
    assert!(quit, "q did not quit:\n{}", top.contents());
    assert!(top.child.wait().unwrap().success());
}

/// `top` with no service to attach to runs dry-run cycles of its own
/// from the service's configuration file (its hosts on the sshd fleet,
/// its rules and policy), says so on screen and acts on nothing, nor
/// writes the service's audit log; once the service answers on the
/// socket, it attaches to it.
#[test]
fn top_with_no_service_looks_by_itself_acting_on_nothing_then_attaches() {
    let Some(mut f) = util::fleet::Fleet::up(1) else {
        return;
    };
    let stray = f.host(0).spawn_as("bob", None);
    f.host(0).write_envs(&[]);
    f.host(0).write_devices(4, &[]);
    f.host(0).set_apps(&[(stray, 2, "100")]);
    let inventory = f.inventory(false, &[], "");
    let dir = util::private_dir();
    let socket = dir.path().join("view.sock");
    let audit = dir.path().join("audit.log");
    let config = dir.path().join("genv-enforce.toml");
    std::fs::write(
        &config,
        format!(
            "[hosts]\ninventory = \"{}\"\nknown-hosts-file = \"{}\"\n\
             [rules]\nnon-env-processes = true\n\
             [policy]\ninterval = \"1s\"\ngrace = \"2s\"\n\
             [state]\naudit-log = \"{}\"\n\
             [metrics]\nview-socket = \"{}\"\n",
            inventory.display(),
            f.dir.path().join("known_hosts").display(),
            audit.display(),
            socket.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o600)).unwrap();
    // The service ran before (its known_hosts holds the host's key): a
    // look trusts no new key.
    let before = f.ours(&["enforce", "--interval", "0", "--dry-run"]);
    assert!(
        matches!(before.status.code(), Some(0 | 3)),
        "{}",
        stderr(&before)
    );
    let bin = env!("CARGO_BIN_EXE_genv-enforce");
    let mut top = std::process::Command::new(bin);
    top.args([
        "--config",
        config.to_str().unwrap(),
        "top",
        "--connect",
        socket.to_str().unwrap(),
    ]);
    let mut top = Pty::spawn(top, 160, 30);
    let looked = (|| {
        top.shows("TOP'S OWN DRY RUN", Duration::from_secs(30))?;
        top.shows("h1", Duration::from_secs(5))?;
        top.keys("4");
        // Past its grace, its termination is a dry run's, again and again.
        top.shows("dry run", Duration::from_secs(15))?;
        top.keys("1");
        Ok::<(), String>(())
    })();
    let acted_on = !f.host(0).running(stray);
    let audited = audit.exists();
    let mut service = std::process::Command::new(bin)
        .args(["--config", config.to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let attached = (|| {
        top.shows("attached to", Duration::from_secs(30))?;
        if util::wait_until(Duration::from_secs(10), || {
            !top.contents().contains("TOP'S OWN")
        }) {
            Ok(())
        } else {
            Err(top.contents())
        }
    })();
    let signalled = f.host(0).wait_signal(stray, Duration::from_secs(30));
    top.keys("q");
    let quit = top.quit_then_stop(&mut service);
    looked.unwrap_or_else(|s| panic!("no look of its own:\n{s}"));
    assert!(!acted_on, "its own cycles acted");
    assert!(!audited, "its own cycles wrote the service's audit log");
    attached.unwrap_or_else(|s| panic!("not attached to the service:\n{s}"));
    assert_eq!(signalled, Some(SIGTERM), "the service acts");
    assert!(quit, "q did not quit:\n{}", top.contents());
}

/// Another user's `top`, with a configuration of their own, facing the
/// service's socket it may not read (root's, 0600): no cycles of its own
/// (that is no reason to sweep the fleet), and it says why.
#[test]
fn another_users_top_facing_roots_socket_says_so_and_looks_at_nothing() {
    if !util::prerequisite(
        rustix::process::geteuid().is_root(),
        "another user's top needs root to run as that user",
    ) {
        return;
    }
    let (h, _, _) = a_stray_beside_alices_job();
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let socket = dir.path().join("view.sock");
    let mut service = h
        .command(Path::new(env!("CARGO_BIN_EXE_genv-enforce")))
        .args([
            "enforce",
            "--interval",
            "1m",
            "--view-socket",
            socket.to_str().unwrap(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (uid, gid) = util::ensure_user("bob");
    let his = tempfile::tempdir().unwrap();
    std::os::unix::fs::chown(his.path(), Some(uid), Some(gid)).unwrap();
    std::fs::set_permissions(his.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let config = his.path().join("mine.toml");
    std::fs::write(
        &config,
        format!(
            "[hosts]\nsnapshot-dir = \"{}\"\n",
            util::repo().join("fixtures/snapshots").display()
        ),
    )
    .unwrap();
    std::os::unix::fs::chown(&config, Some(uid), Some(gid)).unwrap();
    std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert!(util::wait_until(Duration::from_secs(20), || socket.exists()));
    let mut top = std::process::Command::new(env!("CARGO_BIN_EXE_genv-enforce"));
    top.args([
        "--config",
        config.to_str().unwrap(),
        "top",
        "--connect",
        socket.to_str().unwrap(),
    ]);
    std::os::unix::process::CommandExt::uid(&mut top, uid);
    std::os::unix::process::CommandExt::gid(&mut top, gid);
    let mut top = Pty::spawn(top, 200, 20);
    let said = top.shows("you may not read it", Duration::from_secs(20));
    std::thread::sleep(Duration::from_secs(2));
    let screen = top.contents();
    top.keys("q");
    let quit = top.quit_then_stop(&mut service);
    said.unwrap_or_else(|s| panic!("not said:\n{s}"));
    assert!(!screen.contains("TOP'S OWN"), "{screen}");
    assert!(!screen.contains("cycle 1"), "no view at all: {screen}");
    assert!(quit);
}
