//! The protocol between genv-enforce and its host agent (`agent.py`), in
//! one place: the agent's bootstrap, typed requests and answers, their
//! framing, the status convention, and the version both sides speak.
//!
//! The agent is the only code that touches a live host, this machine
//! included. Its command line is a constant bootstrap ([`bootstrap`]); its
//! text travels on stdin, then requests follow, one at a time, over the
//! same pipes (an SSH channel, or a local child's):
//!
//! - a request is `<length>\n<json>`, a [`Request`] (unknown keys refused
//!   on both sides);
//! - an answer is `@<status> <length>\n<body>`: status 0 with the
//!   request's result (a snapshot's frames, parsed by
//!   [`crate::snapshot::frames`]; JSON for the others), status 1 with a
//!   JSON [`Failure`].
//!
//! The first request to a new agent is a [`Request::Hello`]: an agent that
//! speaks another [`PROTOCOL`] is refused. `fixtures/agent/` holds one
//! request and one answer of each kind, checked here and by the agent's
//! own tests.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::model::Pid;
use crate::outcome::{DetachResult, TerminateResult};
use crate::plan::{Signal, Termination};

/// The protocol's version: both sides must speak the same.
pub const PROTOCOL: u32 = 7;

/// The host agent's source.
pub const AGENT: &str = include_str!("agent.py");

/// The most a state file or a tool's answer may hold on the host: real
/// state is a few KiB; more is a user's doing and is refused rather than
/// read into memory.
pub const MAX_STATE_BYTES: u64 = 64 << 20;

/// The most an answer may hold: two state files and two nvidia-smi answers
/// at their caps, and room for the frames.
pub const MAX_ANSWER_BYTES: u64 = 4 * MAX_STATE_BYTES + (1 << 20);

/// The Python arguments that run the agent: it reads its own text from
/// stdin, then requests.
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

/// Limits of one request on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// For the steps (nvidia-smi, waiting on genv's lock), from the start.
    pub step: Duration,
    /// For the whole request, after which the agent ends itself.
    pub run: Duration,
}

/// Which signal a terminate request sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SignalName {
    Term,
    Kill,
}

/// What genv-enforce asks of an agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// The first request to a new agent: which protocol we speak.
    Hello { protocol: u32 },
    /// nvidia-smi's two answers, genv's state files and what `/proc` says
    /// of the pids involved (see `agent.py`).
    Snapshot {
        dir: String,
        nvidia_smi: Vec<String>,
        step: f64,
        limit: f64,
        max_bytes: u64,
        max_records: usize,
        proc: String,
        /// The groups (exemptions', caps') to say the members of, among
        /// the owners of the processes seen.
        groups: Vec<String>,
        /// Also each GPU's and process's utilization (the idle rule).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        utilization: bool,
        /// The leader's epoch (high availability): raises the host's.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fence: Option<Fence>,
        /// Where the host lists its users' subordinate uid ranges.
        subuid: String,
    },
    /// A signal to each `[pid, start time]` whose start time still matches.
    Terminate {
        kills: Vec<(u32, u64)>,
        signal: SignalName,
        limit: f64,
        proc: String,
        /// Refused whole when the host has seen a newer epoch.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fence: Option<Fence>,
    },
    /// Each `[device index, eid]` pair removed from `devices.json`.
    Detach {
        dir: String,
        detach: Vec<(u32, String)>,
        step: f64,
        limit: f64,
        max_bytes: u64,
        /// Refused whole when the host has seen a newer epoch.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fence: Option<Fence>,
    },
    /// Facts about the host, for `doctor`.
    Doctor {
        dir: String,
        nvidia_smi: Vec<String>,
        step: f64,
        limit: f64,
        /// Also what the fencing directory holds.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fence_dir: Option<String>,
    },
    /// Messages on users' terminals.
    Tell {
        notes: Vec<Note>,
        utmp: String,
        limit: f64,
        proc: String,
    },
}

/// A leader's epoch on a request (high availability): the host's agent
/// keeps the highest it has seen in `dir/epoch` (root's own) and refuses
/// an action with a lower one, so a deposed leader cannot act.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fence {
    pub epoch: u64,
    pub dir: String,
}

/// A message for a user's terminals: the controlling terminals of the
/// `[pid, start time]`s that are still theirs, and their login terminals.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Note {
    pub user: String,
    pub pids: Vec<(u32, u64)>,
    pub text: String,
}

/// Where a host lists its users' subordinate uid ranges (root's file).
pub const SUBUID: &str = "/etc/subuid";

/// Where login sessions are listed on a host.
pub const UTMP: &str = "/var/run/utmp";

impl Request {
    /// The hello that opens every agent.
    pub fn hello() -> Request {
        Request::Hello { protocol: PROTOCOL }
    }

    /// The snapshot request.
    pub fn snapshot(
        dir: &str,
        nvidia_smi: &[String],
        limits: Limits,
        max_records: usize,
        proc: &str,
        groups: &[String],
        utilization: bool,
    ) -> Request {
        Request::Snapshot {
            dir: dir.to_string(),
            nvidia_smi: nvidia_smi.to_vec(),
            step: limits.step.as_secs_f64(),
            limit: limits.run.as_secs_f64(),
            max_bytes: MAX_STATE_BYTES,
            max_records,
            proc: proc.to_string(),
            groups: groups.to_vec(),
            utilization,
            fence: None,
            subuid: SUBUID.to_string(),
        }
    }

    /// The kill request for these terminations: only those with a start
    /// time (never signalled blind); [`read_terminations`] answers the rest.
    /// `None` when there is none.
    pub fn terminate(
        terminations: &[Termination],
        signal: Signal,
        limits: Limits,
        proc: &str,
    ) -> Option<Request> {
        let kills: Vec<(u32, u64)> = terminations
            .iter()
            .filter_map(|t| t.start_time.map(|s| (t.pid.0, s)))
            .collect();
        (!kills.is_empty()).then(|| Request::Terminate {
            kills,
            signal: match signal {
                Signal::Term => SignalName::Term,
                Signal::Kill => SignalName::Kill,
            },
            limit: limits.run.as_secs_f64(),
            proc: proc.to_string(),
            fence: None,
        })
    }

    /// The detach request.
    pub fn detach(dir: &str, pairs: &[(u32, String)], limits: Limits) -> Request {
        Request::Detach {
            dir: dir.to_string(),
            detach: pairs.to_vec(),
            step: limits.step.as_secs_f64(),
            limit: limits.run.as_secs_f64(),
            max_bytes: MAX_STATE_BYTES,
            fence: None,
        }
    }

    /// The doctor request; with `fence_dir`, also what the fencing
    /// directory holds.
    pub fn doctor(
        dir: &str,
        nvidia_smi: &[String],
        limits: Limits,
        fence_dir: Option<&str>,
    ) -> Request {
        Request::Doctor {
            dir: dir.to_string(),
            nvidia_smi: nvidia_smi.to_vec(),
            step: limits.step.as_secs_f64(),
            limit: limits.run.as_secs_f64(),
            fence_dir: fence_dir.map(str::to_string),
        }
    }

    /// The request carrying `fence` (snapshots, terminations, detaches;
    /// the others are left as they are).
    #[must_use]
    pub fn fenced(mut self, epoch: Option<Fence>) -> Request {
        if let Request::Snapshot { fence, .. }
        | Request::Terminate { fence, .. }
        | Request::Detach { fence, .. } = &mut self
        {
            *fence = epoch;
        }
        self
    }

    /// The tell request.
    pub fn tell(notes: Vec<Note>, limits: Limits, proc: &str) -> Request {
        Request::Tell {
            notes,
            utmp: UTMP.to_string(),
            limit: limits.run.as_secs_f64(),
            proc: proc.to_string(),
        }
    }

    /// Its name, for reports (`snapshot`, `terminate`, ...).
    pub fn name(&self) -> &'static str {
        match self {
            Request::Hello { .. } => "hello",
            Request::Snapshot { .. } => "snapshot",
            Request::Terminate { .. } => "terminate",
            Request::Detach { .. } => "detach",
            Request::Doctor { .. } => "doctor",
            Request::Tell { .. } => "tell",
        }
    }

    /// `<length>\n<json>`, as the agent reads it.
    pub fn encode(&self) -> Vec<u8> {
        let json = serde_json::to_string(self).expect("a request always serializes");
        let mut bytes = format!("{}\n", json.len()).into_bytes();
        bytes.extend_from_slice(json.as_bytes());
        bytes
    }
}

/// How an answer went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// The body is the request's result.
    Done,
    /// The body is a [`Failure`].
    Failed,
}

/// One answer, as read from the agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: Status,
    pub body: Vec<u8>,
}

/// An answer that is not our protocol's.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ProtocolError {
    #[error("not an answer from our agent: {0:?}")]
    Header(String),
    #[error("an answer of {0} bytes is over our limit")]
    TooLong(u64),
    #[error("the agent's {what} answer is not what we expect: {why}")]
    Body { what: &'static str, why: String },
    #[error("the agent speaks protocol {found}, we speak {PROTOCOL}")]
    Version { found: u32 },
}

/// The header of one answer, `@<status> <length>`: its status and length.
///
/// # Errors
/// Anything else (the agent is not speaking our protocol), or a length
/// over [`MAX_ANSWER_BYTES`].
pub fn answer_header(line: &str) -> Result<(Status, u64), ProtocolError> {
    let bad = || ProtocolError::Header(line.trim_end().to_string());
    let (status, len) = line
        .trim_end()
        .strip_prefix('@')
        .and_then(|h| h.split_once(' '))
        .ok_or_else(bad)?;
    let status = match status {
        "0" => Status::Done,
        "1" => Status::Failed,
        _ => return Err(bad()),
    };
    let len: u64 = len.parse().map_err(|_| bad())?;
    if len > MAX_ANSWER_BYTES {
        return Err(ProtocolError::TooLong(len));
    }
    Ok((status, len))
}

/// A typed JSON body.
fn body<'a, T: Deserialize<'a>>(what: &'static str, body: &'a [u8]) -> Result<T, ProtocolError> {
    serde_json::from_slice(body).map_err(|e| ProtocolError::Body {
        what,
        why: e.to_string(),
    })
}

/// What a new agent says of itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hello {
    pub protocol: u32,
    /// The host Python's version, as `3.x.y`.
    pub python: String,
    /// Whether kills go through a pidfd (Python 3.9+ on Linux 5.3+).
    pub pidfd: bool,
    /// The agent's effective uid (0: root).
    pub euid: u32,
}

impl Hello {
    /// A hello answer's body.
    ///
    /// # Errors
    /// It is not a hello, or another protocol's.
    pub fn read(bytes: &[u8]) -> Result<Hello, ProtocolError> {
        let hello: Hello = body("hello", bytes)?;
        if hello.protocol != PROTOCOL {
            return Err(ProtocolError::Version {
                found: hello.protocol,
            });
        }
        Ok(hello)
    }
}

/// What a kill did, as the agent says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KillResult {
    Signalled,
    Gone,
    Reused,
    Denied,
    Invalid,
}

/// One kill's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Kill {
    pub pid: Option<u64>,
    pub result: KillResult,
    /// The start time found (a reused pid), if it could be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub found: Option<u64>,
}

/// A terminate answer's body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Kills {
    pub kills: Vec<Kill>,
}

/// A detach answer's body: whether each pair was there and is gone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Detached {
    pub detached: Vec<bool>,
    /// Who held genv's lock, when `devices.json` was written without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unlocked: Option<String>,
}

/// A tell answer's body: how many terminals each note was written to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Told {
    pub told: Vec<u32>,
}

/// What kind of step failed on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FailKind {
    /// The request was not one this agent carries out.
    Request,
    /// genv's state could not be read or written safely.
    State,
    /// genv's lock stayed held past the step limit.
    Lock,
    /// nvidia-smi failed or hung.
    NvidiaSmi,
    /// The host has seen a newer leader's epoch: nothing was done.
    Fenced,
    /// The host's fence cannot be used safely (not root's alone, busy,
    /// garbled): nothing was done.
    Fence,
    /// Anything else the agent met.
    Agent,
}

impl FailKind {
    /// The word the agent uses, as in reports (`state: ...`).
    pub fn word(self) -> &'static str {
        match self {
            FailKind::Request => "request",
            FailKind::State => "state",
            FailKind::Lock => "lock",
            FailKind::NvidiaSmi => "nvidia-smi",
            FailKind::Fenced => "fenced",
            FailKind::Fence => "fence",
            FailKind::Agent => "agent",
        }
    }
}

/// A failed request's body (status 1).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Failure {
    pub fail: FailKind,
    pub message: String,
    /// Terminate: the kills done before the failure.
    #[serde(default)]
    pub kills: Vec<Kill>,
}

impl Failure {
    /// A failure answer's body.
    ///
    /// # Errors
    /// It is not a failure.
    pub fn read(bytes: &[u8]) -> Result<Failure, ProtocolError> {
        body("failure", bytes)
    }
}

/// One outcome per termination, in order, from the kills the agent
/// answered (those it did not answer failed with `missing`).
pub fn read_terminations(
    kills: &[Kill],
    terminations: &[Termination],
    missing: &str,
) -> Vec<TerminateResult> {
    use TerminateResult as T;
    let answered: std::collections::HashMap<u64, &Kill> =
        kills.iter().filter_map(|k| Some((k.pid?, k))).collect();
    terminations
        .iter()
        .map(|t| {
            let Some(expected) = t.start_time else {
                return T::NoIdentity;
            };
            match answered.get(&u64::from(t.pid.0)) {
                Some(Kill {
                    result: KillResult::Signalled,
                    ..
                }) => T::Signalled,
                Some(Kill {
                    result: KillResult::Gone,
                    ..
                }) => T::AlreadyGone,
                Some(Kill {
                    result: KillResult::Denied,
                    ..
                }) => T::PermissionDenied,
                Some(Kill {
                    result: KillResult::Reused,
                    found: Some(found),
                    ..
                }) => T::PidReused {
                    expected,
                    found: *found,
                },
                Some(Kill {
                    result: KillResult::Reused,
                    found: None,
                    ..
                }) => T::Failed {
                    error: "its start time could not be read".into(),
                },
                Some(Kill {
                    result: KillResult::Invalid,
                    ..
                }) => T::Failed {
                    error: "refused by the host as invalid".into(),
                },
                None => T::Failed {
                    error: missing.to_string(),
                },
            }
        })
        .collect()
}

/// One outcome per detached pair, in order.
pub fn read_detaches(detached: &[bool], pairs: usize, missing: &str) -> Vec<DetachResult> {
    (0..pairs)
        .map(|n| match detached.get(n) {
            Some(true) => DetachResult::Detached,
            Some(false) => DetachResult::NotAttached,
            None => DetachResult::Failed {
                error: missing.to_string(),
            },
        })
        .collect()
}

/// The pid of a kill, for the termination it answers.
pub fn pid_of(kill: &Kill) -> Option<Pid> {
    kill.pid.and_then(|p| u32::try_from(p).ok()).map(Pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOLDEN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/agent");

    fn golden(name: &str) -> String {
        std::fs::read_to_string(format!("{GOLDEN}/{name}")).unwrap()
    }

    #[test]
    fn every_golden_request_reads_and_writes_back_the_same() {
        for mode in ["hello", "snapshot", "terminate", "detach", "doctor", "tell"] {
            let text = golden(&format!("{mode}.request.json"));
            let req: Request =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{mode}: {e}"));
            assert_eq!(req.name(), mode);
            let again: serde_json::Value = serde_json::to_value(&req).unwrap();
            let expected: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(again, expected, "{mode}");
            // A renamed or extra field is refused.
            let mut extra = expected.clone();
            extra["extra"] = 1.into();
            assert!(serde_json::from_value::<Request>(extra).is_err(), "{mode}");
        }
    }

    #[test]
    fn every_golden_answer_reads_into_its_type() {
        let hello = Hello::read(golden("hello.answer.json").as_bytes()).unwrap();
        assert_eq!((hello.protocol, hello.euid), (PROTOCOL, 0));
        let kills: Kills = serde_json::from_str(&golden("terminate.answer.json")).unwrap();
        assert_eq!(kills.kills[2].found, Some(9_877_999));
        let detached: Detached = serde_json::from_str(&golden("detach.answer.json")).unwrap();
        assert_eq!(detached.detached, [true, false]);
        let told: Told = serde_json::from_str(&golden("tell.answer.json")).unwrap();
        assert_eq!(told.told, [2, 0]);
        let failure = Failure::read(golden("failure.answer.json").as_bytes()).unwrap();
        assert_eq!(failure.fail, FailKind::Lock);
        assert_eq!(failure.kills.len(), 1);
        let fenced = Failure::read(golden("fenced.answer.json").as_bytes()).unwrap();
        assert_eq!((fenced.fail, fenced.kills.len()), (FailKind::Fenced, 0));
        let facts: crate::host::facts::AgentFacts =
            serde_json::from_str(&golden("doctor.answer.json")).unwrap();
        assert_eq!(facts.python, "3.11.2");
        let frames = std::fs::read(format!("{GOLDEN}/snapshot.answer")).unwrap();
        let frames = crate::snapshot::frames::parse_frames(&frames, "golden").unwrap();
        let raw = crate::snapshot::frames::raw_host(&frames, "golden").unwrap();
        assert_eq!(raw.procs.len(), 4);
        assert!(matches!(
            &raw.procs[&5000],
            crate::snapshot::assemble::RawProc::Seen {
                environ: crate::snapshot::assemble::Environ::Hidden(why),
                ..
            } if why.contains("more than any program can be started with")
        ));
        assert!(
            matches!(&raw.procs[&5001], crate::snapshot::assemble::RawProc::Unsure(why) if why.contains("after nvidia-smi was asked"))
        );
        assert_eq!(raw.sub_uids[&300_001], Ok(1002));
        assert_eq!(
            raw.sub_uids[&400_000],
            Err("in the sub-uid ranges of bob, carol".to_string())
        );
        assert_eq!(
            raw.lock_held.as_deref(),
            Some("genv.lock held for over 1s by pid 4242 (bob)")
        );
        assert_eq!(&*raw.user_names[&1001], "alice");
        assert_eq!(
            raw.boot,
            Some(crate::model::Boot {
                btime: 1_795_420_800,
                hz: 100
            })
        );
        let pmon = crate::snapshot::nvidia_smi::parse_pmon(raw.pmon.as_deref().unwrap(), "golden");
        assert_eq!(pmon.unwrap()[0].sm, None, "- is no kernel in the window");
        assert_eq!(raw.gpu_utilization.as_deref(), Some("0, 0\n"));
    }

    #[test]
    fn another_protocol_is_refused() {
        let text = golden("hello.answer.json")
            .replace(&format!("\"protocol\": {PROTOCOL}"), "\"protocol\": 1");
        assert_eq!(
            Hello::read(text.as_bytes()),
            Err(ProtocolError::Version { found: 1 })
        );
    }

    #[test]
    fn requests_are_length_prefixed_json() {
        let req = Request::hello();
        let bytes = req.encode();
        let text = String::from_utf8(bytes).unwrap();
        let (len, json) = text.split_once('\n').unwrap();
        assert_eq!(len.parse::<usize>().unwrap(), json.len());
        assert_eq!(json, format!(r#"{{"mode":"hello","protocol":{PROTOCOL}}}"#));
    }

    #[test]
    fn a_fence_goes_on_snapshots_terminations_and_detaches_only() {
        let limits = Limits {
            step: Duration::from_secs(1),
            run: Duration::from_secs(2),
        };
        let fence = Some(Fence {
            epoch: 9,
            dir: "/run/genv-enforce".into(),
        });
        let snapshot = Request::snapshot("/d", &[], limits, 1, "/proc", &[], false);
        let detach = Request::detach("/d", &[(0, "e".into())], limits);
        for req in [snapshot, detach] {
            let json = String::from_utf8(req.clone().fenced(fence.clone()).encode()).unwrap();
            assert!(
                json.contains(r#""fence":{"epoch":9,"dir":"/run/genv-enforce"}"#),
                "{json}"
            );
            assert!(!String::from_utf8(req.encode()).unwrap().contains("fence"));
        }
        let hello = Request::hello();
        assert_eq!(hello.clone().fenced(fence), hello);
    }

    #[test]
    fn headers() {
        assert_eq!(answer_header("@0 12\n"), Ok((Status::Done, 12)));
        assert_eq!(answer_header("@1 0\n"), Ok((Status::Failed, 0)));
        for bad in ["", "0 12", "@2 1", "@0 x", "@0", "@-1 3"] {
            assert!(answer_header(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            answer_header(&format!("@0 {}", MAX_ANSWER_BYTES + 1)),
            Err(ProtocolError::TooLong(MAX_ANSWER_BYTES + 1))
        );
    }

    #[test]
    fn kills_answer_each_termination_in_order() {
        use TerminateResult as T;
        let t = |pid: u32, start: Option<u64>| Termination::of(Pid(pid), start);
        let ts = [
            t(1, Some(10)),
            t(2, Some(20)),
            t(3, Some(30)),
            t(4, Some(40)),
            t(5, None),
            t(6, Some(60)),
            t(7, Some(70)),
            t(8, Some(80)),
        ];
        let kill = |pid: u64, result: KillResult, found: Option<u64>| Kill {
            pid: Some(pid),
            result,
            found,
        };
        let kills = [
            kill(2, KillResult::Gone, None),
            kill(1, KillResult::Signalled, None),
            kill(3, KillResult::Reused, Some(31)),
            kill(4, KillResult::Denied, None),
            kill(7, KillResult::Reused, None),
            kill(8, KillResult::Invalid, None),
        ];
        let r = read_terminations(&kills, &ts, "lost");
        assert_eq!(r[0], T::Signalled);
        assert_eq!(r[1], T::AlreadyGone);
        assert_eq!(
            r[2],
            T::PidReused {
                expected: 30,
                found: 31
            }
        );
        assert_eq!(r[3], T::PermissionDenied);
        assert_eq!(r[4], T::NoIdentity);
        assert_eq!(
            r[5],
            T::Failed {
                error: "lost".into()
            }
        );
        assert!(matches!(&r[6], T::Failed { error } if error.contains("start time")));
        assert!(matches!(&r[7], T::Failed { error } if error.contains("invalid")));
        let req = Request::terminate(
            &ts,
            Signal::Kill,
            Limits {
                step: Duration::from_secs(1),
                run: Duration::from_secs(2),
            },
            "/proc",
        )
        .unwrap();
        let Request::Terminate { kills, signal, .. } = req else {
            panic!()
        };
        assert_eq!(kills.len(), 7, "no kill without a start time");
        assert_eq!(signal, SignalName::Kill);
        assert_eq!(
            Request::terminate(
                &[t(5, None)],
                Signal::Term,
                Limits {
                    step: Duration::ZERO,
                    run: Duration::ZERO
                },
                "/proc"
            ),
            None
        );
    }

    #[test]
    fn detaches_answer_each_pair_in_order() {
        assert_eq!(
            read_detaches(&[true, false], 3, "lost"),
            vec![
                DetachResult::Detached,
                DetachResult::NotAttached,
                DetachResult::Failed {
                    error: "lost".into()
                }
            ]
        );
    }
}
