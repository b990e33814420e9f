//! The agent's snapshot answer: length-prefixed frames (`@<kind> [<arg>]
//! <len>\n<body>`), split without copying and turned into a host's raw
//! parts. Pure: what the host sent is untrusted bytes, and every malformed
//! or truncated answer is an error naming the host.

use std::borrow::Cow;
use std::collections::BTreeMap;

use super::assemble::{Environ, RawHost, RawMps, RawProc};
use super::ParseError;

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
    // A busy host's answer holds a few dozen frames.
    let mut frames = Vec::with_capacity(64);
    while !bytes.is_empty() {
        let bad = |m: String| ParseError::new(source, format!("frame {}", frames.len() + 1), m);
        // A header is a few bytes: a plain scan (memchr's set-up costs
        // more than it saves there).
        let nl = (bytes.iter().position(|&b| b == b'\n'))
            .ok_or_else(|| bad("header without newline".into()))?;
        let (kind, arg, len) = header(&bytes[..nl]).map_err(bad)?;
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

/// A frame header's kind, argument and length, `@<kind> [<arg>] <len>`
/// (no newline): a few bytes, split by a plain scan.
fn header(line: &[u8]) -> Result<(&str, Option<&str>, usize), String> {
    let line = std::str::from_utf8(line).map_err(|_| "header is not UTF-8".to_string())?;
    let not_one = || format!("not a frame header: {line:?}");
    let rest = line.strip_prefix('@').ok_or_else(not_one)?;
    let mut words = [""; 3];
    let (mut n, mut start) = (0, 0);
    for (i, b) in rest.bytes().enumerate() {
        if b == b' ' {
            *words.get_mut(n).ok_or_else(not_one)? = &rest[start..i];
            (n, start) = (n + 1, i + 1);
        }
    }
    *words.get_mut(n).ok_or_else(not_one)? = &rest[start..];
    let (kind, arg, len) = match n {
        1 => (words[0], None, words[1]),
        2 => (words[0], Some(words[1]), words[2]),
        _ => return Err(not_one()),
    };
    let len = len.parse().map_err(|_| format!("bad length in {line:?}"))?;
    Ok((kind, arg, len))
}

fn text<'a>(frame: &Frame<'a>, source: &str) -> Result<&'a str, ParseError> {
    std::str::from_utf8(frame.body).map_err(|_| ParseError::new(source, frame.kind, "not UTF-8"))
}

/// The raw parts of a host snapshot from the agent's frames.
///
/// # Errors
/// The answer is malformed.
pub fn raw_host<'a>(frames: &[Frame<'a>], source: &str) -> Result<RawHost<'a>, ParseError> {
    // The parts sent once, each at its first frame without an argument,
    // found in one pass: most frames (`proc`, `user`) carry one.
    const ONCE: [&str; 7] = [
        "gpus",
        "apps",
        "envs",
        "devices",
        "pmon",
        "utilization",
        "lock",
    ];
    let mut once: [Option<&Frame<'a>>; ONCE.len()] = [None; ONCE.len()];
    for f in frames.iter().filter(|f| f.arg.is_none()) {
        if let Some(k) = ONCE.iter().position(|&kind| kind == f.kind) {
            once[k].get_or_insert(f);
        }
    }
    let [gpus, apps, envs, devices, pmon, utilization, lock] = once;
    let required = |frame: Option<&Frame<'a>>, kind: &str| {
        let f =
            frame.ok_or_else(|| ParseError::new(source, kind, "missing from the host's answer"))?;
        text(f, source).map(Cow::Borrowed)
    };
    let mut raw = RawHost {
        gpus: required(gpus, "gpus")?,
        apps: required(apps, "apps")?,
        // What users write: checked as UTF-8 only when parsed (a file that
        // is not fails genv's state, not the host).
        envs: envs.map(|f| Cow::Borrowed(f.body)),
        devices: devices.map(|f| Cow::Borrowed(f.body)),
        procs: BTreeMap::new(),
        user_names: BTreeMap::new(),
        groups: BTreeMap::new(),
        boot: None,
        // Its last column is each process's name, which its user picks.
        pmon: pmon.map(|f| String::from_utf8_lossy(f.body)),
        gpu_utilization: utilization
            .map(|f| text(f, source).map(Cow::Borrowed))
            .transpose()?,
        sub_uids: BTreeMap::new(),
        unnamed: BTreeMap::new(),
        state_errors: BTreeMap::new(),
        lock_held: lock.map(|f| String::from_utf8_lossy(f.body).into_owned()),
        mps: BTreeMap::new(),
    };
    let mut procs = Vec::with_capacity(frames.len());
    for f in frames {
        let number = |what: &str| {
            f.arg
                .and_then(|a| a.parse::<u32>().ok())
                .ok_or_else(|| ParseError::new(source, f.kind, format!("bad {what} {:?}", f.arg)))
        };
        match f.kind {
            "proc" => procs.push((number("pid")?, proc_body(f.body, source)?)),
            "user" => {
                raw.user_names
                    .insert(number("uid")?, text(f, source)?.into());
            }
            "groups" => {
                let names = text(f, source)?.lines().map(String::from).collect();
                raw.groups.insert(number("uid")?, names);
            }
            "unnamed" => {
                raw.unnamed
                    .insert(number("uid")?, String::from_utf8_lossy(f.body).into_owned());
            }
            "subuid" => {
                let body = text(f, source)?;
                let owner = match body.strip_prefix("- ") {
                    Some(why) => Err(why.to_string()),
                    None => Ok(body.trim().parse::<u32>().map_err(|_| {
                        ParseError::new(source, "subuid", format!("bad owner {body:?}"))
                    })?),
                };
                raw.sub_uids.insert(number("uid")?, owner);
            }
            "mps" => {
                let role = match f.body.strip_prefix(b"own\n") {
                    Some(why) => RawMps::Own(String::from_utf8_lossy(why).into_owned()),
                    None if f.body == b"shared" => RawMps::Shared,
                    None => {
                        return Err(ParseError::new(
                            source,
                            "mps",
                            format!("malformed: {:?}", String::from_utf8_lossy(f.body)),
                        ))
                    }
                };
                raw.mps.insert(number("pid")?, role);
            }
            "state-error" => {
                let part = f
                    .arg
                    .ok_or_else(|| ParseError::new(source, f.kind, "no part named"))?;
                raw.state_errors.insert(
                    part.to_string(),
                    String::from_utf8_lossy(f.body).into_owned(),
                );
            }
            "clock" => {
                let bad = || ParseError::new(source, "clock", "not \"<btime> <hz>\"");
                let body = text(f, source)?;
                let (btime, hz) = body.trim().split_once(' ').ok_or_else(bad)?;
                raw.boot = Some(crate::model::Boot {
                    btime: btime.parse().map_err(|_| bad())?,
                    hz: hz.parse().ok().filter(|&h: &u64| h > 0).ok_or_else(bad)?,
                });
            }
            _ => {}
        }
    }
    // Built in bulk; a pid sent twice keeps its last frame, as inserting
    // one by one would.
    raw.procs = procs.into_iter().collect();
    Ok(raw)
}

/// A `proc` frame's body: `seen <start> <uid|-> <environ>\n<value>` or
/// `unsure\n<why>` (`environ`: var, novar, notread, unreadable, hidden).
fn proc_body<'a>(body: &'a [u8], source: &str) -> Result<RawProc<'a>, ParseError> {
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
    let mut words = head.split([' ']);
    let words = [(); 5].map(|()| words.next());
    match words {
        [Some("unsure"), None, ..] => Ok(RawProc::Unsure(why())),
        [Some("seen"), Some(start), Some(uid), Some(environ), None] => Ok(RawProc::Seen {
            start_time: start.parse().map_err(|_| bad())?,
            uid: match uid {
                "-" => None,
                n => Some(n.parse().map_err(|_| bad())?),
            },
            environ: match environ {
                "var" => Environ::Var(Cow::Borrowed(rest)),
                "novar" => Environ::NoVar,
                "notread" => Environ::NotRead,
                "unreadable" => Environ::Unreadable(why()),
                "hidden" => Environ::Hidden(why()),
                _ => return Err(bad()),
            },
        }),
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let answer = answer();
        let raw = raw_host(&parse_frames(&answer, "h").unwrap(), "h").unwrap();
        assert_eq!(raw.devices, None);
        assert_eq!(raw.envs.as_deref(), Some(&b"{\"envs\": []}"[..]));
        assert_eq!(
            raw.procs[&100],
            RawProc::Seen {
                start_time: 4242,
                uid: Some(1001),
                environ: Environ::Var(b"e\n\x01; rm -rf /\xff"[..].into())
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
        assert_eq!(&*raw.user_names[&1001], "alice");
    }

    #[test]
    fn a_part_sent_twice_is_its_first_frame_and_a_pid_sent_twice_its_last() {
        let f = [
            frame("gpus", Some("x"), b"not this one"),
            frame("gpus", None, b"GPU-a, 0, 81559\n"),
            frame("proc", Some("7"), b"seen 5 - notread\n"),
            frame("apps", None, b""),
            frame("gpus", None, b"GPU-b, 1, 81559\n"),
            frame("lock", None, b"1 2"),
            frame("lock", None, b"3 4"),
            frame("proc", Some("7"), b"seen 6 - novar\n"),
        ]
        .concat();
        let raw = raw_host(&parse_frames(&f, "h").unwrap(), "h").unwrap();
        assert_eq!(raw.gpus, "GPU-a, 0, 81559\n");
        assert_eq!(raw.lock_held.as_deref(), Some("1 2"));
        assert_eq!(
            raw.procs[&7],
            RawProc::Seen {
                start_time: 6,
                uid: None,
                environ: Environ::NoVar
            }
        );
        let only_with_arg = [frame("gpus", Some("x"), b""), frame("apps", None, b"")].concat();
        let e = raw_host(&parse_frames(&only_with_arg, "h").unwrap(), "h").unwrap_err();
        assert_eq!(e.to_string(), "h: gpus: missing from the host's answer");
    }

    #[test]
    fn the_agents_word_on_mps_servers_is_kept_by_pid() {
        let base = [frame("gpus", None, b""), frame("apps", None, b"")].concat();
        let with = |mps: &[Vec<u8>]| {
            let f = [base.clone(), mps.concat()].concat();
            raw_host(&parse_frames(&f, "h").unwrap(), "h").map(|r| r.mps)
        };
        let said = with(&[
            frame("mps", Some("1048"), b"shared"),
            frame(
                "mps",
                Some("7"),
                b"own\nits parent (pid 1) is not a process of root",
            ),
        ])
        .unwrap();
        assert_eq!(
            said.into_iter().collect::<Vec<_>>(),
            [
                (
                    7,
                    RawMps::Own("its parent (pid 1) is not a process of root".into())
                ),
                (1048, RawMps::Shared),
            ]
        );
        for bad in [&b"sharedx"[..], b"", b"own"] {
            let e = with(&[frame("mps", Some("1"), bad)]).unwrap_err();
            assert!(e.to_string().contains("malformed"), "{e}");
        }
        assert!(with(&[frame("mps", None, b"shared")]).is_err(), "no pid");
    }

    #[test]
    fn bytes_users_write_that_are_not_utf8_never_fail_the_answer() {
        // State files and process names (pmon's last column) are a user's
        // to write; tools' figures and our own frames are not.
        let f = [
            frame("gpus", None, b"GPU-a, 0, 81559\n"),
            frame("apps", None, b""),
            frame("envs", None, b"{\"envs\": [\xff]}"),
            frame("devices", None, b"\xc3"),
            frame("pmon", None, b"    0 100 C 7 1 \xff) x (y\n"),
        ]
        .concat();
        let raw = raw_host(&parse_frames(&f, "h").unwrap(), "h").unwrap();
        assert_eq!(raw.envs.as_deref(), Some(&b"{\"envs\": [\xff]}"[..]));
        assert_eq!(raw.devices.as_deref(), Some(&b"\xc3"[..]));
        assert_eq!(
            raw.pmon.as_deref(),
            Some("    0 100 C 7 1 \u{fffd}) x (y\n")
        );
        let bad = [frame("gpus", None, b"\xff"), frame("apps", None, b"")].concat();
        let e = raw_host(&parse_frames(&bad, "h").unwrap(), "h").unwrap_err();
        assert_eq!(e.to_string(), "h: gpus: not UTF-8");
    }

    #[test]
    fn state_errors_and_sub_uids_are_kept_as_the_agent_said_them() {
        let f = [
            frame("gpus", None, b""),
            frame("apps", None, b""),
            frame("state-error", Some("envs"), b"envs.json: not JSON"),
            frame("subuid", Some("300001"), b"1001"),
            frame("subuid", Some("999999"), b"- in no range of /etc/subuid"),
            frame("unnamed", Some("1002"), b"no time was left"),
        ]
        .concat();
        let raw = raw_host(&parse_frames(&f, "h").unwrap(), "h").unwrap();
        assert_eq!(raw.unnamed[&1002], "no time was left");
        assert_eq!(raw.state_errors["envs"], "envs.json: not JSON");
        assert_eq!(raw.sub_uids[&300001], Ok(1001));
        assert_eq!(
            raw.sub_uids[&999999],
            Err("in no range of /etc/subuid".to_string())
        );
        let unnamed = [
            frame("gpus", None, b""),
            frame("apps", None, b""),
            frame("state-error", None, b"what part?"),
        ]
        .concat();
        assert!(raw_host(&parse_frames(&unnamed, "h").unwrap(), "h").is_err());
    }

    #[test]
    fn headers_are_split_as_split_on_space_splits_them() {
        // The form the scan replaced.
        fn split(line: &str) -> Option<(&str, Option<&str>, usize)> {
            let mut w = line.strip_prefix('@')?.split(' ');
            let (kind, arg, len) = match (w.next(), w.next(), w.next(), w.next()) {
                (Some(k), Some(l), None, None) => (k, None, l),
                (Some(k), Some(a), Some(l), None) => (k, Some(a), l),
                _ => return None,
            };
            Some((kind, arg, len.parse::<usize>().ok()?))
        }
        for line in [
            "@gpus 100",
            "@proc 20005 42",
            "@ 5",
            "@a  5",
            "@a b  5",
            "@a b c d",
            "@a 5 ",
            "@a",
            "@",
            "gpus 1",
            "@a x",
            "@a -1",
            "@é ü 3",
            "@a\tb 3",
        ] {
            assert_eq!(header(line.as_bytes()).ok(), split(line), "{line:?}");
        }
        assert_eq!(header(b"@a\xff 1").unwrap_err(), "header is not UTF-8");
        assert_eq!(
            header(b"@a b c d").unwrap_err(),
            r#"not a frame header: "@a b c d""#
        );
        assert_eq!(header(b"@a x").unwrap_err(), r#"bad length in "@a x""#);
    }

    #[test]
    fn malformed_and_truncated_answers_are_errors() {
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
}
