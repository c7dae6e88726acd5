#!/usr/bin/env bash
# Builds the wheel, installs it alone (--no-deps) into a fresh virtual
# environment that sees the system's site-packages (jax and the rest, no
# downloads), and runs .ci/wheel_check.py from outside the repo, so that
# `import specjax` is the wheel's: its CPU kernels must build from the files it
# ships (a wheel once lacked their headers) and decode a tiny quantized pair.
# The wheel is built from a copy of the tree's files (tracked, or untracked and
# not ignored), so no build/ or egg-info left in the checkout adds files to it.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
start=$SECONDS
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/src" "$tmp/dist" "$tmp/run"
git ls-files -z --cached --others --exclude-standard \
  | tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C "$tmp/src"
python3 -m pip wheel -q --no-deps "$tmp/src" -w "$tmp/dist"
python3 -m venv --system-site-packages "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q --no-deps --force-reinstall "$tmp"/dist/specjax-*.whl
echo "wheel: $(basename "$tmp"/dist/specjax-*.whl); its kernel sources:"
"$tmp/venv/bin/python" -m zipfile -l "$tmp"/dist/specjax-*.whl | grep -E '_src/kernels/.*\.(cc|h|inc) '
# TMPDIR: the check builds the kernels into a fresh temporary cache, removed with $tmp.
(cd "$tmp/run" && TMPDIR="$tmp" "$tmp/venv/bin/python" "$repo/.ci/wheel_check.py")
echo "wheel build, install and check: $((SECONDS - start)) s"
