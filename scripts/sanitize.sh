#!/usr/bin/env bash
# `make sanitize`: the native core built with AddressSanitizer and UndefinedBehaviorSanitizer,
# and the property machines plus the unit tests of its parts run against that build.
#
# The sanitized module goes into a copy of the working tree's package and tests (build/sanitize/
# src), imported from there rather than through the editable install's finder, so the normal
# in-place build is left alone. Python itself is not instrumented: the ASan runtime is preloaded,
# and leak checking is off (the interpreter keeps objects alive at exit by design).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(realpath -s "${PY:-.venv/bin/python}")  # absolute, the venv's link kept
OUT=build/sanitize
TESTS=(tests/property tests/directory tests/core tests/drivers/fake)

cmake -S . -B "$OUT/cmake" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DEVINFRA_SANITIZE=ON \
  -DPython_EXECUTABLE="$PY" -Dnanobind_DIR="$("$PY" -m nanobind --cmake_dir)" >/dev/null
cmake --build "$OUT/cmake"

rm -rf "$OUT/src"
mkdir -p "$OUT/src"
git ls-files -co --exclude-standard -- evinfra tests etc pyproject.toml \
  | grep -v '\.so$' | xargs cp --parents -t "$OUT/src"
cp "$OUT"/cmake/_native*.so "$OUT/src/evinfra/native/"

cd "$OUT/src"
LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)" \
ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
PYTHONPATH=. "$PY" - "${TESTS[@]}" <<'PYEOF'
import sys

# The editable install's finder would import the package from the repository root.
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
import pytest

from evinfra.native import _native

assert "build/sanitize/src" in _native.__file__, _native.__file__
print("sanitized native core:", _native.__file__)
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
PYEOF
