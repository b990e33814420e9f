//! Regressions of issue 42 ("no exceptions"): one count per user, waits a
//! user cannot reset, and nothing a user writes stops enforcement or falls
//! on someone else. One test per row of the table, with real
//! processes of real users, through real sshd where the rule needs the
//! inventory; each failed on `f81a4a4`.

mod util;

use std::process::Output;
use std::time::Duration;

use util::env;
use util::fleet::Fleet;

const SIGTERM: i32 = 15;
const WAIT: Duration = Duration::from_secs(10);

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

// Row 4: a warn-only rule's termination is never carried out, so it frees
// nothing under the memory cap. Row 11: a record forged in an exempt
// user's name never borrows her exemption.
#[test]
fn rows_4_and_11_a_cap_counts_what_is_carried_out_and_an_exemption_follows_the_kernel() {
    let Some(mut f) = Fleet::up(1) else { return };
    let tail = "\n[[exempt]]\nuser = \"alice\"\nreason = \"a deadline\"\n\
                \n[policy.non-env-processes]\naction = \"warn\"\n";
    let inventory = f.inventory(false, &[], tail);
    // bob: two jobs outside genv on GPU 1, 10 GiB and (younger) 60 GiB.
    let older = f.host(0).spawn_as("bob", None);
    std::thread::sleep(Duration::from_millis(50));
    let big = f.host(0).spawn_as("bob", None);
    // alice: her job in `a`, on device 0. bob's record `fake` in her name
    // holds devices 2 and 3, listing a live pid of his (genv keeps it).
    let hers = f.host(0).spawn_as("alice", Some("a"));
    let bobs_shell = f.host(0).spawn_as("bob", None);
    f.host(0).write_envs(&[
        env("a", Some("alice"), None, hers),
        env("fake", Some("alice"), None, bobs_shell),
    ]);
    f.host(0)
        .write_devices(4, &[(0, "a"), (2, "fake"), (3, "fake")]);
    f.host(0)
        .set_apps(&[(older, 1, "10240"), (big, 1, "61440"), (hers, 0, "100")]);
    let out = f
        .command(&[
            "--inventory",
            &inventory.display().to_string(),
            "enforce",
            "--interval",
            "0",
            "--non-env-processes",
            "--max-memory-per-user",
            "40gi",
            "--max-devices-per-user",
            "1",
        ])
        .output()
        .unwrap();
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    // Row 4: the cap took bob's youngest job; the older one is warned only.
    assert_eq!(f.host(0).wait_signal(big, WAIT), Some(SIGTERM), "{err}");
    assert!(f.host(0).running(older), "{err}");
    assert!(
        err.contains(&format!("Process {older} of user bob from environment N/A on GPU(s) 1 violates non-env-processes: warned only")),
        "{err}"
    );
    // Row 11: bob's forgery is detached; alice's own job and attachment,
    // exempt, are left.
    assert!(f.host(0).attached(2).is_empty(), "{err}");
    assert!(f.host(0).attached(3).is_empty(), "{err}");
    assert_eq!(f.host(0).attached(0), ["a"], "{err}");
    assert!(f.host(0).running(hers), "{err}");
    assert!(f.host(0).running(bobs_shell), "{err}");
}

/// The JSON report of a run with `--output json`.
fn report(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            stderr(out)
        )
    })
}

/// The deadlines of what waits in `r`, by pid.
fn deadlines(r: &serde_json::Value) -> Vec<(u64, u64)> {
    r["awaiting_confirmation"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|w| Some((w["pid"].as_u64()?, w["deadline_ms"].as_u64()?)))
        .collect()
}

/// The stages of the ladder's events in `r`.
fn stages(r: &serde_json::Value) -> Vec<String> {
    r["events"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| e["stage"].as_str().unwrap_or("").to_string())
        .collect()
}

// Row 3 and the third limit: a wait is kept through a garbled envs.json,
// and a job restarted under a new pid takes it up.
#[test]
fn row3_a_wait_survives_a_garbled_state_and_a_restart_under_a_new_pid() {
    if !util::prerequisite(
        rustix::process::geteuid().is_root(),
        "jobs of other users, and their signals, need root",
    ) {
        return;
    }
    let mut h = util::Host::new(2);
    let private = util::private_dir();
    let db = private.path().join("state.db");
    let shell = h.spawn_as("exbob", Some("b"));
    let job = h.spawn_as("exbob", Some("b"));
    let envs = [env("b", Some("exbob"), None, shell)];
    h.write_envs(&envs);
    h.write_devices(2, &[(0, "b")]);
    // His job runs on GPU 1, which `b` is not attached to.
    h.set_apps(&[(job, 1, "100")]);
    let run = |h: &util::Host| {
        let out = h.ours(&[
            "enforce",
            "--interval",
            "0",
            "--grace",
            "1h",
            "--output",
            "json",
            "--state-db",
            db.to_str().unwrap(),
        ]);
        report(&out)
    };
    let first = run(&h);
    assert_eq!(stages(&first), ["warned"], "{first:#}");
    let due = deadlines(&first)[0].1;
    // One garbled cycle: nothing cleared, nothing moved.
    std::fs::write(h.state_dir().join("envs.json"), "{garbled").unwrap();
    let garbled = run(&h);
    assert_eq!(stages(&garbled), Vec::<String>::new(), "{garbled:#}");
    h.write_envs(&envs);
    let back = run(&h);
    assert_eq!(stages(&back), Vec::<String>::new(), "{back:#}");
    assert_eq!(deadlines(&back), [(u64::from(job), due)]);
    // Restarted under a new pid on the same GPU: the same deadline.
    h.end(job);
    let again = h.spawn_as("exbob", Some("b"));
    h.set_apps(&[(again, 1, "100")]);
    let restarted = run(&h);
    assert_eq!(
        deadlines(&restarted),
        [(u64::from(again), due)],
        "{restarted:#}"
    );
    assert!(h.running(again));
}
