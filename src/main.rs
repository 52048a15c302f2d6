use clap::Parser;
use std::io::IsTerminal;
use tracing_subscriber::EnvFilter;

fn main() {
    let filter = EnvFilter::try_from_env("IMAJEV_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    // Colours only on a terminal; IMAJEV_LOG_FORMAT=json for log collectors.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none());
    if std::env::var("IMAJEV_LOG_FORMAT").is_ok_and(|f| f == "json") {
        builder.json().init();
    } else {
        builder.init();
    }
    let cli = imajev_serve::cli::Cli::parse();
    if let Err(e) = imajev_serve::cli::run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
