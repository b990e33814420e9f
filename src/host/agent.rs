//! What runs on a remote host, and the pure parsers of what comes back.
//!
//! Hosts need only what a genv host has: `sh`, `sudo`, nvidia-smi, genv's
//! files and the Python 3 that genv runs on. Our host agent (`agent.py`,
//! included here) is not installed there: the command line is a constant
//! bootstrap, the agent's text travels on stdin, and the agent then stays,
//! answering one request per cycle over the same channel, so that a cycle
//! starts no process on the host but nvidia-smi (and sudo's log holds one
//! short line per connection). Host data never reaches a shell: requests
//! are JSON, answers are length-prefixed.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::json;

use crate::model::Pid;
use crate::outcome;
use crate::plan::{Detach, Signal, Termination};

/// The host agent's source.
pub const AGENT: &str = include_str!("agent.py");

/// The most a state file or a tool's answer may hold on the host.
pub const MAX_STATE_BYTES: u64 = super::MAX_STATE_BYTES;

/// The most we read of a remote command's output: two state files and two
/// nvidia-smi answers at their caps, and room for the frames.
pub const MAX_OUTPUT_BYTES: u64 = 4 * MAX_STATE_BYTES + (1 << 20);
const _: () = assert!(
    MAX_OUTPUT_BYTES > 4 * MAX_STATE_BYTES && MAX_OUTPUT_BYTES <= 4 * MAX_STATE_BYTES + (16 << 20),
    "an answer must hold every part at its cap, and little more"
);

/// The Python arguments that run the agent: it reads its own text from
/// stdin, then the request.
pub fn bootstrap() -> [String; 4] {
    [
        "-I".into(),
        "-S".into(),
        "-c".into(),
        format!(
            "import sys;exec(compile(sys.stdin.buffer.read({}),'genv-enforce-agent','exec'))",
            AGENT.len()
        ),
    ]
}

/// One request as the agent reads it: `<length>\n<json>`.
pub fn encode(request: &serde_json::Value) -> Vec<u8> {
    let json = request.to_string();
    let mut bytes = format!("{}\n", json.len()).into_bytes();
    bytes.extend_from_slice(json.as_bytes());
    bytes
}

/// The header of one answer, `@<status> <length>`: its status and length.
///
/// # Errors
/// Anything else (the agent is not speaking our protocol).
pub fn answer_header(line: &str) -> Result<(i32, u64), String> {
    let bad = || format!("not an answer from our agent: {:?}", line.trim_end());
    let (status, len) = line
        .trim_end()
        .strip_prefix('@')
        .and_then(|h| h.split_once(' '))
        .ok_or_else(bad)?;
    let status = status.parse().map_err(|_| bad())?;
    let len: u64 = len.parse().map_err(|_| bad())?;
    if len > MAX_OUTPUT_BYTES {
        return Err(format!("an answer of {len} bytes is over our limit"));
    }
    Ok((status, len))
}

/// Runs its arguments under `timeout` when the host has it (coreutils and
/// busybox both do), so that a command that hangs (sudo waiting on a
/// directory service) is killed on the host before our deadline; otherwise
/// its session would linger on the master and count against sshd's
/// MaxSessions. Used to try `sudo` before the agent is started; past sudo,
/// the agent bounds itself, as root. See the file's header for its
/// arguments and exit statuses.
pub const BOUNDED: &str = include_str!("bounded.sh");

/// Exit statuses of [`BOUNDED`] when its limit was hit.
pub const TIMED_OUT: [i32; 2] = [124, 137];

/// Limits of one agent run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// For the steps (nvidia-smi, waiting on genv's lock), from the start.
    pub step: Duration,
    /// For the whole run, after which the agent ends itself.
    pub run: Duration,
}

/// The snapshot request.
pub fn snapshot_request(
    dir: &str,
    nvidia_smi: &[String],
    limits: Limits,
    max_records: usize,
) -> serde_json::Value {
    json!({
        "mode": "snapshot",
        "dir": dir,
        "nvidia_smi": nvidia_smi,
        "step": limits.step.as_secs_f64(),
        "limit": limits.run.as_secs_f64(),
        "max_bytes": MAX_STATE_BYTES,
        "max_records": max_records,
    })
}

/// The kill request for these terminations: only those with a start time
/// (never signalled blind); [`read_terminations`] answers the rest.
pub fn terminate_request(
    terminations: &[Termination],
    signal: Signal,
    limits: Limits,
) -> Option<serde_json::Value> {
    let signal = match signal {
        Signal::Term => "term",
        Signal::Kill => "kill",
    };
    let kills: Vec<[u64; 2]> = terminations
        .iter()
        .filter_map(|t| t.start_time.map(|s| [u64::from(t.pid.0), s]))
        .collect();
    (!kills.is_empty())
        .then(|| json!({"mode": "terminate", "kills": kills, "signal": signal, "limit": limits.run.as_secs_f64()}))
}

/// The doctor request: facts about the host (see `agent.py`'s `doctor`).
pub fn doctor_request(dir: &str, nvidia_smi: &[String], limits: Limits) -> serde_json::Value {
    json!({
        "mode": "doctor",
        "dir": dir,
        "nvidia_smi": nvidia_smi,
        "step": limits.step.as_secs_f64(),
        "limit": limits.run.as_secs_f64(),
    })
}

/// The detach request.
pub fn detach_request(dir: &str, detaches: &[Detach], limits: Limits) -> serde_json::Value {
    let pairs: Vec<(u32, &str)> = detaches
        .iter()
        .map(|d| (d.device.0, d.eid.0.as_str()))
        .collect();
    json!({
        "mode": "detach",
        "dir": dir,
        "detach": pairs,
        "step": limits.step.as_secs_f64(),
        "limit": limits.run.as_secs_f64(),
        "max_bytes": MAX_STATE_BYTES,
    })
}

/// Reads the agent's kill answer: one outcome per termination, in order.
pub fn read_terminations(
    stdout: &str,
    terminations: &[Termination],
) -> Vec<outcome::TerminateResult> {
    use outcome::TerminateResult as T;
    let answers: BTreeMap<Pid, Vec<&str>> = stdout
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let pid = w.next()?.parse().ok()?;
            Some((Pid(pid), w.collect()))
        })
        .collect();
    terminations
        .iter()
        .map(|t| {
            let Some(expected) = t.start_time else {
                return T::NoIdentity;
            };
            match answers.get(&t.pid).map(Vec::as_slice) {
                Some(["signalled"]) => T::Signalled,
                Some(["gone"]) => T::AlreadyGone,
                Some(["denied"]) => T::PermissionDenied,
                Some(["reused", found]) => match found.parse() {
                    Ok(found) => T::PidReused { expected, found },
                    Err(_) => T::Failed {
                        error: format!("unreadable start time {found:?}"),
                    },
                },
                Some(other) => T::Failed {
                    error: format!("unexpected answer {:?}", other.join(" ")),
                },
                None => T::Failed {
                    error: "no answer from the host".into(),
                },
            }
        })
        .collect()
}

/// Reads the agent's detach answer (`<n> detached|absent` per pair).
pub fn read_detaches(stdout: &str, detaches: &[Detach]) -> Vec<outcome::DetachResult> {
    let answers: BTreeMap<usize, &str> = stdout
        .lines()
        .filter_map(|l| {
            let (n, what) = l.split_once(' ')?;
            Some((n.parse().ok()?, what))
        })
        .collect();
    (0..detaches.len())
        .map(|n| match answers.get(&n) {
            Some(&"detached") => outcome::DetachResult::Detached,
            Some(&"absent") => outcome::DetachResult::NotAttached,
            _ => outcome::DetachResult::Failed {
                error: "no answer from the host".into(),
            },
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{EnvId, GpuIndex};

    fn term(pid: u32, start: Option<u64>) -> Termination {
        Termination::of(Pid(pid), start)
    }

    #[test]
    fn termination_requests_and_answers() {
        use outcome::TerminateResult as T;
        let ts = [
            term(1, Some(10)),
            term(2, Some(20)),
            term(3, Some(30)),
            term(4, Some(40)),
            term(5, None),
            term(6, Some(60)),
            term(7, Some(70)),
        ];
        let limits = Limits {
            step: Duration::from_secs(1),
            run: Duration::from_secs(2),
        };
        let req = terminate_request(&ts, Signal::Term, limits).unwrap();
        assert_eq!(
            req["kills"],
            json!([[1, 10], [2, 20], [3, 30], [4, 40], [6, 60], [7, 70]])
        );
        assert_eq!(req["signal"], "term");
        assert_eq!(
            terminate_request(&ts, Signal::Kill, limits).unwrap()["signal"],
            "kill"
        );
        assert_eq!(
            terminate_request(&ts[4..5], Signal::Term, limits),
            None,
            "nothing is signalled blind"
        );
        let out = read_terminations("1 signalled\n2 gone\n3 reused 31\n4 denied\n7 what\n", &ts);
        assert_eq!(
            out[..5],
            [
                T::Signalled,
                T::AlreadyGone,
                T::PidReused {
                    expected: 30,
                    found: 31
                },
                T::PermissionDenied,
                T::NoIdentity
            ]
        );
        assert!(matches!(out[5], T::Failed { .. }));
        assert!(matches!(&out[6], T::Failed { error } if error.contains("what")));
    }

    #[test]
    fn snapshot_requests_carry_the_hosts_settings_and_limits() {
        let limits = Limits {
            step: Duration::from_millis(2500),
            run: Duration::from_secs(3),
        };
        let req = snapshot_request(
            "/var/tmp/genv",
            &["nvidia-smi".into(), "-x".into()],
            limits,
            7,
        );
        assert_eq!(
            req,
            json!({"mode": "snapshot", "dir": "/var/tmp/genv", "nvidia_smi": ["nvidia-smi", "-x"],
                   "step": 2.5, "limit": 3.0, "max_bytes": MAX_STATE_BYTES, "max_records": 7})
        );
    }

    #[test]
    fn detach_requests_and_answers() {
        let d = |i, e: &str| Detach {
            device: GpuIndex(i),
            eid: EnvId(e.into()),
            username: None,
        };
        let ds = [d(0, "e\n$(x)"), d(3, "f"), d(1, "g")];
        let req = detach_request(
            "/var/tmp/genv",
            &ds,
            Limits {
                step: Duration::from_secs(1),
                run: Duration::from_secs(2),
            },
        );
        assert_eq!(req["detach"], json!([[0, "e\n$(x)"], [3, "f"], [1, "g"]]));
        assert_eq!(req["dir"], "/var/tmp/genv");
        assert_eq!(
            read_detaches("0 detached\n1 absent\n", &ds),
            [
                outcome::DetachResult::Detached,
                outcome::DetachResult::NotAttached,
                outcome::DetachResult::Failed {
                    error: "no answer from the host".into()
                }
            ]
        );
    }

    #[test]
    fn the_command_line_is_constant_and_requests_are_length_prefixed() {
        let boot = bootstrap();
        assert!(boot[3].contains(&format!("read({})", AGENT.len())));
        assert_eq!(encode(&json!({"mode": "x"})), b"12\n{\"mode\":\"x\"}");
        assert_eq!(answer_header("@0 12\n"), Ok((0, 12)));
        assert_eq!(answer_header("@75 0"), Ok((75, 0)));
        for bad in [
            "",
            "0 12",
            "@x 1",
            "@0",
            "@0 -1",
            "Traceback (most recent call last):",
        ] {
            assert!(answer_header(bad).is_err(), "{bad:?}");
        }
        assert!(answer_header(&format!("@0 {}", MAX_OUTPUT_BYTES + 1)).is_err());
        assert_eq!(
            answer_header(&format!("@0 {MAX_OUTPUT_BYTES}")),
            Ok((0, MAX_OUTPUT_BYTES))
        );
    }
}
