#!/usr/bin/env bash
# A one-node SLURM cluster on this machine (munge + slurmctld + slurmd), for development and the tests.
#   sudo launchers/slurm_cluster.sh start     # needs Debian's slurm-wlm and munge (apt-get install slurm-wlm munge)
#   launchers/slurm_cluster.sh status
#   sudo launchers/slurm_cluster.sh restart   # after changing this script's slurm.conf
#   sudo launchers/slurm_cluster.sh stop
# State lives under $SLURM_DEV_DIR (default /tmp/ds_exp_slurm); accounting is off (submitit warns, and goes on).
set -euo pipefail
dir=${SLURM_DEV_DIR:-/tmp/ds_exp_slurm}
conf=/etc/slurm/slurm.conf
host=$(hostname)
cpus=$(nproc)

start() {
  mkdir -p "$dir"/{state,spool,log} /etc/slurm /run/munge /var/log/munge /var/lib/munge
  if [[ ! -s /etc/munge/munge.key ]]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chmod 400 /etc/munge/munge.key
  pgrep -x munged >/dev/null || munged --force
  cat >"$conf" <<CONF
ClusterName=ds_exp_dev
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job may start again after cred_expire seconds (default 120): short, for requeue tests
AuthInfo=cred_expire=10
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
InactiveLimit=0
KillWait=10
MinJobAge=60
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
  pgrep -x slurmctld >/dev/null || slurmctld
  pgrep -x slurmd >/dev/null || slurmd
  for _ in $(seq 30); do
    if sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
      echo "slurm: one-node cluster up on $host ($cpus CPUs)"
      return 0
    fi
    scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true
    sleep 1
  done
  echo "slurm: the node did not become idle; see $dir/log" >&2
  sinfo >&2 || true
  return 1
}

stop() {
  pkill -x slurmd || true
  pkill -x slurmctld || true
  for _ in $(seq 20); do pgrep -x slurmctld >/dev/null || pgrep -x slurmd >/dev/null || return 0; sleep 0.5; done
}

status() { sinfo; squeue; }

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  restart) stop; start ;;
  status) status ;;
  *) echo "usage: $0 start|stop|restart|status" >&2; exit 2 ;;
esac
