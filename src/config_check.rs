//! `config check` and `config schema`: the configuration file checked as
//! the command that runs with it would take it (its keys, then the whole
//! command line, then what `config::resolve` makes of it and the files it
//! names), touching no host; with `--effective`, every resolved value and
//! where it came from.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches};

use crate::cli::{Cli, ConfigCheckArgs};
use crate::config_file::{self, Setting, Source, SECRET_KEYS, SECTIONS};
use crate::error::chain;

/// A check that failed: exit status 2, as any command-line error.
pub const FAILED: u8 = 2;

/// `config schema`: the file's JSON Schema on stdout.
pub fn schema() -> u8 {
    let text =
        serde_json::to_string_pretty(&config_file::schema(&Cli::command())).expect("a JSON value");
    println!("{text}");
    0
}

/// `config check`: 0 when the file at `path` (or the default) passes,
/// [`FAILED`] with each problem on stderr otherwise.
pub fn run(path: Option<PathBuf>, args: &ConfigCheckArgs) -> u8 {
    let given = path.is_some();
    let path = path.unwrap_or_else(|| PathBuf::from(config_file::DEFAULT_PATH));
    let root = Cli::command();
    // Without --config, a missing default file checks the command line
    // alone (moving GENV_ENFORCE_ARGS into a first file).
    let file = (given || path.exists()).then_some(path.as_path());
    // What each message names: the file, or the command line when there
    // is none.
    let origin = file.map_or("command line".into(), |f| f.display().to_string());
    let settings = match file.map(|f| crate::setup::config_settings(f, &root)) {
        None => Vec::new(),
        Some(Ok(s)) => s,
        // One problem a line, as compilers say them.
        Some(Err(crate::setup::SetupError::ConfigFile { path, problems })) => {
            for p in problems {
                eprintln!("{}:{p}", path.display());
            }
            return FAILED;
        }
        Some(Err(e)) => {
            eprintln!("{}", chain(&e));
            return FAILED;
        }
    };
    let line: Vec<OsString> = std::iter::once(OsString::from("genv-enforce"))
        .chain(args.command.iter().cloned())
        .collect();
    let (merged, sources) = config_file::apply(&root, &line, &settings);
    let command = config_file::command_of(&root, &merged).join(" ");
    let fail = |message: &str| {
        match locate(message, &settings, &sources) {
            Some(at) => eprintln!("{}:{}:{}: {message}", path.display(), at.line, at.column),
            None => eprintln!("{origin}: {message}"),
        }
        FAILED
    };
    let matches = match root.clone().try_get_matches_from(&merged) {
        Ok(m) => m,
        Err(e) => return fail(&clap_message(&e)),
    };
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => return fail(&clap_message(&e)),
    };
    let read = match crate::setup::read(&cli) {
        Ok(r) => r,
        Err(e) => return fail(&chain(&e)),
    };
    if let Err(e) = crate::config::resolve(cli, &read) {
        return fail(&chain(&e));
    }
    if args.effective {
        print!("{}", effective(file, &command, &matches, &sources));
    }
    match file {
        Some(_) => eprintln!("{origin}: the configuration is valid for `genv-enforce {command}`"),
        None => eprintln!(
            "{origin}: valid for `genv-enforce {command}` (no configuration file at {})",
            path.display()
        ),
    }
    0
}

/// clap's message without its `error: ` and usage lines.
fn clap_message(e: &clap::Error) -> String {
    let text = e.render().to_string();
    text.lines()
        .next()
        .unwrap_or_default()
        .trim_start_matches("error: ")
        .to_string()
}

/// The file's place of the first key (in file order) that `message`
/// names, as a flag (`--shard`) or by its value (a path).
fn locate(
    message: &str,
    settings: &[Setting],
    sources: &BTreeMap<String, Source>,
) -> Option<config_file::At> {
    let from_file = |s: &&Setting| matches!(sources.get(&s.key), Some(Source::File(_)));
    let named = |s: &&Setting| {
        let flag = format!("--{}", config_file::long_of(&s.key));
        message.match_indices(&flag).any(|(i, _)| {
            !message[i + flag.len()..].starts_with(|c: char| c == '-' || c.is_alphanumeric())
        }) || s
            .values
            .iter()
            // A file it names (`inventory`): other values (`10`, `json`)
            // could be any word of the message.
            .any(|v| v.contains('/') && message.contains(v.as_str()))
    };
    let mut hits: Vec<&Setting> = settings.iter().filter(from_file).filter(named).collect();
    hits.sort_by_key(|s| s.at);
    hits.first().map(|s| s.at)
}

/// The resolved configuration as the file's TOML, each value followed by
/// where it came from, defaults commented out; secrets replaced by a note.
fn effective(
    file: Option<&Path>,
    command: &str,
    matches: &ArgMatches,
    sources: &BTreeMap<String, Source>,
) -> String {
    let root = Cli::command();
    let flags = config_file::flags(&root);
    let mut out = match file {
        Some(path) => format!(
            "# The configuration `genv-enforce {command}` runs with, from {} and the\n\
             # command line; after each value, where it came from.\n",
            path.display()
        ),
        None => format!(
            "# The configuration `genv-enforce {command}` runs with, from the command\n\
             # line (no configuration file); after each value, where it came from.\n"
        ),
    };
    for (section, _, keys) in SECTIONS {
        let mut lines = Vec::new();
        for key in *keys {
            let Some(arg) = flags.get(config_file::long_of(key)) else {
                continue;
            };
            let id = arg.get_id().as_str();
            let Some(m) = config_file::holding(matches, id) else {
                continue;
            };
            let Some(source) = m.value_source(id) else {
                continue;
            };
            let from = match (source, sources.get(*key), file) {
                (ValueSource::DefaultValue, _, _) => "default".to_string(),
                (_, Some(Source::File(at)), Some(path)) => {
                    format!("{}:{}:{}", path.display(), at.line, at.column)
                }
                _ => "command line".to_string(),
            };
            if SECRET_KEYS.contains(key) {
                lines.push(format!("# {key} = (set; secret, not printed)  # {from}"));
                continue;
            }
            let raw: Vec<String> = m
                .get_raw(id)
                .map(|r| r.map(|v| v.to_string_lossy().into_owned()).collect())
                .unwrap_or_default();
            let value = if matches!(
                arg.get_action(),
                clap::ArgAction::SetTrue | clap::ArgAction::SetFalse
            ) {
                // A switch left off says nothing (`env-devices` off is
                // genv's default on, not its opposite).
                if !m.get_flag(id) {
                    continue;
                }
                "true".to_string()
            } else if raw.is_empty() {
                continue;
            } else {
                toml_value(&raw, arg)
            };
            // Defaults commented out: the output is a file that checks and
            // runs as this one does (a default made explicit could need
            // another flag, as --idle-below needs --idle-after).
            let off = if source == ValueSource::DefaultValue {
                "# "
            } else {
                ""
            };
            lines.push(format!("{off}{key} = {value}  # {from}"));
        }
        if !lines.is_empty() {
            out.push_str(&format!("\n[{section}]\n{}\n", lines.join("\n")));
        }
    }
    out
}

/// Raw values as a TOML value: an integer, a string, a list, or for
/// `NAME=VALUE` flags a table.
fn toml_value(raw: &[String], arg: &clap::Arg) -> String {
    // An integer only where it reads back the same (`007` stays a string).
    let one = |v: &str| match v.parse::<i64>() {
        Ok(n) if n.to_string() == v => v.to_string(),
        _ => toml_edit::Value::from(v).to_string().trim().to_string(),
    };
    if config_file::takes_pairs(arg) {
        let items: Vec<String> = raw
            .iter()
            .filter_map(|v| v.split_once('='))
            .map(|(k, v)| format!("{} = {}", toml_edit::Key::new(k), one(v)))
            .collect();
        return format!("{{ {} }}", items.join(", "));
    }
    if config_file::takes_many(arg) {
        format!(
            "[{}]",
            raw.iter().map(|v| one(v)).collect::<Vec<_>>().join(", ")
        )
    } else {
        one(&raw[0])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setting(key: &str, value: &str, line: usize) -> Setting {
        Setting {
            key: key.into(),
            values: vec![value.into()],
            on: true,
            at: config_file::At { line, column: 1 },
        }
    }

    #[test]
    fn a_message_is_placed_at_the_key_it_names_and_no_other() {
        let settings = [
            setting("timeout", "10", 2),
            setting("inventory", "/etc/h.toml", 3),
            setting("shard", "1/2", 4),
            setting("max-devices-per-group", "ml=1", 5),
        ];
        let sources: BTreeMap<String, Source> = settings
            .iter()
            .map(|s| (s.key.clone(), Source::File(s.at)))
            .collect();
        let line = |m: &str| locate(m, &settings, &sources).map(|a| a.line);
        assert_eq!(line("/etc/h.toml: line 10: bad"), Some(3));
        assert_eq!(line("line 10 of something"), None);
        assert_eq!(
            line("--shard counts only ... --max-devices-per-group"),
            Some(4)
        );
        assert_eq!(line("--shard-other is unknown"), None);
        let mut overridden = sources.clone();
        overridden.insert("shard".into(), Source::Overridden(settings[2].at));
        assert_eq!(
            locate("--shard needs --ha-etcd", &settings, &overridden).map(|a| a.line),
            None
        );
    }

    #[test]
    fn values_read_back_as_they_were_typed() {
        let arg = clap::Arg::new("x").long("x");
        assert_eq!(toml_value(&["007".into()], &arg), "\"007\"");
        assert_eq!(toml_value(&["+5".into()], &arg), "\"+5\"");
        assert_eq!(toml_value(&["30".into()], &arg), "30");
        assert_eq!(toml_value(&["30s".into()], &arg), "\"30s\"");
    }
}
