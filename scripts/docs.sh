#!/usr/bin/env bash
# make docs: the book in docs/ built by mdBook into target/book. mdbook comes from crates.io, once
# (about 3 min on 2 cores), like cargo-pgrx in setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
MDBOOK_VERSION=0.5.4
if ! mdbook --version 2>/dev/null | grep -q "v$MDBOOK_VERSION"; then
  echo "docs: installing mdbook $MDBOOK_VERSION"
  cargo install mdbook --version "$MDBOOK_VERSION" --locked --no-default-features --features search
fi
mdbook build docs
