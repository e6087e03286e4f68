#!/usr/bin/env bash
# Starts (or stops) a multi-node Ray cluster over ssh, with one shared Ray auth token.
#
#   bash scripts/run_cluster.sh start --hostfile hosts.txt [OPTION ...] [-- RAY_START_ARG ...]
#   bash scripts/run_cluster.sh stop  --hostfile hosts.txt [OPTION ...]
#
# hostfile: one node per line, the head first; `#` starts a comment. A line is
# `[user@]host [gpus=N] [temp_dir=PATH]` (gpus: what `ray start --num-gpus` declares;
# default: detected. temp_dir: that node's Ray temp dir, overriding --temp-dir).
#
# Options:
#   --token-file PATH   token shared by every node (created if missing; default
#                       ~/.slime_like/ray_token). Copied with scp to the same path on each node.
#   --port N            GCS port of the head (default 6379)
#   --dashboard-port N  dashboard / job API port of the head (default 8265)
#   --ray PATH          the `ray` executable on the nodes (default: ray on their PATH)
#   --temp-dir PATH     Ray's temp dir on every node (`ray start --temp-dir`; default
#                       /tmp/ray). Nodes that share /tmp need one each: give temp_dir= per
#                       node in the hostfile. Keep it short (Ray's socket paths: 107 bytes).
#   --ssh-config FILE   ssh and scp read this ssh config (-F) instead of ~/.ssh/config
#   --env NAME=VALUE    set for `ray start` on every node, so the job's processes inherit it
#                       (repeatable). NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME are passed on
#                       when they are set here.
#   --dry-run           print the commands instead of running them
#
# Requires passwordless ssh from this machine to every node, and the same Python
# environment (slime_like, ray) on each. `stop` runs `ray stop` on each node: it stops every
# Ray process there, so use dedicated nodes.
set -euo pipefail

die() { echo "run_cluster.sh: error: $*" >&2; exit 2; }

[ $# -ge 1 ] || die "expected a command: start or stop (see the header of this script)"
command="$1"; shift
case "$command" in
  start|stop) ;;
  -h|--help) sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) die "unknown command '$command' (expected start or stop)" ;;
esac

hostfile=""; token_file="${HOME}/.slime_like/ray_token"; port=6379; dash_port=8265
ray_bin=ray; dry_run=0; envs=(); extra=(); temp_dir=""; ssh_opts=(-o BatchMode=yes)
while [ $# -gt 0 ]; do
  case "$1" in
    --hostfile|--token-file|--port|--dashboard-port|--ray|--env|--temp-dir|--ssh-config)
      [ $# -ge 2 ] || die "$1: expected a value"
      case "$1" in
        --hostfile) hostfile="$2" ;;
        --token-file) token_file="$2" ;;
        --port) port="$2" ;;
        --dashboard-port) dash_port="$2" ;;
        --ray) ray_bin="$2" ;;
        --temp-dir) temp_dir="$2" ;;
        --ssh-config) [ -f "$2" ] || die "--ssh-config: no such file: $2"
                      ssh_opts=(-F "$2" -o BatchMode=yes) ;;
        --env) [[ "$2" =~ ^[A-Za-z_][A-Za-z0-9_]*=.*$ ]] || die "--env: expected NAME=VALUE, got '$2'"
               envs+=("$2") ;;
      esac
      shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; extra=("$@"); break ;;
    *) die "unknown option '$1'" ;;
  esac
done
[ -n "$hostfile" ] || die "--hostfile is required"
[ -f "$hostfile" ] || die "--hostfile: no such file: $hostfile"
for n in "$port" "$dash_port"; do
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -gt 0 ] && [ "$n" -lt 65536 ] || die "not a port: '$n'"
done
for name in NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME; do
  if [ -n "${!name:-}" ]; then envs+=("$name=${!name}"); fi
done

# ---- hostfile ------------------------------------------------------------------------------
hosts=(); gpus=(); temps=(); lineno=0
while IFS= read -r line || [ -n "$line" ]; do
  lineno=$((lineno + 1))
  line="${line%%#*}"
  read -r -a fields <<<"$line" || true
  [ ${#fields[@]} -gt 0 ] || continue
  g=""; t="$temp_dir"
  for f in "${fields[@]:1}"; do
    case "$f" in
      gpus=*) g="${f#gpus=}"; [[ "$g" =~ ^[0-9]+$ ]] || die "$hostfile:$lineno: gpus must be a number, got '$g'" ;;
      temp_dir=?*) t="${f#temp_dir=}" ;;
      *) die "$hostfile:$lineno: unexpected '$f' (expected '[user@]host [gpus=N] [temp_dir=PATH]')" ;;
    esac
  done
  hosts+=("${fields[0]}"); gpus+=("$g"); temps+=("$t")
done <"$hostfile"
[ ${#hosts[@]} -gt 0 ] || die "$hostfile: no hosts (one per line, the head first)"
head_addr="${hosts[0]#*@}"

# ---- running commands ----------------------------------------------------------------------
run() {  # run (or print) a local command
  if [ "$dry_run" = 1 ]; then printf '%q ' "$@" | sed 's/ $//'; echo; else "$@"; fi
}
on() {  # on HOST COMMAND-STRING: run it in HOST's shell through ssh (or print it)
  if [ "$dry_run" = 1 ]; then echo "ssh ${ssh_opts[*]} $1 '$2'"
  else ssh "${ssh_opts[@]}" "$1" "$2"; fi
}
env_words() {  # the env(1) words for a node's `ray start`
  printf '%s\n' env RAY_AUTH_MODE=token "RAY_AUTH_TOKEN_PATH=$remote_token" "${envs[@]}"
}
# The token lives at the same path on every node; ~ is expanded by each node's shell.
remote_token='$HOME/.slime_like/ray_token'

if [ "$command" = stop ]; then
  stop_node() {
    on "${hosts[$1]}" "$(printf '%q' "$ray_bin") stop" || echo "run_cluster.sh: ray stop failed on ${hosts[$1]}" >&2
  }
  # Workers first (all at once; a dry run prints them in order), the head last.
  for ((i = ${#hosts[@]} - 1; i >= 1; i--)); do
    if [ "$dry_run" = 1 ]; then stop_node "$i"; else stop_node "$i" & fi
  done
  wait
  stop_node 0
  exit 0
fi

if [ ! -f "$token_file" ]; then
  if [ "$dry_run" = 1 ]; then
    echo "# would create a new token in $token_file"
  else
    mkdir -p "$(dirname "$token_file")"
    (umask 077; python3 -c 'import secrets; print(secrets.token_hex(32))' >"$token_file")
  fi
fi

copy_token() {  # copy_token I: the token to the same path on node I
  local host="${hosts[$1]}"
  on "$host" 'mkdir -p "$HOME/.slime_like" && chmod 700 "$HOME/.slime_like"' &&
    run scp -q "${ssh_opts[@]}" "$token_file" "$host:.slime_like/ray_token"
}
start_node() {  # start_node I: start Ray on node I (its token is there)
  local i="$1" host="${hosts[$1]}" words cmd
  mapfile -t words < <(env_words)
  words+=("$ray_bin" start --disable-usage-stats)
  if [ "$i" = 0 ]; then
    words+=(--head --port "$port" --dashboard-host 0.0.0.0 --dashboard-port "$dash_port")
  else
    words+=(--address "$head_addr:$port")
  fi
  [ -z "${gpus[$i]}" ] || words+=(--num-gpus "${gpus[$i]}")
  [ -z "${temps[$i]}" ] || words+=(--temp-dir "${temps[$i]}")
  words+=("${extra[@]}")
  # The token path must reach the node's shell unquoted so that $HOME expands there.
  cmd="$(printf '%q ' "${words[@]}" | sed 's/ $//')"
  cmd="${cmd//\\\$HOME/\$HOME}"
  on "$host" "$cmd"
}

# The token to every node at once (a dry run prints them in order), then the head, then
# the workers all at once.
pids=(); failed=()
for ((i = 0; i < ${#hosts[@]}; i++)); do
  if [ "$dry_run" = 1 ]; then copy_token "$i"; else copy_token "$i" & pids+=("$!"); fi
done
for j in "${!pids[@]}"; do
  wait "${pids[$j]}" || failed+=("${hosts[$j]}")
done
[ ${#failed[@]} -eq 0 ] || die "could not copy the token to: ${failed[*]} (nothing was started)"
start_node 0
pids=(); failed=()
for ((i = 1; i < ${#hosts[@]}; i++)); do
  if [ "$dry_run" = 1 ]; then start_node "$i"; else start_node "$i" & pids+=("$!"); fi
done
for j in "${!pids[@]}"; do
  wait "${pids[$j]}" || failed+=("${hosts[$((j + 1))]}")
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "run_cluster.sh: error: ray start failed on: ${failed[*]} (the head and the other" \
    "nodes are up; stop them with: bash scripts/run_cluster.sh stop --hostfile $hostfile)" >&2
  exit 1
fi

cat <<EOF
# Cluster of ${#hosts[@]} node(s); head $head_addr. Submit jobs from this machine with:
#   export RAY_ADDRESS=http://$head_addr:$dash_port RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$token_file
#   bash scripts/run_job.sh --engine sglang --hf-checkpoint /shared/models/... [FLAG ...]
# Stop it with: bash scripts/run_cluster.sh stop --hostfile $hostfile
EOF
