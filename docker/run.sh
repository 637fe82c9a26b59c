#!/usr/bin/env bash
# Start the training image with GPUs, host networking (NCCL across nodes), a large shared-memory
# segment (data-loader workers, NCCL), unlimited locked memory (RDMA) and data / checkpoint
# folders mounted. Anything after the options is the command to run (default: a shell).
#
# Usage: docker/run.sh [-d DATA_DIR] [-c CKPT_DIR] [-t TAG] [command ...]
#   -d  host folder mounted at /data        (default: ./data/cache)
#   -c  host folder mounted at /checkpoints (default: ./checkpoints)
#   -t  image tag                           (default: megatron-dynapipe:latest)
# Example (one node, 8 GPUs):
#   docker/run.sh -d /mnt/corpus -c /mnt/ckpt torchrun --nproc_per_node 8 pretrain_gpt.py ... \
#       --data-path /data/web_text_document --save /checkpoints/gpt --load /checkpoints/gpt
set -euo pipefail
DATA=$(pwd)/data/cache; CKPT=$(pwd)/checkpoints; TAG=megatron-dynapipe:latest
while getopts "d:c:t:" opt; do
  case $opt in
    d) DATA=$(realpath "$OPTARG") ;;
    c) CKPT=$(realpath "$OPTARG") ;;
    t) TAG=$OPTARG ;;
    *) sed -n 2,13p "$0"; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
mkdir -p "$CKPT"
TTY=(); [ -t 0 ] && TTY=(-it)
exec docker run --rm "${TTY[@]}" --gpus all --network host --ipc host --shm-size 16g \
  --ulimit memlock=-1 --ulimit stack=67108864 \
  -v "$DATA":/data -v "$CKPT":/checkpoints \
  -e NCCL_DEBUG="${NCCL_DEBUG:-WARN}" -e MASTER_ADDR -e MASTER_PORT \
  "$TAG" "${@:-bash}"
