#!/usr/bin/env bash
# Every figure of the speed issue (#9) in one command; each output goes to OUT_DIR/<name>.txt.
#   benchmarks/speed_issue.sh OUT_DIR [cuda|cpu]
# On a GPU machine without hyperfed installed, first: source benchmarks/gpu_env.sh
# (carries pydantic wheels in .whl/ and Fashion-MNIST in data/fashion_mnist/).
# SMOKE=1 shrinks every workload to seconds (to check the script itself on a CPU).
set -euo pipefail
out=$1 device=${2:-cuda}
mkdir -p "$out"
if [ "${SMOKE:-0}" = 1 ]; then
  size=(--clients 2 --samples 40 --shape 1,8,8 --classes 3 --epochs 1) rounds=1 big=3
  acc=(--set dataset.name=digits --set dataset.subsample=200 --set clients.count=2 --set rounds=1)
else
  size=(--clients 50) rounds=3 big=200
  acc=(--set dataset.name=fashion_mnist --set dataset.subsample=60000 --set clients.count=50
       --set rounds=20)
fi
if [ "$device" = cuda ]; then fast=vmap,graphs; else fast=loop,loop-nchw; fi

step() { echo "== $1"; shift; "$@" 2>&1 | tee "$out/$name.txt"; }
name=homogeneous step "item 1-2: 50 clients, LeNet" \
  hyperfed bench "${size[@]}" --rounds "$rounds" --modes "reference,$fast" --device "$device"
name=heterogeneous step "item 1-2: LeNet, VGG8, ResNet-10/12/18" \
  hyperfed bench "${size[@]}" --hetero --rounds "$((rounds > 2 ? 2 : rounds))" \
  --modes "reference,$fast" --device "$device"
name=scale step "item 2: $big clients" \
  hyperfed bench "${size[@]}" --clients "$big" --rounds "$((rounds > 2 ? 2 : rounds))" \
  --modes "$fast" --device "$device"
name=sgd_update step "the flat SGD step, out of place vs in place" \
  python benchmarks/sgd_update.py --device "$device"
# item 4: the same short MH-pFedHN run through the reference loop and through the fast path
for path in reference auto; do
  name=accuracy_$path step "item 4: local.vectorize=$path" \
    hyperfed run --config configs/seed000/fmnist_homo.toml "${acc[@]}" --set device="$device" \
    --set algorithm.name=mh_pfedhn --set local.vectorize=$path --set eval_every=100 \
    --out "$out/run_$path" --force --quiet
done
hyperfed report "$out"/run_reference "$out"/run_auto --out "$out/report" | tee "$out/accuracy.txt"
