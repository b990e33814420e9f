//! What a run writes: reports on stdout and stderr, our own complaints on
//! stderr; a closed stdout (`| head`) ends the run quietly.

use std::io::Write;

use crate::report::{self, CycleReport, Format};

/// A line on stderr, as all our messages; a closed stderr is not worth a
/// panic.
pub fn complain(message: &str) {
    let _ = writeln!(std::io::stderr().lock(), "genv-enforce: {message}");
}

/// Writes lines to stdout; false when stdout is gone (a closed pipe), so
/// that the caller ends the run as `| head` expects. Other write errors are
/// ignored: enforcement goes on.
pub fn print_stdout(lines: &[String]) -> bool {
    let mut out = std::io::stdout().lock();
    let written = lines
        .iter()
        .try_for_each(|l| writeln!(out, "{l}"))
        .and_then(|()| out.flush());
    !matches!(written, Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe)
}

/// Writes a report to stdout/stderr in `format`, host failures in text
/// only if `host_errors`. Returns false when stdout is gone (a closed
/// pipe): the run then ends, as `| head` expects. Other write errors are
/// ignored: enforcement goes on.
pub fn emit(report: &CycleReport, format: Format, host_errors: bool) -> bool {
    let mut out = std::io::stdout().lock();
    let written = match format {
        Format::Json => writeln!(out, "{}", report::render_json(report)),
        Format::Text => {
            let text = report::render_text_with(report, host_errors);
            {
                let mut err = std::io::stderr().lock();
                for l in &text.stderr {
                    let _ = writeln!(err, "{l}");
                }
                if host_errors {
                    let _ = writeln!(err, "{}", report::summary_line(report));
                }
            }
            text.stdout.iter().try_for_each(|l| writeln!(out, "{l}"))
        }
    };
    let flushed = written.and_then(|()| out.flush());
    !matches!(flushed, Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe)
}
