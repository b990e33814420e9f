//! A fleet of fake GPU hosts behind real sshd (`scripts/fleet`), for the
//! remote end-to-end tests. Needs root; [`Fleet::up`] says so and returns
//! `None` elsewhere.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use super::{repo, Dir, Host};

static NEXT: AtomicU32 = AtomicU32::new(0);

/// Hosts up, torn down on drop.
pub struct Fleet {
    pub dir: tempfile::TempDir,
    /// `genv-fleet@ADDR:2222`, as reports name them.
    pub names: Vec<String>,
    pub hosts: Vec<Host>,
}

impl Fleet {
    /// Brings up `k` hosts, host `i` (1-based) with a sudo that wants a
    /// password (as on a host where nobody set NOPASSWD for us).
    pub fn up_with_password_sudo(k: u32, i: u32) -> Option<Fleet> {
        Fleet::up_with(k, |dir, n| {
            if n == i {
                let d = dir.join("sudoers.d");
                std::fs::create_dir_all(&d).unwrap();
                std::fs::write(d.join("genv-fleet"), "genv-fleet ALL=(ALL) ALL\n").unwrap();
            }
        })
    }

    /// Brings up `k` hosts; `prepare(dir_of_host_i, i)` runs before each
    /// sshd starts (to put a `sudoers.d` or an `sshd_extra` there).
    pub fn up_with(k: u32, prepare: impl Fn(&std::path::Path, u32)) -> Option<Fleet> {
        if !super::prerequisite(
            rustix::process::geteuid().is_root(),
            "the SSH fleet needs root (sshd, namespaces, sudoers)",
        ) {
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        for i in 1..=k {
            let h = dir.path().join(format!("h{i}"));
            std::fs::create_dir_all(&h).unwrap();
            prepare(&h, i);
        }
        // A network of its own per fleet: tests run in parallel.
        let net = format!(
            "127.{}.{}",
            100 + std::process::id() % 100,
            NEXT.fetch_add(1, Ordering::SeqCst) + 1
        );
        let out = run_fleet(&[
            "up",
            &dir.path().display().to_string(),
            &k.to_string(),
            &net,
        ]);
        let names = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(String::from)
            .collect();
        let hosts = (1..=k)
            .map(|i| {
                let mut h = Host::at(Dir::At(dir.path().join(format!("h{i}"))), 4);
                h.ns = Some(read_init(&dir.path().join(format!("h{i}"))));
                h
            })
            .collect();
        Some(Fleet { dir, names, hosts })
    }

    pub fn up(k: u32) -> Option<Fleet> {
        Fleet::up_with(k, |_, _| {})
    }

    pub fn host(&mut self, i: usize) -> &mut Host {
        &mut self.hosts[i]
    }

    /// Our binary, set up to reach the fleet: `genv-enforce remote <args>`.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_genv-enforce"));
        cmd.arg("remote")
            .arg("--identity-file")
            .arg(self.dir.path().join("id_ed25519"))
            .arg("--known-hosts-file")
            .arg(self.dir.path().join("known_hosts"))
            .args(args)
            .stdin(Stdio::null());
        cmd
    }

    /// Runs `genv-enforce remote -H <all hosts> <args>`.
    pub fn ours(&self, args: &[&str]) -> Output {
        let hosts = self.names.join(",");
        let mut all = vec!["-H", hosts.as_str()];
        all.extend_from_slice(args);
        self.command(&all).output().unwrap()
    }

    fn script(&self, verb: &str, i: usize) {
        run_fleet(&[
            verb,
            &self.dir.path().display().to_string(),
            &(i + 1).to_string(),
        ]);
    }

    /// The hosts' addresses, as genv would name them.
    pub fn addresses(&self) -> Vec<String> {
        self.names
            .iter()
            .map(|n| {
                n.trim_start_matches("genv-fleet@")
                    .trim_end_matches(":2222")
                    .to_string()
            })
            .collect()
    }

    /// Writes an inventory TOML for the fleet and returns its path: hosts
    /// named `h1`, `h2`, ... (or by address), `extra[i]` added to host i's
    /// entry, `tail` appended (e.g. a `[limits]` table).
    pub fn inventory(&self, by_address: bool, extra: &[&str], tail: &str) -> PathBuf {
        let key = self.dir.path().join("id_ed25519");
        let mut toml = format!(
            "[defaults]\nuser = \"genv-fleet\"\nport = 2222\nidentity_file = \"{}\"\n",
            key.display()
        );
        for (i, address) in self.addresses().iter().enumerate() {
            let name = if by_address {
                address.clone()
            } else {
                format!("h{}", i + 1)
            };
            toml += &format!(
                "\n[[host]]\nname = \"{name}\"\naddress = \"{address}\"\n{}\n",
                extra.get(i).unwrap_or(&"")
            );
        }
        toml += tail;
        let path = self.dir.path().join("hosts.toml");
        std::fs::write(&path, toml).unwrap();
        path
    }

    /// Stops host `i` (0-based) as a reboot would: every sshd process of it.
    pub fn stop(&self, i: usize) {
        self.script("stop", i);
    }

    /// Starts host `i` again (new namespaces: its old jobs died with it).
    pub fn start(&mut self, i: usize) {
        self.script("start", i);
        let init = read_init(&self.dir.path().join(format!("h{}", i + 1)));
        self.hosts[i].ns = Some(init);
    }

    /// SSH connections host `i` has accepted so far.
    pub fn connections(&self, i: usize) -> usize {
        let log = std::fs::read_to_string(self.sshd_log(i)).unwrap_or_default();
        log.lines()
            .filter(|l| l.contains("Accepted publickey"))
            .count()
    }

    pub fn sshd_log(&self, i: usize) -> PathBuf {
        self.dir.path().join(format!("h{}/sshd.log", i + 1))
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        let _ = Command::new(repo().join("scripts/fleet"))
            .args(["down", &self.dir.path().display().to_string()])
            .output();
    }
}

/// The pid of a host's namespace init, as `scripts/fleet` recorded it.
fn read_init(host_dir: &std::path::Path) -> u32 {
    let text = std::fs::read_to_string(host_dir.join("init")).unwrap();
    text.trim().parse().unwrap()
}

/// Runs `scripts/fleet` with `args`, asserting it succeeded.
fn run_fleet(args: &[&str]) -> std::process::Output {
    let out = Command::new(repo().join("scripts/fleet"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "fleet {}: {}",
        args[0],
        String::from_utf8_lossy(&out.stderr)
    );
    out
}
