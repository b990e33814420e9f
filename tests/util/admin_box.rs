//! A fresh admin box: a Debian root booted with a real systemd as PID 1 in
//! a container of its own (`systemd-nspawn`), sharing this machine's network
//! so that the sshd fleet is reachable from it. Commands run inside through
//! `nsenter`. Needs root, `debootstrap` and `systemd-nspawn`
//! (`../shared/notes/real-systemd.md`).
//!
//! The Debian root is made once by `debootstrap` and cached under
//! [`CACHE`]; each box boots a copy of its own, so nothing carries over.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

/// Where the Debian root is kept between runs.
pub const CACHE: &str = "/var/cache/genv-enforce-test/bookworm";

/// What an admin box has beyond debootstrap's minimal base: systemd as
/// init, the SSH client the enforcer drives, curl for the metrics, and
/// Python and sudo as a Debian box has them.
const PACKAGES: &str = "systemd,systemd-sysv,dbus,openssh-client,python3,sudo,procps,curl";

/// A booted container, powered off and removed on drop.
pub struct AdminBox {
    pub root: PathBuf,
    _dir: tempfile::TempDir,
    nspawn: Child,
    /// Its systemd's pid, as this machine numbers it.
    pub init: u32,
}

/// Whether this machine can boot an admin box; why not otherwise.
pub fn missing() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("an admin box needs root (debootstrap, systemd-nspawn)".into());
    }
    for (tool, package) in [
        ("debootstrap", "debootstrap"),
        ("systemd-nspawn", "systemd-container"),
    ] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            return Some(format!("{tool} is missing (apt-get install {package})"));
        }
    }
    None
}

/// The cached Debian root, made by debootstrap when missing (a few
/// minutes, once). Boots in parallel wait for the one that makes it (a
/// lock beside it); a debootstrap that dies leaves nothing that counts.
fn cached_root() -> PathBuf {
    let cache = PathBuf::from(CACHE);
    std::fs::create_dir_all(cache.parent().unwrap()).unwrap();
    let lock = std::fs::File::create(cache.with_extension("lock")).unwrap();
    rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive).unwrap();
    if cache.join(".complete").exists() {
        return cache;
    }
    let tmp = tempfile::Builder::new()
        .prefix("bookworm-")
        .tempdir_in(cache.parent().unwrap())
        .unwrap()
        .keep();
    let out = Command::new("debootstrap")
        .args([
            "--variant=minbase",
            &format!("--include={PACKAGES}"),
            "bookworm",
        ])
        .arg(&tmp)
        .stdin(Stdio::null())
        .output()
        .expect("run debootstrap");
    assert!(
        out.status.success(),
        "debootstrap failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&cache);
    std::fs::rename(&tmp, &cache).unwrap();
    std::fs::write(cache.join(".complete"), "").unwrap();
    cache
}

impl AdminBox {
    /// Boots a fresh copy of the cached root, `hosts` added to its
    /// `/etc/hosts` (name, address), and waits for its systemd to be up.
    pub fn boot(name: &str, hosts: &[(String, String)]) -> AdminBox {
        let cache = cached_root();
        let dir = tempfile::Builder::new()
            .prefix("admin-box-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let root = dir.path().join("root");
        let out = Command::new("cp")
            .arg("-a")
            .arg(&cache)
            .arg(&root)
            .output()
            .unwrap();
        assert!(out.status.success(), "cp -a: {out:?}");
        let mut etc_hosts = String::from("127.0.0.1 localhost\n");
        for (n, a) in hosts {
            etc_hosts += &format!("{a} {n}\n");
        }
        std::fs::write(root.join("etc/hosts"), etc_hosts).unwrap();
        let log = std::fs::File::create(dir.path().join("console.log")).unwrap();
        let nspawn = Command::new("systemd-nspawn")
            .arg("-D")
            .arg(&root)
            .args(["-b", "--register=no", "--keep-unit", "-M", name])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start systemd-nspawn");
        let pid = nspawn.id();
        let mut init = None;
        // nspawn forks helpers before the container's init: its systemd
        // is the child that runs as `systemd`.
        super::wait_until(Duration::from_secs(30), || {
            init = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
                .ok()
                .and_then(|c| {
                    c.split_whitespace()
                        .filter_map(|p| p.parse::<u32>().ok())
                        .find(|p| {
                            std::fs::read_to_string(format!("/proc/{p}/comm"))
                                .is_ok_and(|c| c.trim() == "systemd")
                        })
                });
            init.is_some()
        });
        let b = AdminBox {
            root,
            _dir: dir,
            nspawn,
            init: init.expect("no systemd under systemd-nspawn"),
        };
        let up = super::wait_until(Duration::from_secs(60), || {
            let state = b.run("systemctl is-system-running");
            let s = String::from_utf8_lossy(&state.stdout);
            s.starts_with("running") || s.starts_with("degraded")
        });
        assert!(
            up,
            "the admin box's systemd did not come up: {}",
            b.console()
        );
        b
    }

    /// What the container printed on its console.
    pub fn console(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("console.log")).unwrap_or_default()
    }

    /// Runs `script` in bash (`-euo pipefail`) as root inside, in `/root`,
    /// with a login's plain environment.
    pub fn run(&self, script: &str) -> Output {
        Command::new("nsenter")
            .args(["-t", &self.init.to_string(), "-a", "--"])
            .args([
                "env",
                "-i",
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "HOME=/root",
                "LANG=C.UTF-8",
                "bash",
                "-euo",
                "pipefail",
                "-c",
            ])
            .arg(format!("cd /root\n{script}"))
            .stdin(Stdio::null())
            .output()
            .expect("nsenter the admin box")
    }

    /// [`AdminBox::run`], asserting it succeeded; its stdout.
    pub fn ok(&self, script: &str) -> String {
        let out = self.run(script);
        assert!(
            out.status.success(),
            "in the admin box: {script}\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The unit's journal since boot, messages only.
    pub fn journal(&self) -> String {
        let out = self.run("journalctl -u genv-enforce --no-pager -o cat");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A file of the box, by its path inside.
    pub fn path(&self, inside: &str) -> PathBuf {
        self.root.join(inside.trim_start_matches('/'))
    }

    /// Copies `file` into the box's `/root`.
    pub fn put(&self, file: &Path) {
        std::fs::copy(file, self.path("/root").join(file.file_name().unwrap())).unwrap();
    }
}

impl Drop for AdminBox {
    fn drop(&mut self) {
        // To look inside after a failure: `nsenter -t PID -a bash`.
        if let Some(secs) = std::env::var("GENV_ENFORCE_KEEP_BOX")
            .ok()
            .and_then(|s| s.parse().ok())
        {
            eprintln!(
                "admin box kept for {secs} s: nsenter -t {} -a bash",
                self.init
            );
            std::thread::sleep(Duration::from_secs(secs));
        }
        // SIGRTMIN+4: systemd powers off.
        let _ = Command::new("kill")
            .args(["-s", "RTMIN+4", &self.init.to_string()])
            .status();
        let off = super::wait_until(Duration::from_secs(20), || {
            matches!(self.nspawn.try_wait(), Ok(Some(_)))
        });
        if !off {
            let _ = self.nspawn.kill();
            let _ = self.nspawn.wait();
        }
    }
}
