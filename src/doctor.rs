//! `doctor`: what is wrong with a host before enforcing on it. Each host's
//! facts (gathered by [`crate::host`]: the connection, sudo, our agent's
//! account of the host, a real snapshot) become checks, each with a status
//! and, when not ok, how to fix it. Pure: facts in, table out.

use serde::Serialize;

pub use crate::host::facts::{
    counts, snapshot_counts, AgentFacts, Connected, Counts, Facts, FenceFacts, FileKind, GpuFacts,
    Kind, NotConnected, StateFacts, STATE_UNUSABLE,
};
use crate::model::{ConnectFailure, HostId};

/// How a check went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Ok,
    Warn,
    Fail,
    /// Not checked: an earlier check failed.
    Skip,
}

/// One row of the report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    pub check: &'static str,
    pub status: Status,
    pub detail: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

fn check(
    name: &'static str,
    status: Status,
    detail: impl Into<String>,
    fix: Option<String>,
) -> Check {
    Check {
        check: name,
        status,
        detail: detail.into(),
        fix,
    }
}

/// The oldest Python our agent runs on.
const MIN_PYTHON: (u32, u32) = (3, 7);

/// The checks of one host, in the order they depend on each other.
pub fn checks(f: &Facts) -> Vec<Check> {
    let mut out = Vec::new();
    let mut reachable = true;
    if let Some(ssh) = &f.ssh {
        match ssh {
            Ok(c) => {
                out.push(check(
                    "ssh",
                    Status::Ok,
                    format!("connected in {} ms", c.ms),
                    None,
                ));
                out.push(check("host key", Status::Ok, c.host_key, None));
            }
            Err(e) => {
                reachable = false;
                let host_key = e.failure == ConnectFailure::HostKey;
                out.push(check(
                    "ssh",
                    if host_key { Status::Skip } else { Status::Fail },
                    if host_key {
                        "needs a trusted host key".to_string()
                    } else {
                        e.said.clone()
                    },
                    (!host_key).then(|| connect_fix(e, f.known_hosts_file.as_deref())),
                ));
                out.push(if host_key {
                    check(
                        "host key",
                        Status::Fail,
                        e.said.clone(),
                        Some(connect_fix(e, f.known_hosts_file.as_deref())),
                    )
                } else {
                    check("host key", Status::Skip, "needs ssh", None)
                });
            }
        }
    }
    if let Some(root) = f.root {
        out.push(if root {
            check("privileges", Status::Ok, "running as root", None)
        } else {
            check(
                "privileges",
                Status::Warn,
                "not root: other users' processes cannot be signalled nor their environments read",
                Some("run genv-enforce as root (e.g. the systemd service)".into()),
            )
        });
    }
    let mut agent_ok = reachable;
    if f.ssh.is_some() {
        match (reachable, &f.sudo) {
            (false, _) | (true, None) => out.push(check("sudo", Status::Skip, "needs ssh", None)),
            (true, Some(Ok(allowed))) => out.push(check("sudo", Status::Ok, allowed.clone(), None)),
            (true, Some(Err(why))) => {
                agent_ok = false;
                let user = f.login.as_deref().unwrap_or("USER");
                out.push(check(
                    "sudo",
                    Status::Fail,
                    why.clone(),
                    Some(sudoers_fix(user, &f.python_command)),
                ));
            }
        }
    }
    match (&f.agent, agent_ok) {
        (Some(Ok(a)), true) => agent_checks(f, a, &mut out),
        (Some(Err(e)), true) => out.push(check(
            "python",
            Status::Fail,
            e.clone(),
            Some(format!(
                "genv's hosts have Python {}.{}+: install it, or name it with `python = \"...\"` in the inventory",
                MIN_PYTHON.0, MIN_PYTHON.1
            )),
        )),
        _ => {
            for name in ["python", "nvidia-smi", "genv state", "snapshot", "genv"] {
                out.push(check(name, Status::Skip, if reachable { "needs sudo" } else { "needs ssh" }, None));
            }
        }
    }
    out
}

/// The one sudoers rule the docs give (docs/first-fleet.md): the login
/// user may run the agent's Python as root, with any arguments: root on
/// the host, as the agent must be. sudoers wants a full path: a bare
/// `python3` is named as sudo's `secure_path` finds it on Debian and its
/// kin.
fn sudoers_fix(user: &str, python: &str) -> String {
    let path = if python.starts_with('/') {
        python.to_string()
    } else {
        format!("/usr/bin/{python}")
    };
    format!(
        "let the login user run the agent's Python as root without a password (root on the host: keep the login and its key for the enforcer alone): `echo '{user} ALL=(root) NOPASSWD: {path}' > /etc/sudoers.d/genv-enforce` on the host (where `sudo sh -c 'command -v {python}'` names another file, that one)"
    )
}

/// How to fix `e`; a host key goes into `known_hosts` (the run's file,
/// else the login's own).
fn connect_fix(e: &NotConnected, known_hosts: Option<&std::path::Path>) -> String {
    let file = known_hosts.map_or_else(|| "~/.ssh/known_hosts".into(), |p| p.display().to_string());
    match e.failure {
        ConnectFailure::Refused => format!("nothing listens on port {}: is sshd running there, and is the port right (`port` in the inventory, `host:port` with -H)?", e.port),
        ConnectFailure::Unreachable => "the host does not answer: is it up, and does a firewall let port 22 (or its port) through?".into(),
        ConnectFailure::UnknownHost => "the name does not resolve: check DNS or /etc/hosts, or give the address".into(),
        ConnectFailure::Auth => "the host refused our key: add the enforcer's public key to the login user's ~/.ssh/authorized_keys there (ssh-copy-id), or name the right key with --identity-file or `identity_file`".into(),
        ConnectFailure::HostKey => format!("the host key is unknown or changed: check it, then add it (`ssh-keyscan -p {} HOST >> {file}`), or use --host-key-check accept-new (`host-key-check = \"accept-new\"`) for a first contact", e.port),
        ConnectFailure::Other => "see what ssh said; try `ssh -v` to the host as the enforcer's user".into(),
    }
}

fn agent_checks(f: &Facts, a: &AgentFacts, out: &mut Vec<Check>) {
    let version: Vec<u32> = a.python.split('.').filter_map(|p| p.parse().ok()).collect();
    let old = version.len() < 2 || (version[0], version[1]) < MIN_PYTHON;
    out.push(if old {
        check(
            "python",
            Status::Fail,
            format!(
                "Python {} is older than {}.{}",
                a.python, MIN_PYTHON.0, MIN_PYTHON.1
            ),
            Some("name a newer Python with `python = \"...\"` in the inventory".into()),
        )
    } else if a.euid != 0 && f.root.is_none() {
        check(
            "python",
            Status::Fail,
            format!("Python {} runs as uid {}, not root", a.python, a.euid),
            Some("the `sudo` command must run it as root".into()),
        )
    } else {
        check(
            "python",
            Status::Ok,
            format!("Python {} as root", a.python),
            None,
        )
    });
    if let Some(h) = &f.hello {
        out.push(if h.pidfd {
            check(
                "agent",
                Status::Ok,
                format!("protocol {}; kills go through a pidfd", h.protocol),
                None,
            )
        } else {
            check(
                "agent",
                Status::Warn,
                format!(
                    "protocol {}; no pidfd (Python {}): a pid is re-checked before a kill, but not pinned",
                    h.protocol, h.python
                ),
                Some("Python 3.9 or later on a Linux 5.3+ kernel closes the window".into()),
            )
        });
    }
    out.push(match (&a.nvidia_smi.error, a.nvidia_smi.gpus) {
        (Some(e), _) => check(
            "nvidia-smi",
            Status::Fail,
            e.clone(),
            Some("install the NVIDIA driver (and nvidia-smi) on the host, or name nvidia-smi with `nvidia_smi = \"...\"` in the inventory".into()),
        ),
        (None, Some(n)) => check(
            "nvidia-smi",
            Status::Ok,
            format!(
                "{n} GPUs, driver {}",
                a.nvidia_smi.driver.as_deref().unwrap_or("unknown")
            ),
            None,
        ),
        (None, None) => check("nvidia-smi", Status::Warn, "no GPU listed", None),
    });
    out.push(state_check(a, f.snapshot.as_ref()));
    out.push(match (&f.snapshot, &a.nvidia_smi.error) {
        (Some(Ok(c)), _) => check(
            "snapshot",
            Status::Ok,
            format!(
                "a cycle reads this host: {} GPUs, {} GPU processes",
                c.gpus, c.processes
            ),
            None,
        ),
        (Some(Err(_)), Some(_)) => check("snapshot", Status::Skip, "needs nvidia-smi", None),
        (Some(Err(e)), None) => check(
            "snapshot",
            Status::Fail,
            e.clone(),
            Some("a cycle would fail on this host: fix what the error names".into()),
        ),
        (None, _) => check("snapshot", Status::Skip, "not taken", None),
    });
    out.push(match &a.genv {
        Some(v) if v.starts_with("1.") => check("genv", Status::Ok, format!("genv {v}"), None),
        Some(v) => check(
            "genv",
            Status::Warn,
            format!("genv {v}: only genv 1.x state is known to us"),
            None,
        ),
        None => check(
            "genv",
            Status::Warn,
            format!(
                "not installed for Python {} (it may run from another Python or a virtualenv)",
                a.python
            ),
            None,
        ),
    });
    for (tool, why) in [
        (
            "timeout",
            "without it a sudo that hangs is not killed on the host (coreutils)",
        ),
        ("flock", "genv's own scripts use it (util-linux)"),
    ] {
        out.push(match a.tools.get(tool) {
            Some(Some(path)) => check(tool, Status::Ok, path.clone(), None),
            _ => check(
                tool,
                Status::Warn,
                format!("not found: {why}"),
                Some(format!("install {tool}")),
            ),
        });
    }
    if let Some(fence) = &a.fence {
        out.push(fence_check(fence));
    }
    if let Some(skew) = f.skew {
        out.push(if skew.abs() > 2.0 {
            check(
                "clock",
                Status::Warn,
                format!("{skew:+.1} s from ours"),
                Some("run NTP (chrony, systemd-timesyncd) on both machines: logs and audit times disagree".into()),
            )
        } else {
            check("clock", Status::Ok, format!("{skew:+.2} s from ours"), None)
        });
    }
}

/// The fencing directory: what a leader's requests would meet there.
fn fence_check(fence: &FenceFacts) -> Check {
    match (&fence.problem, fence.epoch) {
        (Some(problem), _) => check(
            "fence",
            Status::Fail,
            problem.clone(),
            Some(format!(
                "as root on the host: `rm -rf {}` (the next leader's request makes it again, root's own, 0700)",
                fence.dir
            )),
        ),
        (None, Some(epoch)) => check(
            "fence",
            Status::Ok,
            format!("{}/epoch: the newest leader seen has epoch {epoch}", fence.dir),
            None,
        ),
        (None, None) => check(
            "fence",
            Status::Ok,
            format!(
                "{} holds no epoch yet: the first leader's request sets it",
                fence.dir
            ),
            None,
        ),
    }
}

fn state_check(a: &AgentFacts, snapshot: Option<&Result<Counts, String>>) -> Check {
    let s = &a.state;
    let unsafe_files: Vec<String> = s
        .files
        .iter()
        .filter(|(_, kind)| !matches!(kind, FileKind::Is(Kind::Regular | Kind::Missing)))
        .map(|(name, kind)| format!("{name} is {kind}"))
        .collect();
    if s.kind == FileKind::Is(Kind::Missing) {
        return check(
            "genv state",
            Status::Warn,
            format!(
                "{} does not exist yet (no environment was ever activated)",
                s.dir
            ),
            None,
        );
    }
    if s.kind != FileKind::Is(Kind::Directory) {
        return check(
            "genv state",
            Status::Fail,
            format!("{} is {}: refused", s.dir, s.kind),
            Some(format!("remove it; genv creates {} as a directory", s.dir)),
        );
    }
    if !unsafe_files.is_empty() {
        return check(
            "genv state",
            Status::Fail,
            format!("{}: {}: refused", s.dir, unsafe_files.join(", ")),
            Some(
                "a user replaced genv's files: remove them (genv recreates them) and find out who"
                    .into(),
            ),
        );
    }
    match snapshot {
        Some(Ok(c)) => check(
            "genv state",
            Status::Ok,
            format!(
                "{}: {} environments, {} attachments",
                s.dir, c.envs, c.attachments
            ),
            None,
        ),
        Some(Err(e)) if e.contains(&s.dir) || e.starts_with(STATE_UNUSABLE) => check(
            "genv state",
            Status::Fail,
            e.clone(),
            Some("fix or remove the file named (genv recreates missing state)".into()),
        ),
        _ => check("genv state", Status::Ok, format!("{}: safe", s.dir), None),
    }
}

/// What a device cap leaves open when GPU jobs outside genv are neither
/// terminated (`--non-env-processes`) nor counted
/// (`--count-non-env-devices`): genv counts attached devices only.
pub const DEVICE_CAP_HOLE: &str = "a device cap counts attached devices only: GPU jobs run outside genv (env -u GENV_ENVIRONMENT_ID) escape it";

/// What `policy` leaves open, said when enforcement starts.
pub fn policy_hole(policy: &crate::rules::Policy) -> Option<String> {
    (policy.has_caps() && !policy.non_env_processes && !policy.count_non_env_devices)
        .then(|| format!("{DEVICE_CAP_HOLE}; add --non-env-processes (or --count-non-env-devices)"))
}

/// The doctor's word on an inventory that caps devices.
pub fn device_cap_check() -> Check {
    check(
        "device caps",
        Status::Warn,
        DEVICE_CAP_HOLE,
        Some("enforce with --non-env-processes (or --count-non-env-devices)".into()),
    )
}

/// Whether a host passed: no check failed.
pub fn passed(checks: &[Check]) -> bool {
    checks.iter().all(|c| c.status != Status::Fail)
}

/// The report as a table (with a fix under each failure) and a last line.
pub fn render_text(hosts: &[(HostId, Vec<Check>)]) -> Vec<String> {
    let hw = hosts
        .iter()
        .map(|(h, _)| h.0.len())
        .max()
        .unwrap_or(0)
        .max(4);
    let cw = hosts
        .iter()
        .flat_map(|(_, cs)| cs.iter().map(|c| c.check.len()))
        .max()
        .unwrap_or(0)
        .max(5);
    let mut lines = vec![format!(
        "{:hw$}  {:cw$}  {:6}  DETAIL",
        "HOST", "CHECK", "STATUS"
    )];
    for (host, checks) in hosts {
        for c in checks {
            let status = match c.status {
                Status::Ok => "ok",
                Status::Warn => "warn",
                Status::Fail => "FAIL",
                Status::Skip => "-",
            };
            lines.push(format!(
                "{:hw$}  {:cw$}  {status:6}  {}",
                crate::report::clean(&host.0),
                c.check,
                crate::report::clean(&c.detail)
            ));
            if let Some(fix) = &c.fix {
                lines.push(format!(
                    "{:hw$}  {:cw$}  {:6}  fix: {}",
                    "",
                    "",
                    "",
                    crate::report::clean(fix)
                ));
            }
        }
    }
    let ok = hosts.iter().filter(|(_, c)| passed(c)).count();
    lines.push(format!("{ok} of {} hosts ready", hosts.len()));
    lines
}

/// The report as one JSON object.
pub fn render_json(hosts: &[(HostId, Vec<Check>)]) -> String {
    let hosts: Vec<serde_json::Value> = hosts
        .iter()
        .map(|(h, checks)| serde_json::json!({"host": h, "ok": passed(checks), "checks": checks}))
        .collect();
    crate::report::json_safe(serde_json::json!({ "hosts": hosts }).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::protocol::Hello;

    fn agent() -> AgentFacts {
        AgentFacts {
            python: "3.11.2".into(),
            euid: 0,
            time: 0.0,
            nvidia_smi: GpuFacts {
                gpus: Some(8),
                driver: Some("580.159.04".into()),
                error: None,
            },
            state: StateFacts {
                dir: "/var/tmp/genv".into(),
                kind: FileKind::Is(Kind::Directory),
                mode: Some(0o777),
                uid: Some(0),
                files: [
                    ("envs.json", Kind::Regular),
                    ("devices.json", Kind::Regular),
                ]
                .into_iter()
                .map(|(a, b)| (a.to_string(), FileKind::Is(b)))
                .collect(),
            },
            genv: Some("1.4.3".into()),
            tools: [("timeout", Some("/usr/bin/timeout")), ("flock", None)]
                .into_iter()
                .map(|(a, b)| (a.to_string(), b.map(String::from)))
                .collect(),
            fence: None,
        }
    }

    fn healthy() -> Facts {
        Facts {
            host: HostId("gpu1".into()),
            ssh: Some(Ok(Connected {
                ms: 80,
                host_key: "verified",
            })),
            sudo: Some(Ok("(root) NOPASSWD: /usr/bin/python3".into())),
            login: Some("ops".into()),
            known_hosts_file: None,
            python_command: "python3".into(),
            agent: Some(Ok(agent())),
            hello: Some(Hello {
                protocol: crate::host::protocol::PROTOCOL,
                python: "3.11.2".into(),
                pidfd: true,
                euid: 0,
            }),
            snapshot: Some(Ok(Counts {
                gpus: 8,
                processes: 3,
                envs: 2,
                attachments: 4,
            })),
            skew: Some(0.03),
            root: None,
        }
    }

    fn status(checks: &[Check], name: &str) -> Status {
        checks.iter().find(|c| c.check == name).unwrap().status
    }

    #[test]
    fn a_healthy_host_passes_with_warnings_for_what_is_optional() {
        let c = checks(&healthy());
        assert!(passed(&c), "{c:#?}");
        let names: Vec<_> = c.iter().map(|c| c.check).collect();
        assert_eq!(
            names,
            [
                "ssh",
                "host key",
                "sudo",
                "python",
                "agent",
                "nvidia-smi",
                "genv state",
                "snapshot",
                "genv",
                "timeout",
                "flock",
                "clock"
            ]
        );
        assert_eq!(status(&c, "flock"), Status::Warn);
        assert!(c
            .iter()
            .find(|c| c.check == "genv state")
            .unwrap()
            .detail
            .contains("2 environments, 4 attachments"));
        assert!(c
            .iter()
            .find(|c| c.check == "nvidia-smi")
            .unwrap()
            .detail
            .contains("8 GPUs, driver 580.159.04"));
    }

    #[test]
    fn the_fence_is_checked_only_under_high_availability_and_a_problem_fails() {
        let named = |f: &Facts| checks(f).into_iter().find(|c| c.check == "fence");
        assert_eq!(named(&healthy()), None);
        let mut f = healthy();
        let mut a = agent();
        a.fence = Some(FenceFacts {
            dir: "/run/genv-enforce".into(),
            kind: FileKind::Is(Kind::Missing),
            epoch: None,
            problem: None,
        });
        f.agent = Some(Ok(a.clone()));
        let c = named(&f).unwrap();
        assert_eq!(c.status, Status::Ok);
        assert!(c.detail.contains("holds no epoch yet"), "{c:?}");
        a.fence.as_mut().unwrap().epoch = Some(12);
        f.agent = Some(Ok(a.clone()));
        assert!(named(&f).unwrap().detail.contains("has epoch 12"));
        a.fence.as_mut().unwrap().problem = Some("/run/genv-enforce: a symbolic link".into());
        f.agent = Some(Ok(a));
        let c = named(&f).unwrap();
        assert_eq!(c.status, Status::Fail);
        assert!(c.fix.unwrap().contains("rm -rf /run/genv-enforce"));
        assert!(!passed(&checks(&f)));
    }

    #[test]
    fn each_failure_says_how_to_fix_it_and_skips_what_depends_on_it() {
        let mut f = healthy();
        f.ssh = Some(Err(NotConnected {
            failure: ConnectFailure::Auth,
            said: "ops@gpu1: Permission denied (publickey).".into(),
            port: 22,
        }));
        let c = checks(&f);
        assert!(!passed(&c));
        assert!(c[0].fix.as_deref().unwrap().contains("authorized_keys"));
        assert_eq!(status(&c, "sudo"), Status::Skip);
        assert_eq!(status(&c, "nvidia-smi"), Status::Skip);

        let mut f = healthy();
        f.ssh = Some(Err(NotConnected {
            failure: ConnectFailure::HostKey,
            said: "Host key verification failed.".into(),
            port: 22,
        }));
        let c = checks(&f);
        assert_eq!(
            (status(&c, "ssh"), status(&c, "host key")),
            (Status::Skip, Status::Fail)
        );
        assert!(c[1]
            .fix
            .as_deref()
            .unwrap()
            .contains("`ssh-keyscan -p 22 HOST >> ~/.ssh/known_hosts`"));
        f.known_hosts_file = Some("/var/lib/genv-enforce/known_hosts".into());
        assert!(checks(&f)[1]
            .fix
            .as_deref()
            .unwrap()
            .contains("`ssh-keyscan -p 22 HOST >> /var/lib/genv-enforce/known_hosts`"));

        let mut f = healthy();
        f.sudo = Some(Err("sudo: a password is required".into()));
        let sudo_fix = |f: &Facts| {
            let c = checks(f);
            assert_eq!(status(&c, "python"), Status::Skip);
            let sudo = c.into_iter().find(|c| c.check == "sudo").unwrap();
            sudo.fix.unwrap()
        };
        assert!(sudo_fix(&f)
            .contains("'ops ALL=(root) NOPASSWD: /usr/bin/python3' > /etc/sudoers.d/genv-enforce"));
        f.python_command = "/opt/py/bin/python3".into();
        assert!(sudo_fix(&f).contains("NOPASSWD: /opt/py/bin/python3'"));

        let mut f = healthy();
        let mut a = agent();
        a.nvidia_smi = GpuFacts {
            error: Some("nvidia-smi exited with status 9: NVIDIA-SMI has failed".into()),
            ..GpuFacts::default()
        };
        a.state
            .files
            .insert("envs.json".into(), FileKind::Is(Kind::Symlink));
        a.python = "3.6.15".into();
        f.agent = Some(Ok(a));
        f.skew = Some(-75.0);
        let c = checks(&f);
        for name in ["nvidia-smi", "genv state", "python"] {
            assert_eq!(status(&c, name), Status::Fail, "{name}: {c:#?}");
        }
        f.snapshot = Some(Err("nvidia-smi exited with status 9".into()));
        assert_eq!(status(&checks(&f), "snapshot"), Status::Skip);
        assert_eq!(status(&c, "clock"), Status::Warn);
        assert!(c
            .iter()
            .all(|c| c.status != Status::Fail || c.fix.is_some()));

        let mut f = healthy();
        f.snapshot = Some(Err(
            "/var/tmp/genv/envs.json: envs[0].eid: invalid type".into()
        ));
        assert_eq!(status(&checks(&f), "genv state"), Status::Fail);
        let mut a = agent();
        a.state.kind = FileKind::Is(Kind::Missing);
        f.agent = Some(Ok(a));
        assert_eq!(status(&checks(&f), "genv state"), Status::Warn);
    }

    #[test]
    fn boundaries_versions_tools_and_what_names_the_state() {
        let with = |change: &dyn Fn(&mut AgentFacts)| {
            let mut f = healthy();
            let mut a = agent();
            change(&mut a);
            f.agent = Some(Ok(a));
            checks(&f)
        };
        assert_eq!(
            status(&with(&|a| a.python = "3.7.0".into()), "python"),
            Status::Ok
        );
        assert_eq!(
            status(&with(&|a| a.python = "3.7".into()), "python"),
            Status::Ok
        );
        assert_eq!(
            status(&with(&|a| a.python = "3".into()), "python"),
            Status::Fail
        );
        assert_eq!(
            status(&with(&|a| a.python = "2.7.18".into()), "python"),
            Status::Fail
        );
        assert_eq!(status(&with(&|a| a.euid = 1000), "python"), Status::Fail);
        assert_eq!(
            status(&with(&|a| a.genv = Some("2.0.0".into())), "genv"),
            Status::Warn
        );
        assert_eq!(status(&with(&|a| a.genv = None), "genv"), Status::Warn);
        let c = with(&|_| ());
        assert_eq!(status(&c, "genv"), Status::Ok);
        assert_eq!(status(&c, "timeout"), Status::Ok);
        assert_eq!(
            c.iter().find(|c| c.check == "timeout").unwrap().detail,
            "/usr/bin/timeout"
        );
        // The agent itself failing (no Python 3 there) is Python's failure.
        let mut f = healthy();
        f.agent = Some(Err("python3: command not found".into()));
        let c = checks(&f);
        assert_eq!(status(&c, "python"), Status::Fail);
        assert!(c
            .iter()
            .find(|c| c.check == "python")
            .unwrap()
            .fix
            .is_some());
        // Skew: 2 s is within bounds, more is a warning.
        let mut f = healthy();
        f.skew = Some(2.0);
        assert_eq!(status(&checks(&f), "clock"), Status::Ok);
        f.skew = Some(-2.5);
        assert_eq!(status(&checks(&f), "clock"), Status::Warn);
        // A snapshot that failed for another reason leaves the state dir ok.
        let mut f = healthy();
        f.snapshot = Some(Err(
            "gpu1: nvidia-smi --query-compute-apps: line 3: bad pid".into(),
        ));
        let c = checks(&f);
        assert_eq!(status(&c, "genv state"), Status::Ok);
        assert_eq!(status(&c, "snapshot"), Status::Fail);
    }

    #[test]
    fn local_hosts_report_privileges_instead_of_ssh_and_sudo() {
        let mut f = healthy();
        f.ssh = None;
        f.sudo = None;
        f.skew = None;
        f.root = Some(false);
        let c = checks(&f);
        assert_eq!(c[0].check, "privileges");
        assert_eq!(c[0].status, Status::Warn);
        assert!(passed(&c));
        assert!(!c
            .iter()
            .any(|c| c.check == "ssh" || c.check == "sudo" || c.check == "clock"));
    }

    #[test]
    fn the_table_has_a_fix_under_each_failure_and_json_says_which_hosts_pass() {
        let mut bad = healthy();
        bad.host = HostId("gpu2".into());
        bad.sudo = Some(Err("sudo: a password is required".into()));
        let hosts = vec![
            (HostId("gpu1".into()), checks(&healthy())),
            (HostId("gpu2".into()), checks(&bad)),
        ];
        let text = render_text(&hosts);
        assert!(text[0].starts_with("HOST"));
        let fail = text.iter().position(|l| l.contains("FAIL")).unwrap();
        assert!(text[fail + 1].contains("fix: "));
        assert_eq!(text.last().unwrap(), "1 of 2 hosts ready");
        let json: serde_json::Value = serde_json::from_str(&render_json(&hosts)).unwrap();
        assert_eq!(json["hosts"][0]["ok"], true);
        assert_eq!(json["hosts"][1]["ok"], false);
        assert_eq!(json["hosts"][1]["checks"][2]["status"], "fail");
    }

    #[test]
    fn a_device_cap_with_jobs_outside_genv_neither_ended_nor_counted_is_a_hole() {
        use crate::rules::Policy;
        let capped = Policy {
            max_devices_per_user: Some(2),
            ..Policy::default()
        };
        assert!(policy_hole(&capped)
            .unwrap()
            .contains("env -u GENV_ENVIRONMENT_ID"));
        for closed in [
            Policy {
                non_env_processes: true,
                ..capped.clone()
            },
            Policy {
                count_non_env_devices: true,
                ..capped.clone()
            },
            Policy::default(),
        ] {
            assert_eq!(policy_hole(&closed), None, "{closed:?}");
        }
        let one = Policy {
            max_devices_for_user: [("bob".to_string(), 1)].into_iter().collect(),
            ..Policy::default()
        };
        assert!(policy_hole(&one).is_some());
        assert_eq!(device_cap_check().status, Status::Warn);
    }

    #[test]
    fn a_degraded_snapshot_fails_the_state_and_snapshot_checks() {
        let mut snap = crate::model::HostSnapshot {
            truth: Some(crate::model::HostTruth::default()),
            ..Default::default()
        };
        assert!(snapshot_counts(&snap).is_ok());
        snap.truth.as_mut().unwrap().state_problem = Some("envs.json: garbled".into());
        let e = snapshot_counts(&snap).unwrap_err();
        assert_eq!(e, "genv's state cannot be used: envs.json: garbled");
    }
}
