//! Receivers on loopback for what the enforcer tells: a real SMTP server
//! (aiosmtpd) and HTTP webhooks (`tests/util/sinks.py`).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{prerequisite, repo};

/// A receiver (`tests/util/sinks.py`), stopped when dropped.
pub struct Sink {
    child: Child,
    pub port: u16,
    file: PathBuf,
    _dir: tempfile::TempDir,
}

impl Sink {
    /// Starts `sinks.py kind` on a free loopback port; `None` (after
    /// [`prerequisite`]) where aiosmtpd is missing.
    pub fn start(kind: &str) -> Option<Sink> {
        let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        if kind == "smtp" {
            let has = Command::new(&python)
                .args(["-c", "import aiosmtpd"])
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if !prerequisite(
                has,
                "aiosmtpd (pip install aiosmtpd) for a real SMTP server",
            ) {
                return None;
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("received.jsonl");
        let port = free_port();
        let mut child = Command::new(&python)
            .arg(repo().join("tests/util/sinks.py"))
            .args([kind, &port.to_string(), file.to_str().unwrap()])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready", "{kind} sink did not start");
        Some(Sink {
            child,
            port,
            file,
            _dir: dir,
        })
    }

    /// What it received so far, one JSON value each.
    pub fn received(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.file)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// Waits (up to 20 s) until it received `n`.
    pub fn wait_for(&self, n: usize) -> Vec<Value> {
        let start = Instant::now();
        loop {
            let got = self.received();
            if got.len() >= n || start.elapsed() > Duration::from_secs(20) {
                return got;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The (stage, pid) of each webhook post in `posts`, in order.
pub fn stages(posts: &[Value]) -> Vec<(String, u64)> {
    posts
        .iter()
        .map(|p| {
            let body: Value = serde_json::from_str(p["body"].as_str().unwrap()).unwrap();
            (
                body["event"]["stage"].as_str().unwrap().to_string(),
                body["event"]["pid"].as_u64().unwrap(),
            )
        })
        .collect()
}
