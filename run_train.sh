#!/usr/bin/env bash
# Train: ./run_train.sh [--config FILE] [--section.key VALUE ...]   (default config: train_configs/debug_model.toml)
# Environment: NGPU (processes per node; default: visible CUDA GPUs, else 1; at most the visible GPUs),
# TITANLITE_DEVICE (cpu: gloo on the CPU whatever GPUs there are; cuda; default: CUDA if visible), NNODES, NODE_RANK,
# RDZV_ENDPOINT (host:port, multi-node; NODE_RANK 0 hosts the rendezvous store there), RDZV_ID, RDZV_TIMEOUT (seconds a
# node waits for the store to answer and for every node to join; default 300), MAX_RESTARTS, LOG_RANK (e.g. 0 or 0,1:
# whose output to show), START_METHOD (spawn: each rank its own interpreter rather than a fork of the launcher's server),
# OMP_NUM_THREADS (threads per process, 1 or more; default: the cores / NGPU).
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup_env.sh

for arg in "$@"; do
  case "$arg" in -h|--help) exec "$PY" -m titanlite.commands.cli help ;; esac
done

if [ -z "${NGPU:-}" ]; then  # one process per visible GPU; one on the CPU (TITANLITE_DEVICE=cpu, or no GPU)
  NGPU=0
  if [ "${TITANLITE_DEVICE:-}" != cpu ]; then
    NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    if [ "${NGPU:-0}" -ge 1 ] && [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then  # the GPUs left visible, if fewer
      listed=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c '[^[:space:]]' || true)
      [ "$listed" -ge "$NGPU" ] || NGPU=$listed
    fi
  fi
  [ "${NGPU:-0}" -ge 1 ] || NGPU=1
fi
NNODES=${NNODES:-1}
MAX_RESTARTS=${MAX_RESTARTS:-0}
refuse() { echo "titanlite: error: $1" >&2; exit 2; }
[[ "$NGPU" =~ ^[1-9][0-9]*$ ]] || refuse "NGPU='$NGPU' is not a number of processes per node; set NGPU to 1 or more (e.g. NGPU=2)"
[[ "$NNODES" =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]] || refuse "NNODES='$NNODES' is not a node count; set NNODES to N or MIN:MAX (e.g. NNODES=2)"
[[ "${START_METHOD:-forkserver}" =~ ^(forkserver|spawn|fork)$ ]] || refuse "START_METHOD='$START_METHOD' is not a start method; set START_METHOD to forkserver (the default), spawn or fork"
[[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] || refuse "MAX_RESTARTS='$MAX_RESTARTS' is not a number of restarts; set MAX_RESTARTS to 0 or more"
# libgomp takes a positive count (or a comma-separated one per nesting level); anything else it warns about and ignores.
threads='^[[:space:]]*0*[1-9][0-9]*([[:space:]]*,[[:space:]]*0*[1-9][0-9]*)*[[:space:]]*$'
[ -z "${OMP_NUM_THREADS:-}" ] || [[ "$OMP_NUM_THREADS" =~ $threads ]] \
  || refuse "OMP_NUM_THREADS='$OMP_NUM_THREADS' is not a number of threads; set it to 1 or more (e.g. OMP_NUM_THREADS=4), or leave it unset for the cores per process"
if [ "$NNODES" != 1 ] && [ -z "${RDZV_ENDPOINT:-}" ]; then
  refuse "NNODES=$NNODES needs RDZV_ENDPOINT=host:port, the rendezvous every node joins (the same on every node)"
fi
if [ -n "${RDZV_ENDPOINT:-}" ]; then  # host:port or [ipv6]:port, the port 1 to 65535
  [[ "$RDZV_ENDPOINT" =~ ^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})$ ]] && (( 10#${BASH_REMATCH[2]} >= 1 && 10#${BASH_REMATCH[2]} <= 65535 )) \
    || refuse "RDZV_ENDPOINT='$RDZV_ENDPOINT' is not host:port with a port from 1 to 65535; set it as e.g. RDZV_ENDPOINT=node0:29500"
fi
RDZV_TIMEOUT=${RDZV_TIMEOUT:-300}
[[ "$RDZV_TIMEOUT" =~ ^[1-9][0-9]*$ ]] || refuse "RDZV_TIMEOUT='$RDZV_TIMEOUT' is not a number of seconds; set it to 1 or more (default 300)"
if [ -n "${NODE_RANK:-}" ] && { [ -n "${RDZV_ENDPOINT:-}" ] || [ "$NNODES" != 1 ]; }; then  # multi-node: 0 to NNODES - 1
  nodes=$(( 10#${NNODES#*:} ))
  others=""
  (( nodes == 2 )) && others=" and 1 on the other"
  (( nodes > 2 )) && others=" and 1 to $(( nodes - 1 )) on the others"
  [[ "$NODE_RANK" =~ ^[0-9]+$ ]] && (( 10#$NODE_RANK < nodes )) \
    || refuse "NODE_RANK='$NODE_RANK' is not a node of NNODES=$NNODES; set it to 0 on the node at RDZV_ENDPOINT$others"
fi
if [ -n "${LOG_RANK:-}" ]; then  # torchrun's --local-ranks-filter: local ranks of this node, 0 to NGPU - 1
  log_ranks_ok=0
  if [[ "$LOG_RANK" =~ ^[0-9]+(,[0-9]+)*$ ]]; then
    log_ranks_ok=1
    for rank in ${LOG_RANK//,/ }; do (( 10#$rank < NGPU )) || log_ranks_ok=0; done
  fi
  [ "$log_ranks_ok" = 1 ] \
    || refuse "LOG_RANK='$LOG_RANK' is not a list of this node's ranks; set it to ranks from 0 to $((NGPU - 1)) (NGPU=$NGPU), comma-separated (e.g. LOG_RANK=0)"
fi

# Restarted workers must not reuse the dead workers' rendezvous store (torch 2.13 shares it across restarts
# by default, and the restarted workers then fail to connect: docs/checkpointing.md).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# CUDA allocator: growable segments fragment far less with FSDP's varying all-gather sizes (ignored on CPU).
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NGPU > 0 ? $(nproc) / NGPU : 1 ))}

launch=(--nproc-per-node "$NGPU" --max-restarts "$MAX_RESTARTS")
if [ -n "${RDZV_ENDPOINT:-}" ] || [ "$NNODES" != 1 ]; then
  # read_timeout bounds the wait for the store to answer, join_timeout the wait for every node (torch: 60 s, 600 s).
  rdzv_conf=last_call_timeout=1,read_timeout=$RDZV_TIMEOUT,join_timeout=$RDZV_TIMEOUT
  # NODE_RANK is not passed as --node-rank: the c10d rendezvous assigns node ranks itself (and warns if given one). It
  # says which node hosts the store (is_host): node 0, and it alone; without it, torch guesses from the host name.
  [ -z "${NODE_RANK:-}" ] || rdzv_conf+=,is_host=$(( 10#$NODE_RANK == 0 ? 1 : 0 ))
  launch+=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port for multi-node}"
           --rdzv-id "${RDZV_ID:-titanlite}" --rdzv-conf "$rdzv_conf")
else
  launch+=(--standalone)
fi
[ -z "${START_METHOD:-}" ] || launch+=(--start-method "$START_METHOD")  # spawn: an interpreter per rank, not forks
[ -z "${LOG_RANK:-}" ] || launch+=(--local-ranks-filter "$LOG_RANK" --role rank --tee 3)

# torchrun (titanlite/commands/launch.py): a failed worker's one-line reason comes last, and its exit status is ours.
# --check: first, in the same process, `titanlite check` validates the config (and NGPU against the visible GPUs,
# and the memory it needs) for the world size about to launch and builds the token cache, before any worker starts.
exec "$PY" -m titanlite.commands.launch --check "${launch[@]}" -m titanlite.commands.train "$@"
