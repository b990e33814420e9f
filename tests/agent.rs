//! The host agent's own unit tests (`tests/agent/test_agent.py`), run under
//! every Python 3 found here: the system's (what sudo finds on a host) and,
//! where pyenv has them, 3.7 (genv 1.4.3's oldest) and up.

use std::path::PathBuf;
use std::process::Command;

fn pythons() -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = ["/usr/bin/python3"]
        .into_iter()
        .map(PathBuf::from)
        .filter(|p| p.exists())
        .collect();
    let pyenv = std::env::var_os("PYENV_ROOT")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".pyenv")));
    if let Some(versions) = pyenv.map(|p| p.join("versions")) {
        let mut more: Vec<PathBuf> = std::fs::read_dir(versions)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.strip_prefix("3."))
                    .and_then(|n| n.split('.').next()?.parse::<u32>().ok())
                    .is_some_and(|minor| minor >= 7)
            })
            .map(|p| p.join("bin/python3"))
            .filter(|p| p.exists())
            .collect();
        more.sort();
        found.extend(more);
    }
    found
}

#[test]
fn agent_unit_tests_pass_under_every_python() {
    let pythons = pythons();
    assert!(
        !pythons.is_empty(),
        "no Python 3 found: the host agent needs one (apt-get install python3)"
    );
    let test = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/agent/test_agent.py");
    for python in pythons {
        let out = Command::new(&python).arg("-B").arg(&test).output().unwrap();
        assert!(
            out.status.success(),
            "{}: {}",
            python.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        eprintln!("agent tests pass under {}", python.display());
    }
}
