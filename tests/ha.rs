//! High availability end to end: real etcd nodes on loopback (Debian's
//! `etcd-server`), two enforcer boxes (two processes of our binary) over
//! the sshd fleet, real processes of real users that really get
//! signalled. Each test says what it measures on stderr.

mod util;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use util::fleet::Fleet;
use util::sink::{stages, Sink};

const SIGTERM: i32 = 15;
const SIGKILL: i32 = 9;
const WAIT: Duration = Duration::from_secs(20);

static NEXT: AtomicU32 = AtomicU32::new(1);

/// One etcd member, killed on drop.
struct Etcd {
    child: Option<Child>,
    name: String,
    args: Vec<String>,
    client: String,
    _dir: Arc<tempfile::TempDir>,
}

impl Etcd {
    fn start(&mut self) {
        let log =
            std::fs::File::create(self._dir.path().join(format!("{}.log", self.name))).unwrap();
        self.child = Some(
            Command::new("etcd")
                .args(&self.args)
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .expect("etcd"),
        );
    }

    fn pid(&self) -> i32 {
        i32::try_from(self.child.as_ref().unwrap().id()).unwrap()
    }

    fn signal(&self, sig: i32) {
        unsafe_kill(self.pid(), sig);
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        if let Some(c) = &self.child {
            unsafe_kill(i32::try_from(c.id()).unwrap(), 18); // SIGCONT, if stopped
        }
        self.kill();
    }
}

fn unsafe_kill(pid: i32, sig: i32) {
    let _ = Command::new("kill")
        .args([format!("-{sig}"), pid.to_string()])
        .stderr(Stdio::null())
        .status();
}

/// `n` etcd members on loopback addresses of their own, up and healthy;
/// `None` (or a failure in CI) without etcd.
fn etcd(n: usize) -> Option<Vec<Etcd>> {
    let found = Command::new("etcd")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !util::prerequisite(
        found,
        "the HA tests need etcd (apt-get install etcd-server)",
    ) {
        return None;
    }
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let net = format!(
        "127.{}.{}",
        200 + std::process::id() % 50,
        NEXT.fetch_add(1, Ordering::SeqCst)
    );
    let peers: Vec<String> = (1..=n)
        .map(|i| format!("m{i}=http://{net}.{i}:2380"))
        .collect();
    let mut members: Vec<Etcd> = (1..=n)
        .map(|i| {
            let addr = format!("{net}.{i}");
            let client = format!("http://{addr}:2379");
            let args = vec![
                format!("--name=m{i}"),
                format!("--data-dir={}", dir.path().join(format!("m{i}")).display()),
                format!("--listen-client-urls={client}"),
                format!("--advertise-client-urls={client}"),
                format!("--listen-peer-urls=http://{addr}:2380"),
                format!("--initial-advertise-peer-urls=http://{addr}:2380"),
                format!("--initial-cluster={}", peers.join(",")),
                "--initial-cluster-state=new".into(),
                format!("--initial-cluster-token={net}"),
                "--heartbeat-interval=50".into(),
                "--election-timeout=500".into(),
                "--log-level=warn".into(),
            ];
            Etcd {
                child: None,
                name: format!("m{i}"),
                args,
                client,
                _dir: Arc::clone(&dir),
            }
        })
        .collect();
    for m in &mut members {
        m.start();
    }
    for m in &members {
        assert!(
            wait(Duration::from_secs(30), || healthy(&m.client)),
            "etcd {} did not come up: {}",
            m.name,
            std::fs::read_to_string(dir.path().join(format!("{}.log", m.name))).unwrap_or_default()
        );
    }
    Some(members)
}

/// Whether etcd's `/health` at `url` says so.
fn healthy(url: &str) -> bool {
    let addr = url.trim_start_matches("http://");
    let Ok(mut s) = TcpStream::connect(addr) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let req = format!("GET /health HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    if s.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    text.contains("\"health\":\"true\"")
}

fn wait(within: Duration, mut done: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + within;
    while Instant::now() < end {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    done()
}

/// An enforcer box: our binary looping over the fleet, its stderr lines
/// kept with the time each arrived.
struct Enforcer {
    child: Child,
    lines: Arc<Mutex<Vec<(Instant, String)>>>,
    audit: PathBuf,
}

impl Enforcer {
    fn start(f: &Fleet, name: &str, etcd: &[&Etcd], extra: &[&str]) -> Enforcer {
        let audit = f.dir.path().join(format!("audit-{name}.log"));
        let urls: Vec<&str> = etcd.iter().map(|e| e.client.as_str()).collect();
        let urls = urls.join(",");
        let hosts = f.names.join(",");
        let mut args = vec![
            "-H",
            hosts.as_str(),
            "enforce",
            "--interval",
            "1s",
            "--ha-etcd",
            urls.as_str(),
            "--ha-name",
            name,
            "--non-env-processes",
            "--audit-log",
            audit.to_str().unwrap(),
        ];
        if !extra.contains(&"--ha-ttl") {
            args.extend_from_slice(&["--ha-ttl", "3s"]);
        }
        args.extend_from_slice(extra);
        let mut child = f
            .command(&args)
            .env("GENV_ENFORCE_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let keep = Arc::clone(&lines);
        let err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                keep.lock().unwrap().push((Instant::now(), line));
            }
        });
        Enforcer {
            child,
            lines,
            audit,
        }
    }

    fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).unwrap()
    }

    /// When a stderr line with `text` first came after `since`, waiting
    /// up to `within`.
    fn said_after(&self, since: Instant, text: &str, within: Duration) -> Option<Instant> {
        let mut at = None;
        wait(within, || {
            at = self
                .lines
                .lock()
                .unwrap()
                .iter()
                .find(|(t, l)| *t >= since && l.contains(text))
                .map(|(t, _)| *t);
            at.is_some()
        });
        at
    }

    /// As [`Enforcer::said_after`], failing the test (with its stderr)
    /// when nothing came.
    fn saw(&self, since: Instant, text: &str, within: Duration) -> Instant {
        self.said_after(since, text, within)
            .unwrap_or_else(|| panic!("no {text:?} within {within:?}: {}", self.stderr()))
    }

    fn stderr(&self) -> String {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .map(|(_, l)| l.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The audit log's `done` entries, as (action, host, pid, outcome).
    fn done(&self) -> Vec<(String, String, u64, Value)> {
        let text = std::fs::read_to_string(&self.audit).unwrap_or_default();
        text.lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|e| e["phase"] == "done")
            .map(|e| {
                (
                    e["action"].as_str().unwrap().to_string(),
                    e["host"].as_str().unwrap().to_string(),
                    e["pid"].as_u64().unwrap_or(0),
                    e["outcome"].clone(),
                )
            })
            .collect()
    }

    fn stop(&mut self) {
        unsafe_kill(self.pid(), SIGTERM);
        let end = Instant::now() + Duration::from_secs(5);
        while Instant::now() < end {
            if self.child.try_wait().unwrap().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Enforcer {
    fn drop(&mut self) {
        unsafe_kill(self.pid(), 18);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until one of `boxes` says it leads and the others follow; the
/// leader's index.
fn leader_of(boxes: &[&Enforcer], since: Instant) -> usize {
    let mut who = None;
    assert!(
        wait(Duration::from_secs(30), || {
            who = boxes.iter().position(|b| {
                b.said_after(since, "ha: leader (epoch", Duration::ZERO)
                    .is_some()
            });
            who.is_some_and(|w| {
                boxes.iter().enumerate().all(|(i, b)| {
                    i == w
                        || b.said_after(since, "ha: following", Duration::ZERO)
                            .is_some()
                })
            })
        }),
        "no leader and follower: {}",
        boxes
            .iter()
            .map(|b| b.stderr())
            .collect::<Vec<_>>()
            .join("\n---\n")
    );
    who.unwrap()
}

/// The signalled terminations in `done`, by (host, pid).
fn signalled(done: &[(String, String, u64, Value)], action: &str) -> Vec<(String, u64)> {
    let mut v: Vec<_> = done
        .iter()
        .filter(|(a, _, _, o)| a == action && o["result"] == "signalled")
        .map(|(_, h, p, _)| (h.clone(), *p))
        .collect();
    v.sort();
    v
}

#[test]
fn two_boxes_one_leader_every_violation_acted_on_once() {
    let Some(etcd) = etcd(1) else { return };
    let Some(mut f) = Fleet::up(2) else { return };
    let a = Enforcer::start(&f, "box-a", &[&etcd[0]], &[]);
    let b = Enforcer::start(&f, "box-b", &[&etcd[0]], &[]);
    let start = Instant::now();
    let leader = leader_of(&[&a, &b], start);
    let mut strays = Vec::new();
    for h in 0..2 {
        let p1 = f.host(h).spawn_as("gealice", None);
        let p2 = f.host(h).spawn_as("gebob", None);
        f.host(h).set_apps(&[(p1, 0, "100"), (p2, 1, "100")]);
        strays.push((h, p1));
        strays.push((h, p2));
    }
    for &(h, p) in &strays {
        assert_eq!(f.host(h).wait_signal(p, WAIT), Some(SIGTERM), "{p}");
    }
    // A few more cycles: nobody acts twice on what is gone.
    std::thread::sleep(Duration::from_secs(3));
    let (mut a, mut b) = (a, b);
    a.stop();
    b.stop();
    let (da, db) = (a.done(), b.done());
    let (acted, idle) = if leader == 0 { (&da, &db) } else { (&db, &da) };
    assert!(idle.is_empty(), "the follower acted: {idle:?}");
    let mut want: Vec<(String, u64)> = strays
        .iter()
        .map(|&(h, p)| (f.names[h].clone(), u64::from(p)))
        .collect();
    want.sort();
    let mut both = signalled(&da, "terminate");
    both.extend(signalled(&db, "terminate"));
    both.sort();
    assert_eq!(both, want, "each once, by the leader: {acted:?}");
    let follower = [&a, &b][1 - leader];
    assert!(
        follower.stderr().contains("ha: following box-"),
        "{}",
        follower.stderr()
    );
}

#[test]
fn a_killed_leader_is_replaced_within_the_ttl_and_one_interval_nothing_twice() {
    let Some(mut etcd) = etcd(3) else { return };
    let Some(mut f) = Fleet::up(2) else { return };
    let members: Vec<&Etcd> = etcd.iter().collect();
    let a = Enforcer::start(&f, "box-a", &members, &[]);
    let b = Enforcer::start(&f, "box-b", &members, &[]);
    let start = Instant::now();
    let leader = leader_of(&[&a, &b], start);
    let (mut dead, mut heir) = if leader == 0 { (a, b) } else { (b, a) };
    let p = f.host(0).spawn_as("gealice", None);
    f.host(0).set_apps(&[(p, 0, "100")]);
    assert_eq!(f.host(0).wait_signal(p, WAIT), Some(SIGTERM));
    let killed = Instant::now();
    unsafe_kill(dead.pid(), SIGKILL);
    let _ = dead.child.wait();
    let took = heir
        .said_after(killed, "ha: leader (epoch", Duration::from_secs(15))
        .unwrap_or_else(|| panic!("no takeover: {}", heir.stderr()));
    let takeover = took - killed;
    eprintln!(
        "measured: takeover {:.2} s after SIGKILL (TTL 3 s, interval 1 s)",
        takeover.as_secs_f64()
    );
    // The lease lapses within its TTL; the heir looks once an interval,
    // and a cycle's own time (and etcd's tick) on top.
    assert!(
        takeover <= Duration::from_millis(3000 + 1000 + 1500),
        "{takeover:?}"
    );
    // The new leader acts, on a new violation, once; one etcd member down
    // changes nothing (a majority still answers).
    etcd[2].kill();
    let q = f.host(1).spawn_as("gebob", None);
    f.host(1).set_apps(&[(q, 2, "100")]);
    assert_eq!(f.host(1).wait_signal(q, WAIT), Some(SIGTERM));
    std::thread::sleep(Duration::from_secs(2));
    heir.stop();
    let mut both = signalled(&dead.done(), "terminate");
    both.extend(signalled(&heir.done(), "terminate"));
    both.sort();
    let mut want = vec![
        (f.names[0].clone(), u64::from(p)),
        (f.names[1].clone(), u64::from(q)),
    ];
    want.sort();
    assert_eq!(both, want);
    assert!(!heir.stderr().contains("fenced"), "{}", heir.stderr());
}

/// A job of alice's on host 0 that ignores SIGTERM: a leader signals it,
/// then waits `--kill-after` (4 s) within its cycle before SIGKILL.
fn stubborn(f: &mut Fleet) -> u32 {
    let p = f.host(0).start(
        "gealice",
        None,
        &["sh", "-c", "trap '' TERM; exec sleep 1000"],
    );
    f.host(0).set_apps(&[(p, 0, "100")]);
    p
}

/// The `kill` outcomes of `e` for `pid`.
fn kills(e: &Enforcer, pid: u32) -> Vec<Value> {
    e.done()
        .into_iter()
        .filter(|(act, _, p, _)| act == "kill" && *p == u64::from(pid))
        .map(|(_, _, _, o)| o)
        .collect()
}

#[test]
fn a_leader_paused_past_its_lease_sends_nothing_more_and_steps_down() {
    let Some(etcd) = etcd(1) else { return };
    let Some(mut f) = Fleet::up(1) else { return };
    let job = stubborn(&mut f);
    let extra = ["--kill-after", "4s"];
    let a = Enforcer::start(&f, "box-a", &[&etcd[0]], &extra);
    let start = Instant::now();
    a.saw(start, "ha: leader (epoch", Duration::from_secs(20));
    // Its SIGTERM is audited: it now sleeps 4 s before SIGKILL. Pause it
    // past its lease (3 s).
    assert!(
        wait(WAIT, || !signalled(&a.done(), "terminate").is_empty()),
        "{}",
        a.stderr()
    );
    unsafe_kill(a.pid(), 19); // SIGSTOP
    let paused = Instant::now();
    let b = Enforcer::start(&f, "box-b", &[&etcd[0]], &extra);
    b.saw(paused, "ha: leader (epoch", Duration::from_secs(20));
    assert!(
        wait(WAIT, || !signalled(&b.done(), "terminate").is_empty()),
        "{}",
        b.stderr()
    );
    // It wakes up mid-cycle: its lease ended on its own clock, so its
    // SIGKILL is not sent, and it steps down.
    wake_deposed(
        &mut f,
        a,
        b,
        job,
        "lease ended during the cycle; stepping down",
        "lease ended",
    );
}

/// SIGCONTs the paused old leader `a` mid-cycle: it says `said` and steps
/// down to follow `b`; its SIGKILL of `job` ends as `refused` says, and
/// only `b`'s lands.
fn wake_deposed(
    f: &mut Fleet,
    mut a: Enforcer,
    mut b: Enforcer,
    job: u32,
    said: &str,
    refused: &str,
) {
    let woke = Instant::now();
    unsafe_kill(a.pid(), 18); // SIGCONT
    for text in [said, "stepping down", "ha: following box-b"] {
        assert!(
            a.said_after(woke, text, Duration::from_secs(15)).is_some(),
            "{text}: {}",
            a.stderr()
        );
    }
    assert_eq!(f.host(0).wait_signal(job, WAIT), Some(SIGKILL));
    std::thread::sleep(Duration::from_secs(1));
    a.stop();
    b.stop();
    let kills = kills(&a, job);
    assert_eq!(kills.len(), 1, "{kills:?}");
    assert!(kills[0].to_string().contains(refused), "{kills:?}");
    assert_eq!(
        signalled(&b.done(), "kill"),
        vec![(f.names[0].clone(), u64::from(job))]
    );
}

/// POSTs `body` to etcd's JSON gateway at `url` + `path`; the answer's JSON.
fn gateway(url: &str, path: &str, body: &str) -> Value {
    let addr = url.trim_start_matches("http://");
    let mut s = TcpStream::connect(addr).unwrap();
    let req = format!(
        "POST {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let json = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {text}"))
}

fn base64(bytes: &[u8]) -> String {
    const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[test]
fn a_leader_etcd_moved_on_from_is_fenced_by_the_agents_and_steps_down() {
    let Some(etcd) = etcd(1) else { return };
    let Some(mut f) = Fleet::up(1) else { return };
    let job = stubborn(&mut f);
    // A long lease: the leader's own clock (and etcd) say it holds.
    let extra = ["--kill-after", "4s", "--ha-ttl", "30s"];
    let a = Enforcer::start(&f, "box-a", &[&etcd[0]], &extra);
    let start = Instant::now();
    a.saw(start, "ha: leader (epoch", Duration::from_secs(20));
    let b = Enforcer::start(&f, "box-b", &[&etcd[0]], &extra);
    b.saw(start, "ha: following box-a", Duration::from_secs(20));
    assert!(
        wait(WAIT, || !signalled(&a.done(), "terminate").is_empty()),
        "{}",
        a.stderr()
    );
    // Mid-cycle, etcd's election moves on while this leader's lease still
    // holds (an admin deletes the key, as an etcd restored from a backup
    // or a clock that runs slow would do): the other box takes over and
    // reaches the host first.
    unsafe_kill(a.pid(), 19);
    let deleted = gateway(
        &etcd[0].client,
        "/v3/kv/deleterange",
        &format!("{{\"key\":\"{}\"}}", base64(b"/genv-enforce/leader")),
    );
    assert_eq!(deleted["deleted"], "1", "{deleted}");
    let revoked = Instant::now();
    b.saw(revoked, "ha: leader (epoch", Duration::from_secs(20));
    assert!(
        wait(WAIT, || !signalled(&b.done(), "terminate").is_empty()),
        "{}",
        b.stderr()
    );
    // The old leader goes on with its cycle: its SIGKILL is refused by
    // the host's agent, which has seen the newer epoch; it steps down.
    let dir = f.dir.path().to_path_buf();
    wake_deposed(&mut f, a, b, job, "ha: fenced on", "fenced: epoch");
    let epoch = std::fs::read_to_string(dir.join("h1/run/epoch")).unwrap();
    assert!(epoch.trim().parse::<u64>().unwrap() > 0, "{epoch}");
}

#[test]
fn without_etcd_the_leader_stops_acting_within_the_ttl_and_resumes_after() {
    let Some(etcd) = etcd(1) else { return };
    let Some(mut f) = Fleet::up(1) else { return };
    let mut a = Enforcer::start(&f, "box-a", &[&etcd[0]], &[]);
    let start = Instant::now();
    a.saw(start, "ha: leader (epoch", Duration::from_secs(20));
    // etcd stops answering (as a partition would).
    etcd[0].signal(19);
    let cut = Instant::now();
    let stopped = a
        .said_after(cut, "ha: not acting", Duration::from_secs(10))
        .unwrap_or_else(|| panic!("{}", a.stderr()));
    eprintln!(
        "measured: stopped acting {:.2} s after etcd went silent (TTL 3 s, interval 1 s)",
        (stopped - cut).as_secs_f64()
    );
    // No cycle starts acting with less than a keep-alive tick (1 s) of
    // lease left, and the lease was renewed at most a tick before etcd
    // went silent: the first cycle after that says so.
    assert!(
        stopped - cut <= Duration::from_secs(4),
        "{:?}",
        stopped - cut
    );
    // A violation now is reported, not acted on.
    let p = f.host(0).spawn_as("gealice", None);
    f.host(0).set_apps(&[(p, 0, "100")]);
    std::thread::sleep(Duration::from_secs(3));
    assert!(f.host(0).running(p));
    assert!(
        signalled(&a.done(), "terminate").is_empty(),
        "{:?}",
        a.done()
    );
    // etcd back: the box leads again and acts.
    let back = Instant::now();
    etcd[0].signal(18);
    a.saw(back, "ha: leader (epoch", Duration::from_secs(20));
    assert_eq!(f.host(0).wait_signal(p, WAIT), Some(SIGTERM));
    a.stop();
}

#[test]
fn doctor_checks_etcd_the_election_and_each_hosts_fence() {
    let Some(etcd) = etcd(1) else { return };
    let Some(f) = Fleet::up(1) else { return };
    let hosts = f.names.join(",");
    let url = etcd[0].client.clone();
    let doctor = || {
        f.command(&[
            "-H",
            &hosts,
            "doctor",
            "--output",
            "json",
            "--ha-etcd",
            &url,
        ])
        .output()
        .unwrap()
    };
    let out = doctor();
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let text = report.to_string();
    assert!(text.contains("\"check\":\"etcd\""), "{report:#}");
    assert!(text.contains("granted and revoked"), "{report:#}");
    assert!(text.contains("nobody leads now"), "{report:#}");
    assert!(text.contains("holds no epoch yet"), "{report:#}");
    // A fence directory someone else could write is refused, and said.
    let run = f.dir.path().join("h1/run");
    std::fs::set_permissions(&run, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let out = doctor();
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(text.contains("is not a directory of uid 0 only"), "{text}");
}

/// Shards one and two of 2 over `f`, on `etcd`, under a cap of 2 devices
/// a user.
fn two_shards(f: &Fleet, etcd: &Etcd) -> (Enforcer, Enforcer) {
    let cap = ["--max-devices-per-user", "2"];
    let shard = |name, k| Enforcer::start(f, name, &[etcd], &[&cap[..], &["--shard", k]].concat());
    (shard("shard-one", "1/2"), shard("shard-two", "2/2"))
}

/// alice's one excess over the fleet of
/// [`two_shards_detach_one_global_excess_once_and_a_dead_shards_hosts_drop_out`]
/// taken once: each shard its part, h1:0 (shard one), h4:1 and h2:0 (shard
/// two), her jobs there terminated; h3:0 and h4:0 kept.
fn excess_taken_once(f: &mut Fleet, jobs: &[u32], one: &Enforcer, two: &Enforcer) {
    assert_eq!(
        f.host(0).wait_signal(jobs[0], WAIT),
        Some(SIGTERM),
        "{}",
        one.stderr()
    );
    assert_eq!(
        f.host(1).wait_signal(jobs[1], WAIT),
        Some(SIGTERM),
        "{}",
        two.stderr()
    );
    assert!(
        wait(WAIT, || f.host(3).attached(1).is_empty()),
        "{}",
        two.stderr()
    );
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(f.host(2).attached(0), ["a2"], "{}", two.stderr());
    assert_eq!(f.host(3).attached(0), ["a3"]);
    assert!(f.host(2).running(jobs[2]) && f.host(3).running(jobs[3]));
}

#[test]
fn two_shards_detach_one_global_excess_once_and_a_dead_shards_hosts_drop_out() {
    let Some(etcd) = etcd(1) else { return };
    let Some(mut f) = Fleet::up(4) else { return };
    // alice works on GPU 0 of each host (environment aN), and on h4 her
    // environment is also attached to GPU 1, idle. Her cap is 2: 5 held,
    // 3 over. The one box's order: the idle device first (h4:1), then the
    // working ones by host (h1:0, h2:0).
    let mut jobs = Vec::new();
    for h in 0..4 {
        let eid = format!("a{h}");
        let p = f.host(h).spawn_as("gealice", Some(&eid));
        f.host(h)
            .write_envs(&[util::env(&eid, Some("gealice"), None, p)]);
        let attached: &[(u32, &str)] = if h == 3 {
            &[(0, "a3"), (1, "a3")]
        } else {
            &[(0, eid.as_str())]
        };
        f.host(h).write_devices(4, attached);
        f.host(h).set_apps(&[(p, 0, "100")]);
        jobs.push(p);
    }
    let (one, mut two) = two_shards(&f, &etcd[0]);
    excess_taken_once(&mut f, &jobs, &one, &two);
    assert_eq!(f.host(0).attached(0), Vec::<String>::new());
    assert_eq!(f.host(1).attached(0), Vec::<String>::new());
    let detached = |e: &Enforcer| -> Vec<(String, u64)> {
        let text = std::fs::read_to_string(&e.audit).unwrap_or_default();
        let mut v: Vec<_> = text
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|e| {
                e["phase"] == "done"
                    && e["action"] == "detach"
                    && e["outcome"]["result"] == "detached"
            })
            .map(|e| {
                (
                    e["host"].as_str().unwrap().to_string(),
                    e["device"].as_u64().unwrap(),
                )
            })
            .collect();
        v.sort();
        v
    };
    let n = f.names.clone();
    assert_eq!(detached(&one), [(n[0].clone(), 0)], "{}", one.stderr());
    let mut theirs = vec![(n[1].clone(), 0), (n[3].clone(), 1)];
    theirs.sort();
    assert_eq!(detached(&two), theirs, "{}", two.stderr());
    // Shard two dies: once its lease ends, its hosts (alice's h4:0) are no
    // longer counted. A second device of alice's on h3 then keeps her at
    // 2 as shard one counts: nothing is detached.
    unsafe_kill(two.pid(), SIGKILL);
    let _ = two.child.wait();
    std::thread::sleep(Duration::from_secs(3 + 2));
    f.host(2).write_devices(4, &[(0, "a2"), (2, "a2")]);
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(f.host(2).attached(2), ["a2"], "{}", one.stderr());
    assert_eq!(f.host(2).attached(0), ["a2"]);
    assert!(f.host(2).running(jobs[2]));
    assert_eq!(detached(&one), [(n[0].clone(), 0)], "{}", one.stderr());
}

#[test]
fn a_cron_run_leads_acts_and_leaves_the_key_to_the_next_run() {
    let Some(etcd) = etcd(1) else { return };
    let Some(mut f) = Fleet::up(1) else { return };
    let hosts = f.names.join(",");
    let url = etcd[0].client.clone();
    let mut run = |name: &str| {
        let p = f.host(0).spawn_as("gebob", None);
        f.host(0).set_apps(&[(p, 0, "100")]);
        let out = f
            .command(&[
                "-H",
                &hosts,
                "enforce",
                "--interval",
                "0",
                "--non-env-processes",
                "--ha-etcd",
                &url,
                "--ha-name",
                name,
            ])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{err}");
        assert_eq!(f.host(0).wait_signal(p, WAIT), Some(SIGTERM), "{err}");
        let epoch: u64 = err
            .split("ha: leader (epoch ")
            .nth(1)
            .and_then(|r| r.split(')').next())
            .and_then(|e| e.parse().ok())
            .unwrap_or_else(|| panic!("{err}"));
        epoch
    };
    // Each run leads at once: the one before revoked its lease on leaving.
    let first = run("cron-a");
    let second = run("cron-b");
    assert!(second > first, "{first} then {second}");
    let epoch = std::fs::read_to_string(f.dir.path().join("h1/run/epoch")).unwrap();
    assert_eq!(epoch.trim(), second.to_string());
}

#[test]
fn boxes_that_run_different_configurations_are_told_by_the_leader_and_doctor() {
    let Some(etcd) = etcd(1) else { return };
    let Some(f) = Fleet::up(1) else { return };
    let url = etcd[0].client.clone();
    let hosts = f.names.join(",");
    let doctor = || {
        let out = f
            .command(&[
                "-H",
                &hosts,
                "doctor",
                "--output",
                "json",
                "--ha-etcd",
                &url,
            ])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let a = Enforcer::start(&f, "box-a", &[&etcd[0]], &["--max-devices-per-user", "2"]);
    let mut b = Enforcer::start(&f, "box-b", &[&etcd[0]], &["--max-devices-per-user", "3"]);
    let start = Instant::now();
    let leader = leader_of(&[&a, &b], start);
    let (lead, follow, other) = if leader == 0 {
        (&a, &b, "box-b")
    } else {
        (&b, &a, "box-a")
    };
    // Said on every cycle (1 s apart), by the leader only.
    let first = lead.saw(start, " leads with configuration ", WAIT);
    std::thread::sleep(Duration::from_secs(4));
    let said = lead
        .lines
        .lock()
        .unwrap()
        .iter()
        .filter(|(t, l)| *t >= first && l.contains(&format!("and {other} runs ")))
        .count();
    assert!(said >= 3, "{said} times in 4 s: {}", lead.stderr());
    assert!(
        !follow.stderr().contains("leads with configuration"),
        "{}",
        follow.stderr()
    );
    let text = doctor();
    assert!(
        text.contains("2 configurations among the boxes: box-a: ") && text.contains(", box-b: "),
        "{text}"
    );
    // box-b again, as box-a runs: the same configuration, and said so.
    b.stop();
    let b = Enforcer::start(&f, "box-b", &[&etcd[0]], &["--max-devices-per-user", "2"]);
    let mut last = String::new();
    let same = wait(Duration::from_secs(30), || {
        last = doctor();
        last.contains("every box runs the same configuration (box-a: ")
    });
    assert!(same, "{last}\n{}\n---\n{}", a.stderr(), b.stderr());
}

#[test]
fn a_follower_warns_nobody_only_the_leader_tells_and_once() {
    let Some(etcd) = etcd(1) else { return };
    let Some(mut f) = Fleet::up(1) else { return };
    let hook = Sink::start("http").unwrap();
    let url = format!("http://127.0.0.1:{}/", hook.port);
    let told = ["--grace", "1h", "--webhook", url.as_str()];
    let a = Enforcer::start(&f, "box-a", &[&etcd[0]], &told);
    let b = Enforcer::start(&f, "box-b", &[&etcd[0]], &told);
    leader_of(&[&a, &b], Instant::now());
    let stray = f.host(0).spawn_as("gealice", None);
    f.host(0).set_apps(&[(stray, 0, "100")]);
    let got = hook.wait_for(1);
    assert_eq!(got.len(), 1, "{got:?}");
    // Five cycles more of each box: the follower's dry run, which reads
    // the ladder and leaves it, sends nothing; the leader warned once.
    std::thread::sleep(Duration::from_secs(5));
    let stages = stages(&hook.received());
    assert_eq!(stages, vec![("warned".to_string(), u64::from(stray))]);
    // Read while both run: a follower that takes over from a stopped
    // leader warns anew (each box's ladder is its own).
    let warned: Vec<usize> = [&a, &b]
        .iter()
        .map(|e| {
            std::fs::read_to_string(&e.audit)
                .unwrap_or_default()
                .matches("\"phase\":\"warned\"")
                .count()
        })
        .collect();
    assert_eq!(
        warned.iter().sum::<usize>(),
        1,
        "warnings audited: {warned:?}"
    );
}

/// Issue 42, row 9: under `--shard`, bob writes a record with a 2 MiB
/// username on a host of shard one. The name is over the bound, so the
/// record is garbled at parse time: shard one's part stays small and is
/// published, and shard two still counts shard one's hosts, so the one
/// global excess of alice's is taken once, as without bob's record.
#[test]
fn row9_a_huge_username_never_withdraws_a_shards_part() {
    let Some(etcd) = etcd(1) else { return };
    let Some(mut f) = Fleet::up(4) else { return };
    let mut jobs = Vec::new();
    let huge = "b".repeat(2 << 20);
    for h in 0..4 {
        let eid = format!("a{h}");
        let p = f.host(h).spawn_as("gealice", Some(&eid));
        let mut envs = vec![util::env(&eid, Some("gealice"), None, p)];
        let mut attached: Vec<(u32, &str)> = vec![(0, eid.as_str())];
        if h == 3 {
            attached.push((1, "a3"));
        }
        if h == 0 {
            let shell = f.host(h).spawn_as("gebob", None);
            // Built here: a lookup of such a name overflows the stack.
            envs.push(serde_json::json!({
                "eid": "big", "uid": 0, "creation": "22/11/2026 15:04:05",
                "username": huge, "config": {"name": null, "gpu_memory": null, "gpus": null},
                "pids": [shell], "kernel_ids": []
            }));
            attached.push((2, "big"));
        }
        f.host(h).write_envs(&envs);
        f.host(h).write_devices(4, &attached);
        f.host(h).set_apps(&[(p, 0, "100")]);
        jobs.push(p);
    }
    // As without bob's record.
    let (one, two) = two_shards(&f, &etcd[0]);
    excess_taken_once(&mut f, &jobs, &one, &two);
    let stderr = one.stderr();
    assert!(!stderr.contains("too large"), "{stderr}");
    assert!(
        stderr.contains("over 256 bytes"),
        "the record is said garbled: {stderr}"
    );
}
