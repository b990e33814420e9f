//! genv memory strings: an integer with an optional unit suffix.

/// Units genv accepts, longest suffix first so that `mi` is not read as `i`.
const UNITS: [(&str, u64); 7] = [
    ("ki", 1024),
    ("mi", 1024 * 1024),
    ("gi", 1024 * 1024 * 1024),
    ("b", 1),
    ("k", 1000),
    ("m", 1000 * 1000),
    ("g", 1000 * 1000 * 1000),
];

/// Parses a genv memory string (`"2gi"`, `"900mi"`, `"1000"`) into bytes.
///
/// # Errors
/// A message when the string is not a non-negative integer with a known
/// unit, or overflows 64 bits.
pub fn parse(text: &str) -> Result<u64, String> {
    let (digits, multiplier) = UNITS
        .iter()
        .find_map(|(unit, m)| text.strip_suffix(unit).map(|d| (d, *m)))
        .unwrap_or((text, 1));
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("not a memory amount: {text:?}"));
    }
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(multiplier))
        .ok_or_else(|| format!("memory amount too large: {text:?}"))
}

/// Whether a usage string is nvidia-smi's "cannot measure" (`[N/A]`,
/// `[Not Supported]`), possibly with genv's `mi` appended.
pub fn is_unmeasured(text: &str) -> bool {
    let t = text.strip_suffix("mi").unwrap_or(text);
    t.starts_with('[') && t.ends_with(']')
}

/// Decimal megabytes, rounded down, as genv prints them (`bytes_to_memory(.., "m")`).
pub fn megabytes(bytes: u64) -> u64 {
    bytes / 1_000_000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(parse("1000"), Ok(1000));
        assert_eq!(parse("3b"), Ok(3));
        assert_eq!(parse("2k"), Ok(2000));
        assert_eq!(parse("2m"), Ok(2_000_000));
        assert_eq!(parse("2g"), Ok(2_000_000_000));
        assert_eq!(parse("2ki"), Ok(2048));
        assert_eq!(parse("900mi"), Ok(900 * 1024 * 1024));
        assert_eq!(parse("2gi"), Ok(2 * 1024 * 1024 * 1024));
    }

    #[test]
    fn malformed() {
        for bad in ["", "mi", "-1mi", "1.5gi", "2 gi", "2GB", "[N/A]mi", "x"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        assert!(parse("99999999999999999999gi").is_err());
    }

    #[test]
    fn unmeasured() {
        assert!(is_unmeasured("[N/A]mi"));
        assert!(is_unmeasured("[Not Supported]"));
        assert!(!is_unmeasured("900mi"));
    }

    #[test]
    fn megabytes_round_down() {
        assert_eq!(megabytes(parse("3gi").unwrap()), 3221);
        assert_eq!(megabytes(999_999), 0);
    }
}
