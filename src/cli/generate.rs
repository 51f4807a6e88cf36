//! `leasehold generate man|completions --out DIR`: the manual pages and shell completions,
//! generated from the same clap definitions that parse the command line, so they cannot
//! drift from it. Hidden: the package build runs it (see `packaging/build`).

use std::path::Path;
use std::process::ExitCode;

use clap::CommandFactory;
use clap_complete::Shell;

use super::{Cli, GenerateWhat};

pub fn run(what: GenerateWhat) -> ExitCode {
    let result = match &what {
        GenerateWhat::Man { out } => man(out),
        GenerateWhat::Completions { out } => completions(out),
    };
    match result {
        Ok(files) => {
            for f in files {
                println!("{f}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("leasehold: {e}");
            ExitCode::FAILURE
        }
    }
}

/// One page in section 1 for `leasehold` and one for each visible subcommand, at every
/// depth (`leasehold-sessions-list.1`); hidden commands get none.
fn man(out: &Path) -> std::io::Result<Vec<String>> {
    std::fs::create_dir_all(out)?;
    clap_mangen::generate_to(Cli::command(), out)?;
    let mut files: Vec<String> = std::fs::read_dir(out)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".1"))
        .collect();
    files.sort();
    Ok(files)
}

/// bash (`leasehold.bash`), zsh (`_leasehold`) and fish (`leasehold.fish`).
fn completions(out: &Path) -> std::io::Result<Vec<String>> {
    std::fs::create_dir_all(out)?;
    let mut cmd = Cli::command();
    let mut files = Vec::new();
    for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
        let path = clap_complete::generate_to(shell, &mut cmd, "leasehold", out)?;
        files.push(path.display().to_string());
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_for_every_visible_subcommand_and_none_for_generate() {
        let dir = tempfile::tempdir().unwrap();
        let files = man(dir.path()).unwrap();
        for page in [
            "leasehold.1",
            "leasehold-serve.1",
            "leasehold-check.1",
            "leasehold-sessions-list.1",
            "leasehold-pools-put.1",
        ] {
            assert!(files.iter().any(|f| f == page), "{page} missing: {files:?}");
        }
        assert!(!files.iter().any(|f| f.contains("generate")), "{files:?}");
        let serve = std::fs::read_to_string(dir.path().join("leasehold-serve.1")).unwrap();
        assert!(serve.contains("shutdown\\-grace\\-ms"), "{serve}");
    }

    #[test]
    fn completions_for_three_shells() {
        let dir = tempfile::tempdir().unwrap();
        completions(dir.path()).unwrap();
        for f in ["leasehold.bash", "_leasehold", "leasehold.fish"] {
            let text = std::fs::read_to_string(dir.path().join(f)).unwrap();
            assert!(text.contains("reaper-interval-ms"), "{f}");
        }
    }
}
