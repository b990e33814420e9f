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

use crate::error::HostError;
use crate::model::Pid;
use crate::outcome;
use crate::plan::{Detach, Termination};
use crate::snapshot::assemble::{Environ, RawHost, RawProc};
use crate::snapshot::ParseError;

/// The host agent's source.
pub const AGENT: &str = include_str!("agent.py");

/// The most a state file or a tool's answer may hold on the host.
pub const MAX_STATE_BYTES: u64 = crate::state::MAX_STATE_BYTES;

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
/// the agent bounds itself, as root. Arguments: seconds, then argv. Exit
/// status 124 (or 137 after the kill) means the limit was hit.
pub const BOUNDED: &str = r#"l=$1; shift; if command -v timeout >/dev/null 2>&1; then exec timeout -k 1 "$l" "$@"; fi; exec "$@""#;

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
pub fn snapshot_request(dir: &str, nvidia_smi: &[String], limits: Limits) -> serde_json::Value {
    json!({
        "mode": "snapshot",
        "dir": dir,
        "nvidia_smi": nvidia_smi,
        "step": limits.step.as_secs_f64(),
        "limit": limits.run.as_secs_f64(),
        "max_bytes": MAX_STATE_BYTES,
    })
}

/// The kill request for these terminations: only those with a start time
/// (never signalled blind); [`read_terminations`] answers the rest.
pub fn terminate_request(
    terminations: &[Termination],
    limits: Limits,
) -> Option<serde_json::Value> {
    let kills: Vec<[u64; 2]> = terminations
        .iter()
        .filter_map(|t| t.start_time.map(|s| [u64::from(t.pid.0), s]))
        .collect();
    (!kills.is_empty())
        .then(|| json!({"mode": "terminate", "kills": kills, "limit": limits.run.as_secs_f64()}))
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

/// One frame of the agent's snapshot answer, borrowed from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame<'a> {
    pub kind: &'a str,
    pub arg: Option<&'a str>,
    pub body: &'a [u8],
}

/// Splits the agent's snapshot answer into frames.
///
/// # Errors
/// A malformed header or a frame shorter than announced (truncated output).
pub fn parse_frames<'a>(mut bytes: &'a [u8], source: &str) -> Result<Vec<Frame<'a>>, ParseError> {
    let mut frames = Vec::new();
    while !bytes.is_empty() {
        let bad = |m: String| ParseError::new(source, format!("frame {}", frames.len() + 1), m);
        let nl = bytes
            .iter()
            .position(|&b| b == b'\n')
            .ok_or_else(|| bad("header without newline".into()))?;
        let header =
            std::str::from_utf8(&bytes[..nl]).map_err(|_| bad("header is not UTF-8".into()))?;
        let words: Vec<&str> = header
            .strip_prefix('@')
            .ok_or_else(|| bad(format!("not a frame header: {header:?}")))?
            .split(' ')
            .collect();
        let (kind, arg, len) = match words[..] {
            [kind, len] => (kind, None, len),
            [kind, arg, len] => (kind, Some(arg), len),
            _ => return Err(bad(format!("not a frame header: {header:?}"))),
        };
        let len: usize = len
            .parse()
            .map_err(|_| bad(format!("bad length in {header:?}")))?;
        let rest = &bytes[nl + 1..];
        if rest.len() < len {
            return Err(bad(format!(
                "{kind} truncated: {} of {len} bytes",
                rest.len()
            )));
        }
        frames.push(Frame {
            kind,
            arg,
            body: &rest[..len],
        });
        bytes = &rest[len..];
    }
    Ok(frames)
}

fn text(frame: &Frame, source: &str) -> Result<String, ParseError> {
    std::str::from_utf8(frame.body)
        .map(str::to_string)
        .map_err(|_| ParseError::new(source, frame.kind, "not UTF-8"))
}

/// The raw parts of a host snapshot from the agent's frames.
///
/// # Errors
/// A step failed on the host (nvidia-smi, genv's lock, a state file), or
/// the answer is malformed.
pub fn raw_host(frames: &[Frame], source: &str) -> Result<RawHost, HostError> {
    if let Some(f) = frames.iter().find(|f| f.kind == "fail") {
        return Err(HostError::Remote {
            what: f.arg.unwrap_or_default().to_string(),
            message: String::from_utf8_lossy(f.body).trim().to_string(),
        });
    }
    let find = |kind: &str| frames.iter().find(|f| f.kind == kind && f.arg.is_none());
    let required = |kind: &str| {
        find(kind).ok_or_else(|| ParseError::new(source, kind, "missing from the host's answer"))
    };
    let optional = |kind: &str| find(kind).map(|f| text(f, source)).transpose();
    let mut raw = RawHost {
        gpus: text(required("gpus")?, source)?,
        apps: text(required("apps")?, source)?,
        envs: optional("envs")?,
        devices: optional("devices")?,
        procs: BTreeMap::new(),
        user_names: BTreeMap::new(),
    };
    for f in frames {
        let number = |what: &str| {
            f.arg
                .and_then(|a| a.parse::<u32>().ok())
                .ok_or_else(|| ParseError::new(source, f.kind, format!("bad {what} {:?}", f.arg)))
        };
        match f.kind {
            "proc" => {
                raw.procs.insert(number("pid")?, proc_body(f.body, source)?);
            }
            "user" => {
                raw.user_names.insert(number("uid")?, text(f, source)?);
            }
            _ => {}
        }
    }
    Ok(raw)
}

/// A `proc` frame's body: `seen <start> <uid|-> <environ>\n<value>` or
/// `unsure\n<why>`.
fn proc_body(body: &[u8], source: &str) -> Result<RawProc, ParseError> {
    let bad = || {
        ParseError::new(
            source,
            "proc",
            format!("malformed: {:?}", String::from_utf8_lossy(body)),
        )
    };
    let (head, rest) = match body.iter().position(|&b| b == b'\n') {
        Some(nl) => (&body[..nl], &body[nl + 1..]),
        None => (body, &b""[..]),
    };
    let head = std::str::from_utf8(head).map_err(|_| bad())?;
    let why = || String::from_utf8_lossy(rest).into_owned();
    match head.split(' ').collect::<Vec<_>>()[..] {
        ["unsure"] => Ok(RawProc::Unsure(why())),
        ["seen", start, uid, environ] => Ok(RawProc::Seen {
            start_time: start.parse().map_err(|_| bad())?,
            uid: match uid {
                "-" => None,
                n => Some(n.parse().map_err(|_| bad())?),
            },
            environ: match environ {
                "var" => Environ::Var(rest.to_vec()),
                "novar" => Environ::NoVar,
                "notread" => Environ::NotRead,
                "unreadable" => Environ::Unreadable(why()),
                _ => return Err(bad()),
            },
        }),
        _ => Err(bad()),
    }
}

/// Reads the agent's kill answer: one outcome per termination, in order.
pub fn read_terminations(stdout: &str, terminations: &[Termination]) -> Vec<outcome::Termination> {
    use outcome::Termination as T;
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
pub fn read_detaches(stdout: &str, detaches: &[Detach]) -> Vec<outcome::Detach> {
    let answers: BTreeMap<usize, &str> = stdout
        .lines()
        .filter_map(|l| {
            let (n, what) = l.split_once(' ')?;
            Some((n.parse().ok()?, what))
        })
        .collect();
    (0..detaches.len())
        .map(|n| match answers.get(&n) {
            Some(&"detached") => outcome::Detach::Detached,
            Some(&"absent") => outcome::Detach::NotAttached,
            _ => outcome::Detach::Failed {
                error: "no answer from the host".into(),
            },
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{EnvId, GpuIndex};

    fn frame(kind: &str, arg: Option<&str>, body: &[u8]) -> Vec<u8> {
        let mut f = match arg {
            Some(a) => format!("@{kind} {a} {}\n", body.len()),
            None => format!("@{kind} {}\n", body.len()),
        }
        .into_bytes();
        f.extend_from_slice(body);
        f
    }

    fn answer() -> Vec<u8> {
        [
            frame("gpus", None, b"GPU-a, 0, 81559\n"),
            frame("apps", None, b"GPU-a, 100, 50\n"),
            frame("envs", None, b"{\"envs\": []}"),
            frame(
                "proc",
                Some("100"),
                b"seen 4242 1001 var\ne\n\x01; rm -rf /\xff",
            ),
            frame("proc", Some("7"), b"seen 5 - notread\n"),
            frame(
                "proc",
                Some("8"),
                b"seen 6 0 unreadable\nnot enough permissions",
            ),
            frame(
                "proc",
                Some("9"),
                b"unsure\nits pid was reused while it was read",
            ),
            frame("proc", Some("10"), b"seen 8 2 novar\n"),
            frame("user", Some("1001"), b"alice"),
        ]
        .concat()
    }

    #[test]
    fn frames_become_raw_parts_byte_for_byte() {
        let raw = raw_host(&parse_frames(&answer(), "h").unwrap(), "h").unwrap();
        assert_eq!(raw.devices, None);
        assert_eq!(raw.envs.as_deref(), Some("{\"envs\": []}"));
        assert_eq!(
            raw.procs[&100],
            RawProc::Seen {
                start_time: 4242,
                uid: Some(1001),
                environ: Environ::Var(b"e\n\x01; rm -rf /\xff".to_vec())
            }
        );
        assert_eq!(
            raw.procs[&7],
            RawProc::Seen {
                start_time: 5,
                uid: None,
                environ: Environ::NotRead
            }
        );
        assert!(
            matches!(&raw.procs[&8], RawProc::Seen { environ: Environ::Unreadable(w), .. } if w == "not enough permissions")
        );
        assert!(matches!(&raw.procs[&9], RawProc::Unsure(w) if w.contains("reused")));
        assert_eq!(
            raw.procs[&10],
            RawProc::Seen {
                start_time: 8,
                uid: Some(2),
                environ: Environ::NoVar
            }
        );
        assert_eq!(raw.user_names[&1001], "alice");
    }

    #[test]
    fn failures_malformed_and_truncated_answers_are_errors() {
        let failed = [
            frame("gpus", None, b""),
            frame(
                "fail",
                Some("nvidia-smi"),
                b"--query-compute-apps exited with status 9: NVIDIA driver\n",
            ),
        ]
        .concat();
        let e = raw_host(&parse_frames(&failed, "h").unwrap(), "h").unwrap_err();
        assert_eq!(
            e.to_string(),
            "nvidia-smi: --query-compute-apps exited with status 9: NVIDIA driver"
        );
        let mut cut = answer();
        cut.truncate(cut.len() - 3);
        assert!(parse_frames(&cut, "h").is_err());
        assert!(parse_frames(b"@gpus 100\nGPU-a, 0\n", "h")
            .unwrap_err()
            .message
            .contains("truncated"));
        assert!(parse_frames(b"garbage\n", "h").is_err());
        assert!(parse_frames(b"@a b c d\n", "h").is_err());
        let no_apps = frame("gpus", None, b"");
        assert!(raw_host(&parse_frames(&no_apps, "h").unwrap(), "h").is_err());
        for bad in [
            &b"seen x 1 var\n"[..],
            b"seen 1 x var\n",
            b"seen 1 1 what\n",
            b"",
            b"gone",
        ] {
            let f = [
                frame("gpus", None, b""),
                frame("apps", None, b""),
                frame("proc", Some("1"), bad),
            ]
            .concat();
            assert!(
                raw_host(&parse_frames(&f, "h").unwrap(), "h").is_err(),
                "{bad:?}"
            );
        }
        let f = [
            frame("gpus", None, b""),
            frame("apps", None, b""),
            frame("proc", Some("x"), b"unsure\n"),
        ]
        .concat();
        assert!(raw_host(&parse_frames(&f, "h").unwrap(), "h").is_err());
    }

    fn term(pid: u32, start: Option<u64>) -> Termination {
        Termination::of(Pid(pid), start)
    }

    #[test]
    fn termination_requests_and_answers() {
        use outcome::Termination as T;
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
        let req = terminate_request(&ts, limits).unwrap();
        assert_eq!(
            req["kills"],
            json!([[1, 10], [2, 20], [3, 30], [4, 40], [6, 60], [7, 70]])
        );
        assert_eq!(
            terminate_request(&ts[4..5], limits),
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
        let req = snapshot_request("/var/tmp/genv", &["nvidia-smi".into(), "-x".into()], limits);
        assert_eq!(
            req,
            json!({"mode": "snapshot", "dir": "/var/tmp/genv", "nvidia_smi": ["nvidia-smi", "-x"],
                   "step": 2.5, "limit": 3.0, "max_bytes": MAX_STATE_BYTES})
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
                outcome::Detach::Detached,
                outcome::Detach::NotAttached,
                outcome::Detach::Failed {
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
