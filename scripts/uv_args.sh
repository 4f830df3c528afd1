# Sourced by setup_env.sh and setup_xla_env.sh. uv does not read pip's configuration, so the links,
# indexes and constraints pip is configured with on this machine (`pip config list`: find-links,
# index-url, extra-index-url, constraint) are handed to it, and both resolve from the same places,
# every index weighed equally as pip does (`--index-strategy unsafe-best-match`).
# uv_args_from_pip PYTHON: fills the array `uv_args` from PYTHON's pip.
uv_args_from_pip() {
  uv_args=(--index-strategy unsafe-best-match)
  local line key value item
  while IFS= read -r line; do  # e.g. global.find-links='/opt/wheels' or :env:.find-links='/opt/wheels'
    key="${line%%=*}"
    key="${key##*.}"
    value="${line#*=}"
    value="${value#\'}"
    value="${value%\'}"
    for item in $value; do
      case "$key" in
        find-links) uv_args+=(--find-links "$item") ;;
        index-url) uv_args+=(--index-url "$item") ;;
        extra-index-url) uv_args+=(--extra-index-url "$item") ;;
        constraint) uv_args+=(--constraint "$item") ;;
      esac
    done
  done < <("$1" -m pip config list 2>/dev/null)
}
# installer_pin: uv's pin, `[tool.gemma4lib] installer` in pyproject.toml (run from the repository's root)
installer_pin() {
  "${PYTHON:-python3}" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["tool"]["gemma4lib"]["installer"])'
}
