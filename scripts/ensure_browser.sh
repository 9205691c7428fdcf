#!/usr/bin/env bash
# Installs Debian's headless Chromium for the dashboard browser test when it is missing.
# Never fails the build: the browser test skips with a reason when no browser is found.
set -u
if command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ]; then exit 0; fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure_browser: cannot install chromium (not root or no apt-get); browser test will skip"; exit 0
fi
export DEBIAN_FRONTEND=noninteractive
(apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
  || echo "ensure_browser: chromium install failed; browser test will skip"
exit 0
