#!/usr/bin/env bash
# SAPIEN (ManiSkill3) needs a Vulkan device even for state observations. On a machine without
# a GPU driver, install Mesa 25's software Vulkan (lavapipe) from bookworm-backports into
# .vulkan/ (Debian 12's own lavapipe lacks descriptorBindingPartiallyBound, which SAPIEN needs).
# Skipped when a usable device already exists. Idempotent. See ../shared/PLATFORM.md.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=$PWD/.vulkan
ICD=$DEST/lvp_icd.json
if [ -f "$ICD" ]; then exit 0; fi
# A real GPU driver (workstation): nothing to do.
for f in /usr/share/vulkan/icd.d/nvidia_icd.json /etc/vulkan/icd.d/nvidia_icd.json /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json; do
  if [ -f "$f" ]; then echo "[vulkan] found GPU driver $f; skipping software Vulkan"; exit 0; fi
done
if ! command -v apt-get >/dev/null; then
  echo "[vulkan] no apt-get: install a Vulkan driver (Mesa >= 24 lavapipe or a GPU driver) by hand" >&2
  exit 1
fi
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
if ! ldconfig -p | grep -q libvulkan.so.1; then
  echo "[vulkan] installing the Vulkan loader (libvulkan1, mesa-vulkan-drivers)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq mesa-vulkan-drivers libvulkan1 >/dev/null
fi
# The machine's own Debian mirror, from its deb822 sources.
URI=$(grep -h '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | grep -v security | head -n1 | awk '{print $2}')
URI=${URI:-http://deb.debian.org/debian}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/lists/partial" "$WORK/cache/archives/partial"
echo "deb $URI bookworm-backports main" > "$WORK/sources.list"
APT="-o Dir::Etc::SourceList=$WORK/sources.list -o Dir::Etc::SourceParts=/nonexistent -o Dir::State::Lists=$WORK/lists -o Dir::Cache=$WORK/cache"
echo "[vulkan] fetching Mesa lavapipe from bookworm-backports ($URI)"
apt-get $APT update -qq
(cd "$WORK" && apt-get $APT download -qq mesa-vulkan-drivers/bookworm-backports libdrm2/bookworm-backports libdrm-amdgpu1/bookworm-backports)
rm -rf "$DEST.tmp"; mkdir -p "$DEST.tmp"
for deb in "$WORK"/*.deb; do dpkg-deb -x "$deb" "$DEST.tmp"; done
LIB=$DEST/usr/lib/x86_64-linux-gnu/libvulkan_lvp.so
cat > "$DEST.tmp/lvp_icd.json" <<JSON
{"ICD": {"api_version": "1.4.305", "library_path": "$LIB"}, "file_format_version": "1.0.0"}
JSON
rm -rf "$DEST"; mv "$DEST.tmp" "$DEST"
echo "[vulkan] software Vulkan ready in $DEST"
