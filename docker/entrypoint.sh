#!/bin/sh
# The training image's entry point: torchrun, through dtrain.common.launch (which takes exactly
# torchrun's arguments and exits with the job's own code: 0, 1, 2 usage, 3 preempted, 130).
#
#   docker run IMAGE --nproc-per-node=1 -m dtrain.mnist.train --dataset fashion-mnist --data-dir /data
#
# `docker run IMAGE` alone prints torchrun's help. Anything that is not an option (e.g. `python3 -c ...`,
# `bash`) runs as given, for debugging inside the image.
set -eu

case "${1:-}" in
  -*) ;;
  "") set -- --help ;;
  *) exec "$@" ;;
esac

# A volume the image's user cannot write fails here in one line instead of in every worker's traceback.
if [ "${1:-}" != --help ] && [ ! -w . ]; then
  echo "error: the working directory $(pwd) is not writable by uid $(id -u): mount a volume there that it owns" \
    "(chown $(id -u):$(id -g) DIR), or run the container with --user set to the directory's owner" >&2
  exit 2
fi
exec python3 -m dtrain.common.launch "$@"
