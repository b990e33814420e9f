//! The man pages and shell completions, made from the command line's own
//! definitions (`genv-enforce docs --out DIR`, run when packaging), so
//! that they never drift from `--help`.

use std::path::{Path, PathBuf};

use clap::CommandFactory;
use clap_complete::Shell;

use crate::cli::Cli;

/// Writes `DIR/man/genv-enforce.1` and a page per subcommand
/// (`genv-enforce-remote-enforce.1`, ...), and `DIR/completions/` for bash
/// (`genv-enforce.bash`), zsh (`_genv-enforce`) and fish
/// (`genv-enforce.fish`); returns the files written.
///
/// # Errors
/// A directory or file cannot be written.
pub fn write(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let man = dir.join("man");
    std::fs::create_dir_all(&man)?;
    clap_mangen::generate_to(Cli::command(), &man)?;
    let completions = dir.join("completions");
    std::fs::create_dir_all(&completions)?;
    let mut written = Vec::new();
    for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
        let path =
            clap_complete::generate_to(shell, &mut Cli::command(), "genv-enforce", &completions)?;
        if shell == Shell::Bash {
            let text = std::fs::read_to_string(&path)?;
            std::fs::write(&path, bash_hyphen_fix(&text))?;
        }
        written.push(path);
    }
    let mut pages: Vec<PathBuf> = std::fs::read_dir(&man)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    pages.sort();
    pages.extend(written);
    Ok(pages)
}

/// clap_complete's bash script names a hyphenated program's states two
/// ways (`genv__enforce__subcmd__remote` where it walks the words,
/// `genv__subcmd__enforce__subcmd__remote` in its cases: clap issues 6421
/// and 6529), so nothing past the subcommand completes: one spelling.
fn bash_hyphen_fix(script: &str) -> String {
    script.replace("genv__subcmd__enforce", "genv__enforce")
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_subcommand_has_a_page_and_every_shell_its_completions() {
        let dir = tempfile::tempdir().unwrap();
        let written = super::write(dir.path()).unwrap();
        let names: Vec<String> = written
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        for name in [
            "genv-enforce.1",
            "genv-enforce-enforce.1",
            "genv-enforce-remote.1",
            "genv-enforce-remote-enforce.1",
            "genv-enforce-remote-doctor.1",
            "genv-enforce-doctor.1",
            "genv-enforce-report.1",
            "genv-enforce-snapshot.1",
            "genv-enforce.bash",
            "_genv-enforce",
            "genv-enforce.fish",
        ] {
            assert!(names.contains(&name.to_string()), "{name} not in {names:?}");
        }
        assert!(
            !names
                .iter()
                .any(|n| n.contains("docs") || n.contains("help")),
            "{names:?}"
        );
        let page =
            std::fs::read_to_string(dir.path().join("man/genv-enforce-remote-enforce.1")).unwrap();
        assert!(page.contains("notify\\-terminal"), "a page says every flag");
        // `genv-enforce remote --inv<TAB>`, as bash completes it.
        let script = dir.path().join("completions/genv-enforce.bash");
        let out = std::process::Command::new("bash")
            .arg("-c")
            .arg(format!(
                "source '{}'; f=$(complete -p genv-enforce | sed -E 's/.*-F ([^ ]+).*/\\1/'); \
                 COMP_WORDS=(genv-enforce remote --inv); COMP_CWORD=2; \
                 $f genv-enforce --inv remote; echo \"${{COMPREPLY[@]}}\"",
                script.display()
            ))
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "--inventory");
    }
}
