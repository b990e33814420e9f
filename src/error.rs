//! How an error becomes text: [`chain`] tells it and all its causes on one
//! line (reports, stderr). Each layer keeps its own typed errors (a host's
//! are [`crate::host::HostError`]).

/// An error and all its causes, `: `-separated, on one line.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text.trim().replace('\n', " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error with a message and, maybe, a cause.
    #[derive(Debug)]
    struct E(&'static str, Option<Box<E>>);

    impl std::fmt::Display for E {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for E {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|e| e as _)
        }
    }

    #[test]
    fn causes_are_told_once_in_order_on_one_line() {
        let e = E(
            "outer",
            Some(Box::new(E("wrapped\n", Some(Box::new(E("denied", None)))))),
        );
        assert_eq!(chain(&e), "outer: wrapped : denied");
        assert_eq!(chain(&E(" alone\n", None)), "alone");
    }
}
