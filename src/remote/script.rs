//! What runs on a remote host, and the pure parsers of what comes back.
//!
//! Hosts need only `sh`, `sudo`, nvidia-smi and genv's files: each script
//! below is sent as the argument of `sh -c`, with its inputs as further
//! arguments (typed integers or admin configuration, each shell-quoted by
//! the transport), never spliced into the script text.

use std::collections::{BTreeSet, HashMap};

use crate::error::HostError;
use crate::model::{EnvId, HostSnapshot, Owner, Pid, Process};
use crate::outcome;
use crate::plan::{Detach, Termination};
use crate::snapshot::genv::{self, EnvsJson};
use crate::snapshot::{nvidia_smi, proc, ParseError};

/// Takes a host snapshot in one round trip. Arguments: genv's state dir,
/// the nvidia-smi command, the per-call deadline in seconds.
///
/// Prints frames `@<kind> [<arg>] <length>\n<length bytes>`: nvidia-smi's
/// two answers, queried concurrently as genv does (or `fail`); `envs.json`
/// and `devices.json`, read under a shared lock on genv.lock (absent when
/// missing); the live pids; and per GPU pid its stat, Uid line and
/// `GENV_ENVIRONMENT_ID` (no environ frame when it cannot be read). Environ
/// NULs become newlines and newlines become \001, so a hostile value
/// cannot forge a line.
pub const SNAPSHOT: &str = r#"set -u
dir=$1 smi=$2 limit=$3
tmp=$(mktemp -d 2>/dev/null) || { echo "genv-enforce: mktemp failed on the host" >&2; exit 70; }
trap 'rm -rf "$tmp"' EXIT
frame() { printf '@%s %s\n' "$1" "$(wc -c < "$2" | tr -d ' ')"; cat "$2"; }
t=
command -v timeout >/dev/null 2>&1 && t="timeout -k 2 $limit"
for q in gpus:--query-gpu=uuid,index,memory.total apps:--query-compute-apps=gpu_uuid,pid,used_gpu_memory; do
  name=${q%%:*}
  ( GENV_BYPASS=1 $t $smi "${q#*:}" --format=csv,noheader,nounits > "$tmp/$name" 2> "$tmp/$name.err"
    echo $? > "$tmp/$name.rc" ) &
done
wait
for name in gpus apps; do
  rc=$(cat "$tmp/$name.rc")
  if [ "$rc" = 0 ]; then frame "$name" "$tmp/$name"; else
    cat "$tmp/$name.err" >> "$tmp/$name"
    frame "fail $name.$rc" "$tmp/$name"
    exit 0
  fi
done
if [ -e "$dir/genv.lock" ] && command -v flock >/dev/null 2>&1; then
  exec 9< "$dir/genv.lock"
  flock -s -w "$limit" 9 || { echo "genv.lock held by another process for ${limit}s" > "$tmp/err"; frame "fail lock.1" "$tmp/err"; exit 0; }
fi
for f in envs devices; do
  [ -e "$dir/$f.json" ] || continue
  if cat "$dir/$f.json" > "$tmp/state" 2> "$tmp/err"; then frame "$f" "$tmp/state"; else frame "fail $f.1" "$tmp/err"; exit 0; fi
done
exec 9<&-
ls /proc | grep -E '^[0-9]+$' > "$tmp/live"
frame live "$tmp/live"
for pid in $(awk -F', ' 'NF >= 2 { print $2 }' "$tmp/apps" | sort -u); do
  case $pid in ''|*[!0-9]*) continue ;; esac
  cat "/proc/$pid/stat" > "$tmp/x" 2>/dev/null && frame "stat $pid" "$tmp/x"
  grep '^Uid:' "/proc/$pid/status" > "$tmp/x" 2>/dev/null && frame "status $pid" "$tmp/x"
  if tr '\000\n' '\n\001' < "/proc/$pid/environ" > "$tmp/x" 2>/dev/null; then
    grep -a '^GENV_ENVIRONMENT_ID=' "$tmp/x" | tail -n 1 > "$tmp/y"
    frame "environ $pid" "$tmp/y"
  fi
done
"#;

/// SIGTERMs processes only if they are still the ones the snapshot saw.
/// Arguments: pid / start-time pairs (integers; anything else is refused).
/// Prints one line per pid: `<pid> signalled|gone|reused <start>|denied|invalid`.
pub const TERMINATE: &str = r#"set -u
while [ $# -ge 2 ]; do
  pid=$1 want=$2
  shift 2
  case $pid$want in ''|*[!0-9]*) echo "$pid invalid"; continue ;; esac
  found=$(tr '\n' ' ' < "/proc/$pid/stat" 2>/dev/null | awk '{ sub(/.*\) /, ""); print $20 }')
  if [ -z "$found" ]; then echo "$pid gone"; continue; fi
  if [ "$found" != "$want" ]; then echo "$pid reused $found"; continue; fi
  if kill -TERM "$pid" 2>/dev/null; then echo "$pid signalled"
  elif [ -e "/proc/$pid" ]; then echo "$pid denied"
  else echo "$pid gone"; fi
done
"#;

/// Runs its arguments under `timeout` when the host has it (coreutils and
/// busybox both do), so a command that hangs (sudo waiting on a directory
/// service, a wedged GPU) is killed on the host, with its process group,
/// before our deadline; otherwise its session would linger on the master
/// and count against sshd's MaxSessions. Arguments: seconds, then argv.
/// Exit status 124 (or 137 after the kill) means the limit was hit.
pub const BOUNDED: &str = r#"l=$1
shift
if command -v timeout >/dev/null 2>&1; then exec timeout -k 1 "$l" "$@"; fi
exec "$@"
"#;

/// Exit statuses of [`BOUNDED`] when the host-side limit was hit.
pub const BOUNDED_TIMED_OUT: [i32; 2] = [124, 137];

/// Runs `genv usage execute` (the remaining arguments) on genv's state dir,
/// but only once genv's lock could be had within the limit: genv waits for
/// it forever, and a detach decided now must not land minutes later. It is
/// never killed once started (genv rewrites devices.json in place).
/// Arguments: genv's state dir, seconds, then genv's argv.
pub const EXECUTE: &str = r#"set -u
dir=$1 l=$2
shift 2
export GENV_TMPDIR="$dir"
if [ -e "$dir/genv.lock" ] && command -v flock >/dev/null 2>&1; then
  flock -w "$l" "$dir/genv.lock" true || { echo "genv.lock held by another process for ${l}s: nothing detached" >&2; exit 75; }
fi
exec "$@"
"#;

/// One frame of the snapshot script's output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub kind: String,
    pub arg: Option<String>,
    pub body: Vec<u8>,
}

/// Splits the snapshot script's output into frames.
///
/// # Errors
/// A malformed header or a frame shorter than announced (truncated output).
pub fn parse_frames(mut bytes: &[u8], source: &str) -> Result<Vec<Frame>, ParseError> {
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
            [kind, arg, len] => (kind, Some(arg.to_string()), len),
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
            kind: kind.to_string(),
            arg,
            body: rest[..len].to_vec(),
        });
        bytes = &rest[len..];
    }
    Ok(frames)
}

fn text(frame: &Frame, source: &str) -> Result<String, ParseError> {
    String::from_utf8(frame.body.clone())
        .map_err(|_| ParseError::new(source, &frame.kind, "not UTF-8"))
}

/// Builds a host snapshot from the snapshot script's frames, with genv's
/// load-time clean-up and our per-process identity.
///
/// # Errors
/// A tool failed on the host (nvidia-smi, the lock, a state file), or its
/// output cannot be parsed.
pub fn assemble(frames: &[Frame], host: &str) -> Result<HostSnapshot, HostError> {
    let find = |kind: &str| frames.iter().find(|f| f.kind == kind && f.arg.is_none());
    if let Some(f) = frames.iter().find(|f| f.kind == "fail") {
        let (what, status) = f
            .arg
            .as_deref()
            .unwrap_or("?")
            .split_once('.')
            .unwrap_or(("?", "?"));
        let command = match what {
            "gpus" | "apps" => format!("nvidia-smi ({what})"),
            "lock" => "genv.lock".to_string(),
            other => format!("{other}.json"),
        };
        let output = String::from_utf8_lossy(&f.body).trim().to_string();
        return Err(HostError::Command {
            command,
            status: format!("exit status: {status}"),
            output,
        });
    }
    let required = |kind: &str| {
        find(kind).ok_or_else(|| ParseError::new(host, kind, "missing from the host's answer"))
    };
    let gpus = nvidia_smi::parse_gpus(
        &text(required("gpus")?, host)?,
        &format!("{host}: nvidia-smi --query-gpu"),
    )?;
    let apps = nvidia_smi::parse_compute_apps(
        &text(required("apps")?, host)?,
        &format!("{host}: nvidia-smi --query-compute-apps"),
    )?;
    let by_pid = nvidia_smi::processes(&gpus, &apps, host)?;
    let mut envs = match find("envs") {
        Some(f) => genv::parse_envs(&text(f, host)?, &format!("{host}: envs.json"))?,
        None => Vec::new(),
    };
    let mut devices = match find("devices") {
        Some(f) => genv::parse_devices(&text(f, host)?, &format!("{host}: devices.json"))?,
        None => nvidia_smi::devices(&gpus),
    };
    let live: BTreeSet<i64> = text(required("live")?, host)?
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    genv::clean_up(&mut envs, &mut devices, |p| live.contains(&p), |_| true);

    let per_pid: HashMap<(String, String), &Frame> = frames
        .iter()
        .filter_map(|f| f.arg.clone().map(|a| ((f.kind.clone(), a), f)))
        .collect();
    let processes = by_pid
        .into_iter()
        .map(|(pid, gpus)| {
            let key = pid.to_string();
            let get = |kind: &str| per_pid.get(&(kind.to_string(), key.clone()));
            let owner = match get("environ") {
                Some(f) => match f.body.strip_prefix(b"GENV_ENVIRONMENT_ID=") {
                    Some(v) => Owner::Env(EnvId(
                        String::from_utf8_lossy(v.strip_suffix(b"\n").unwrap_or(v)).into_owned(),
                    )),
                    None => Owner::NoEnv,
                },
                None if get("stat").is_none() => {
                    Owner::Unknown("it exited during the snapshot".into())
                }
                None => Owner::Unknown("its environment could not be read".into()),
            };
            Process {
                pid,
                owner,
                gpus,
                start_time: get("stat").and_then(|f| proc::start_time(&f.body)),
                uid: get("status").and_then(|f| proc::real_uid(&String::from_utf8_lossy(&f.body))),
                user: None,
            }
        })
        .collect();
    Ok(HostSnapshot {
        processes,
        envs,
        devices,
        truth: None,
    })
}

/// The arguments of [`TERMINATE`] for these terminations: only typed
/// integers. Terminations without a start time are left out (never
/// signalled blind) and answered by [`read_terminations`] as such.
pub fn terminate_args(terminations: &[Termination]) -> Vec<String> {
    terminations
        .iter()
        .filter_map(|t| t.start_time.map(|s| [t.pid.to_string(), s.to_string()]))
        .flatten()
        .collect()
}

/// Reads [`TERMINATE`]'s answer: one outcome per termination, in order.
pub fn read_terminations(stdout: &str, terminations: &[Termination]) -> Vec<outcome::Termination> {
    use outcome::Termination as T;
    let answers: HashMap<Pid, Vec<&str>> = stdout
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

/// The report `genv usage execute` reads on stdin for these detaches (and
/// nothing to terminate): host data travels as JSON, never as arguments.
pub fn execute_report(detaches: &[Detach], snapshot: &HostSnapshot) -> String {
    let mut detach: Vec<(String, EnvsJson)> = Vec::new();
    let json = genv::to_json(snapshot);
    for d in detaches {
        let Some(env) = json.envs.envs.iter().find(|e| e.eid == d.eid.0) else {
            continue;
        };
        let key = d.device.to_string();
        match detach.iter_mut().find(|(k, _)| *k == key) {
            Some((_, envs)) => envs.envs.push(env.clone()),
            None => detach.push((
                key,
                EnvsJson {
                    envs: vec![env.clone()],
                },
            )),
        }
    }
    let detach: serde_json::Map<String, serde_json::Value> = detach
        .into_iter()
        .map(|(k, v)| (k, serde_json::to_value(v).unwrap_or_default()))
        .collect();
    serde_json::json!({ "terminate": { "processes": [] }, "detach": detach }).to_string()
}

/// Reads `genv usage execute`'s answer: a detach is done when genv printed
/// its exact `Detaching environment <eid> of user <user> from device <i>`
/// line (searched in the whole output: a hostile eid may hold a newline).
pub fn read_detaches(
    stdout: &str,
    success: bool,
    error: &str,
    detaches: &[Detach],
) -> Vec<outcome::Detach> {
    detaches
        .iter()
        .map(|d| {
            let line = format!(
                "Detaching environment {} of user {} from device {}\n",
                d.eid,
                d.username
                    .as_deref()
                    .filter(|u| !u.is_empty())
                    .unwrap_or("N/A"),
                d.device
            );
            if success && stdout.contains(&line) {
                outcome::Detach::Detached
            } else {
                outcome::Detach::Failed {
                    error: if error.is_empty() {
                        "genv usage execute did not detach it".into()
                    } else {
                        error.to_string()
                    },
                }
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::GpuIndex;

    fn frame(kind: &str, arg: Option<&str>, body: &str) -> String {
        match arg {
            Some(a) => format!("@{kind} {a} {}\n{body}", body.len()),
            None => format!("@{kind} {}\n{body}", body.len()),
        }
    }

    fn answer(extra: &str) -> Vec<u8> {
        let mut s = String::new();
        s += &frame("gpus", None, "GPU-a, 0, 81559\nGPU-b, 1, 81559\n");
        s += &frame(
            "apps",
            None,
            "GPU-a, 100, 50\nGPU-b, 200, [N/A]\nGPU-a, 300, 10\n",
        );
        s += &frame(
            "envs",
            None,
            r#"{"envs": [{"eid": "e", "uid": 0, "creation": "x", "username": "u", "config": {}, "pids": [100], "kernel_ids": []},
            {"eid": "dead", "uid": 0, "creation": "x", "username": "u", "config": {}, "pids": [999], "kernel_ids": []}]}"#,
        );
        s += &frame(
            "devices",
            None,
            r#"{"devices": [{"index": 0, "total_memory": "1mi", "attachments": [{"eid": "e", "gpu_memory": null, "time": "t"}, {"eid": "dead", "gpu_memory": null, "time": "t"}]}]}"#,
        );
        s += &frame("live", None, "1\n100\n200\n300\n");
        s += &frame(
            "stat",
            Some("100"),
            "100 (sleep) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 4242 0 0\n",
        );
        s += &frame("status", Some("100"), "Uid:\t1001\t1001\t1001\t1001\n");
        s += &frame("environ", Some("100"), "GENV_ENVIRONMENT_ID=e\n");
        s += &frame(
            "stat",
            Some("200"),
            "200 (x) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 77 0 0\n",
        );
        s += &frame("environ", Some("200"), "");
        s += extra;
        s.into_bytes()
    }

    #[test]
    fn assembles_a_snapshot_with_identity_and_clean_up() {
        let frames = parse_frames(&answer(""), "gpu1").unwrap();
        let s = assemble(&frames, "gpu1").unwrap();
        assert_eq!(s.envs.len(), 1, "the env without live pids is dropped");
        assert_eq!(s.devices[0].attachments.len(), 1);
        let p = |n| s.process(Pid(n)).unwrap();
        assert_eq!(p(100).owner, Owner::Env(EnvId("e".into())));
        assert_eq!((p(100).start_time, p(100).uid), (Some(4242), Some(1001)));
        assert_eq!(p(200).owner, Owner::NoEnv);
        assert_eq!(p(200).gpus[0].usage, crate::model::Usage::Unknown);
        assert!(
            matches!(p(300).owner, Owner::Unknown(_)),
            "no frames at all: it vanished"
        );
    }

    #[test]
    fn hostile_environ_value_stays_one_value() {
        let extra = frame(
            "environ",
            Some("300"),
            "GENV_ENVIRONMENT_ID=$(touch /tmp/x)\u{1}; rm -rf /\n",
        );
        let frames = parse_frames(&answer(&extra), "gpu1").unwrap();
        let s = assemble(&frames, "gpu1").unwrap();
        assert_eq!(
            s.process(Pid(300)).unwrap().owner,
            Owner::Env(EnvId("$(touch /tmp/x)\u{1}; rm -rf /".into()))
        );
    }

    #[test]
    fn failures_and_truncation_are_errors() {
        let failed = frame("gpus", None, "")
            + &frame(
                "fail",
                Some("apps.9"),
                "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n",
            );
        let e = assemble(&parse_frames(failed.as_bytes(), "h").unwrap(), "h").unwrap_err();
        assert!(
            e.to_string().contains("exit status: 9") && e.to_string().contains("NVIDIA driver"),
            "{e}"
        );
        let mut cut = answer("");
        cut.truncate(cut.len() - 3);
        assert!(parse_frames(&cut, "h").is_err());
        let short = "@gpus 100\nGPU-a, 0\n";
        assert!(parse_frames(short.as_bytes(), "h")
            .unwrap_err()
            .message
            .contains("truncated"));
        assert!(parse_frames(b"garbage\n", "h").is_err());
        let no_live = frame("gpus", None, "") + &frame("apps", None, "");
        assert!(assemble(&parse_frames(no_live.as_bytes(), "h").unwrap(), "h").is_err());
    }

    fn term(pid: u32, start: Option<u64>) -> Termination {
        Termination {
            pid: Pid(pid),
            start_time: start,
            eid: None,
            gpus: vec![],
            uid: None,
            user: None,
            rules: Default::default(),
        }
    }

    #[test]
    fn termination_answers() {
        use outcome::Termination as T;
        let ts = [
            term(1, Some(10)),
            term(2, Some(20)),
            term(3, Some(30)),
            term(4, Some(40)),
            term(5, None),
            term(6, Some(60)),
        ];
        assert_eq!(
            terminate_args(&ts),
            ["1", "10", "2", "20", "3", "30", "4", "40", "6", "60"]
        );
        let out = read_terminations("1 signalled\n2 gone\n3 reused 31\n4 denied\n", &ts);
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
    }

    #[test]
    fn execute_report_is_genv_shaped() {
        let frames = parse_frames(&answer(""), "gpu1").unwrap();
        let s = assemble(&frames, "gpu1").unwrap();
        let d = [Detach {
            device: GpuIndex(0),
            eid: EnvId("e".into()),
            username: Some("u".into()),
        }];
        let report: serde_json::Value = serde_json::from_str(&execute_report(&d, &s)).unwrap();
        assert_eq!(report["terminate"]["processes"], serde_json::json!([]));
        let env = &report["detach"]["0"]["envs"][0];
        let keys: Vec<_> = env.as_object().unwrap().keys().cloned().collect();
        assert_eq!(
            keys,
            [
                "eid",
                "uid",
                "creation",
                "username",
                "config",
                "pids",
                "kernel_ids"
            ]
        );
        let ok = read_detaches(
            "Detaching environment e of user u from device 0\n",
            true,
            "",
            &d,
        );
        assert_eq!(ok, [outcome::Detach::Detached]);
        assert!(matches!(
            read_detaches("", false, "boom", &d)[0],
            outcome::Detach::Failed { .. }
        ));
    }
}
