//! Command-line settings for reaching replicas that require credentials,
//! shared by `lockctl`, the device plugin, the extender and the bridge.

use std::path::PathBuf;
use std::time::Duration;

use tether_tls::{TlsFiles, TlsMaterial};

use crate::client::Options;
use crate::error::{Error, Result};

/// How often a client looks for a rotated certificate.
pub const TLS_RELOAD_INTERVAL: Duration = Duration::from_secs(10);

/// `--endpoints` and the credentials: how a binary that embeds the client
/// (the device plugin, the extender, the bridge) reaches Tether.
#[derive(clap::Args, Debug, Clone)]
pub struct ConnectArgs {
    /// Tether replicas, comma-separated host:port.
    #[arg(
        long,
        env = "TETHER_ENDPOINTS",
        default_value = "127.0.0.1:7420",
        value_delimiter = ','
    )]
    pub endpoints: Vec<String>,
    /// Credentials (the certificate names the binary's role).
    #[command(flatten)]
    pub security: SecurityArgs,
}

impl ConnectArgs {
    /// A client of these replicas with these credentials on top of
    /// `options`.
    pub fn client(&self, mut options: Options) -> Result<crate::Client> {
        self.security.apply(&mut options)?;
        crate::Client::new(self.endpoints.clone(), options)
    }
}

/// `--tls-dir` and `--token-file`.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct SecurityArgs {
    /// Directory with this client's certificate in cert-manager's layout
    /// (`tls.crt`, `tls.key`, `ca.crt`); needed when the replicas run with
    /// --tls-dir. The certificate's common name (or `tether:<role>` URI SAN)
    /// is the role: scheduler, device-plugin:<node>, bridge, reader, admin.
    #[arg(long, env = "TETHER_TLS_DIR", global = true)]
    pub tls_dir: Option<PathBuf>,

    /// File holding a bearer token, for replicas run with --auth-tokens
    /// (development without TLS).
    #[arg(long, env = "TETHER_TOKEN_FILE", global = true)]
    pub token_file: Option<PathBuf>,
}

impl SecurityArgs {
    /// Sets `options`' credentials. A TLS directory is watched for a
    /// rotated certificate when called inside a Tokio runtime.
    pub fn apply(&self, options: &mut Options) -> Result<()> {
        if let Some(dir) = &self.tls_dir {
            let tls = TlsMaterial::load(TlsFiles::in_dir(dir))
                .map_err(|e| Error::InvalidArgument(format!("--tls-dir {}: {e}", dir.display())))?;
            if tokio::runtime::Handle::try_current().is_ok() {
                // Detached: lives as long as the process.
                drop(tls.watch(TLS_RELOAD_INTERVAL));
            }
            options.tls = Some(tls);
        }
        if let Some(path) = &self.token_file {
            let token = std::fs::read_to_string(path).map_err(|e| {
                Error::InvalidArgument(format!("--token-file {}: {e}", path.display()))
            })?;
            let token = token.trim();
            if token.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "--token-file {} is empty",
                    path.display()
                )));
            }
            options.bearer_token = Some(token.to_string());
        }
        Ok(())
    }
}
