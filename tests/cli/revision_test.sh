#!/usr/bin/env bash
# cmake/write_revision.cmake, the build-time revision every --version prints, in a scratch git
# repository: it names the commit checked out when it runs (not the one the build folder was
# configured at), adds "-dirty" while a tracked file differs, says "unknown" outside git, and
# leaves the header untouched (same mtime) when nothing changed, so an unchanged revision
# rebuilds nothing. Then the built server's --version names this checkout's revision.
#   tests/cli/revision_test.sh SOURCE_DIR SERVER_BINARY
set -uo pipefail
src=$1 server=$2
failed=0
fail() { echo "FAIL: $*"; failed=1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
script="$src/cmake/write_revision.cmake"
header="$tmp/out/revision.h"
mkdir -p "$tmp/out"
write() { cmake -DSOURCE_DIR="$1" -DOUT="$header" -P "$script" || fail "the script failed"; }
rev_in_header() { sed -n 's/^#define DI_GIT_REVISION "\(.*\)"$/\1/p' "$header"; }

repo="$tmp/repo"
git init -q "$repo"
git -C "$repo" -c user.name=t -c user.email=t@t commit -q --allow-empty -m one
first=$(git -C "$repo" rev-parse --short=12 HEAD)
write "$repo"
[ "$(rev_in_header)" = "$first" ] || fail "first commit: header says '$(rev_in_header)', want $first"

# Unchanged: the header is not rewritten.
touch -d '2000-01-01' "$header"
before=$(stat -c %Y "$header")
write "$repo"
[ "$(stat -c %Y "$header")" = "$before" ] || fail "an unchanged revision rewrote the header"

# A later commit: the header follows it.
echo a > "$repo/file"
git -C "$repo" add file
git -C "$repo" -c user.name=t -c user.email=t@t commit -q -m two
second=$(git -C "$repo" rev-parse --short=12 HEAD)
write "$repo"
[ "$(rev_in_header)" = "$second" ] || fail "second commit: header says '$(rev_in_header)', want $second"

# A tracked file changed: -dirty; an untracked one alone is not.
echo b > "$repo/untracked"
write "$repo"
[ "$(rev_in_header)" = "$second" ] || fail "an untracked file made '$(rev_in_header)'"
echo b > "$repo/file"
write "$repo"
[ "$(rev_in_header)" = "$second-dirty" ] || fail "a changed file: '$(rev_in_header)', want $second-dirty"

# Outside a git checkout.
mkdir -p "$tmp/plain"
write "$tmp/plain"
[ "$(rev_in_header)" = "unknown" ] || fail "outside git: '$(rev_in_header)', want unknown"

# The built server names this checkout's revision (what the build last wrote; ctest runs after
# a build, so it is the checkout's HEAD, with -dirty when tracked files differ).
if head=$(git -C "$src" rev-parse --short=12 HEAD 2>/dev/null); then
  out=$("$server" --version 2>&1)
  grep -Eq "\(revision $head(-dirty)?," <<< "$out" || fail "server --version '$out', HEAD is $head"
fi

[ "$failed" -eq 0 ] && echo "revision_test: all checks passed"
exit "$failed"
