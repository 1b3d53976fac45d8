#!/usr/bin/env bash
# A SLURM cluster on this machine (munge + slurmctld + slurmd), for development and the tests.
#   sudo launchers/slurm_cluster.sh start               # one node: this machine, under its own hostname
#   sudo launchers/slurm_cluster.sh start --nodes 2     # two nodes, node1 and node2 (see below)
#   launchers/slurm_cluster.sh status
#   sudo launchers/slurm_cluster.sh restart [--nodes 2] # after changing this script's slurm.conf
#   sudo launchers/slurm_cluster.sh stop                # either kind; idempotent
# Needs Debian's slurm-wlm and munge (apt-get install slurm-wlm munge), and iproute2 for --nodes 2.
# State lives under $SLURM_DEV_DIR (default /tmp/ds_exp_slurm); accounting is off (submitit warns, and goes on).
# `start` with another --nodes than the running cluster's replaces it (the saved job state is kept).
#
# --nodes N (2 or more): slurmctld stays in this machine's network namespace; node i is a slurmd in its own
# network and UTS namespace `dsx-node<i>` (hostname node<i>, NodeAddr $SLURM_DEV_SUBNET.(10+i)), joined to the
# controller at $SLURM_DEV_SUBNET.1 by a veth on the bridge `dsx-br0`. The node names go into /etc/hosts (removed
# by stop) so a job's processes resolve each other: torch.distributed's rendezvous and gloo connect to node<i>
# over that subnet, as they would between real machines. The namespaces share the filesystem, so munged's socket,
# the run directories and the Python environment are the same on every node, as on a cluster with shared
# storage. Every node has all of this machine's CPUs (the nodes overcommit them), so 1-node jobs with 2 tasks
# fit on either node and 2-node jobs get one task per node. The partition `debug` holds all nodes.
#
# Settings (environment):
#   SLURM_DEV_DIR        state, spool, logs and pid files (default /tmp/ds_exp_slurm)
#   SLURM_CONF           the slurm.conf written and used; SLURM's own variable, so clients given the same value
#                        find this cluster (default /etc/slurm/slurm.conf)
#   SLURM_DEV_PORT       slurmctld's port (default 6817): another value runs a second cluster beside the first
#   SLURM_DEV_SUBNET     the /24 of the nodes' network, as its first three octets (default 10.213.0)
#   SLURM_DEV_NODE_CPUS  CPUs of each of the --nodes N nodes (default: this machine's)
# Only one multi-node cluster per machine at a time: the namespace, bridge and node names are fixed.
set -euo pipefail
dir=${SLURM_DEV_DIR:-/tmp/ds_exp_slurm}
export SLURM_CONF=${SLURM_CONF:-/etc/slurm/slurm.conf}
conf=$SLURM_CONF
port=${SLURM_DEV_PORT:-6817}
subnet=${SLURM_DEV_SUBNET:-10.213.0}
host=$(hostname)
cpus=$(nproc)
node_cpus=${SLURM_DEV_NODE_CPUS:-$cpus}
bridge=dsx-br0
hosts_mark="# ds_exp slurm_cluster.sh"

# ------------------------------------------------------------------ daemons, found by their pid files
# (not by name: a second cluster on another SLURM_DEV_PORT, or the nodes of this one, run the same programs)
alive() { # alive PIDFILE PROGRAM
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [[ $pid =~ ^[0-9]+$ && $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]]
}

kill_pidfile() { # kill_pidfile PIDFILE PROGRAM
  alive "$1" "$2" && kill "$(cat "$1")" 2>/dev/null
  return 0
}

running_nodes() { # the node count of the cluster running from $dir, 0 if none
  if alive "$dir/slurmctld.pid" slurmctld; then cat "$dir/nodes" 2>/dev/null || echo 1; else echo 0; fi
}

# ------------------------------------------------------------------ munge (one munged serves every node)
start_munge() {
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  if [[ ! -s /etc/munge/munge.key ]]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chmod 400 /etc/munge/munge.key
  pgrep -x munged >/dev/null || munged --force
}

# ------------------------------------------------------------------ slurm.conf
write_conf() { # write_conf NODES
  local n=$1 i
  mkdir -p "$(dirname "$conf")"
  {
    echo "ClusterName=ds_exp_dev"
    if ((n == 1)); then
      echo "SlurmctldHost=$host"
    else
      # the controller's address on the nodes' subnet: inside a node's namespace this machine's hostname
      # resolves to that namespace's own loopback
      echo "SlurmctldHost=$host($subnet.1)"
    fi
    echo "SlurmctldPort=$port"
    cat <<CONF
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job may start again after cred_expire seconds (default 120): short, for requeue tests
AuthInfo=cred_expire=10
StateSaveLocation=$dir/state
SlurmctldPidFile=$dir/slurmctld.pid
SlurmctldLogFile=$dir/log/slurmctld.log
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
# sbatch --wait polls every 2 s only while that is under MinJobAge/3; past it the polls stretch to 8 s, then 32 s
# (a 12 s job was seen to end 42 s after submission). Finished jobs stay listed for 6 s and until the next purge.
MinJobAge=6
# A requeued job (preempted, or warned of its time limit) waits out its BeginTime, then for a scheduling pass: the
# main loop's every 60 s and backfill's every 30 s by default (a requeued job was seen pending 53 s on an idle node)
SchedulerParameters=sched_interval=2,bf_interval=5
CONF
    if ((n == 1)); then
      cat <<CONF
SlurmdSpoolDir=$dir/spool
SlurmdPidFile=$dir/slurmd.pid
SlurmdLogFile=$dir/log/slurmd.log
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
    else
      # %n: each node's slurmd keeps its own spool (job scripts, step sockets), pid file and log
      cat <<CONF
SlurmdSpoolDir=$dir/spool/%n
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmdLogFile=$dir/log/slurmd-%n.log
CONF
      for ((i = 1; i <= n; i++)); do
        echo "NodeName=node$i NodeAddr=$subnet.$((10 + i)) CPUs=$node_cpus State=UNKNOWN"
      done
      echo "PartitionName=debug Nodes=node[1-$n] Default=YES MaxTime=INFINITE State=UP"
    fi
  } >"$conf"
}

# ------------------------------------------------------------------ the nodes' network (--nodes N)
rewrite_hosts() { # rewrite_hosts [LINE...]: /etc/hosts without our lines, plus LINEs
  local kept
  kept=$(grep -vF "$hosts_mark" /etc/hosts || true)
  # written in place, not replaced: in containers /etc/hosts is often a bind mount that cannot be renamed over
  printf '%s\n' "$kept" "$@" >/etc/hosts
}

network_check() { # network_check: can this machine make the nodes' network? One line saying why not.
  local err
  if ! command -v ip >/dev/null; then
    echo "slurm: several nodes need the ip command (apt-get install iproute2)" >&2
    return 1
  fi
  if ip -4 -o addr show | grep -v " $bridge " | grep -qF " $subnet."; then
    echo "slurm: $subnet.0/24 is already in use on this machine; choose another SLURM_DEV_SUBNET" >&2
    return 1
  fi
  # the real operations, tried once: listing namespaces works without CAP_NET_ADMIN, creating them does not
  if ! ip link show "$bridge" >/dev/null 2>&1 && ! err=$(ip link add "$bridge" type bridge 2>&1); then
    echo "slurm: cannot create network devices here (ip link: ${err//$'\n'/ }; needs root with CAP_NET_ADMIN)" >&2
    return 1
  fi
  if ! ip netns list | grep -qx "dsx-node1\( .*\)\?" && ! err=$(ip netns add dsx-node1 2>&1); then
    echo "slurm: cannot create network namespaces here (ip netns: ${err//$'\n'/ }; needs CAP_NET_ADMIN)" >&2
    ip link del "$bridge" 2>/dev/null || true
    return 1
  fi
}

network_up() { # network_up NODES
  local n=$1 i ns lines=()
  ip link show "$bridge" >/dev/null 2>&1 || ip link add "$bridge" type bridge
  ip addr replace "$subnet.1/24" dev "$bridge"
  ip link set "$bridge" up
  for ((i = 1; i <= n; i++)); do
    ns=dsx-node$i
    ip netns list | grep -qx "$ns\( .*\)\?" || ip netns add "$ns"
    if ! ip link show "dsx-v$i" >/dev/null 2>&1; then
      ip link add "dsx-v$i" type veth peer name eth0 netns "$ns"
    fi
    ip link set "dsx-v$i" master "$bridge" up
    ip -n "$ns" addr replace "$subnet.$((10 + i))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up # slurmstepd and the job's processes talk to themselves over localhost
    lines+=("$subnet.$((10 + i)) node$i $hosts_mark")
  done
  rewrite_hosts "${lines[@]}"
}

in_node() { # in_node I COMMAND...: run COMMAND in node I's network namespace
  # nsenter, not `ip netns exec`: that one also mounts a new /sys, hiding /sys/fs/cgroup, and slurmd 22.05
  # refuses to start without it even with proctrack/linuxproc and task/none
  local i=$1
  shift
  nsenter --net="/run/netns/dsx-node$i" "$@"
}

network_down() { # network_down NODES: idempotent, whatever part of network_up happened
  local n=$1 i ns pids
  command -v ip >/dev/null || return 0
  for ((i = 1; i <= n; i++)); do
    ns=dsx-node$i
    if ip netns list 2>/dev/null | grep -qx "$ns\( .*\)\?"; then
      # a node that goes away takes its processes along (job steps slurmd left behind would keep it alive)
      pids=$(ip netns pids "$ns" 2>/dev/null || true)
      [[ -n $pids ]] && kill $pids 2>/dev/null || true
      ip netns del "$ns" 2>/dev/null || true
    fi
    ip link del "dsx-v$i" 2>/dev/null || true
  done
  ip link del "$bridge" 2>/dev/null || true
  if grep -qF "$hosts_mark" /etc/hosts 2>/dev/null; then rewrite_hosts; fi
}

# ------------------------------------------------------------------ start / stop
start() { # start NODES
  local n=$1 i running
  # before anything changes: a machine that cannot make the nodes' network keeps the cluster it runs
  if ((n > 1)) && ! network_check; then exit 3; fi
  running=$(running_nodes)
  if ((running != 0 && running != n)); then
    echo "slurm: replacing the running $running-node cluster with $n node(s)"
    stop
  fi
  if ((n > 1)); then
    # a start that fails from here on leaves no namespace, bridge or hosts line behind
    teardown_nodes=$n
    trap 'network_down "$teardown_nodes"; rm -f "$dir/nodes"' EXIT
  fi
  mkdir -p "$dir"/{state,spool,log}
  start_munge
  echo "$n" >"$dir/nodes" # stop reads it to know what to tear down
  write_conf "$n"
  if ((n > 1)); then
    network_up "$n"
    for ((i = 1; i <= n; i++)); do
      mkdir -p "$dir/spool/node$i"
      # the munge socket is a path on the shared filesystem: check it answers from inside a node
      if ! in_node "$i" sh -c 'munge -n | unmunge' >/dev/null 2>&1; then
        echo "slurm: munge does not answer inside dsx-node$i; see /var/log/munge" >&2
        exit 1
      fi
    done
    trap - EXIT
  fi
  alive "$dir/slurmctld.pid" slurmctld || slurmctld -f "$conf"
  if ((n == 1)); then
    alive "$dir/slurmd.pid" slurmd || slurmd -f "$conf"
  else
    for ((i = 1; i <= n; i++)); do
      # its own UTS namespace: the job's processes see hostname node<i>, which gloo resolves to the node's address
      alive "$dir/slurmd-node$i.pid" slurmd ||
        in_node "$i" unshare --uts sh -c 'hostname "$1" && exec slurmd -f "$2" -N "$1"' sh "node$i" "$conf"
    done
  fi
  local nodes=$host
  ((n == 1)) || nodes="node[1-$n]"
  for _ in $(seq 30); do
    if (($(sinfo -h -N -o %t 2>/dev/null | grep -cE '^(idle|mix|alloc)') >= n)); then
      if ((n == 1)); then
        echo "slurm: one-node cluster up on $host ($cpus CPUs)"
      else
        echo "slurm: $n-node cluster up: $nodes at $subnet.11-$((10 + n)) ($node_cpus CPUs each), controller $host at $subnet.1:$port"
      fi
      return 0
    fi
    scontrol update nodename="$nodes" state=resume >/dev/null 2>&1 || true
    sleep 1
  done
  echo "slurm: the nodes did not become idle; see $dir/log" >&2
  sinfo >&2 || true
  return 1
}

stop() {
  local n i
  n=$(cat "$dir/nodes" 2>/dev/null || echo 1)
  kill_pidfile "$dir/slurmctld.pid" slurmctld
  kill_pidfile "$dir/slurmd.pid" slurmd
  for ((i = 1; i <= n; i++)); do kill_pidfile "$dir/slurmd-node$i.pid" slurmd; done
  for _ in $(seq 20); do
    local left=0
    alive "$dir/slurmctld.pid" slurmctld && left=1
    alive "$dir/slurmd.pid" slurmd && left=1
    for ((i = 1; i <= n; i++)); do alive "$dir/slurmd-node$i.pid" slurmd && left=1; done
    ((left)) || break
    sleep 0.5
  done
  if ((n > 1)); then network_down "$n"; fi
  rm -f "$dir/nodes"
}

status() {
  local n
  n=$(running_nodes)
  if ((n > 1)); then
    echo "slurm: $n-node cluster (namespaces $(ip netns list | grep -o '^dsx-node[0-9]*' | tr '\n' ' ')bridge $bridge)"
  fi
  sinfo
  squeue
}

cmd=${1:-}
shift || true
nodes=1
while (($#)); do
  case "$1" in
    --nodes) nodes=${2:-}; shift 2 || true ;;
    --nodes=*) nodes=${1#*=}; shift ;;
    *) echo "usage: $0 start|stop|restart|status [--nodes N]" >&2; exit 2 ;;
  esac
done
if ! [[ $nodes =~ ^[1-9]$ ]]; then
  echo "slurm: --nodes takes 1 to 9, not '$nodes'" >&2
  exit 2
fi

case "$cmd" in
  start) start "$nodes" ;;
  stop) stop ;;
  restart) stop; start "$nodes" ;;
  status) status ;;
  *) echo "usage: $0 start|stop|restart|status [--nodes N]" >&2; exit 2 ;;
esac
