//! The release this binary serves, as data: `adapter/manifest.json` (what the base and adapter
//! are, at which revisions, what every file must hold, the serving recipe and the public name,
//! description and date), the hash lock `verify --pin` writes from a trusted download, and
//! `verify`, which checks a downloaded release against both and prints a table.
//!
//! This layer reads files and safetensors headers only: it never loads weights, and the serving
//! path asks it nothing but the release's name, description, date and recipe.

pub mod cli;
mod headers;
pub mod lock;
pub mod manifest;
pub mod report;
pub mod verify;

pub use lock::Lock;
pub use manifest::{Manifest, Recipe, ReleaseInfo};
pub use report::{Report, Status};
pub use verify::{pin, verify, ReleaseDirs};
