//! `leasehold tokens create|list|revoke`: edits the tokens file. The server reads it at
//! start and on SIGHUP; a change takes effect there, without a restart.

use std::path::Path;
use std::process::ExitCode;

use super::TokensAction;
use crate::auth::{self, TokenEntry, TokensFile};

pub fn run(file: &Path, action: TokensAction) -> ExitCode {
    match apply(file, action) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("leasehold: {e}");
            ExitCode::FAILURE
        }
    }
}

fn apply(file: &Path, action: TokensAction) -> Result<(), String> {
    match action {
        TokensAction::Create {
            name,
            role,
            keys,
            pools,
            queues,
        } => {
            let mut tokens = TokensFile::read_or_empty(file).map_err(|e| e.to_string())?;
            if !auth::valid_name(&name) {
                return Err(format!(
                    "token name {name:?} must be 1 to 64 characters of a-z, A-Z, 0-9, '-', '_' and '.'"
                ));
            }
            if tokens.token.iter().any(|t| t.name == name) {
                return Err(format!(
                    "a token named {name:?} exists; revoke it first, or give the new one another name to roll it"
                ));
            }
            let secret = auth::new_secret();
            let scope = |v: Vec<String>| (!v.is_empty()).then_some(v);
            tokens.token.push(TokenEntry {
                name: name.clone(),
                role,
                hash: auth::hash_text(&auth::hash(&secret)),
                keys: scope(keys),
                pools: scope(pools),
                queues: scope(queues),
                created_at: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64),
            });
            tokens.validate()?;
            tokens.write(file).map_err(|e| e.to_string())?;
            // The secret goes to stdout alone, so `$(leasehold tokens create …)` captures it.
            println!("{secret}");
            eprintln!(
                "leasehold: token {name:?} ({}) added to {}; it is shown only now. Send the server SIGHUP to load it.",
                role.as_str(),
                file.display()
            );
            Ok(())
        }
        TokensAction::List => {
            let tokens = TokensFile::read_or_empty(file).map_err(|e| e.to_string())?;
            let rows: Vec<_> = tokens
                .token
                .iter()
                .map(|t| {
                    serde_json::json!({
                        "name": t.name,
                        "role": t.role,
                        "keys": t.keys,
                        "pools": t.pools,
                        "queues": t.queues,
                        "created_at": t.created_at,
                    })
                })
                .collect();
            println!(
                "{}",
                serde_json::to_string_pretty(&serde_json::json!({ "tokens": rows }))
                    .expect("JSON values serialize")
            );
            Ok(())
        }
        TokensAction::Revoke { name } => {
            let mut tokens = TokensFile::read(file).map_err(|e| e.to_string())?;
            let before = tokens.token.len();
            tokens.token.retain(|t| t.name != name);
            if tokens.token.len() == before {
                return Err(format!("no token named {name:?} in {}", file.display()));
            }
            tokens.write(file).map_err(|e| e.to_string())?;
            eprintln!(
                "leasehold: token {name:?} removed from {}; send the server SIGHUP to stop accepting it",
                file.display()
            );
            Ok(())
        }
    }
}
