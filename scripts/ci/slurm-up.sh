#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for the `--runner slurm` test: Debian's
# slurmctld, slurmd and munge (22.05 on bookworm), every file under one directory.
#
#   scripts/ci/slurm-up.sh up DIR     generate munge.key and slurm.conf in DIR, start munged,
#                                     slurmctld and slurmd, wait until the node is idle
#   scripts/ci/slurm-up.sh down DIR   stop the three daemons (by the pids in DIR) and
#                                     remove DIR
#
# After `up`, point the clients at the cluster with `export SLURM_CONF=DIR/slurm.conf`.
# Needs root (slurmd runs as root: SlurmdUser=root), and `hostname -s` must resolve.
# No accounting database: job completions go to DIR/jobcomp.txt (jobcomp/filetxt),
# and `MinJobAge` keeps finished jobs in `squeue -t all` / `scontrol show job` for an
# hour, which is where `cargo xtask merge` reads a dead task's state when `sacct` has
# nothing.
set -euo pipefail

cmd="${1:-}"
dir="${2:-}"
if [ -z "$cmd" ] || [ -z "$dir" ]; then
  echo "usage: $0 up|down DIR" >&2
  exit 2
fi

stop_pidfile() {
  local f="$1"
  [ -s "$f" ] || return 0
  local pid
  pid="$(cat "$f")"
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

case "$cmd" in
down)
  [ -d "$dir" ] || exit 0
  stop_pidfile "$dir/slurmd.pid"
  stop_pidfile "$dir/slurmctld.pid"
  stop_pidfile "$dir/munged.pid"
  rm -rf "$dir"
  exit 0
  ;;
up) ;;
*)
  echo "$0: unknown command \`$cmd\`: expected up or down" >&2
  exit 2
  ;;
esac

if [ "$(id -u)" != 0 ]; then
  echo "$0: needs root (slurmd runs as root, SlurmdUser=root): run it with sudo" >&2
  exit 1
fi
for bin in munged slurmctld slurmd sinfo; do
  command -v "$bin" >/dev/null || {
    echo "$0: $bin is not installed: apt-get install -y slurmctld slurmd munge slurm-client" >&2
    exit 1
  }
done

mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
mkdir -p "$dir/spool/ctld" "$dir/spool/d" "$dir/log" "$dir/munge"
chmod 700 "$dir/munge"

# munge: a fresh key and its own socket, so an existing munged is left alone.
dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$dir/munge/munge.key"
munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.sock" \
  --pid-file="$dir/munged.pid" --log-file="$dir/log/munged.log" \
  --seed-file="$dir/munge/munge.seed"

host="$(hostname -s)"
cpus="$(nproc)"
# RealMemory in MiB, a little under MemTotal so slurmd never reports less than configured.
mem_mib=$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024 * 9 / 10 ))

# Two free ports (another cluster, or another CI run, may hold the usual 6817/6818).
listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
port=""
for p in $(seq 16817 2 16999); do
  if ! listening "$p" && ! listening "$((p + 1))"; then
    port="$p"
    break
  fi
done
[ -n "$port" ] || { echo "$0: no two free ports in 16817-17000" >&2; exit 1; }

cat >"$dir/slurm.conf" <<CONF
ClusterName=kiln-ci
SlurmctldHost=$host
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$port
SlurmdPort=$((port + 1))
StateSaveLocation=$dir/spool/ctld
SlurmdSpoolDir=$dir/spool/d
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/jobcomp.txt
MinJobAge=3600
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
MpiDefault=none
SwitchType=switch/none
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$host CPUs=$cpus RealMemory=$mem_mib State=UNKNOWN
PartitionName=ci Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF

export SLURM_CONF="$dir/slurm.conf"
slurmctld -f "$dir/slurm.conf"
slurmd -f "$dir/slurm.conf"

# The node is usable once sinfo says idle; give it 30 seconds.
for _ in $(seq 60); do
  state="$(sinfo -h -n "$host" -o '%t' 2>/dev/null || true)"
  if [ "$state" = "idle" ]; then
    echo "slurm: one-node cluster up: node $host ($cpus CPUs, ${mem_mib} MiB), SLURM_CONF=$dir/slurm.conf"
    exit 0
  fi
  sleep 0.5
done
echo "$0: the node did not become idle (state: ${state:-unknown}); logs follow" >&2
tail -n 30 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" >&2 || true
exit 1
