//! The configuration file: every flag has a key, the shipped schema is the
//! one the definitions make and a real JSON Schema validator accepts the
//! shipped example with it, `config check` passes that example and names
//! each problem of broken files at its line and column, and a file runs a
//! real replay as the same flags would.

mod util;

use std::path::Path;
use std::process::{Command, Output};

use clap::CommandFactory;
use genv_enforce::cli::Cli;
use genv_enforce::config_file::{self, NOT_KEYS, SECTIONS};

fn ours(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_genv-enforce"))
        .args(args)
        .current_dir(util::repo())
        .env_remove("GENV_ENFORCE_ARGS")
        .output()
        .unwrap()
}

/// `genv-enforce config check` with `args`.
fn check(args: &[&str]) -> Output {
    ours(&[&["config", "check"], args].concat())
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Every flag of every command an enforcer runs (`enforce`, `remote`,
/// `remote enforce`, `remote doctor`, `doctor`), by long name.
fn every_flag() -> Vec<String> {
    let mut root = Cli::command();
    root.build();
    let mut out = Vec::new();
    let mut stack = vec![&root];
    while let Some(cmd) = stack.pop() {
        for a in cmd.get_arguments() {
            if let Some(long) = a.get_long() {
                out.push(long.to_string());
            }
        }
        stack.extend(cmd.get_subcommands().filter(|c| {
            !["report", "docs", "snapshot", "config", "status", "top"].contains(&c.get_name())
        }));
    }
    out.sort();
    out.dedup();
    out
}

#[test]
fn every_flag_has_a_key_in_one_section_and_the_schema() {
    let schema = config_file::schema(&Cli::command());
    let mut keys = Vec::new();
    for (section, _, in_section) in SECTIONS {
        for key in *in_section {
            assert!(
                schema["properties"][section]["properties"][key].is_object(),
                "[{section}] {key} is not in the schema"
            );
            keys.push(config_file::long_of(key).to_string());
        }
    }
    let mut sorted = keys.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), keys.len(), "a key in two sections");
    let flags: Vec<String> = every_flag()
        .into_iter()
        .filter(|f| !NOT_KEYS.contains(&f.as_str()))
        .collect();
    let missing: Vec<&String> = flags.iter().filter(|f| !sorted.contains(f)).collect();
    assert!(missing.is_empty(), "flags without a key: {missing:?}");
    let stale: Vec<&String> = sorted.iter().filter(|k| !flags.contains(k)).collect();
    assert!(stale.is_empty(), "keys without a flag: {stale:?}");
}

#[test]
fn the_shipped_schema_is_the_one_the_definitions_make() {
    let shipped =
        std::fs::read_to_string(util::repo().join("contrib/genv-enforce.schema.json")).unwrap();
    let made = ours(&["config", "schema"]);
    assert!(made.status.success(), "{}", stderr(&made));
    assert_eq!(
        shipped,
        String::from_utf8_lossy(&made.stdout),
        "contrib/genv-enforce.schema.json is stale: genv-enforce config schema > contrib/genv-enforce.schema.json"
    );
    let example = std::fs::read_to_string(util::repo().join("contrib/genv-enforce.toml")).unwrap();
    assert_eq!(
        example.lines().next(),
        Some("#:schema ./genv-enforce.schema.json"),
        "the example names its schema for editors"
    );
}

/// Validates TOML files against the shipped schema with the reference
/// validator (Python's jsonschema): the exit status and its words.
fn validate(files: &[&Path]) -> (bool, String) {
    let found = Command::new("python3")
        .args(["-c", "import jsonschema, tomllib"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found,
        "python3 with jsonschema and tomllib (3.11+) is needed: pip install jsonschema (scripts/test does)"
    );
    let out = Command::new("python3")
        .arg("-c")
        .arg(
            r#"
import json, sys, tomllib, jsonschema
schema = json.load(open(sys.argv[1]))
jsonschema.Draft202012Validator.check_schema(schema)
bad = 0
for f in sys.argv[2:]:
    for e in jsonschema.Draft202012Validator(schema).iter_errors(tomllib.load(open(f, "rb"))):
        print(f, e.message); bad += 1
sys.exit(1 if bad else 0)
"#,
        )
        .arg(util::repo().join("contrib/genv-enforce.schema.json"))
        .args(files)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &stderr(&out),
    )
}

#[test]
fn a_real_validator_accepts_the_example_with_the_schema_and_refuses_a_typo() {
    let example = util::repo().join("contrib/genv-enforce.toml");
    let (ok, words) = validate(&[&example]);
    assert!(ok, "{words}");
    let dir = tempfile::tempdir().unwrap();
    let typo = dir.path().join("typo.toml");
    std::fs::write(
        &typo,
        "[rules]\nmax-device-per-user = 2\n[policy]\noutput = \"yaml\"\n",
    )
    .unwrap();
    let (ok, words) = validate(&[&typo]);
    assert!(!ok, "{words}");
    assert!(words.contains("max-device-per-user"), "{words}");
    assert!(words.contains("'yaml' is not one of"), "{words}");
}

#[test]
fn config_check_passes_the_shipped_example() {
    let out = check(&[
        "--config",
        "contrib/genv-enforce.toml",
        "--",
        "remote",
        "--inventory",
        "hosts.example.toml",
        "enforce",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("valid for `genv-enforce remote enforce`"),
        "{}",
        stderr(&out)
    );
    // No example leaves a device cap open to jobs outside genv, nor one
    // job's count to whoever carries its id.
    let example = std::fs::read_to_string(util::repo().join("contrib/genv-enforce.toml")).unwrap();
    assert!(example.contains("\nnon-env-processes = true"));
    assert!(example.contains("\nenv-devices = true"));
}

#[test]
fn config_check_names_each_problem_at_its_line_and_column() {
    let dir = tempfile::tempdir().unwrap();
    let cases: &[(&str, &str)] = &[
        ("syntax", "[rules\nmax-devices-per-user = 2\n"),
        (
            "keys",
            "interval = 10\n[rules]\nmax-device-per-user = 2\ngrace = \"5m\"\n[tunables]\nx = 1\n",
        ),
        (
            "types",
            "[rules]\nnon-env-processes = \"yes\"\nmax-devices-per-user = [1, 2]\nmax-devices-for-user = 3\n[policy]\ninterval = 1.5\n",
        ),
        (
            "values",
            "[rules]\nmax-devices-per-user = -1\nmax-memory-per-user = \"lots\"\nidle-below = 0\n[policy]\noutput = \"yaml\"\nconfirm-cycles = 0\n",
        ),
        (
            "contradictions",
            "[hosts]\nsnapshot-dir = \"fixtures/snapshots\"\n[rules]\nnon-env-processes = true\nno-non-env-processes = true\n",
        ),
        (
            "shard-with-a-group-cap",
            "[hosts]\ninventory = \"hosts.example.toml\"\n[rules]\nmax-devices-per-group = { ml = 4 }\n[high-availability]\nha-etcd = \"http://127.0.0.1:2379\"\nshard = \"1/2\"\n",
        ),
        (
            "missing-inventory",
            "[hosts]\ninventory = \"/nonexistent/hosts.toml\"\n",
        ),
    ];
    let mut all = String::new();
    for (name, text) in cases {
        let path = dir.path().join(format!("{name}.toml"));
        std::fs::write(&path, text).unwrap();
        let out = check(&["--config", &path.display().to_string()]);
        assert_eq!(out.status.code(), Some(2), "{name}: {}", stderr(&out));
        all.push_str(&format!(
            "--- {name}.toml\n{}",
            stderr(&out).replace(&dir.path().display().to_string(), "DIR")
        ));
    }
    insta::assert_snapshot!(all);
}

#[test]
fn effective_says_where_each_value_came_from_and_prints_no_secret() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    std::fs::write(
        &path,
        "[hosts]\nsnapshot-dir = \"fixtures/snapshots\"\n[rules]\nmax-devices-per-user = 2\n\
         non-env-processes = true\n[notifications]\nwebhook = \"https://hooks.example/T0/SECRET\"\n",
    )
    .unwrap();
    let out = check(&[
        "--effective",
        "--config",
        &path.display().to_string(),
        "--",
        "remote",
        "enforce",
        "--interval",
        "0",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    let name = path.display().to_string();
    for line in [
        format!("snapshot-dir = \"fixtures/snapshots\"  # {name}:2:1"),
        format!("max-devices-per-user = 2  # {name}:4:1"),
        "interval = 0  # command line".to_string(),
        "# concurrency = 32  # default".to_string(),
        format!("non-env-processes = true  # {name}:5:1"),
        format!("# webhook = (set; secret, not printed)  # {name}:7:1"),
    ] {
        assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
    }
    // A switch left off says nothing.
    assert!(!text.contains("dry-run"), "{text}");
    assert!(!text.contains("SECRET"), "{text}");
    // What it prints is a configuration file that checks the same.
    let again = dir.path().join("again.toml");
    std::fs::write(&again, text.as_bytes()).unwrap();
    let out = check(&["--config", &again.display().to_string()]);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn a_file_runs_the_replay_as_the_same_flags_do_and_flags_win() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    std::fs::write(
        &path,
        "[hosts]\nsnapshot-dir = \"fixtures/snapshots\"\n[rules]\nnon-env-processes = true\n\
         max-devices-per-user = 1\n[policy]\ninterval = 0\n",
    )
    .unwrap();
    let by_flags = ours(&[
        "remote",
        "enforce",
        "--snapshot-dir",
        "fixtures/snapshots",
        "--non-env-processes",
        "--max-devices-per-user",
        "1",
        "--interval",
        "0",
    ]);
    let by_file = ours(&["--config", &path.display().to_string()]);
    assert_eq!(by_file.status.code(), Some(3), "{}", stderr(&by_file));
    assert_eq!(by_file.stdout, by_flags.stdout);
    // A flag on the command line wins over the file's key.
    let wider = ours(&[
        "--config",
        &path.display().to_string(),
        "remote",
        "enforce",
        "--max-devices-per-user",
        "9",
    ]);
    let text = String::from_utf8_lossy(&wider.stdout);
    assert!(!text.contains("more than the maximum allowed"), "{text}");
    assert!(String::from_utf8_lossy(&by_file.stdout).contains("more than the maximum allowed"));
    // A broken file stops the run before anything is touched.
    std::fs::write(&path, "[rules]\nmax-devices-per-user = \"x\"\n").unwrap();
    let out = ours(&["--config", &path.display().to_string()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains(&format!("{}:2:24: max-devices-per-user", path.display())),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_configuration_file_others_could_write_is_refused_and_none_blocks() {
    let root = rustix::process::geteuid().is_root();
    if !util::prerequisite(
        root,
        "the refusals of another user's file need root (chown)",
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let good = "[hosts]\nsnapshot-dir = \"fixtures/snapshots\"\n[policy]\ninterval = 0\n";
    let file = |name: &str, mode: u32| {
        let p = dir.path().join(name);
        std::fs::write(&p, good).unwrap();
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap();
        p
    };
    let fine = file("fine.toml", 0o644);
    let link = dir.path().join("link.toml");
    std::os::unix::fs::symlink(&fine, &link).unwrap();
    let writable = file("writable.toml", 0o666);
    let bobs = file("bobs.toml", 0o644);
    std::os::unix::fs::chown(&bobs, Some(65534), Some(65534)).unwrap();
    let fifo = dir.path().join("fifo.toml");
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &fifo,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
    let open_dir = dir.path().join("open");
    std::fs::create_dir(&open_dir).unwrap();
    std::fs::set_permissions(
        &open_dir,
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let in_open = open_dir.join("c.toml");
    std::fs::write(&in_open, good).unwrap();
    let huge = dir.path().join("huge.toml");
    std::fs::File::create(&huge)
        .unwrap()
        .set_len(genv_enforce::private::CONFIG_MAX + 1)
        .unwrap();
    for (path, ok, words) in [
        (&fine, true, ""),
        (&link, true, ""),
        (&writable, false, "writable by others: refused"),
        (&bobs, false, "owned by another user than root: refused"),
        (&fifo, false, "a socket or FIFO: refused"),
        (
            &in_open,
            false,
            "could be replaced by another user: refused",
        ),
        (&huge, false, "larger than 16777216 bytes: refused"),
        (
            &Path::new("/dev/zero").to_path_buf(),
            false,
            "not a regular file: refused",
        ),
    ] {
        let started = std::time::Instant::now();
        let out = ours(&["--config", &path.display().to_string()]);
        assert!(
            started.elapsed() < std::time::Duration::from_secs(20),
            "{path:?} held the run"
        );
        if ok {
            assert_eq!(out.status.code(), Some(3), "{path:?}: {}", stderr(&out));
        } else {
            assert_eq!(out.status.code(), Some(2), "{path:?}");
            let err = stderr(&out);
            assert!(
                err.contains(&format!("{}: ", path.display())) && err.contains(words),
                "{path:?}: {err}"
            );
            let check = check(&["--config", &path.display().to_string()]);
            assert_eq!(check.status.code(), Some(2), "{path:?}");
            assert!(stderr(&check).contains(words), "{}", stderr(&check));
        }
    }
    // An inventory is read the same way.
    let inventory = dir.path().join("hosts.toml");
    std::fs::copy(util::repo().join("hosts.example.toml"), &inventory).unwrap();
    std::fs::set_permissions(
        &inventory,
        std::os::unix::fs::PermissionsExt::from_mode(0o666),
    )
    .unwrap();
    let out = ours(&[
        "remote",
        "--inventory",
        &inventory.display().to_string(),
        "doctor",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("writable by others: refused"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn config_check_fails_on_a_named_file_that_is_missing_and_not_on_a_missing_default() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nowhere.toml");
    let out = check(&["--config", &missing.display().to_string()]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&missing.display().to_string()),
        "{}",
        stderr(&out)
    );
    // Without --config, a missing default file checks the command line
    // alone.
    if !util::prerequisite(
        !Path::new(config_file::DEFAULT_PATH).exists(),
        "no configuration file at the default path",
    ) {
        return;
    }
    let out = check(&["--", "remote", "-H", "gpu1", "enforce"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // No file: what is checked, and what each message names, is the
    // command line.
    assert!(
        stderr(&out).starts_with("command line: valid for `genv-enforce remote enforce`")
            && stderr(&out).contains(&format!(
                "(no configuration file at {})",
                config_file::DEFAULT_PATH
            )),
        "{}",
        stderr(&out)
    );
    let out = check(&["--effective", "--", "remote", "-H", "gpu1", "enforce"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        printed.contains("from the command\n# line (no configuration file)")
            && !printed.contains(config_file::DEFAULT_PATH),
        "{printed}"
    );
    let out = check(&["--", "remote", "enforce", "--interval", "x"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).starts_with("command line: ")
            && !stderr(&out).contains(config_file::DEFAULT_PATH),
        "{}",
        stderr(&out)
    );
}
