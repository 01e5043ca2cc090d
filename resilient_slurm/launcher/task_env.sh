#!/bin/sh
# resilient_slurm: the srun --task-prolog that `rslurm launch -- srun ...` (and bin/rsrun) adds, so that a
# program written for torchrun runs unchanged under srun (resilient_slurm/launcher/rank_env.py adds it).
#
# slurmstepd runs this before each task, with the task's environment, and applies the lines it prints:
# `export NAME=value` sets NAME for the task, `unset NAME` removes it. For each task it exports, from
# Slurm's own task variables:
#   RANK              SLURM_PROCID
#   LOCAL_RANK        SLURM_LOCALID
#   WORLD_SIZE        SLURM_STEP_NUM_TASKS (else SLURM_NTASKS)
#   LOCAL_WORLD_SIZE  this node's entry of SLURM_STEP_TASKS_PER_NODE (else SLURM_TASKS_PER_NODE), e.g.
#                     "2(x2)" or "3,1", at SLURM_NODEID
#   GROUP_RANK        SLURM_NODEID (the node's index in the step, as torchrun's GROUP_RANK)
#   NODE_RANK         SLURM_NODEID
#   MASTER_ADDR       the address of the first host of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST), where
#                     task 0 runs: its entry in _RSLURM_NODE_ADDRS, the launcher's map of the allocation's
#                     node names to their NodeAddr ("n1=10.0.0.1 n2=10.0.0.2"; only nodes whose address is
#                     not their name are listed; an empty entry, "n3=", means no address works: no export);
#                     the host's name when it is not listed (resilient_slurm/rendezvous.py has the rule)
# MASTER_PORT comes from the launcher, in srun's environment (15000 + SLURM_JOB_ID % 17000).
#
# A variable the task already has (not empty) is left alone: one the user set for the step. The launcher
# takes the per-task ones it inherited from the batch script out of srun's environment first (one value
# cannot be right for every task), so what is left was set on purpose (`srun --export=ALL,RANK=...`).
#
# The user's own task prolog (srun --task-prolog=X or SLURM_TASK_PROLOG; the launcher moves it to
# _RSLURM_USER_TASK_PROLOG) runs last, with these variables in its environment; its output follows ours,
# so its exports win, and its exit status is the prolog's (non-zero fails the task, as Slurm does).
# POSIX sh, no other program: this runs once per task at every step start.

emit() {  # NAME VALUE: export unless the task has NAME already (not empty); the user's prolog sees it too
    eval "_rs_have=\${$1-}"
    if [ -z "$_rs_have" ] && [ -n "$2" ]; then
        printf 'export %s=%s\n' "$1" "$2"
        eval "$1=\$2"
        export "$1"
    fi
}

is_count() {  # a non-negative decimal integer
    case $1 in '' | *[!0-9]*) return 1 ;; esac
    return 0
}

tasks_on_node() {  # LIST INDEX: the INDEX-th node's count in a tasks-per-node list ("2(x2)", "3,1")
    _rs_rest=$1
    _rs_left=$2
    is_count "$_rs_left" || return 1
    while [ -n "$_rs_rest" ]; do
        _rs_item=${_rs_rest%%,*}
        case $_rs_rest in *,*) _rs_rest=${_rs_rest#*,} ;; *) _rs_rest= ;; esac
        case $_rs_item in
            *'(x'*')') _rs_n=${_rs_item%%'(x'*}; _rs_times=${_rs_item#*'(x'}; _rs_times=${_rs_times%')'} ;;
            *) _rs_n=$_rs_item; _rs_times=1 ;;
        esac
        is_count "$_rs_n" && is_count "$_rs_times" || return 1
        if [ "$_rs_left" -lt "$_rs_times" ]; then
            echo "$_rs_n"
            return 0
        fi
        _rs_left=$((_rs_left - _rs_times))
    done
    return 1
}

first_host() {  # NODELIST: its first host ("gpu-[07-10],a1" -> gpu-07, "r[1-2]n[3,5]" -> r1n3)
    _rs_rest=$1
    _rs_host=
    while [ -n "$_rs_rest" ]; do
        _rs_head=${_rs_rest%%[[,]*}
        _rs_host=$_rs_host$_rs_head
        _rs_rest=${_rs_rest#"$_rs_head"}
        case $_rs_rest in
            '['*)
                _rs_body=${_rs_rest#?}
                _rs_body=${_rs_body%%]*}
                _rs_rest=${_rs_rest#*]}
                _rs_host=$_rs_host${_rs_body%%[,-]*}
                ;;
            *) break ;;  # a comma (the next host) or the end
        esac
    done
    echo "$_rs_host"
}

node_addr() {  # HOST: its address from _RSLURM_NODE_ADDRS ("" when listed without one); HOST when not listed
    _rs_map=" ${_RSLURM_NODE_ADDRS-} "
    case $_rs_map in
        *" $1="*)
            _rs_addr=${_rs_map#*" $1="}
            echo "${_rs_addr%%" "*}"
            ;;
        *) echo "$1" ;;
    esac
}

if is_count "${SLURM_PROCID-}"; then
    _rs_world=${SLURM_STEP_NUM_TASKS:-${SLURM_NTASKS-}}
    _rs_node=${SLURM_NODEID:-0}
    is_count "$_rs_node" || _rs_node=
    _rs_local_world=$(tasks_on_node "${SLURM_STEP_TASKS_PER_NODE:-${SLURM_TASKS_PER_NODE-}}" "$_rs_node") \
        || _rs_local_world=1
    emit RANK "$SLURM_PROCID"
    emit LOCAL_RANK "${SLURM_LOCALID-}"
    emit WORLD_SIZE "$_rs_world"
    emit LOCAL_WORLD_SIZE "$_rs_local_world"
    emit GROUP_RANK "$_rs_node"
    emit NODE_RANK "$_rs_node"
    _rs_first=$(first_host "${SLURM_STEP_NODELIST:-${SLURM_JOB_NODELIST:-${SLURM_NODELIST-}}}")
    [ -n "$_rs_first" ] && emit MASTER_ADDR "$(node_addr "$_rs_first")"
fi
if [ -n "${_RSLURM_NODE_ADDRS+set}" ]; then
    echo "unset _RSLURM_NODE_ADDRS"
    unset _RSLURM_NODE_ADDRS
fi

_rs_user=${_RSLURM_USER_TASK_PROLOG-}
if [ -n "${_RSLURM_USER_TASK_PROLOG+set}" ]; then
    echo "unset _RSLURM_USER_TASK_PROLOG"
    unset _RSLURM_USER_TASK_PROLOG
fi
if [ -n "$_rs_user" ]; then
    exec "$_rs_user"
fi
exit 0
