//! Regressions of issue 14: nothing one user writes or runs gets another
//! user's job killed, takes their own devices out of their count, or
//! stalls the enforcer; a job whose genv record is gone is left alone.
//! One test per row of the issue's table, with real processes of real
//! users, on this machine and (where the row applies) through real sshd;
//! each failed on 1a75ad2.

mod util;

use std::path::Path;
use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use util::fleet::Fleet;
use util::{env, lines, Host};

const SIGTERM: i32 = 15;

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Where a row runs: this machine, or host 1 of a fleet.
enum Place {
    Local(Host),
    Fleet(Fleet),
}

impl Place {
    fn local() -> Place {
        Place::Local(Host::new(4))
    }

    fn fleet() -> Option<Place> {
        Fleet::up(1).map(Place::Fleet)
    }

    fn host(&mut self) -> &mut Host {
        match self {
            Place::Local(h) => h,
            Place::Fleet(f) => f.host(0),
        }
    }

    /// `enforce --interval 0 <flags>` here.
    fn enforce(&self, flags: &[&str]) -> Output {
        let mut args = vec!["enforce", "--interval", "0"];
        args.extend_from_slice(flags);
        match self {
            Place::Local(h) => h.ours(&args),
            Place::Fleet(f) => f.ours(&args),
        }
    }

    /// How genv's lines name this host.
    fn prefix(&self) -> String {
        match self {
            Place::Local(_) => String::new(),
            Place::Fleet(f) => format!("[{}] ", f.names[0]),
        }
    }

    /// " on 1 hosts" in remote mode, as genv words the cap.
    fn on_hosts(&self) -> &'static str {
        match self {
            Place::Local(_) => "",
            Place::Fleet(_) => " on 1 hosts",
        }
    }

    /// What a run says of `user`'s `count` devices, `over` the cap, and
    /// the detaches of `eid` from `devices`.
    fn capped(&self, user: &str, count: u32, over: u32, eid: &str, devices: &[u32]) -> Vec<String> {
        let mut said = vec![format!(
            "User {user} is using {count} devices{} which is {over} more than the maximum allowed",
            self.on_hosts()
        )];
        said.extend(devices.iter().map(|d| {
            format!(
                "{}Detaching environment {eid} of user {user} from device {d}",
                self.prefix()
            )
        }));
        said
    }
}

/// The job is still running a moment after the run (a SIGTERM has had time
/// to land).
fn alive(p: &mut Place, pid: u32) -> bool {
    p.host()
        .wait_signal(pid, Duration::from_millis(300))
        .is_none()
        && p.host().running(pid)
}

// Row 1: a `nohup` job outlives its shell; genv's load-time clean-up drops
// its environment's record; the job runs on with its id.

fn orphaned_job_is_left_alone(mut p: Place) {
    let shell = p.host().spawn_as("alice", None);
    let job = p.host().spawn_as("alice", Some("4100"));
    p.host().set_apps(&[(job, 0, "100")]);
    p.host()
        .write_envs(&[env("4100", Some("alice"), None, shell)]);
    p.host().write_devices(4, &[(0, "4100")]);
    p.host().end(shell);
    for flags in [&[][..], &["--non-env-processes"][..]] {
        let out = p.enforce(flags);
        assert!(out.status.success(), "{flags:?}: {}", stderr(&out));
        assert!(lines(&out).is_empty(), "{flags:?}: {:?}", lines(&out));
        assert!(
            stderr(&out).contains(&format!(
                "{}[WARNING] Process {job} (user alice) on GPU(s) 0 carries environment 4100, which does not exist (its record is gone): it is left alone",
                p.prefix()
            )),
            "{}",
            stderr(&out)
        );
        assert!(alive(&mut p, job), "{flags:?}: the orphaned job was killed");
    }
}

#[test]
fn row1_an_orphaned_job_is_left_alone_locally() {
    orphaned_job_is_left_alone(Place::local());
}

#[test]
fn row1_an_orphaned_job_is_left_alone_on_a_fleet_host() {
    if let Some(p) = Place::fleet() {
        orphaned_job_is_left_alone(p);
    }
}

// Row 1, continued: once orphaned, a job stays a stray for life; a record
// that appears later with its id (bob's, listing pid 1 to stay alive, and
// attached nowhere) does not make it a member to be terminated.

fn a_reappearing_record_does_not_reclaim_an_orphan(mut p: Place) {
    let shell = p.host().spawn_as("alice", None);
    let job = p.host().spawn_as("alice", Some("4100"));
    p.host().set_apps(&[(job, 0, "100")]);
    p.host()
        .write_envs(&[env("4100", Some("alice"), None, shell)]);
    p.host().write_devices(4, &[(0, "4100")]);
    p.host().end(shell);
    let mut args = vec!["enforce", "--interval", "300ms", "--output", "json"];
    let mut child = match &p {
        Place::Local(h) => h
            .command(Path::new(env!("CARGO_BIN_EXE_genv-enforce")))
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
        Place::Fleet(f) => {
            let hosts = f.names.join(",");
            args.splice(0..0, ["-H", hosts.as_str()]);
            f.command(&args)
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .unwrap()
        }
    };
    let mut cycles = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
    let mut next = || -> Value { serde_json::from_str(&cycles.next().unwrap().unwrap()).unwrap() };
    let first = next();
    assert_eq!(first["notices"][0]["why"], "orphaned", "{first}");
    // bob's record with her job's id.
    let mut forged = env("4100", Some("bob"), None, 1);
    forged["pids"] = json!([1]);
    p.host().write_envs(&[forged]);
    let mut reclaimed = None;
    for _ in 0..4 {
        let c = next();
        assert!(c["plan"]["hosts"].as_array().unwrap().is_empty(), "{c}");
        if c["notices"][0]["why"] == "reclaimed" {
            reclaimed = Some(c);
        }
    }
    rustix::process::kill_process(
        rustix::process::Pid::from_child(&child),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    let _ = child.wait();
    assert!(reclaimed.is_some(), "the reappeared record was never seen");
    assert!(alive(&mut p, job), "the orphaned job was killed");
}

#[test]
fn row1_a_reappearing_record_does_not_reclaim_an_orphan_locally() {
    a_reappearing_record_does_not_reclaim_an_orphan(Place::local());
}

#[test]
fn row1_a_reappearing_record_does_not_reclaim_an_orphan_on_a_fleet_host() {
    if let Some(p) = Place::fleet() {
        a_reappearing_record_does_not_reclaim_an_orphan(p);
    }
}

// Row 2: bob empties envs.json (anyone may write it).

fn emptied_envs_kill_nobody(mut p: Place) {
    let mut jobs = Vec::new();
    let mut envs = Vec::new();
    let mut attached = Vec::new();
    for (i, user) in ["alice", "carol"].into_iter().enumerate() {
        let shell = p.host().spawn_as(user, None);
        let eid = format!("{user}-env");
        let job = p.host().spawn_as(user, Some(&eid));
        jobs.push((job, i as u32));
        envs.push(env(&eid, Some(user), None, shell));
        attached.push((i as u32, eid));
    }
    p.host().set_apps(
        &jobs
            .iter()
            .map(|(j, d)| (*j, *d, "100"))
            .collect::<Vec<_>>(),
    );
    p.host().write_envs(&envs);
    let attached: Vec<(u32, &str)> = attached.iter().map(|(d, e)| (*d, e.as_str())).collect();
    p.host().write_devices(4, &attached);
    // bob's edit.
    let bob = util::ensure_user("bob");
    std::fs::write(p.host().state_dir().join("envs.json"), "{\"envs\": []}").unwrap();
    std::os::unix::fs::chown(
        p.host().state_dir().join("envs.json"),
        Some(bob.0),
        Some(bob.1),
    )
    .unwrap();
    let out = p.enforce(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(lines(&out).is_empty(), "{:?}", lines(&out));
    for (job, _) in jobs {
        assert!(alive(&mut p, job), "job {job} was killed");
    }
}

#[test]
fn row2_an_emptied_envs_json_kills_nobody_locally() {
    emptied_envs_kill_nobody(Place::local());
}

#[test]
fn row2_an_emptied_envs_json_kills_nobody_on_a_fleet_host() {
    if let Some(p) = Place::fleet() {
        emptied_envs_kill_nobody(p);
    }
}

// Row 3: bob's own record lists alice's GPU job (genv lists the activating
// shell, never the job) and is attached to three devices.

fn a_record_listing_her_job_counts_toward_bob(mut p: Place) {
    let shell = p.host().spawn_as("alice", None);
    let job = p.host().spawn_as("alice", Some("a"));
    let bob_shell = p.host().spawn_as("bob", None);
    p.host().set_apps(&[(job, 0, "100")]);
    let mut forged = env("b", Some("bob"), None, bob_shell);
    forged["pids"] = json!([job]);
    p.host()
        .write_envs(&[env("a", Some("alice"), None, shell), forged]);
    p.host()
        .write_devices(4, &[(0, "a"), (1, "b"), (2, "b"), (3, "b")]);
    let out = p.enforce(&["--max-devices-per-user", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(lines(&out), p.capped("bob", 3, 1, "b", &[1]));
    assert!(alive(&mut p, job), "alice's job was killed");
    assert_eq!(p.host().attached(0), vec!["a"]);
}

#[test]
fn row3_a_record_listing_alices_job_counts_toward_its_writer_locally() {
    a_record_listing_her_job_counts_toward_bob(Place::local());
}

#[test]
fn row3_a_record_listing_alices_job_counts_toward_its_writer_on_a_fleet_host() {
    if let Some(p) = Place::fleet() {
        a_record_listing_her_job_counts_toward_bob(p);
    }
}

// Row 4: bob starts a job with alice's id (readable in envs.json) on her
// device; the environment goes over its gpu_memory.

fn a_borrowed_id_gets_nobody_killed(mut p: Place) {
    let shell = p.host().spawn_as("alice", None);
    // bob's job after hers in genv's (CPython set) order of the pids, so
    // that genv's greedy choice takes hers first. Both are drawn again
    // until it is so: no pid of bob's comes after a pid in slot 7.
    let (job, bob_job) = (0..64)
        .find_map(|_| {
            let a = p.host().spawn_as("alice", Some("a"));
            let b = p.host().spawn_as("bob", Some("a"));
            if genv_enforce::snapshot::pyset::set_order(&[a, b])[0] == a {
                return Some((a, b));
            }
            p.host().end(a);
            p.host().end(b);
            None
        })
        .expect("64 draws of two pids, none in the order wanted");
    p.host().set_apps(&[(job, 0, "1000"), (bob_job, 0, "1000")]);
    p.host()
        .write_envs(&[env("a", Some("alice"), Some("1gi"), shell)]);
    p.host().write_devices(4, &[(0, "a")]);
    let out = p.enforce(&[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(lines(&out).is_empty(), "{:?}", lines(&out));
    let err = stderr(&out);
    for (pid, user) in [(job, "alice"), (bob_job, "bob")] {
        assert!(
            err.contains(&format!(
                "{}[WARNING] Process {pid} (user {user}) on GPU(s) 0 carries environment a, which processes of several users carry (alice, bob): it is nobody's: it is left alone",
                p.prefix()
            )),
            "{err}"
        );
    }
    assert!(alive(&mut p, job), "alice's job was killed");
    assert!(alive(&mut p, bob_job));
}

#[test]
fn row4_a_borrowed_id_never_gets_the_owners_job_killed_locally() {
    a_borrowed_id_gets_nobody_killed(Place::local());
}

#[test]
fn row4_a_borrowed_id_never_gets_the_owners_job_killed_on_a_fleet_host() {
    if let Some(p) = Place::fleet() {
        a_borrowed_id_gets_nobody_killed(p);
    }
}

// Row 5: bob lists pid 1 (root's) in his own record.

fn listing_pid_one_keeps_bobs_devices_his(mut p: Place) {
    let shell = p.host().spawn_as("bob", None);
    let job = p.host().spawn_as("bob", Some("b"));
    p.host().set_apps(&[(job, 0, "100")]);
    let mut b = env("b", Some("bob"), None, shell);
    b["pids"] = json!([shell, 1]);
    p.host().write_envs(&[b]);
    p.host()
        .write_devices(4, &[(0, "b"), (1, "b"), (2, "b"), (3, "b")]);
    let out = p.enforce(&["--max-devices-per-user", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(lines(&out), p.capped("bob", 4, 3, "b", &[1, 2, 3]));
    for d in 1..4 {
        assert_eq!(p.host().attached(d), Vec::<String>::new());
    }
    assert_eq!(p.host().attached(0), vec!["b"]);
}

#[test]
fn row5_listing_root_s_pid_keeps_the_writers_devices_in_his_count_locally() {
    listing_pid_one_keeps_bobs_devices_his(Place::local());
}

#[test]
fn row5_listing_root_s_pid_keeps_the_writers_devices_in_his_count_on_a_fleet_host() {
    if let Some(p) = Place::fleet() {
        listing_pid_one_keeps_bobs_devices_his(p);
    }
}

// Row 9: bob attaches alice's environment to three spare devices (anyone
// can write devices.json).

fn spare_attachments_go_first(mut p: Place) {
    let shell = p.host().spawn_as("alice", None);
    let job = p.host().spawn_as("alice", Some("a"));
    p.host().set_apps(&[(job, 0, "100")]);
    p.host().write_envs(&[env("a", Some("alice"), None, shell)]);
    p.host()
        .write_devices(4, &[(0, "a"), (1, "a"), (2, "a"), (3, "a")]);
    let out = p.enforce(&["--max-devices-per-user", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(lines(&out), p.capped("alice", 4, 2, "a", &[1, 2]));
    assert!(alive(&mut p, job), "alice's job was killed");
    assert_eq!(p.host().attached(0), vec!["a"]);
    assert_eq!(p.host().attached(3), vec!["a"]);
}

#[test]
fn row9_spare_attachments_of_her_env_go_before_her_working_device_locally() {
    spare_attachments_go_first(Place::local());
}

#[test]
fn row9_spare_attachments_of_her_env_go_before_her_working_device_on_a_fleet_host() {
    if let Some(p) = Place::fleet() {
        spare_attachments_go_first(p);
    }
}

// Row 9 again: alice also runs a job outside genv (no id) on device 1,
// where bob attached her environment: that device is still the spare one
// (no job of the environment runs there), not her working device 0.

fn a_job_outside_genv_never_shields_a_spare_attachment(mut p: Place) {
    let shell = p.host().spawn_as("alice", None);
    let job = p.host().spawn_as("alice", Some("a"));
    let plain = p.host().spawn_as("alice", None);
    p.host().set_apps(&[(job, 0, "100"), (plain, 1, "100")]);
    p.host().write_envs(&[env("a", Some("alice"), None, shell)]);
    p.host().write_devices(4, &[(0, "a"), (1, "a")]);
    let out = p.enforce(&["--max-devices-per-user", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(lines(&out), p.capped("alice", 2, 1, "a", &[1]));
    assert!(alive(&mut p, job), "alice's job was killed");
    assert!(alive(&mut p, plain), "alice's job outside genv was killed");
    assert_eq!(p.host().attached(0), vec!["a"]);
    assert!(p.host().attached(1).is_empty());
}

#[test]
fn row9_a_job_of_hers_outside_genv_never_shields_a_spare_attachment_locally() {
    a_job_outside_genv_never_shields_a_spare_attachment(Place::local());
}

#[test]
fn row9_a_job_of_hers_outside_genv_never_shields_a_spare_attachment_on_a_fleet_host() {
    if let Some(p) = Place::fleet() {
        a_job_outside_genv_never_shields_a_spare_attachment(p);
    }
}

// Row 8: an eid with terminal escapes, on the "already detached" path; and
// devices.json listing device 0 twice, the attachment in the second entry.

fn escapes_and_a_device_listed_twice(mut p: Place) {
    let eid = "e\u{1b}]0;pwned\u{7}\u{1b}[2J\r";
    let shell = p.host().spawn_as("alice", None);
    let job = p.host().spawn_as("alice", Some(eid));
    p.host().set_apps(&[(job, 0, "100"), (job, 1, "100")]);
    p.host().write_envs(&[env(eid, Some("alice"), None, shell)]);
    p.host().write_devices(4, &[(0, eid), (1, eid)]);
    // Someone detaches it between the snapshot and the detach.
    let state = p.host().state_dir();
    let devices = state.join("devices.json");
    let watched = devices.clone();
    p.host().answer_late();
    let user = util::after_read(&watched, move || {
        let mut d: Value =
            serde_json::from_str(&std::fs::read_to_string(&devices).unwrap()).unwrap();
        for dev in d["devices"].as_array_mut().unwrap() {
            dev["attachments"] = json!([]);
        }
        std::fs::write(&devices, d.to_string()).unwrap();
    });
    let out = p.enforce(&["--max-devices-per-user", "1"]);
    assert!(user.join().unwrap());
    let err = stderr(&out);
    assert!(err.contains("was already detached from device 0"), "{err}");
    for text in [&err, &String::from_utf8_lossy(&out.stdout).into_owned()] {
        assert!(
            !text.contains('\u{1b}') && !text.contains('\r') && !text.contains('\u{7}'),
            "{text:?}"
        );
    }
    // Device 0 listed twice; the attachment only in the second entry.
    let other = p.host().spawn_as("carol", Some("c"));
    let shell = p.host().spawn_as("carol", None);
    p.host().set_apps(&[(other, 3, "100")]);
    p.host().write_envs(&[env("c", Some("carol"), None, shell)]);
    let text = json!({"devices": [
        {"index": 0, "total_memory": "81559mi", "attachments": []},
        {"index": 3, "total_memory": "81559mi", "attachments": [{"eid": "c", "gpu_memory": null, "time": "t"}]},
        {"index": 0, "total_memory": "81559mi", "attachments": [{"eid": "c", "gpu_memory": null, "time": "t"}]},
    ]});
    std::fs::write(p.host().state_dir().join("devices.json"), text.to_string()).unwrap();
    let out = p.enforce(&["--max-devices-per-user", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(lines(&out), p.capped("carol", 2, 1, "c", &[0]));
    let after: Value = serde_json::from_str(
        &std::fs::read_to_string(p.host().state_dir().join("devices.json")).unwrap(),
    )
    .unwrap();
    for dev in after["devices"].as_array().unwrap() {
        if dev["index"] == 0 {
            assert_eq!(dev["attachments"], json!([]), "{after}");
        }
    }
    assert!(alive(&mut p, other));
}

#[test]
fn row8_escapes_are_escaped_and_a_device_listed_twice_is_detached_whole_locally() {
    escapes_and_a_device_listed_twice(Place::local());
}

#[test]
fn row8_escapes_are_escaped_and_a_device_listed_twice_is_detached_whole_on_a_fleet_host() {
    if let Some(p) = Place::fleet() {
        escapes_and_a_device_listed_twice(p);
    }
}

#[test]
fn row8_user_text_is_escaped_on_every_output_path() {
    // An orphaned job whose id holds ESC, CR, LF and bytes that are not
    // UTF-8: stderr (text), stdout (JSON), the audit log and a doctor
    // report all carry it escaped.
    let mut h = Host::new(1);
    h.write_devices(1, &[]);
    h.write_envs(&[]);
    let eid = "x\u{1b}[31m\r\nforged line\u{9b}2J";
    let job = h.spawn_as("alice", Some(eid));
    h.set_apps(&[(job, 0, "100")]);
    let log = h.dir.path().join("audit.log");
    let log_arg = log.display().to_string();
    let raw =
        |text: &str| text.contains('\u{1b}') || text.contains('\r') || text.contains('\u{9b}');
    let text = h.ours(&["enforce", "--interval", "0", "--audit-log", &log_arg]);
    assert!(text.status.success(), "{}", stderr(&text));
    let err = stderr(&text);
    assert!(
        err.contains("carries environment x\\u{1b}[31m\\r\\nforged line\\u{9b}2J"),
        "{err}"
    );
    assert!(
        !raw(&err) && err.lines().all(|l| !l.starts_with("forged line")),
        "{err:?}"
    );
    let json = h.ours(&["enforce", "--interval", "0", "--output", "json"]);
    let out = String::from_utf8_lossy(&json.stdout).into_owned();
    assert!(!raw(&out) && out.lines().count() == 1, "{out:?}");
    let report: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["notices"][0]["eid"], eid);
    let audit = std::fs::read_to_string(&log).unwrap();
    assert!(!raw(&audit) && audit.lines().count() == 1, "{audit:?}");
    let line: Value = serde_json::from_str(&audit).unwrap();
    assert_eq!(
        (line["phase"].as_str(), line["eid"].as_str()),
        (Some("noticed"), Some(eid))
    );
    // Bytes that are not UTF-8 arrive as U+FFFD.
    h.end(job);
    let (uid, gid) = util::ensure_user("alice");
    let mut cmd = std::process::Command::new("sleep");
    cmd.arg("1000").env_remove("GENV_ENVIRONMENT_ID").env(
        "GENV_ENVIRONMENT_ID",
        <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(b"bad\xff\xfe\x1b[2J"),
    );
    std::os::unix::process::CommandExt::uid(&mut cmd, uid);
    std::os::unix::process::CommandExt::gid(&mut cmd, gid);
    let mut bad = cmd.spawn().unwrap();
    h.set_apps(&[(bad.id(), 0, "100")]);
    let text = h.ours(&["enforce", "--interval", "0", "--audit-log", &log_arg]);
    let json = h.ours(&["enforce", "--interval", "0", "--output", "json"]);
    let _ = bad.kill();
    let _ = bad.wait();
    let err = stderr(&text);
    assert!(
        err.contains("carries environment bad\u{fffd}\u{fffd}\\u{1b}[2J"),
        "{err}"
    );
    assert!(!raw(&err), "{err:?}");
    let out = String::from_utf8_lossy(&json.stdout).into_owned();
    assert!(!raw(&out), "{out:?}");
    let report: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["notices"][0]["eid"], "bad\u{fffd}\u{fffd}\u{1b}[2J");
    let audit = std::fs::read_to_string(&log).unwrap();
    assert!(!raw(&audit) && audit.lines().count() == 2, "{audit:?}");
    // The doctor report of this machine: the state dir named with an escape.
    let odd = h.dir.path().join("state\u{1b}[2J");
    std::fs::create_dir(&odd).unwrap();
    let doctor = h
        .command(Path::new(env!("CARGO_BIN_EXE_genv-enforce")))
        .env("GENV_TMPDIR", &odd)
        .arg("doctor")
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&doctor.stdout).into_owned();
    assert!(report.contains("state\\u{1b}[2J"), "{report}");
    assert!(!raw(&report), "{report:?}");
}

// Row 6: bob writes a large but valid state: 100k environments listing his
// shell, 100k attachments.

/// `n` environments of bob's listing `shell`, each attached to a device.
fn write_big_state(h: &Host, shell: u32, n: usize) {
    let envs: Vec<String> = (0..n)
        .map(|i| {
            format!(
                r#"{{"eid": "x{i}", "uid": 0, "creation": "", "username": "bob", "config": {{}}, "pids": [{shell}], "kernel_ids": []}}"#
            )
        })
        .collect();
    std::fs::write(
        h.state_dir().join("envs.json"),
        format!(r#"{{"envs": [{}]}}"#, envs.join(",")),
    )
    .unwrap();
    let attachments: Vec<String> = (0..n)
        .map(|i| format!(r#"{{"eid": "x{i}", "gpu_memory": null, "time": ""}}"#))
        .collect();
    std::fs::write(
        h.state_dir().join("devices.json"),
        format!(
            r#"{{"devices": [{{"index": 0, "total_memory": "1mi", "attachments": [{}]}}, {{"index": 1, "total_memory": "1mi", "attachments": []}}]}}"#,
            attachments.join(",")
        ),
    )
    .unwrap();
}

fn spawn_ours(h: &Host, args: &[&str]) -> Child {
    h.command(Path::new(env!("CARGO_BIN_EXE_genv-enforce")))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits for `child` at most `limit`, which it must not need.
fn finish_within(mut child: Child, limit: Duration) -> (Output, Duration) {
    let start = Instant::now();
    while start.elapsed() < limit {
        if child.try_wait().unwrap().is_some() {
            return (child.wait_with_output().unwrap(), start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    panic!("still running after {limit:?}; stderr: {}", stderr(&out));
}

#[test]
fn row6_a_huge_state_is_assessed_linearly_and_sigterm_ends_the_run_within_2s() {
    let mut h = Host::new(2);
    let shell = h.spawn_as("bob", None);
    let stray = h.spawn_as("bob", None);
    h.set_apps(&[(stray, 1, "100")]);
    write_big_state(&h, shell, 100_000);
    let flags = ["--non-env-processes", "--max-devices-per-user", "1"];
    // One cycle over it, and its violations enforced (bob is over his cap,
    // his stray terminated): no stall, no quadratic pass.
    let mut args = vec!["enforce", "--interval", "0", "--output", "json"];
    args.extend_from_slice(&flags);
    let out = h.ours(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["hosts"][0]["envs"], 100_000, "{}", report["hosts"]);
    assert_eq!(h.wait_signal(stray, Duration::from_secs(10)), Some(SIGTERM));
    eprintln!(
        "one cycle over 100k environments and attachments: {} ms",
        report["duration_ms"]
    );
    // Cycles back to back over it: a SIGTERM at any point ends the run
    // within 2 s, mid-cycle included.
    for delay in [300, 700, 1500] {
        let mut args = vec!["enforce", "--interval", "10ms", "--dry-run"];
        args.extend_from_slice(&flags);
        let child = spawn_ours(&h, &args);
        std::thread::sleep(Duration::from_millis(delay));
        let pid = rustix::process::Pid::from_child(&child);
        let sent = Instant::now();
        rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
        let (_, took) = finish_within(child, Duration::from_secs(60));
        let since = sent.elapsed().min(took);
        assert!(
            since < Duration::from_secs(2),
            "SIGTERM after {delay} ms took {since:?}"
        );
    }
}

#[test]
fn row6_one_hosts_huge_state_does_not_hold_up_the_others() {
    // Host 1's user wrote 300k environments (its parse takes seconds in a
    // debug build); host 2 answers 2 s after it (a slow sudo): host 2's
    // stray is terminated while host 1 is still being parsed, as the
    // audit log's order shows.
    let Some(mut f) = Fleet::up(2) else { return };
    let shell = f.host(0).spawn_as("bob", None);
    write_big_state(f.host(0), shell, 300_000);
    let stray1 = f.host(0).spawn_as("bob", None);
    f.host(0).set_apps(&[(stray1, 1, "100")]);
    let stray2 = f.host(1).spawn_as("bob", None);
    f.host(1).set_apps(&[(stray2, 0, "100")]);
    let slow = f.dir.path().join("h2/sbin/slow-sudo");
    util::write_executable(&slow, "#!/bin/sh\nsleep 2\nexec sudo \"$@\"\n");
    let inventory = f.inventory(false, &["", "sudo = \"/usr/local/sbin/slow-sudo -n\""], "");
    let log = f.dir.path().join("audit.log");
    let out = f
        .command(&[
            "--inventory",
            &inventory.display().to_string(),
            "--command-timeout",
            "60s",
            "enforce",
            "--interval",
            "0",
            "--non-env-processes",
            "--max-records",
            "1000000",
            "--audit-log",
            &log.display().to_string(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        f.host(0).wait_signal(stray1, Duration::from_secs(10)),
        Some(SIGTERM)
    );
    assert_eq!(
        f.host(1).wait_signal(stray2, Duration::from_secs(10)),
        Some(SIGTERM)
    );
    let lines: Vec<Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let at = |host: &str, phase: &str| {
        lines
            .iter()
            .position(|l| l["host"] == host && l["phase"] == phase)
            .unwrap_or_else(|| panic!("no {phase} line of {host}: {lines:?}"))
    };
    assert!(
        at("h2", "done") < at("h1", "decided"),
        "host 2 waited for host 1: {lines:#?}"
    );
}

#[test]
fn row6_a_state_over_max_records_degrades_its_host_naming_the_file_and_the_others_are_enforced() {
    let Some(mut f) = Fleet::up(2) else { return };
    let shell = f.host(0).spawn_as("bob", None);
    write_big_state(f.host(0), shell, 2000);
    let stray = f.host(1).spawn_as("bob", None);
    f.host(1).set_apps(&[(stray, 0, "100")]);
    let out = f.ours(&[
        "enforce",
        "--interval",
        "0",
        "--non-env-processes",
        "--max-records",
        "1000",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    // Both files are counted, and refused, on the host.
    assert!(
        err.contains(&format!(
            "[{}] [ERROR] genv's state cannot be used (/var/tmp/genv/devices.json: 2002 records (devices and attachments), more than the limit of 1000 (--max-records): refused; /var/tmp/genv/envs.json: 4000 records (environments, their pids and kernel ids), more than the limit of 1000 (--max-records): refused)",
            f.names[0]
        )),
        "{err}"
    );
    assert_eq!(
        f.host(1).wait_signal(stray, Duration::from_secs(10)),
        Some(SIGTERM)
    );
    // Locally the same, naming the file.
    let mut h = Host::new(1);
    let shell = h.spawn_as("bob", None);
    write_big_state(&h, shell, 2000);
    let out = h.ours(&["enforce", "--interval", "0", "--max-records", "1000"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("envs.json: 4000 records (environments, their pids and kernel ids), more than the limit of 1000 (--max-records): refused"),
        "{}",
        stderr(&out)
    );
}

// Row 10: envs.json nested 200k deep on a remote host.

/// The pids of our agent on fleet host `i` (in its pid namespace, as this
/// machine numbers them).
fn agents(f: &Fleet, i: usize) -> Vec<u32> {
    let ns = std::fs::read_link(format!("/proc/{}/ns/pid", f.hosts[i].ns.unwrap())).unwrap();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            let ours = std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok();
            comm.starts_with("python")
                && String::from_utf8_lossy(&cmdline).contains("genv-enforce-agent")
                && ours.as_ref() == Some(&ns)
        })
        .collect()
}

#[test]
fn row10_state_nested_too_deeply_degrades_its_host_without_a_traceback_or_restarts() {
    let Some(f) = Fleet::up(1) else { return };
    let deep = format!(
        "{{\"envs\": {}{}}}",
        "[".repeat(200_000),
        "]".repeat(200_000)
    );
    std::fs::write(f.hosts[0].state_dir().join("envs.json"), deep).unwrap();
    let hosts = f.names.join(",");
    let mut child = f
        .command(&[
            "-H",
            &hosts,
            "enforce",
            "--interval",
            "500ms",
            "--output",
            "json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
    let mut seen = Vec::new();
    for _ in 0..3 {
        let cycle: Value = serde_json::from_str(&out.next().unwrap().unwrap()).unwrap();
        let error = cycle["hosts"][0]["degraded"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(
            error.contains("/var/tmp/genv/envs.json: cannot parse: nested too deeply"),
            "{error}"
        );
        seen.push(agents(&f, 0));
    }
    rustix::process::kill_process(
        rustix::process::Pid::from_child(&child),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(!stderr(&out).contains("Traceback"), "{}", stderr(&out));
    // One agent, the same one every cycle: it answered, it did not die.
    assert_eq!(seen[0].len(), 1, "{seen:?}");
    assert!(
        seen.iter().all(|s| *s == seen[0]),
        "the agent was restarted: {seen:?}"
    );
}
