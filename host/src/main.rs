//! `kvroute`: the operator's command line.
//!
//! The routing core lives in the `kvroute_host` library; this binary wires it to the outside world.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "kvroute",
    version,
    about = "KV-cache-aware request router for LLM inference fleets"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the router's HTTP server.
    Serve {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: String,
        /// Tokens per KV block; must match the engines'.
        #[arg(long, default_value_t = 16)]
        block_size: u32,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve { listen, block_size } => {
            // Validate what we can now so a bad flag fails the same way it will with the server.
            if block_size == 0 {
                eprintln!("error: --block-size must be at least 1");
                return ExitCode::from(2);
            }
            if listen.parse::<std::net::SocketAddr>().is_err() {
                eprintln!("error: --listen {listen:?} is not an address like 127.0.0.1:8080");
                return ExitCode::from(2);
            }
            eprintln!(
                "kvroute {}: the HTTP server lands in a later step; the routing core \
                 (indexer, eligibility, load, queue, native cost) is available as the \
                 kvroute-host library. Nothing is listening on {listen}.",
                env!("CARGO_PKG_VERSION")
            );
            ExitCode::from(2)
        }
    }
}
