//! The parts of `/proc/<pid>/{stat,environ,status}` we need, parsed from
//! their bytes, and the order in which a process's identity is read.
//! Reading the files is left to the caller.

use std::io::ErrorKind;

use super::assemble::{Environ, RawProc};

/// The variable that places a process in a genv environment.
pub const ENV_VAR: &str = "GENV_ENVIRONMENT_ID";

/// A process's start time (clock ticks since boot): field 22 of
/// `/proc/<pid>/stat`, counted after the parenthesised command name, which
/// may itself hold spaces and parentheses.
pub fn start_time(stat: &[u8]) -> Option<u64> {
    let close = stat.iter().rposition(|&b| b == b')')?;
    let rest = std::str::from_utf8(&stat[close + 1..]).ok()?;
    // Field 3 (state) is the first after the name; field 22 is 19 further.
    rest.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// Whether `/proc/<pid>/stat` shows a process that has exited and only
/// waits for its parent (zombie `Z`, dead `X`): a signal to it does nothing.
pub fn exited(stat: &[u8]) -> bool {
    let Some(close) = stat.iter().rposition(|&b| b == b')') else {
        return false;
    };
    matches!(
        stat[close + 1..]
            .split(u8::is_ascii_whitespace)
            .find(|w| !w.is_empty()),
        Some(b"Z" | b"X")
    )
}

/// The value of `GENV_ENVIRONMENT_ID` in a NUL-separated environ, byte
/// for byte, the last one winning as in genv; `None` when absent.
pub fn environment_id(environ: &[u8]) -> Option<&[u8]> {
    environ
        .split(|&b| b == 0)
        .rev()
        .find_map(|var| var.strip_prefix(ENV_VAR.as_bytes())?.strip_prefix(b"="))
}

/// Reads one process's identity through `read` (the contents of a file of
/// its `/proc/<pid>/` directory): the start time, then its real uid and
/// (with `environ`) its `GENV_ENVIRONMENT_ID`, then the start time again.
/// Everything read between two equal start times belongs to one process; a
/// different second start time means the pid was reused while we read, and
/// nothing read is trusted. `None` when the process is gone.
pub fn identity(
    mut read: impl FnMut(&str) -> std::io::Result<Vec<u8>>,
    environ: bool,
) -> Option<RawProc> {
    let start = |stat: std::io::Result<Vec<u8>>| stat.map(|s| start_time(&s));
    let before = match start(read("stat")) {
        Ok(Some(t)) => t,
        Ok(None) => return Some(RawProc::Unsure("its /proc stat does not parse".into())),
        Err(_) => return None,
    };
    let uid = read("status")
        .ok()
        .and_then(|s| real_uid(&String::from_utf8_lossy(&s)));
    let environ = if environ {
        match read("environ") {
            Ok(bytes) => match environment_id(&bytes) {
                Some(v) => Environ::Var(v.to_vec()),
                None => Environ::NoVar,
            },
            Err(e) if e.kind() == ErrorKind::PermissionDenied => {
                Environ::Unreadable("not enough permissions to read its environment".into())
            }
            Err(e) if e.kind() == ErrorKind::NotFound => return None,
            Err(e) => Environ::Unreadable(format!("cannot read its environment: {e}")),
        }
    } else {
        Environ::NotRead
    };
    match start(read("stat")) {
        Ok(Some(after)) if after == before => Some(RawProc::Seen {
            start_time: before,
            uid,
            environ,
        }),
        Ok(_) => Some(RawProc::Unsure(
            "its pid was reused while it was read".into(),
        )),
        Err(_) => None,
    }
}

/// The real uid from `/proc/<pid>/status`.
pub fn real_uid(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_ascii_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_with_tricky_name() {
        let stat = b"4242 (my (weird) name) S 1 4242 4242 0 -1 4194560 150 0 0 0 1 2 0 0 20 0 1 0 987654 12345 100 18446744073709551615";
        assert_eq!(start_time(stat), Some(987654));
        assert_eq!(start_time(b"4242 (x) S 1"), None);
        assert_eq!(start_time(b""), None);
    }

    #[test]
    fn exited_processes_are_told_by_their_state() {
        assert!(exited(b"4242 (my) Z) Z 1 4242"));
        assert!(exited(b"4242 (x) X 1"));
        assert!(!exited(b"4242 (Z) S 1 4242"));
        assert!(!exited(b"4242 (x"));
        assert!(!exited(b""));
    }

    #[test]
    fn environ() {
        assert_eq!(
            environment_id(b"PATH=/bin\0GENV_ENVIRONMENT_ID=4100\0HOME=/root\0"),
            Some(&b"4100"[..])
        );
        assert_eq!(
            environment_id(b"GENV_ENVIRONMENT_ID=a\0GENV_ENVIRONMENT_ID=b\0"),
            Some(&b"b"[..])
        );
        assert_eq!(environment_id(b"GENV_ENVIRONMENT_IDX=1\0"), None);
        assert_eq!(environment_id(b""), None);
        assert_eq!(environment_id(b"GENV_ENVIRONMENT_ID=\0"), Some(&b""[..]));
        assert_eq!(
            environment_id(b"GENV_ENVIRONMENT_ID=a\nb\xff\0"),
            Some(&b"a\nb\xff"[..])
        );
    }

    fn stat(start: u64) -> Vec<u8> {
        format!("42 (x) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {start} 0 0").into_bytes()
    }

    /// A `/proc/42` whose files answer in turn from `answers`.
    fn reads(
        answers: Vec<(&'static str, std::io::Result<Vec<u8>>)>,
    ) -> impl FnMut(&str) -> std::io::Result<Vec<u8>> {
        let mut answers = answers.into_iter();
        move |file| {
            let (expected, answer) = answers.next().expect("no more reads expected");
            assert_eq!(file, expected);
            answer
        }
    }

    fn gone() -> std::io::Result<Vec<u8>> {
        Err(std::io::Error::from(ErrorKind::NotFound))
    }

    #[test]
    fn identity_is_read_between_two_equal_start_times() {
        let status = || Ok(b"Uid:\t1001\t1001\t1001\t1001\n".to_vec());
        let environ = || Ok(b"GENV_ENVIRONMENT_ID=e\0".to_vec());
        let seen = identity(
            reads(vec![
                ("stat", Ok(stat(7))),
                ("status", status()),
                ("environ", environ()),
                ("stat", Ok(stat(7))),
            ]),
            true,
        );
        assert_eq!(
            seen,
            Some(RawProc::Seen {
                start_time: 7,
                uid: Some(1001),
                environ: Environ::Var(b"e".to_vec())
            })
        );
        // Reused between the reads: the uid and environ may be the new process's.
        let reused = identity(
            reads(vec![
                ("stat", Ok(stat(7))),
                ("status", status()),
                ("environ", environ()),
                ("stat", Ok(stat(8))),
            ]),
            true,
        );
        assert!(matches!(reused, Some(RawProc::Unsure(w)) if w.contains("reused")));
        // Gone before, or between the reads.
        assert_eq!(identity(reads(vec![("stat", gone())]), true), None);
        let vanished = identity(
            reads(vec![
                ("stat", Ok(stat(7))),
                ("status", gone()),
                ("stat", gone()),
            ]),
            false,
        );
        assert_eq!(vanished, None);
        let denied = identity(
            reads(vec![
                ("stat", Ok(stat(7))),
                ("status", status()),
                ("environ", Err(ErrorKind::PermissionDenied.into())),
                ("stat", Ok(stat(7))),
            ]),
            true,
        );
        assert!(matches!(
            denied,
            Some(RawProc::Seen { environ: Environ::Unreadable(w), .. }) if w.contains("permissions")
        ));
        let environ_gone = identity(
            reads(vec![
                ("stat", Ok(stat(7))),
                ("status", status()),
                ("environ", gone()),
            ]),
            true,
        );
        assert_eq!(environ_gone, None, "it exited while read");
        let environ_io = identity(
            reads(vec![
                ("stat", Ok(stat(7))),
                ("status", status()),
                ("environ", Err(std::io::Error::other("disk on fire"))),
                ("stat", Ok(stat(7))),
            ]),
            true,
        );
        assert!(matches!(
            environ_io,
            Some(RawProc::Seen { environ: Environ::Unreadable(w), .. }) if w == "cannot read its environment: disk on fire"
        ));
        let no_var = identity(
            reads(vec![
                ("stat", Ok(stat(7))),
                ("status", status()),
                ("environ", Ok(b"A=1\0".to_vec())),
                ("stat", Ok(stat(7))),
            ]),
            true,
        );
        assert!(matches!(
            no_var,
            Some(RawProc::Seen {
                environ: Environ::NoVar,
                ..
            })
        ));
        let garbled = identity(reads(vec![("stat", Ok(b"42 (x".to_vec()))]), true);
        assert!(matches!(garbled, Some(RawProc::Unsure(_))));
    }

    #[test]
    fn uid() {
        assert_eq!(
            real_uid("Name:\tsleep\nUid:\t1001\t1001\t1001\t1001\n"),
            Some(1001)
        );
        assert_eq!(real_uid("Name:\tsleep\n"), None);
    }
}
