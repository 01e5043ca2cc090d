#!/usr/bin/env bash
# Idempotent installer for the real-Slurm end-to-end tests (tests/test_slurm_cluster.py).
#
# Installs Debian bookworm's slurm-wlm (Slurm 22.05: slurmctld, slurmd, sbatch, srun, ...) and munge.
# Nothing is configured or started here: tests/slurm_cluster.py writes its own slurm.conf, munge key
# and state directories into a temp dir and runs private daemons on free loopback ports.
#
# Exit status: 0 when the tools are present (already, or after installing); 1 when they are missing and
# cannot be installed here (not root, or no apt-get). The tests skip themselves when Slurm is missing.
set -euo pipefail
# slurmctld, slurmd and munged live in /usr/sbin, which a non-root PATH may lack.
export PATH="$PATH:/usr/sbin:/sbin"

have_all() {
    command -v slurmctld >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1 \
        && command -v sbatch >/dev/null 2>&1 && command -v munged >/dev/null 2>&1
}

if have_all; then
    echo "install.sh: slurm-wlm and munge already installed ($(slurmctld -V 2>/dev/null || echo slurmctld))"
    exit 0
fi

if [ "${EUID:-$(id -u)}" -ne 0 ]; then
    echo "install.sh: slurmctld/slurmd/munged not found and not running as root;" >&2
    echo "install.sh: run as root (or: sudo apt-get install -y slurm-wlm munge) to enable the Slurm tests." >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install.sh: slurmctld not found and apt-get is unavailable; install Slurm 22.05+ and munge by hand." >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends slurm-wlm munge
# Debian's postinst may start the system munge/slurm services where an init system runs; the tests do
# not use them (private munged socket, private ports), so they are left alone.
have_all || { echo "install.sh: installation finished but slurmctld/slurmd/munged are still missing" >&2; exit 1; }
echo "install.sh: installed $(slurmctld -V)"
