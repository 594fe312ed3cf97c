//! `ssd-oracle`: the command line of the SSD oracle. See `ssd-oracle --help`.

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
