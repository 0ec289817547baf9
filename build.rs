//! Links the PROJ shared library that PostGIS itself uses (see src/edit/area_of_use.rs). Debian's
//! runtime package ships only the versioned file (libproj.so.25); libproj-dev adds libproj.so.
use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-env-changed=PROJ_LIB_DIR");
    let dirs: Vec<PathBuf> = match std::env::var_os("PROJ_LIB_DIR") {
        Some(d) => vec![d.into()],
        None => ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"]
            .iter()
            .map(PathBuf::from)
            .collect(),
    };
    for dir in &dirs {
        if dir.join("libproj.so").exists() {
            println!("cargo:rustc-link-search=native={}", dir.display());
            println!("cargo:rustc-link-lib=dylib=proj");
            return;
        }
        if let Some(lib) = versioned(dir) {
            println!("cargo:rustc-link-arg={}", lib.display());
            return;
        }
    }
    panic!("PROJ's shared library (libproj.so*) was not found in {dirs:?}: install PostGIS (postgresql-15-postgis-3), or set PROJ_LIB_DIR");
}

/// The newest libproj.so.<major> in `dir`.
fn versioned(dir: &Path) -> Option<PathBuf> {
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let major: u32 = name.strip_prefix("libproj.so.")?.parse().ok()?;
            Some((major, e.path()))
        })
        .max_by_key(|(major, _)| *major)
        .map(|(_, path)| path)
}
