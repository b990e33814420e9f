//! The service files in `contrib/`: the unit passes `systemd-analyze
//! verify`, the environment file runs the shipped configuration, and the binary
//! speaks systemd's notify protocol (ready, watchdog, reloading, stopping).

mod util;

use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use clap::Parser;
use util::Host;

#[test]
fn the_unit_passes_systemd_analyze_verify() {
    let found = Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_ok();
    if !util::prerequisite(found, "systemd-analyze (package systemd) is not installed") {
        return;
    }
    let repo = util::repo();
    let unit = std::fs::read_to_string(repo.join("contrib/genv-enforce.service")).unwrap();
    // The paths an install would have, pointed at this checkout.
    let unit = unit
        .replace(
            "/usr/local/bin/genv-enforce",
            env!("CARGO_BIN_EXE_genv-enforce"),
        )
        .replace(
            "/etc/genv-enforce/genv-enforce.env",
            &repo.join("contrib/genv-enforce.env").display().to_string(),
        );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("genv-enforce.service");
    std::fs::write(&path, unit).unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.trim().is_empty(), "{err}");
    // The check is real: a typo is reported.
    let typo = std::fs::read_to_string(&path)
        .unwrap()
        .replace("Type=notify", "Typ=notify");
    std::fs::write(&path, typo).unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("Unknown key"));
}

#[test]
fn the_environment_file_runs_the_shipped_configuration() {
    let repo = util::repo();
    let env = std::fs::read_to_string(repo.join("contrib/genv-enforce.env")).unwrap();
    let lines: Vec<&str> = env
        .lines()
        .filter_map(|l| l.strip_prefix("GENV_ENFORCE_ARGS="))
        .collect();
    assert_eq!(lines.len(), 1, "one command line: {lines:?}");
    let example = repo.join("contrib/genv-enforce.toml").display().to_string();
    let args: Vec<std::ffi::OsString> = std::iter::once("genv-enforce".to_string())
        .chain(shell_words::split(lines[0].trim_matches('"')).unwrap())
        .map(|a| {
            a.replace("/etc/genv-enforce/genv-enforce.toml", &example)
                .into()
        })
        .collect();
    assert!(
        args.iter().any(|a| a.to_str() == Some(example.as_str())),
        "{args:?}"
    );
    let line = genv_enforce::setup::config_args(args).unwrap();
    let cli = genv_enforce::cli::Cli::try_parse_from(&line);
    assert!(cli.is_ok(), "{line:?}: {:?}", cli.err());
    let words: Vec<String> = line
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    assert!(words.contains(&"remote".to_string()) && words.contains(&"enforce".to_string()));
    // No example leaves a device cap open to jobs outside genv.
    assert!(words.contains(&"--max-devices-per-user=2".to_string()));
    assert!(
        words.contains(&"--non-env-processes".to_string()),
        "{words:?}"
    );
}

/// Kills the enforcer if the test fails before it ends.
struct KillOnDrop(rustix::process::Pid);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = rustix::process::kill_process(self.0, rustix::process::Signal::KILL);
    }
}

/// Reads notify messages from `sock` until one equals `want` (or the deadline).
fn wait_for(sock: &UnixDatagram, want: &str, seen: &mut Vec<String>) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut buf = [0u8; 4096];
    while Instant::now() < deadline {
        if let Ok(n) = sock.recv(&mut buf) {
            let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
            let hit = msg.lines().any(|l| l == want);
            seen.push(msg);
            if hit {
                return true;
            }
        }
    }
    false
}

#[test]
fn the_binary_tells_systemd_it_is_ready_alive_reloading_and_stopping() {
    let h = Host::new(1);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notify");
    let sock = UnixDatagram::bind(&path).unwrap();
    sock.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    // As systemd starts it: WATCHDOG_PID names the service's own pid.
    let child = h
        .command(Path::new("sh"))
        .args([
            "-c",
            "WATCHDOG_PID=$$ exec \"$0\" enforce --interval 30s --output json",
            env!("CARGO_BIN_EXE_genv-enforce"),
        ])
        .env("NOTIFY_SOCKET", &path)
        .env("WATCHDOG_USEC", "1000000")
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = rustix::process::Pid::from_child(&child);
    let _reaper = KillOnDrop(pid);
    let mut seen = Vec::new();
    assert!(wait_for(&sock, "READY=1", &mut seen), "{seen:?}");
    // Pinged while it sleeps between cycles (every half watchdog period).
    seen.clear();
    assert!(wait_for(&sock, "WATCHDOG=1", &mut seen), "{seen:?}");
    assert!(wait_for(&sock, "WATCHDOG=1", &mut seen), "{seen:?}");
    rustix::process::kill_process(pid, rustix::process::Signal::HUP).unwrap();
    assert!(wait_for(&sock, "RELOADING=1", &mut seen), "{seen:?}");
    assert!(wait_for(&sock, "READY=1", &mut seen), "{seen:?}");
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    assert!(wait_for(&sock, "STOPPING=1", &mut seen), "{seen:?}");
    let status = child.wait_with_output().unwrap().status;
    assert!(status.success(), "{status:?}");
}

#[test]
fn every_metric_the_dashboard_queries_exists() {
    let text =
        std::fs::read_to_string(util::repo().join("contrib/grafana-dashboard.json")).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).unwrap();
    let exprs: Vec<String> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().iter())
        .map(|t| t["expr"].as_str().unwrap().to_string())
        .collect();
    assert!(exprs.len() >= 8, "{exprs:?}");
    let ours = genv_enforce::metrics::Metrics::new().render();
    let families: Vec<&str> = ours
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    let mut queried = 0;
    for expr in &exprs {
        for name in expr
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| w.starts_with("genv_enforce_"))
        {
            let family = ["_total", "_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(name);
            assert!(
                families.contains(&family),
                "{name} (in `{expr}`) is not one of our metrics: {families:?}"
            );
            queried += 1;
        }
    }
    assert!(queried >= 9, "{queried}");
}

/// The fence epoch (high availability) lives in the unit's runtime
/// directory, which systemd removes on every stop unless told to keep it.
#[test]
fn the_units_runtime_directory_survives_a_restart() {
    let unit = std::fs::read_to_string(util::repo().join("contrib/genv-enforce.service")).unwrap();
    let lines: Vec<&str> = unit.lines().map(str::trim).collect();
    assert!(lines.contains(&"RuntimeDirectory=genv-enforce"), "{unit}");
    assert!(lines.contains(&"RuntimeDirectoryPreserve=yes"), "{unit}");
    assert_eq!(
        genv_enforce::ha::fence::FENCE_DIR,
        "/run/genv-enforce",
        "the fence directory is the unit's runtime directory"
    );
}
