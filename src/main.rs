//! `genv-enforce`: parse arguments, set up logging, run, map to an exit code.

use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

use genv_enforce::cli::{Cli, Command, EnforceArgs};
use genv_enforce::cycle::{self, Settings};
use genv_enforce::local::LocalHost;
use genv_enforce::snapshot::genv;

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_env("GENV_ENFORCE_LOG").unwrap_or_else(|_| EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("genv-enforce: cannot start the runtime: {e}");
            return ExitCode::from(2);
        }
    };
    let ok = match cli.command {
        Command::Enforce(args) => runtime.block_on(enforce(args)),
        Command::Snapshot(args) => runtime.block_on(async {
            match LocalHost::from_env(args.command_timeout).snapshot().await {
                Ok(s) => serde_json::to_string_pretty(&genv::to_json(&s))
                    .map(|t| println!("{t}"))
                    .is_ok(),
                Err(e) => {
                    eprintln!("genv-enforce: {}", chain(&e));
                    false
                }
            }
        }),
    };
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

async fn enforce(args: EnforceArgs) -> bool {
    let settings = Settings {
        policy: args.rules.policy(),
        interval: args.interval,
        dry_run: args.dry_run || !args.snapshot.is_empty(),
        output: args.output,
    };
    if !args.snapshot.is_empty() {
        return cycle::replay(&args.snapshot, &settings);
    }
    match cycle::run_local(LocalHost::from_env(args.command_timeout), settings).await {
        Ok(ok) => ok,
        Err(e) => {
            eprintln!("genv-enforce: {}", chain(&e));
            false
        }
    }
}

/// An error with all its causes, `: `-separated.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    text
}
