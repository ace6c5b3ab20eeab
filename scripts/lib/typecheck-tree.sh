# Sourced by scripts/test: build/typecheck/tiered_kv is the package as it installs (tiers/ and
# policies/ inside it), as links to the sources, for mypy and lint-imports, which know no
# package-dir mapping. Rebuilt on every run, so new modules are always in it.
typecheck="$root/build/typecheck"
rm -rf "$typecheck"
mkdir -p "$typecheck"
cp -rs "$root/tiered_kv" "$typecheck/tiered_kv"
cp -rs "$root/tiers" "$typecheck/tiered_kv/tiers"
cp -rs "$root/policies" "$typecheck/tiered_kv/policies"
find "$typecheck" -name __pycache__ -prune -exec rm -rf {} +
