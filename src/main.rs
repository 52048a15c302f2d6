use clap::Parser;
use tracing_subscriber::EnvFilter;

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_env("IMAJEV_LOG").unwrap_or_else(|_| EnvFilter::new("info")))
        .with_writer(std::io::stderr)
        .init();
    let cli = imajev_serve::cli::Cli::parse();
    if let Err(e) = imajev_serve::cli::run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
