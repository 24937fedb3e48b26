#!/usr/bin/env bash
# ctest `layers`: the build's include views (CMakeLists.txt, SUBLINEAR_LAYERS) make an upward include
# fail to compile. Usage: test_layers.sh CXX BUILD_LAYERS_DIR LAYER...  (the layers bottom first)
set -uo pipefail
cxx=$1 views=$2
shift 2
layers=("$@")
fail() { echo "FAIL: $*"; exit 1; }
# Each view holds exactly its own folder and those below it.
for ((i = 0; i < ${#layers[@]}; i++)); do
  view=$views/${layers[i]}
  [[ -e $view/errors.h ]] || fail "$view has no errors.h"
  for ((j = 0; j < ${#layers[@]}; j++)); do
    if ((j <= i)); then
      [[ -d $view/${layers[j]} ]] || fail "${layers[i]} cannot see ${layers[j]} (below it)"
    else
      [[ -e $view/${layers[j]} ]] && fail "${layers[i]} sees ${layers[j]} (above it)"
    fi
  done
done
# The compiler, given config's view: a header of layout (below) compiles, one of log (above) does not.
compile() { echo "#include \"$2\"" | "$cxx" -std=c++20 -fsyntax-only -I "$views/$1" -x c++ - 2>&1; }
out=$(compile config layout/mesh.h) || fail "config cannot include layout/mesh.h: $out"
out=$(compile config log/files.h) && fail "config included log/files.h (a layer above it)"
grep -q "log/files.h: No such file" <<<"$out" || fail "unexpected compiler output: $out"
echo "layers: ${#layers[@]} views, each its own folder and those below; an upward include does not compile"
