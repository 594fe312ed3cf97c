//! The one error type of this crate.

use std::path::{Path, PathBuf};

use ssd_reference::ReferenceError;

/// Everything that can go wrong in `ssd-verify` and the `ssd-oracle` command line.
///
/// Every message is one line that names the file and, where there is one, the tensor or key at
/// fault. The command line prints it as `error: <message>` and exits with
/// [`VerifyError::exit_code`].
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// A file could not be read or written.
    #[error("cannot {action} `{}`: {source}", path.display())]
    Io {
        /// What was attempted: "read", "write", ...
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A manifest that is not a valid `ssd-fixture/1` manifest (bad JSON, wrong `format`, a key
    /// missing or of the wrong type, a bad `dt_limit`).
    #[error("manifest `{}`: {message}", path.display())]
    Manifest { path: PathBuf, message: String },

    /// A safetensors file that cannot be parsed, or that lacks a tensor, or holds one of the
    /// wrong dtype or shape.
    #[error("tensor file `{}`: {message}", path.display())]
    Tensors { path: PathBuf, message: String },

    /// Sizes, options and tensors that do not make a valid problem (the reference's checks).
    #[error("case `{}`: {source}", path.display())]
    Problem {
        path: PathBuf,
        #[source]
        source: ReferenceError,
    },

    /// A request that cannot be honoured as asked (a bad combination of options, an output path
    /// that would overwrite an input, ...).
    #[error("{0}")]
    Usage(String),

    /// An implementation that this build or this machine does not provide.
    #[error("{0}")]
    Unavailable(String),
}

impl VerifyError {
    /// The process exit status for this error: 2 ("unusable input") for every variant, so that
    /// 1 stays free for a verdict ("the candidate is wrong").
    pub fn exit_code(&self) -> u8 {
        2
    }

    pub(crate) fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.to_path_buf();
        move |source| VerifyError::Io {
            action,
            path,
            source,
        }
    }

    pub(crate) fn tensors(path: &Path, message: impl Into<String>) -> Self {
        VerifyError::Tensors {
            path: path.to_path_buf(),
            message: message.into(),
        }
    }

    pub(crate) fn manifest(path: &Path, message: impl Into<String>) -> Self {
        VerifyError::Manifest {
            path: path.to_path_buf(),
            message: message.into(),
        }
    }
}
