#!/usr/bin/env bash
# Build the lily binary of a git revision into .carry/variants/NAME/bundle.tar.xz,
# for `tools/gpu_run.sh variants` (builds compared in one device call).
#   tools/build_variant.sh REV NAME
set -euo pipefail
rev=$1 name=$2
root="$(cd "$(dirname "$0")/.." && pwd)"
wt="$root/target/variant-src-$name"
rm -rf "$wt"
git -C "$root" worktree add -f --detach "$wt" "$rev" -q
trap 'git -C "$root" worktree remove --force "$wt"; git -C "$root" worktree prune' EXIT
# one target folder for every variant: only the crates a revision changes rebuild
(cd "$wt" && CARGO_TARGET_DIR="$root/target/variants" cargo build --release -p lily-cli)
dst="$root/.carry/variants/$name"
mkdir -p "$dst"
cp "$root/target/variants/release/lily" "$dst/lily"
strip "$dst/lily"
(cd "$dst" && tar -cJf bundle.tar.xz lily && rm lily)
echo "$name = $(git -C "$root" rev-parse --short "$rev"): $dst/bundle.tar.xz"
