//! `leasehold tokens`: API tokens in the tokens file (`create`, `list`, `revoke`; the server
//! reads the file at start and on SIGHUP, so a change takes effect there without a restart),
//! and the fencing-token floor of a running server (`raise-floor`).

use std::path::Path;
use std::process::ExitCode;

use clap::Subcommand;
use serde_json::json;

use super::ServerArg;
use crate::auth::{self, TokenEntry, TokensFile};

#[derive(Subcommand)]
pub enum TokensAction {
    /// Add a token and print its secret, once: only its hash is stored.
    Create {
        /// A unique name, named in audit records and logs.
        name: String,
        #[arg(long, value_enum)]
        role: crate::auth::Role,
        /// Restrict the token to lock keys starting with this prefix (repeatable).
        #[arg(long = "key-prefix")]
        keys: Vec<String>,
        /// Restrict the token to pools starting with this prefix (repeatable).
        #[arg(long = "pool-prefix")]
        pools: Vec<String>,
        /// Restrict the token to queues starting with this prefix (repeatable).
        #[arg(long = "queue-prefix")]
        queues: Vec<String>,
        /// A DNS name in the subjectAltName of a client certificate (signed by the server's
        /// tls_client_ca) that acts as this token without its secret.
        #[arg(long)]
        cert_subject: Option<String>,
    },
    /// List the tokens: names, roles and scopes (never secrets).
    List,
    /// Remove a token; it stops working when the server reloads the file.
    Revoke { name: String },
    /// Raise the fencing-token floor of a running server: every fencing token issued
    /// afterwards is greater than FLOOR (admin; audited; the counter never moves back). Use it
    /// after restoring a backend's database from a backup, with FLOOR at or above the last
    /// token the lost state issued.
    RaiseFloor {
        /// Every later token is greater than this (at most 2^62).
        floor: u64,
    },
}

pub fn run(file: Option<&Path>, server: &ServerArg, action: TokensAction) -> ExitCode {
    if let TokensAction::RaiseFloor { floor } = action {
        return super::remote::block_on(async move {
            let client = super::remote::connect(server)?;
            super::remote::print(
                client
                    .post("/v1/admin/tokens/floor", &json!({ "floor": floor }))
                    .await?,
            )
        });
    }
    let Some(file) = file else {
        eprintln!(
            "leasehold: tokens create, list and revoke need the tokens file: --file PATH or LEASEHOLD_TOKENS_FILE"
        );
        return ExitCode::from(2);
    };
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
        TokensAction::RaiseFloor { .. } => unreachable!("raise-floor is sent to the server"),
        TokensAction::Create {
            name,
            role,
            keys,
            pools,
            queues,
            cert_subject,
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
                cert_subject,
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
                        "cert_subject": t.cert_subject,
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
