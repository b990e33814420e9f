//! The parts of `/proc/<pid>/{stat,environ,status}` we need, parsed from
//! their bytes. Reading them is left to [`crate::local`].

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

/// The value of `GENV_ENVIRONMENT_ID` in a NUL-separated environ, the last
/// one winning as in genv; `None` when absent.
pub fn environment_id(environ: &[u8]) -> Option<String> {
    environ
        .split(|&b| b == 0)
        .rev()
        .find_map(|var| var.strip_prefix(ENV_VAR.as_bytes())?.strip_prefix(b"="))
        .map(|v| String::from_utf8_lossy(v).into_owned())
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
    fn environ() {
        assert_eq!(
            environment_id(b"PATH=/bin\0GENV_ENVIRONMENT_ID=4100\0HOME=/root\0"),
            Some("4100".into())
        );
        assert_eq!(
            environment_id(b"GENV_ENVIRONMENT_ID=a\0GENV_ENVIRONMENT_ID=b\0"),
            Some("b".into())
        );
        assert_eq!(environment_id(b"GENV_ENVIRONMENT_IDX=1\0"), None);
        assert_eq!(environment_id(b""), None);
        assert_eq!(
            environment_id(b"GENV_ENVIRONMENT_ID=\0"),
            Some(String::new())
        );
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
