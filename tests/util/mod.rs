//! Shared harness for the integration tests: a fake GPU host on this
//! machine (fake nvidia-smi printing real-format CSV, its own genv state
//! directory, real `sleep` processes standing in for GPU jobs), and runners
//! for our binary and for the real genv 1.4.3.

#![allow(dead_code)]

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// The repository root.
/// A temporary directory only its owner may enter (0700), as
/// `--state-db` and the audit log want theirs.
pub fn private_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    dir
}

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The uuid of fake GPU `i`.
pub fn uuid(i: u32) -> String {
    format!("GPU-{i:08x}-1e2d-4c3b-9a8f-7e6d5c4b3a29")
}

pub mod admin_box;
pub mod fleet;
pub mod sink;

/// One fake GPU host: a directory with `gpu/` tables for the fake
/// nvidia-smi, `genv/` state and `bin/nvidia-smi`; processes it spawned.
pub struct Host {
    pub dir: Dir,
    jobs: Vec<Job>,
    /// For a fleet host: a process of its pid (and mount) namespace, as
    /// this machine numbers it; its jobs are started in there.
    pub ns: Option<u32>,
}

/// A process started on a host, and its pid as the host sees it.
struct Job {
    child: Child,
    pid: u32,
}

/// A host's directory: our own temporary one, or one the fleet made.
pub enum Dir {
    Temp(tempfile::TempDir),
    At(PathBuf),
}

impl Dir {
    pub fn path(&self) -> &Path {
        match self {
            Dir::Temp(t) => t.path(),
            Dir::At(p) => p,
        }
    }
}

impl Host {
    /// A host with `gpus` 80 GB GPUs, no processes and no genv state.
    pub fn new(gpus: u32) -> Host {
        Host::at(Dir::Temp(tempfile::tempdir().expect("tempdir")), gpus)
    }

    /// The same in an existing directory (a fleet host's).
    pub fn at(dir: Dir, gpus: u32) -> Host {
        for sub in ["bin", "gpu", "genv"] {
            std::fs::create_dir_all(dir.path().join(sub)).unwrap();
        }
        let mut table = String::from("index, uuid, memory.total\n");
        for i in 0..gpus {
            table.push_str(&format!("{i}, {}, 81559\n", uuid(i)));
        }
        std::fs::write(dir.path().join("gpu/gpus.csv"), table).unwrap();
        let wrapper = format!(
            "#!/bin/sh\nFAKE_GPU_DIR='{}' exec '{}' \"$@\"\n",
            dir.path().join("gpu").display(),
            repo().join("scripts/fake-nvidia-smi").display()
        );
        write_executable(&dir.path().join("bin/nvidia-smi"), &wrapper);
        let host = Host {
            dir,
            jobs: Vec::new(),
            ns: None,
        };
        host.set_apps(&[]);
        host
    }

    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("genv")
    }

    pub fn gpu_dir(&self) -> PathBuf {
        self.dir.path().join("gpu")
    }

    /// nvidia-smi lists the compute apps half a second late. The agent
    /// reads genv's state meanwhile, so what a test does once that is read
    /// ([`after_read`]) is done before the enforcer can decide anything.
    pub fn answer_late(&self) {
        write_executable(&self.gpu_dir().join("on-apps"), "#!/bin/sh\nsleep 0.5\n");
    }

    /// Starts a real process (`sleep`, as root) in environment `eid` (or none).
    pub fn spawn(&mut self, eid: Option<&str>) -> u32 {
        self.spawn_as("root", eid)
    }

    /// Starts a real process (`sleep`) as `user` (created if missing) in
    /// environment `eid` (or none), as a job of that user would run; its
    /// pid as the host sees it.
    pub fn spawn_as(&mut self, user: &str, eid: Option<&str>) -> u32 {
        self.start(user, eid, &["sleep", "1000"])
    }

    /// Starts `argv` on the host as `user` in environment `eid` (or none);
    /// its pid as the host sees it.
    pub fn start(&mut self, user: &str, eid: Option<&str>, argv: &[&str]) -> u32 {
        let (uid, gid) = ensure_user(user);
        let mut cmd = match self.ns {
            // In the host's namespaces, as the user: the shell prints its
            // pid there, then becomes the job.
            Some(ns) => {
                let mut cmd = Command::new("nsenter");
                cmd.args(["--target", &ns.to_string(), "--mount", "--pid", "--"]);
                if uid != 0 {
                    cmd.args([
                        "setpriv",
                        &format!("--reuid={uid}"),
                        &format!("--regid={gid}"),
                        "--clear-groups",
                        "--",
                    ]);
                }
                cmd.args(["sh", "-c", "echo $$; exec \"$@\"", "job"])
                    .args(argv)
                    .stdout(Stdio::piped());
                cmd
            }
            None => {
                let mut cmd = Command::new(argv[0]);
                cmd.args(&argv[1..]);
                if uid != 0 {
                    std::os::unix::process::CommandExt::uid(&mut cmd, uid);
                    std::os::unix::process::CommandExt::gid(&mut cmd, gid);
                }
                cmd
            }
        };
        cmd.env_remove("GENV_ENVIRONMENT_ID").stdin(Stdio::null());
        if let Some(e) = eid {
            cmd.env("GENV_ENVIRONMENT_ID", e);
        }
        let mut child = cmd.spawn().expect("spawn a job");
        let pid = match child.stdout.take() {
            Some(out) => {
                let mut line = String::new();
                std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line).unwrap();
                line.trim()
                    .parse()
                    .unwrap_or_else(|_| panic!("no pid from the host's job: {line:?}"))
            }
            None => child.id(),
        };
        self.jobs.push(Job { child, pid });
        pid
    }

    /// Two processes in `eid` whose pids sit in distinct slots of CPython's
    /// 8-slot set table, in the order genv's `set(pids)` gives them whatever
    /// nvidia-smi's line order.
    pub fn spawn_pair_in_set_order(&mut self, user: &str, eid: &str) -> (u32, u32) {
        let first = self.spawn_as(user, Some(eid));
        let second = (0..64)
            .find_map(|_| {
                let p = self.spawn_as(user, Some(eid));
                if p % 8 != first % 8 {
                    return Some(p);
                }
                self.end(p);
                None
            })
            .expect("64 pids, all in the first one's slot");
        let order = genv_enforce::snapshot::pyset::set_order(&[first, second]);
        (order[0], order[1])
    }

    /// What nvidia-smi reports: (pid, gpu index, used MiB or `[N/A]`).
    pub fn set_apps(&self, apps: &[(u32, u32, &str)]) {
        let mut table = String::from("gpu_uuid, pid, used_gpu_memory\n");
        for (pid, gpu, mem) in apps {
            table.push_str(&format!("{}, {pid}, {mem}\n", uuid(*gpu)));
        }
        std::fs::write(self.gpu_dir().join("apps.csv"), table).unwrap();
    }

    /// Writes `envs.json` as genv does.
    pub fn write_envs(&self, envs: &[Value]) {
        let text = serde_json::to_string_pretty(&json!({ "envs": envs })).unwrap();
        std::fs::write(self.state_dir().join("envs.json"), text).unwrap();
    }

    /// Writes `devices.json` with `n` devices and `(device, eid)` attachments.
    pub fn write_devices(&self, n: u32, attachments: &[(u32, &str)]) {
        let devices: Vec<Value> = (0..n)
            .map(|i| {
                let a: Vec<Value> = attachments
                    .iter()
                    .filter(|(d, _)| *d == i)
                    .map(|(_, e)| json!({"eid": e, "gpu_memory": null, "time": "22/11/2026 15:04:06"}))
                    .collect();
                json!({"index": i, "total_memory": "81559mi", "attachments": a})
            })
            .collect();
        let text = serde_json::to_string_pretty(&json!({ "devices": devices })).unwrap();
        std::fs::write(self.state_dir().join("devices.json"), text).unwrap();
    }

    pub fn read_devices(&self) -> Value {
        serde_json::from_str(
            &std::fs::read_to_string(self.state_dir().join("devices.json")).unwrap(),
        )
        .unwrap()
    }

    /// The eids attached to device `i`.
    pub fn attached(&self, i: u32) -> Vec<String> {
        let d = self.read_devices();
        d["devices"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["index"] == i)
            .map(|d| {
                d["attachments"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|a| a["eid"].as_str().unwrap().to_string())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// `program` with this host's PATH (fake nvidia-smi first) and GENV_TMPDIR.
    pub fn command(&self, program: &Path) -> Command {
        let mut cmd = Command::new(program);
        let path = format!(
            "{}:{}",
            self.dir.path().join("bin").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        cmd.env("PATH", path)
            .env("GENV_TMPDIR", self.state_dir())
            .env_remove("GENV_ENVIRONMENT_ID")
            .stdin(Stdio::null());
        cmd
    }

    /// Runs our binary against this host.
    pub fn ours(&self, args: &[&str]) -> Output {
        self.command(Path::new(env!("CARGO_BIN_EXE_genv-enforce")))
            .args(args)
            .output()
            .expect("run genv-enforce")
    }

    /// Runs the real genv against this host, never letting it kill.
    pub fn genv(&self, args: &[&str]) -> Output {
        self.command(&genv_bin())
            .args(args)
            .env("GENV_TERMINATE_PROCESSES", "0")
            .output()
            .expect("run genv")
    }

    /// Waits for a spawned process to end; the signal that ended it
    /// (`nsenter` reports its job's signal as 128 + the signal).
    pub fn wait_signal(&mut self, pid: u32, timeout: Duration) -> Option<i32> {
        let job = self.jobs.iter_mut().find(|j| j.pid == pid)?;
        let start = Instant::now();
        while start.elapsed() < timeout {
            if let Some(status) = job.child.try_wait().unwrap() {
                return status
                    .signal()
                    .or_else(|| status.code().filter(|c| *c > 128).map(|c| c - 128));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    /// Hands the processes over (to be killed with another host).
    pub fn adopt(&mut self, other: &mut Host) {
        self.jobs.append(&mut other.jobs);
    }

    /// Whether a spawned process is still running.
    pub fn running(&mut self, pid: u32) -> bool {
        self.jobs
            .iter_mut()
            .find(|j| j.pid == pid)
            .is_some_and(|j| j.child.try_wait().unwrap().is_none())
    }

    /// Ends a spawned process (SIGKILL) and waits for it.
    pub fn end(&mut self, pid: u32) {
        if let Some(i) = self.jobs.iter().position(|j| j.pid == pid) {
            let mut job = self.jobs.remove(i);
            match self.ns {
                // Killing nsenter would leave its job running in the host.
                Some(_) => {
                    let _ = Command::new("kill")
                        .args(["-KILL", &job_pid_outside(&job.child).to_string()])
                        .status();
                }
                None => {
                    let _ = job.child.kill();
                }
            }
            let _ = job.child.wait();
        }
    }
}

/// The pid, as this machine numbers it, of the job `nsenter` runs.
fn job_pid_outside(nsenter: &Child) -> u32 {
    let id = nsenter.id();
    std::fs::read_to_string(format!("/proc/{id}/task/{id}/children"))
        .ok()
        .and_then(|c| c.split_whitespace().next()?.parse().ok())
        .unwrap_or(id)
}

impl Drop for Host {
    fn drop(&mut self) {
        let pids: Vec<u32> = self.jobs.iter().map(|j| j.pid).collect();
        for pid in pids {
            self.end(pid);
        }
    }
}

/// Writes a script to `path`, mode 0755.
pub fn write_executable(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
}

/// Whether a test's prerequisite holds. In CI (`GENV_ENFORCE_CI` set, as
/// `.ci/run` does) a missing one fails the test; elsewhere the test is
/// skipped, said on stderr and listed in `target/genv-enforce-skipped`,
/// which `scripts/test` prints in its summary.
///
/// # Panics
/// In CI, when `holds` is false.
pub fn prerequisite(holds: bool, why: &str) -> bool {
    if holds {
        return true;
    }
    let test = std::thread::current()
        .name()
        .unwrap_or("a test")
        .to_string();
    assert!(
        std::env::var_os("GENV_ENFORCE_CI").is_none(),
        "{test}: prerequisite missing in CI: {why}"
    );
    eprintln!("SKIPPED {test}: {why}");
    let list = repo().join("target/genv-enforce-skipped");
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(list)
    {
        let _ = std::io::Write::write_all(&mut f, format!("{test}: {why}\n").as_bytes());
    }
    false
}

/// The uid and gid of the OS user `name`, created (no home, no login) if
/// missing: tests run jobs as the users their environments name, so that
/// records and the host agree.
///
/// # Panics
/// When the user is missing and cannot be created (not root).
pub fn ensure_user(name: &str) -> (u32, u32) {
    static CREATING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let lookup = || nix::unistd::User::from_name(name).ok().flatten();
    if let Some(u) = lookup() {
        return (u.uid.as_raw(), u.gid.as_raw());
    }
    let _one_at_a_time = CREATING.lock().unwrap_or_else(|e| e.into_inner());
    if lookup().is_none() {
        let out = Command::new("useradd")
            .args([
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                "--user-group",
                name,
            ])
            .output()
            .expect("useradd");
        // 9: created meanwhile by another test binary.
        assert!(
            out.status.success() || out.status.code() == Some(9),
            "cannot create test user {name} (tests that run jobs as users need root): {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let u = lookup().unwrap_or_else(|| panic!("user {name} missing after useradd"));
    (u.uid.as_raw(), u.gid.as_raw())
}

/// An `envs.json` entry with a live `pid`, recording `user`'s uid.
pub fn env(eid: &str, user: Option<&str>, gpu_memory: Option<&str>, pid: u32) -> Value {
    let uid = user
        .and_then(|u| nix::unistd::User::from_name(u).ok().flatten())
        .map_or(0, |u| u.uid.as_raw());
    json!({
        "eid": eid, "uid": uid, "creation": "22/11/2026 15:04:05", "username": user,
        "config": {"name": null, "gpu_memory": gpu_memory, "gpus": null},
        "pids": [pid], "kernel_ids": []
    })
}

/// A process's start time (clock ticks since boot): field 22 of its
/// `/proc/<pid>/stat`, counted after the last `)`.
pub fn start_time(pid: u32) -> u64 {
    let stat = std::fs::read(format!("/proc/{pid}/stat")).unwrap();
    let close = stat.iter().rposition(|&b| b == b')').unwrap();
    std::str::from_utf8(&stat[close + 1..])
        .unwrap()
        .split_ascii_whitespace()
        .nth(19)
        .unwrap()
        .parse()
        .unwrap()
}

/// Carries out `plan` on this machine's `host` (through its agent) and
/// returns the outcomes, on a runtime of its own.
pub fn execute(
    host: &genv_enforce::host::LiveHost,
    plan: &genv_enforce::plan::HostPlan,
) -> Vec<genv_enforce::outcome::Outcome> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let out = host.execute(plan).await;
            let _ = host.close().await;
            out
        })
}

/// SIGTERMs the process `pid` seen with `start_time` through `host`.
pub fn terminate(
    host: &genv_enforce::host::LiveHost,
    pid: u32,
    start_time: Option<u64>,
) -> genv_enforce::outcome::TerminateResult {
    let plan = genv_enforce::plan::HostPlan {
        terminate: vec![genv_enforce::plan::Termination::of(
            genv_enforce::model::Pid(pid),
            start_time,
        )],
        detach: Vec::new(),
    };
    match execute(host, &plan).pop() {
        Some(genv_enforce::outcome::Outcome::Terminate { outcome, .. }) => outcome,
        other => panic!("{other:?}"),
    }
}

/// The real genv 1.4.3 entry point: `$GENV_BIN`, else `genv` on PATH.
///
/// # Panics
/// When neither exists: `scripts/test` installs it.
pub fn genv_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("GENV_BIN") {
        return PathBuf::from(p);
    }
    let out = Command::new("sh")
        .args(["-c", "command -v genv"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the real genv 1.4.3 is needed: run scripts/test, or `pip install genv==1.4.3` and set GENV_BIN"
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// stdout lines.
pub fn lines(out: &Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(String::from)
        .collect()
}

/// Same envs, devices and processes, in the same order, our extra fields aside.
pub fn assert_same_snapshot(genv: &[u8], ours: &[u8]) {
    let genv: Value = serde_json::from_slice(genv).unwrap();
    let mut ours: Value = serde_json::from_slice(ours).unwrap();
    assert_eq!(ours["envs"], genv["envs"]);
    assert_eq!(ours["devices"], genv["devices"]);
    for p in ours["processes"]["processes"].as_array_mut().unwrap() {
        let o = p.as_object_mut().unwrap();
        o.remove("start_time");
        o.remove("uid");
    }
    assert_eq!(ours["processes"], genv["processes"]);
}

/// Runs `action` on a thread right after `file` has next been read and
/// closed by anyone (our agent, taking a snapshot): a user acting between
/// the enforcer's decision and its action. The handle ends with `action`,
/// or after 60 s without a read.
pub fn after_read(
    file: &Path,
    action: impl FnOnce() + Send + 'static,
) -> std::thread::JoinHandle<bool> {
    use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
    let watch = Inotify::init(InitFlags::IN_CLOEXEC | InitFlags::IN_NONBLOCK).unwrap();
    watch
        .add_watch(file, AddWatchFlags::IN_CLOSE_NOWRITE)
        .unwrap();
    std::thread::spawn(move || {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(60) {
            if watch.read_events().is_ok_and(|e| !e.is_empty()) {
                action();
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        false
    })
}

/// The test job `tests/jobs/<name>.c` compiled with gcc (once per source
/// change, shared by the test binaries): a user's program doing what a
/// few lines of C can.
///
/// # Panics
/// gcc is missing or the source does not compile (`.ci/run` installs gcc).
pub fn job(name: &str) -> PathBuf {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _lock = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let source = repo().join(format!("tests/jobs/{name}.c"));
    let dir = repo().join("target/test-jobs");
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join(name);
    let fresh = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    if fresh(&out).is_some_and(|built| Some(built) >= fresh(&source)) {
        return out;
    }
    let tmp = dir.join(format!(".{name}.{}", std::process::id()));
    let status = Command::new("gcc")
        .args(["-O2", "-Wall", "-pthread", "-o"])
        .arg(&tmp)
        .arg(&source)
        .status()
        .expect("gcc (the test jobs are C): apt-get install gcc");
    assert!(status.success(), "{} does not compile", source.display());
    std::fs::rename(&tmp, &out).unwrap();
    out
}

/// Waits until `holds` (polled every 10 ms) or `limit` passes; whether it held.
pub fn wait_until(limit: Duration, mut holds: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if holds() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    holds()
}

/// The state letter of process `pid` (field 3 of `/proc/<pid>/stat`), as
/// this machine sees it.
pub fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    let close = stat.iter().rposition(|&b| b == b')')?;
    stat.get(close + 2).map(|&b| b as char)
}

/// A directory for programs that stand in for a driver's (root's files,
/// in directories only root may write, as `/usr/bin` is: `/tmp` is every
/// user's), that every user may enter: under `/run/genv-enforce-test`.
pub fn driver_dir() -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    let base = Path::new("/run/genv-enforce-test");
    std::fs::create_dir_all(base).unwrap();
    let open = std::fs::Permissions::from_mode(0o755);
    std::fs::set_permissions(base, open.clone()).unwrap();
    let dir = tempfile::tempdir_in(base).unwrap();
    std::fs::set_permissions(dir.path(), open).unwrap();
    dir
}
