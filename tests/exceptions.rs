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
