//! insta snapshots of what an admin reads: the dry run over the recorded
//! fixtures (genv's message strings), local and remote wording, and `--help`.

use std::process::Command;

use genv_enforce::assess::assess;
use genv_enforce::model::{FailureKind, HostFailure, HostId, Mode};
use genv_enforce::outcome::dry_run as dry_run_outcomes;
use genv_enforce::report::render_text;
use genv_enforce::report::CycleReport;
use genv_enforce::rules::Policy;
use genv_enforce::snapshot::genv::parse_snapshot;

fn fixture(
    name: &str,
) -> (
    HostId,
    Result<genv_enforce::model::HostSnapshot, HostFailure>,
) {
    let path = format!(
        "{}/fixtures/snapshots/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap();
    (
        HostId(name.into()),
        parse_snapshot(&text, &path)
            .map_err(|e| HostFailure::new(FailureKind::Parse, e.to_string())),
    )
}

fn policy() -> Policy {
    Policy {
        non_env_processes: true,
        max_devices_per_user: Some(2),
        max_devices_for_user: [("erin".to_string(), 0)].into_iter().collect(),
        ..Policy::default()
    }
}

fn render(mode: Mode, hosts: &[&str]) -> String {
    let a = assess(
        1,
        mode,
        true,
        &policy(),
        hosts.iter().map(|h| fixture(h)).collect(),
    );
    let outcomes = dry_run_outcomes(&a.plan);
    let report = CycleReport::new(a, outcomes, None);
    let text = render_text(&report);
    format!(
        "--- stdout\n{}\n--- stderr\n{}\n",
        text.stdout.join("\n"),
        text.stderr.join("\n")
    )
}

#[test]
fn local_dry_run_per_fixture() {
    for host in ["gpu1", "gpu2", "gpu3"] {
        insta::assert_snapshot!(format!("local_{host}"), render(Mode::Local, &[host]));
    }
}

#[test]
fn remote_wording_over_the_three_fixtures() {
    insta::assert_snapshot!(render(Mode::Remote, &["gpu1", "gpu2", "gpu3"]));
}

#[test]
fn host_errors_are_reported() {
    let bad: (
        HostId,
        Result<genv_enforce::model::HostSnapshot, HostFailure>,
    ) = (
        HostId("gpu9".into()),
        Err(HostFailure::new(
            FailureKind::NvidiaSmi,
            "nvidia-smi exited with exit status: 9: NVIDIA-SMI has failed",
        )),
    );
    let report = CycleReport::new(
        assess(1, Mode::Remote, true, &policy(), vec![fixture("gpu2"), bad]),
        Vec::new(),
        None,
    );
    insta::assert_snapshot!(render_text(&report).stderr.join("\n"));
}

#[test]
fn help_texts() {
    let bin = env!("CARGO_BIN_EXE_genv-enforce");
    let help = |args: &[&str]| {
        String::from_utf8(Command::new(bin).args(args).output().unwrap().stdout).unwrap()
    };
    insta::assert_snapshot!("help", help(&["--help"]));
    insta::assert_snapshot!("enforce_help", help(&["enforce", "--help"]));
    insta::assert_snapshot!("remote_help", help(&["remote", "--help"]));
    insta::assert_snapshot!(
        "remote_enforce_help",
        help(&["remote", "enforce", "--help"])
    );
    insta::assert_snapshot!("doctor_help", help(&["doctor", "--help"]));
    // An example for each common case.
    let top = help(&["--help"]);
    for case in [
        "enforce --non-env-processes",
        "remote -H gpu1,gpu2,gpu3 enforce",
        "--interval 0",
        "--dry-run",
        "--snapshot-dir",
        "genv-enforce doctor",
        "remote --inventory hosts.toml doctor",
    ] {
        assert!(top.contains(case), "{case}: {top}");
    }
    for sub in [&["enforce", "--help"][..], &["remote", "--help"]] {
        assert!(help(sub).contains("Examples:"), "{sub:?}");
    }
}

#[test]
fn json_report_shape() {
    let a = assess(1, Mode::Remote, true, &policy(), vec![fixture("gpu1")]);
    let outcomes = dry_run_outcomes(&a.plan);
    let report = CycleReport::new(a, outcomes, None);
    let json: serde_json::Value =
        serde_json::from_str(&genv_enforce::report::render_json(&report)).unwrap();
    insta::assert_snapshot!(serde_json::to_string_pretty(&json).unwrap());
}

#[test]
fn replays_name_what_they_cannot_read() {
    // Issue 9: a mistyped --snapshot-dir replayed zero hosts and exited 0;
    // a recorded host that cannot be read was "Failed running SSH command".
    let bin = env!("CARGO_BIN_EXE_genv-enforce");
    let run = |args: &[&str]| {
        let out = std::process::Command::new(bin).args(args).output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, _, err) = run(&["remote", "enforce", "--snapshot-dir", "/nonexistent/snaps"]);
    assert_eq!(code, Some(2));
    assert!(
        err.contains("--snapshot-dir /nonexistent/snaps: No such file or directory"),
        "{err}"
    );
    let empty = tempfile::tempdir().unwrap();
    let dir = empty.path().to_str().unwrap();
    let (code, _, err) = run(&["remote", "enforce", "--snapshot-dir", dir]);
    assert_eq!(code, Some(2));
    assert!(err.contains("no recorded snapshots"), "{err}");
    let fixtures = format!("{}/fixtures/snapshots", env!("CARGO_MANIFEST_DIR"));
    let (code, out, err) = run(&[
        "remote",
        "-H",
        "gpu1,gpu9",
        "enforce",
        "--snapshot-dir",
        &fixtures,
        "--non-env-processes",
    ]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains("Failed reading the recorded snapshot of gpu9 (")
            && err.contains("gpu9.json: No such file or directory"),
        "{err}"
    );
    assert!(
        out.contains("gpu1"),
        "the readable host is still assessed: {out}"
    );
    let (code, _, err) = run(&["enforce", "--snapshot", "/nonexistent/gpu1.json"]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains(
            "[ERROR] Failed reading a recorded snapshot: /nonexistent/gpu1.json: No such file"
        ),
        "{err}"
    );
}

#[test]
fn exit_codes_for_cron() {
    // 0 clean, 1 a host or action failed, 2 usage, 3 a dry run found violations.
    let bin = env!("CARGO_BIN_EXE_genv-enforce");
    let fixtures = format!("{}/fixtures/snapshots", env!("CARGO_MANIFEST_DIR"));
    let gpu1 = format!("{fixtures}/gpu1.json");
    let code = |args: &[&str]| {
        let out = std::process::Command::new(bin).args(args).output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (c, err) = code(&["enforce", "--snapshot", &gpu1, "--non-env-processes"]);
    assert_eq!(c, Some(3), "{err}");
    assert!(
        err.lines()
            .last()
            .unwrap()
            .starts_with("[SUMMARY] cycle 1: 1 hosts ok, 0 failed;")
            && err.contains("actions planned (dry run)"),
        "{err}"
    );
    let (c, err) = code(&[
        "enforce",
        "--snapshot",
        &gpu1,
        "--no-env-devices",
        "--no-env-memory",
    ]);
    assert_eq!(c, Some(0), "{err}");
    assert!(
        err.contains("; 0 violations; 0 actions planned (dry run)"),
        "{err}"
    );
    let (c, _) = code(&["enforce", "--snapshot", "/nonexistent.json"]);
    assert_eq!(c, Some(1));
    let (c, _) = code(&["remote", "--inventory", "/nonexistent.toml", "enforce"]);
    assert_eq!(c, Some(2));
    let (c, _) = code(&["enforce", "--interval", "x"]);
    assert_eq!(c, Some(2));
    let (c, err) = code(&[
        "remote",
        "-q",
        "enforce",
        "--snapshot-dir",
        &fixtures,
        "--non-env-processes",
    ]);
    assert_eq!(c, Some(3));
    assert!(!err.contains("[SUMMARY]"), "-q: {err}");
}
