//! Command lines, parsed the same way by every Tether program: bad flags exit 64 (sysexits `EX_USAGE`), not clap's 2.

use std::ffi::OsString;

/// The exit status for bad usage or configuration (sysexits `EX_USAGE`).
pub const EX_USAGE: u8 = 64;

/// Parses the process's arguments into `C`; on `--help`/`--version` prints and exits 0, on bad flags prints clap's
/// message and exits [`EX_USAGE`].
pub fn parse<C: clap::Parser>() -> C {
    parse_from(std::env::args_os())
}

/// [`parse`] over the given arguments (the first is the program name).
pub fn parse_from<C, I, T>(args: I) -> C
where
    C: clap::Parser,
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    match C::try_parse_from(args) {
        Ok(parsed) => parsed,
        Err(e) => {
            // Printing can only fail if stdout/stderr are gone; the exit status still says what happened.
            let _ = e.print();
            std::process::exit(i32::from(exit_code(&e)));
        }
    }
}

/// The exit status for a clap outcome: 0 for `--help`/`--version` (printed to stdout), [`EX_USAGE`] otherwise.
pub fn exit_code(error: &clap::Error) -> u8 {
    if error.use_stderr() { EX_USAGE } else { 0 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    #[command(name = "t", version)]
    struct Flags {
        #[arg(long)]
        count: u32,
    }

    #[test]
    fn bad_flags_are_usage_errors_and_help_is_not() {
        let err = Flags::try_parse_from(["t", "--count", "x"]).err();
        assert_eq!(err.as_ref().map(exit_code), Some(EX_USAGE));
        let err = Flags::try_parse_from(["t", "--nope"]).err();
        assert_eq!(err.as_ref().map(exit_code), Some(EX_USAGE));
        let err = Flags::try_parse_from(["t", "--help"]).err();
        assert_eq!(err.as_ref().map(exit_code), Some(0));
        let err = Flags::try_parse_from(["t", "--version"]).err();
        assert_eq!(err.as_ref().map(exit_code), Some(0));
        assert_eq!(parse_from::<Flags, _, _>(["t", "--count", "3"]).count, 3);
    }
}
