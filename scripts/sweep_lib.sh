# sweep_lib.sh: helpers shared by sweep_batch.sh and sweep_interval.sh (sourced, not run).
# Needs PROG, ROOT and a usage() function defined by the caller.
die_usage() { echo "$PROG: $*" >&2; usage >&2; exit 2; }
die() { echo "$PROG: $*" >&2; exit 1; }
is_posint() { [[ "$1" =~ ^[1-9][0-9]*$ ]] && (( ${#1} <= 9 )); }

# Resolve CONFIG: as given when absolute or existing relative to the current directory,
# else relative to the repository root.
resolve_path() {
  local p="$1"
  if [[ "$p" == /* ]]; then printf '%s\n' "$p"
  elif [[ -e "$p" ]]; then printf '%s\n' "$PWD/$p"
  else printf '%s\n' "$ROOT/$p"
  fi
}
abs_path() { if [[ "$1" == /* ]]; then printf '%s\n' "$1"; else printf '%s\n' "$PWD/$1"; fi; }
