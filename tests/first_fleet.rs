//! Day one, as an admin does it: `docs/first-fleet.md` run as written, its
//! blocks taken from the Markdown, on a fresh admin box (a container booted
//! with a real systemd, the Debian package of `scripts/package` installed)
//! against two hosts behind real sshd whose login user has exactly the
//! page's sudoers rule. Then the packaged unit under that systemd: it
//! enforces (a real stray of a real user is terminated), `systemctl reload`
//! applies a changed file and refuses a broken one, the watchdog is fed,
//! `restart` keeps the state database and the runtime directory, and `stop`
//! leaves no SSH master nor agent behind. Needs root, debootstrap,
//! systemd-nspawn and the package (`.ci/run` builds it first).

mod util;

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use util::admin_box::AdminBox;
use util::fleet::Fleet;

const SIGTERM: i32 = 15;
const PAGE: &str = "docs/first-fleet.md";

/// Where a block of the page runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Admin,
    Host,
}

/// A fenced block of the page: ```` ```sh admin|host [vars] [rollback] [exit=0,3] ````.
#[derive(Debug)]
struct Block {
    side: Side,
    /// Settings the later blocks of its side start with.
    vars: bool,
    /// Run last, after the unit's checks.
    rollback: bool,
    /// The exit statuses that mean it worked.
    exits: Vec<i32>,
    text: String,
    line: usize,
}

/// The page's shell blocks, in order. A block of another language (a
/// build machine's command, indented) is not one of them.
fn blocks(page: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut lines = page.lines().enumerate();
    while let Some((n, l)) = lines.next() {
        let Some(info) = l.strip_prefix("```sh ") else {
            continue;
        };
        let words: Vec<&str> = info.split_whitespace().collect();
        let side = match words.first() {
            Some(&"admin") => Side::Admin,
            Some(&"host") => Side::Host,
            other => panic!(
                "{PAGE}:{}: a sh block says where it runs, not {other:?}",
                n + 1
            ),
        };
        let exits = words
            .iter()
            .find_map(|w| w.strip_prefix("exit="))
            .map_or(vec![0], |e| {
                e.split(',').map(|s| s.parse().unwrap()).collect()
            });
        let text: Vec<&str> = lines
            .by_ref()
            .map(|(_, l)| l)
            .take_while(|l| *l != "```")
            .collect();
        out.push(Block {
            side,
            vars: words.contains(&"vars"),
            rollback: words.contains(&"rollback"),
            exits,
            text: text.join("\n") + "\n",
            line: n + 1,
        });
    }
    out
}

/// `text` with each `NAME=value  # set: ...` line given the test's value
/// for NAME (a name the test does not know fails it: the page grew a
/// setting this test must learn).
fn set(text: &str, values: &[(&str, String)]) -> String {
    text.lines()
        .map(|l| {
            let Some((assign, _)) = l.split_once("# set:") else {
                return l.to_string();
            };
            let name = assign.split('=').next().unwrap().trim();
            let (_, value) = values
                .iter()
                .find(|(n, _)| *n == name)
                .unwrap_or_else(|| panic!("{PAGE}: a setting this test does not know: {name}"));
            format!("{name}={value}")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Runs `script` as root in host `ns`'s mount namespace (its own
/// `/etc/sudoers.d`, genv state and nvidia-smi), as an admin logged in there.
fn on_host(ns: u32, script: &str) -> Output {
    Command::new("nsenter")
        .args(["--target", &ns.to_string(), "--mount", "--"])
        .args([
            "env",
            "-i",
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME=/root",
            "bash",
            "-euo",
            "pipefail",
            "-c",
            script,
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn said(out: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The package `scripts/package` built.
fn package() -> Option<PathBuf> {
    std::fs::read_dir(util::repo().join("target/debian"))
        .ok()?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("genv-enforce_") && n.ends_with(".deb"))
        })
}

/// The package to install, where an admin box can be booted; otherwise
/// the missing prerequisite is said (and fails the test in CI).
fn ready() -> Option<PathBuf> {
    if let Some(why) = util::admin_box::missing() {
        util::prerequisite(false, &why);
        return None;
    }
    let deb = package();
    util::prerequisite(
        deb.is_some(),
        "no target/debian/genv-enforce_*.deb: run scripts/package",
    );
    deb
}

/// Pids of this machine whose command line holds `needle`.
fn processes_with(needle: &str) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.windows(needle.len()).any(|w| w == needle.as_bytes()))
        })
        .collect()
}

/// How many cycles the service has summed up in its journal.
fn cycles(b: &AdminBox) -> usize {
    b.journal()
        .lines()
        .filter(|l| l.contains("[SUMMARY] cycle"))
        .count()
}

/// Runs one block of the page where it says, with the test's settings;
/// fails the test unless it ends with one of its exit statuses.
fn run_block(b: &AdminBox, hosts: &[u32], blk: &Block, admin_vars: &str) {
    let key =
        std::fs::read_to_string(b.path("/etc/genv-enforce/id_ed25519.pub")).unwrap_or_default();
    let text = set(&blk.text, &settings(&key));
    let outs: Vec<Output> = match blk.side {
        Side::Admin => vec![b.run(&format!("{admin_vars}{text}"))],
        Side::Host => hosts.iter().map(|ns| on_host(*ns, &text)).collect(),
    };
    for out in outs {
        let code = out.status.code().unwrap_or(-1);
        assert!(
            blk.exits.contains(&code),
            "{PAGE}:{}: the block failed ({:?} expected)\n{text}\n{}\njournal:\n{}",
            blk.line,
            blk.exits,
            said(&out),
            b.journal()
        );
    }
}

/// The test's values of the page's settings: its two hosts, the login
/// user it names, and the key step 2 made.
fn settings(key: &str) -> [(&'static str, String); 3] {
    [
        ("HOSTS", "\"gpu1 gpu2\"".to_string()),
        ("LOGIN", "genv-enforce".to_string()),
        ("KEY", format!("'{}'", key.trim())),
    ]
}

#[test]
fn the_first_fleet_page_takes_a_fresh_admin_box_to_a_service_that_enforces() {
    let Some(deb) = ready() else { return };
    let page = std::fs::read_to_string(util::repo().join(PAGE)).unwrap();
    let blocks = blocks(&page);
    assert!(blocks.len() >= 8, "{PAGE}: {} blocks", blocks.len());
    // The hosts' sshd listens on port 22 of their own addresses: nothing
    // else may hold port 22 of every address (a system sshd).
    let free = std::net::TcpStream::connect_timeout(
        &"127.0.0.1:22".parse().unwrap(),
        Duration::from_secs(1),
    )
    .is_err();
    if !util::prerequisite(
        free,
        "port 22 is taken on loopback (a system sshd?): the test hosts need it",
    ) {
        return;
    }
    // Each host: its own /etc/sudoers.d (empty: the page writes its one
    // rule there), sshd on port 22 too, the page's login user let in.
    let Some(mut f) = Fleet::up_with(2, |dir, _| {
        let d = dir.join("sudoers.d");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(
            dir.join("sshd_extra"),
            "ListenAddress @ADDRESS@:22\nAllowUsers genv-enforce\n",
        )
        .unwrap();
    }) else {
        return;
    };
    let names: Vec<(String, String)> = f
        .addresses()
        .into_iter()
        .enumerate()
        .map(|(i, a)| (format!("gpu{}", i + 1), a))
        .collect();
    let b = AdminBox::boot("first-fleet", &names);
    b.put(&deb);
    // bob's job outside any environment on gpu1's GPU 0: the shipped
    // configuration's non-env-processes terminates it.
    let stray = f.host(0).spawn_as("bob", None);
    f.host(0).set_apps(&[(stray, 0, "100")]);

    let hosts: Vec<u32> = f.hosts.iter().map(|h| h.ns.unwrap()).collect();
    let mut admin_vars = String::new();
    let mut installed = false;
    for blk in blocks.iter().filter(|b| !b.rollback) {
        if blk.vars {
            assert_eq!(blk.side, Side::Admin, "{PAGE}:{}", blk.line);
            admin_vars += &set(&blk.text, &settings(""));
            admin_vars.push('\n');
            continue;
        }
        run_block(&b, &hosts, blk, &admin_vars);
        if !installed && blk.text.contains("genv-enforce_*.deb") {
            installed = true;
            // As installed, before the inventory is written: the check
            // fails naming the one file to write, and how.
            let out = b.run("genv-enforce config check");
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{}", said(&out));
            assert!(
                err.contains("/etc/genv-enforce/hosts.toml: no such file: write it")
                    && err.contains(
                        "install -m 600 /usr/share/genv-enforce/hosts.example.toml /etc/genv-enforce/hosts.toml"
                    ),
                "{err}"
            );
        }
    }
    assert!(installed, "{PAGE} never installs the package");

    // Started by step 9: its first cycle terminated the stray.
    assert_eq!(
        f.host(0).wait_signal(stray, Duration::from_secs(30)),
        Some(SIGTERM),
        "journal:\n{}",
        b.journal()
    );
    let journal = b.journal();
    assert!(
        journal.contains(&format!("Terminating process {stray} ")),
        "{journal}"
    );
    assert!(journal.contains("2 hosts ok"), "{journal}");
    // The live view from the packaged unit's socket (its runtime
    // directory), root's alone.
    let status = b.ok("genv-enforce status");
    assert!(
        status.contains("hosts: 2 (2 ok, 0 degraded, 0 failed)"),
        "{status}"
    );
    // What the unit did, in its recent actions, under the owner the
    // host's kernel names.
    assert!(
        status.contains(&format!(
            "terminate pid {stray} of bob (non-env-processes): signalled"
        )),
        "{status}"
    );
    let mode = b.ok("stat -c %a /run/genv-enforce/view.sock");
    assert_eq!(mode.trim(), "600");

    // A changed file, reloaded whole: cycles every 2 s instead of 30 s.
    b.ok(
        "sed -i 's/^interval = \"30s\"/interval = \"2s\"/' /etc/genv-enforce/genv-enforce.toml
          genv-enforce config check
          systemctl reload genv-enforce",
    );
    assert!(
        util::wait_until(Duration::from_secs(10), || b
            .journal()
            .contains("configuration reloaded")),
        "{}",
        b.journal()
    );
    let before = cycles(&b);
    assert!(
        util::wait_until(Duration::from_secs(20), || cycles(&b) >= before + 3),
        "no cycle every 2 s after the reload:\n{}",
        b.journal()
    );
    // A broken file is refused, the running configuration kept.
    b.ok("cp /etc/genv-enforce/genv-enforce.toml /root/good.toml
          sed -i 's/^max-devices-per-user = 2/max-devices-per-user = \"two\"/' /etc/genv-enforce/genv-enforce.toml
          systemctl reload genv-enforce");
    assert!(
        util::wait_until(Duration::from_secs(10), || b
            .journal()
            .contains("configuration not reloaded, the old one is kept")),
        "{}",
        b.journal()
    );
    let before = cycles(&b);
    assert!(
        util::wait_until(Duration::from_secs(20), || cycles(&b) >= before + 2),
        "no cycles after a refused reload:\n{}",
        b.journal()
    );
    assert_eq!(b.ok("systemctl is-active genv-enforce").trim(), "active");
    b.ok("cp /root/good.toml /etc/genv-enforce/genv-enforce.toml");

    // The watchdog is fed.
    let watchdog = || b.ok("systemctl show -p WatchdogTimestampMonotonic --value genv-enforce");
    let fed = watchdog();
    assert!(fed.trim().parse::<u64>().unwrap() > 0, "never fed: {fed}");
    assert!(
        util::wait_until(Duration::from_secs(15), || watchdog() != fed),
        "the watchdog was not fed again in 15 s"
    );

    // A restart keeps the state database and the runtime directory.
    let kept = "stat -c %i /var/lib/genv-enforce/state.db
                genv-enforce report --state-db /var/lib/genv-enforce/state.db --since 1h";
    b.ok("touch /run/genv-enforce/kept-across-restarts");
    let report = b.ok(kept);
    assert!(report.lines().any(|l| l.starts_with("bob ")), "{report}");
    b.ok("systemctl restart genv-enforce");
    assert_eq!(b.ok(kept), report);
    b.ok("test -e /run/genv-enforce/kept-across-restarts");

    // An upgrade (the package installed again) loads the unit and
    // restarts the running service on the new binary.
    let main_pid = || b.ok("systemctl show -p MainPID --value genv-enforce");
    let before = main_pid();
    b.ok("dpkg -i genv-enforce_*.deb >/dev/null");
    assert_ne!(main_pid(), before, "not restarted by the upgrade");
    assert_eq!(b.ok("systemctl is-active genv-enforce").trim(), "active");

    // Stopped: no SSH master in the box, no agent on the hosts.
    let agents = || processes_with("genv-enforce-agent");
    assert!(!agents().is_empty(), "no agent while the service runs");
    b.ok("systemctl stop genv-enforce");
    let masters = b.run("pgrep -a -x ssh");
    assert!(!masters.status.success(), "SSH left: {}", said(&masters));
    assert!(
        util::wait_until(Duration::from_secs(10), || agents().is_empty()),
        "agents left on the hosts: {:?}",
        agents()
    );
    assert_eq!(b.ok("find /run/genv-enforce -type s | wc -l").trim(), "0");

    // The page's roll back.
    for blk in blocks.iter().filter(|b| b.rollback) {
        run_block(&b, &hosts, blk, &admin_vars);
    }
    assert!(!b.run("systemctl is-enabled genv-enforce").status.success());
    assert!(!b.path("/usr/bin/genv-enforce").exists());
    for h in &f.hosts {
        let left = on_host(h.ns.unwrap(), "ls /etc/sudoers.d");
        assert_eq!(String::from_utf8_lossy(&left.stdout).trim(), "");
    }
}

#[test]
fn the_pages_blocks_are_found_as_the_test_reads_them() {
    let page = std::fs::read_to_string(util::repo().join(PAGE)).unwrap();
    let found = blocks(&page);
    let admin = found.iter().filter(|b| b.side == Side::Admin).count();
    let host = found.iter().filter(|b| b.side == Side::Host).count();
    assert!(admin >= 8 && host >= 2, "admin {admin}, host {host}");
    assert!(found.iter().any(|b| b.exits == [0, 3]));
    assert_eq!(found.iter().filter(|b| b.rollback).count(), 2);
    // Every setting the page asks for is one this test sets (`set`
    // panics on any other).
    for b in &found {
        set(&b.text, &settings("k"));
    }
}

/// Starts `argv` in the box as `user`, with `GENV_ENVIRONMENT_ID=eid` if
/// any; its pid as the box sees it.
fn job_in_box(b: &AdminBox, user: &str, eid: Option<&str>) -> u32 {
    let env = eid.map_or(String::new(), |e| format!("GENV_ENVIRONMENT_ID={e}"));
    let pid = b.ok(&format!(
        "setpriv --reuid={user} --regid={user} --clear-groups env -i {env} sleep 1000 </dev/null >/dev/null 2>&1 &\necho $!"
    ));
    pid.trim().parse().unwrap()
}

#[test]
fn the_packaged_units_sandbox_lets_it_enforce_its_own_machine() {
    let Some(deb) = ready() else { return };
    let b = AdminBox::boot("this-machine", &[]);
    b.put(&deb);
    let fake = util::repo().join("scripts/fake-nvidia-smi");
    std::fs::create_dir_all(b.path("/opt/fake-gpu")).unwrap();
    std::fs::copy(&fake, b.path("/opt/fake-gpu/nvidia-smi")).unwrap();
    b.ok("dpkg -i genv-enforce_*.deb >/dev/null
          useradd --no-create-home --shell /usr/sbin/nologin bob
          printf '#!/bin/sh\\nFAKE_GPU_DIR=/opt/fake-gpu exec /opt/fake-gpu/nvidia-smi \"$@\"\\n' >/usr/local/sbin/nvidia-smi
          chmod 755 /usr/local/sbin/nvidia-smi /opt/fake-gpu/nvidia-smi
          printf 'index, uuid, memory.total\\n0, GPU-00000000-0000-4c3b-9a8f-7e6d5c4b3a29, 81559\\n1, GPU-00000001-0000-4c3b-9a8f-7e6d5c4b3a29, 81559\\n' >/opt/fake-gpu/gpus.csv
          install -d -m 1777 /var/tmp/genv");
    // bob's environment b holds GPUs 0 and 1 (his devices.json, as genv
    // writes it for him), a job of b on each, and a stray beside them.
    let shell = job_in_box(&b, "bob", Some("b"));
    let (j0, j1) = (
        job_in_box(&b, "bob", Some("b")),
        job_in_box(&b, "bob", Some("b")),
    );
    let stray = job_in_box(&b, "bob", None);
    let uid = b.ok("id -u bob").trim().to_string();
    let envs = serde_json::json!({"envs": [{
        "eid": "b", "uid": uid.parse::<u32>().unwrap(), "creation": "22/11/2026 15:04:05",
        "username": "bob", "config": {"name": null, "gpu_memory": null, "gpus": null},
        "pids": [shell], "kernel_ids": []
    }]});
    let attached = |i: u32| {
        serde_json::json!({"index": i, "total_memory": "81559mi",
        "attachments": [{"eid": "b", "gpu_memory": null, "time": "22/11/2026 15:04:06"}]})
    };
    let devices = serde_json::json!({"devices": [attached(0), attached(1)]});
    std::fs::write(b.path("/var/tmp/genv/envs.json"), envs.to_string()).unwrap();
    std::fs::write(b.path("/var/tmp/genv/devices.json"), devices.to_string()).unwrap();
    std::fs::write(
        b.path("/opt/fake-gpu/apps.csv"),
        format!(
            "gpu_uuid, pid, used_gpu_memory\n\
             GPU-00000000-0000-4c3b-9a8f-7e6d5c4b3a29, {j0}, 100\n\
             GPU-00000001-0000-4c3b-9a8f-7e6d5c4b3a29, {j1}, 100\n\
             GPU-00000000-0000-4c3b-9a8f-7e6d5c4b3a29, {stray}, 100\n"
        ),
    )
    .unwrap();
    b.ok("chown bob: /var/tmp/genv/envs.json /var/tmp/genv/devices.json");
    // The packaged unit, every setting of its sandbox as shipped, running
    // one local cycle (`genv-enforce enforce`, as `genv enforce`).
    b.ok("sed -e 's|^ExecStart=.*|ExecStart=/usr/bin/genv-enforce enforce --interval 0 --non-env-processes --max-devices-per-user 1|' \
              -e 's|^Type=notify|Type=oneshot|' -e '/^Restart/d' -e '/^WatchdogSec/d' \
              /lib/systemd/system/genv-enforce.service >/etc/systemd/system/genv-enforce-here.service
          grep -q '^ProtectSystem=strict' /etc/systemd/system/genv-enforce-here.service
          grep -q '^CapabilityBoundingSet=' /etc/systemd/system/genv-enforce-here.service
          systemctl daemon-reload");
    let start = b.run("systemctl start genv-enforce-here");
    let journal = String::from_utf8_lossy(
        &b.run("journalctl -u genv-enforce-here --no-pager -o cat")
            .stdout,
    )
    .into_owned();
    assert!(start.status.success(), "{}\n{journal}", said(&start));
    // The stray and the detached device's job were signalled ...
    let alive = |pid: u32| b.run(&format!("kill -0 {pid}")).status.success();
    assert!(
        util::wait_until(Duration::from_secs(5), || !alive(stray)),
        "{journal}"
    );
    assert!(
        journal.contains(&format!("Terminating process {stray} ")),
        "{journal}"
    );
    assert!(
        journal.contains("Detaching environment b of user bob from device"),
        "{journal}"
    );
    // ... and devices.json rewritten under the sandbox, still bob's.
    let after: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(b.path("/var/tmp/genv/devices.json")).unwrap(),
    )
    .unwrap();
    let kept: usize = after["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["attachments"].as_array().unwrap().len())
        .sum();
    assert_eq!(kept, 1, "{after}\n{journal}");
    assert_eq!(b.ok("stat -c %U /var/tmp/genv/devices.json").trim(), "bob");
    assert!(alive(shell), "bob's shell is no GPU job");
}
