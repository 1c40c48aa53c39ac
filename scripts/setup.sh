#!/usr/bin/env bash
# Creates the project venv: the CPU build of torch first (so nothing pulls a CUDA build), then
# this package with its test extras and one TorchX line: TORCHX_LINE=nightly (default: torchx-nightly,
# what Monarch depends on) or TORCHX_LINE=0.7.0 (torchx 0.7.0 and compat/torchx07, which registers
# our schedulers there). Idempotent; used by `make setup|demo|test` and `make test-torchx07`.
set -euo pipefail
PY=${PY:-python3}
VENV=${VENV:-.venv}
TORCH=${TORCH_VERSION:-2.13.0}
LINE=${TORCHX_LINE:-nightly}
case "$LINE" in
    nightly) EXTRAS="test,nightly"; COMPAT=""; OTHER="torchx monarch-torchx-torchx07" ;;
    0.7.0) EXTRAS="test,torchx07"; COMPAT="-e compat/torchx07"; OTHER="torchx-nightly" ;;
    *) echo "error: TORCHX_LINE=$LINE: use nightly or 0.7.0" >&2; exit 1 ;;
esac

if ! "$PY" -m venv --help >/dev/null 2>&1 || ! "$PY" -c "import ensurepip" >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "installing python3-venv (Debian)" >&2
        apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
    else
        echo "error: '$PY -m venv' is unavailable; install your distribution's python3-venv" >&2
        exit 1
    fi
fi
# syncfs serves targets with FUSE (pyfuse3 builds against libfuse3)
if ! pkg-config --exists fuse3 2>/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "installing libfuse3-dev, fuse3, pkg-config (Debian) for syncfs' FUSE mounts" >&2
        apt-get update -qq && apt-get install -y -qq libfuse3-dev fuse3 pkg-config >/dev/null
    else
        echo "warning: libfuse3-dev and pkg-config are missing: pyfuse3 will not build" >&2
    fi
fi
# the dashboard's test drives a real headless Chromium (Debian's package) through Selenium
if ! command -v chromedriver >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "installing chromium, chromium-driver (Debian) for the dashboard's browser test" >&2
        apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1 \
            || { apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1; } \
            || echo "warning: chromium could not be installed: the dashboard's browser test will skip" >&2
    else
        echo "warning: no chromedriver: the dashboard's browser test will skip (apt install chromium chromium-driver)" >&2
    fi
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    echo "installing torch==$TORCH (CPU build where available)" >&2
    $PIP install -q "torch==$TORCH" 2>&1 | grep -v "^WARNING: Location" || true
fi
# both TorchX lines write one `torchx/` package: the other line goes first, never on top
for dist in $OTHER; do
    if $PIP show -q "$dist" >/dev/null 2>&1; then
        echo "removing $dist (this venv is for the torchx $LINE line)" >&2
        $PIP uninstall -q -y "$dist" torchx torchx-nightly 2>/dev/null || true
    fi
done
echo "installing monarch-torchx (editable) with test extras, torchx $LINE" >&2
# shellcheck disable=SC2086  # COMPAT is two words or none
$PIP install -q -e ".[$EXTRAS]" $COMPAT 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -c "import torch, torchx, monarch_torchx" || { echo "error: install failed" >&2; exit 1; }
