//! Names the commit genv-enforce is built from, for `--version`:
//! `GENV_ENFORCE_COMMIT` when set (a build from a tarball), else git's
//! short hash of HEAD (with `-dirty` for uncommitted changes), else
//! `unknown`.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    println!("cargo:rerun-if-env-changed=GENV_ENFORCE_COMMIT");
    let commit = std::env::var("GENV_ENFORCE_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .or_else(|| {
            let hash = git(&["rev-parse", "--short=12", "HEAD"])?;
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            Some(if dirty { format!("{hash}-dirty") } else { hash })
        })
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=GENV_ENFORCE_COMMIT={commit}");
    // Built again when HEAD moves or the branch gets a commit.
    if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
        println!("cargo:rerun-if-changed={dir}/HEAD");
        println!("cargo:rerun-if-changed={dir}/index");
        if let Some(head) = git(&["symbolic-ref", "-q", "HEAD"]) {
            println!("cargo:rerun-if-changed={dir}/{head}");
        }
        println!("cargo:rerun-if-changed={dir}/packed-refs");
    }
}
